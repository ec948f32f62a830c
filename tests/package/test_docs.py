"""The README is a map and docs/ holds the reference, each page generated from the code or
checked against it here: the pages' sizes, the generated CLI reference, the facts each page
states of the code, the local links, and no benchmark run labels cited from code."""

import argparse
import importlib.util
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.paths import DOCS, README, ROOT

PAGES = [README, *sorted(DOCS.rglob("*.md"))]


def test_the_readme_is_a_map_and_architecture_a_summary():
    assert len(README.read_text().splitlines()) <= 250, "README.md: move reference material to docs/"
    assert len((DOCS / "ARCHITECTURE.md").read_text().splitlines()) <= 400


def test_the_cli_reference_is_current():
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "cli_reference.py"), "--check"],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_cli_reference_names_every_command_and_flag():
    spec = importlib.util.spec_from_file_location("cli_reference", ROOT / "tools" / "cli_reference.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    page = (DOCS / "CLI.md").read_text()
    assert tool.reference() in page

    def walk(parser, name):
        yield name, parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, p in action.choices.items():
                    yield from walk(p, f"{name} {sub}")

    for name, parser in walk(tool.build_parser(), "fastattn"):
        assert f"### `{name}`" in page
        for action in parser._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}`" in page, (name, flag)


def _links(path):
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_local_link_exists(page):
    missing = []
    for target in _links(page):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        if not (page.parent / target.split("#", 1)[0]).exists():
            missing.append(target)
    assert missing == [], f"{page.relative_to(ROOT)} links to missing files: {missing}"


def test_every_fastattn_variable_the_docs_name_is_declared():
    from fastattn import env

    pattern = r"\b(FASTATTN_[A-Z0-9_]*[A-Z0-9])\b"
    scripts = set().union(*(re.findall(pattern, p.read_text()) for p in (ROOT / "tools").glob("*.sh")))
    for page in PAGES:
        if "history" in page.parts:
            continue  # history names what existed then
        named = set(re.findall(pattern, page.read_text()))
        assert named - set(env.VARIABLES) - scripts == set(), page  # the GPU machine's scripts read their own


def test_the_api_page_names_every_config_field():
    from fastattn.config import FIELDS

    text = (DOCS / "API.md").read_text()
    assert [f.name for f in FIELDS if not re.search(rf"`{f.name}[`=]", text)] == []


def test_the_verification_page_states_the_codes_rules():
    from fastattn import defects, verdict

    text = (DOCS / "VERIFICATION.md").read_text()
    for d in defects.DEFECTS:
        assert f"`{d.name}`" in text, d.name
    for dtype, tol in verdict.TOLERANCE.items():
        assert f"{tol:g} for {dtype}" in text, (dtype, tol)
    for kind in ("random", "low_lse", "lengths"):  # verify.py's data kinds, as verdict.Check names them
        assert f"`{kind}`" in text and f'"{kind}"' in inspect.getsource(verdict)


def test_the_pytorch_page_names_every_keyword():
    pytest.importorskip("torch", reason="torch is not installed")
    from fastattn.torch import attention, attention_paged, attention_varlen

    text = (DOCS / "PYTORCH.md").read_text()
    for fn in (attention, attention_varlen, attention_paged):
        missing = [p for p in inspect.signature(fn).parameters if not re.search(rf"\b{p}\b", text)]
        assert missing == [], (fn.__name__, missing)


def test_the_integrations_page_names_every_flash_function():
    pytest.importorskip("torch", reason="torch is not installed")
    import fastattn.flash

    text = (DOCS / "INTEGRATIONS.md").read_text()
    assert [n for n in fastattn.flash.__all__ if f"`{n}`" not in text] == []


# Code says what is true now and why; the history of how it came to be (issues, sessions, the
# benchmark runs' labels such as "s20-1") lives in docs/history/ and the commits, where it does not
# go stale. A regression test names the defect it guards against, not where it was found.
# Another project's tracker reference (cudnn-frontend#1071, pytorch/pytorch#190388) names a
# defect that exists today, and stays.
HISTORY = re.compile(r"\bs[0-9]{1,2}-[0-9]\b"  # a benchmark run's label
                     r"|\b(?:issues?|sessions?) #?[0-9]+"  # "issue 26", "Issue 27, item 2", "session 13"
                     r"|(?<![\w/.-])#[0-9]+\b", re.IGNORECASE)  # "#56" alone; "owner/repo#N" stays
COMMENT_START = re.compile(r"^\s*(?:#|//|\*)?\s*")
CODE = (".py", ".pyx", ".pxi", ".pxd", ".pyi", ".h", ".cpp", ".cu", ".sh")


def history_lines(text: str) -> list[int]:
    """The numbers of the lines where history narration starts: each line is read with the
    next one's words, so that an "issue" at a line's end and its number on the next are seen."""
    lines = text.splitlines()
    found = []
    for n, line in enumerate(lines, 1):
        after = COMMENT_START.sub("", lines[n]) if n < len(lines) else ""
        match = HISTORY.search(f"{line} {after}")
        if match and match.start() < len(line):
            found.append(n)
    return found


def _written_files(folders: tuple[str, ...]) -> list[Path]:
    """The files git tracks under the folders: what people write, not what a build generates
    there (Cython's fastattn/_core.cpp holds compressed bytes that can spell anything). All
    files where the tree is not a git checkout."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--", *folders], cwd=ROOT, capture_output=True,
                                check=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        return [p for folder in folders for p in (ROOT / folder).rglob("*")]
    return [ROOT / name for name in listed if name]


def test_no_history_in_code():
    found = []
    for path in _written_files(("fastattn", "tests", "benchmarks", "tools", "csrc")):
        if not path.is_file() or path.suffix not in CODE or path.resolve() == Path(__file__).resolve():
            continue  # this file spells out the patterns
        lines = path.read_text().splitlines()
        found += [f"{path.relative_to(ROOT)}:{n}: {lines[n - 1].strip()}" for n in history_lines(path.read_text())]
    assert found == [], "\n".join(found)


def test_the_history_guard_tells_history_from_references():
    for text in ("# seen in run s20-1", "# issue 26 asks for it", '"""Issue 27, item 2: ..."""',
                 "# (session 15: ...)", "// what #56 asks", "x = 1\n# NaN on 9.19 (issue\n# 27)",
                 "// the log (sessions\n// 8 and 9)"):
        assert history_lines(text), text
    for text in ("# cudnn-frontend#1071 crashes on 9.28", "# pytorch/pytorch#190388", "x = s[0]  # s1-x",
                 "# the session's cache", "color: #fff", "# an issue of the tracker\n# 27 configs"):
        assert not history_lines(text), text


@pytest.mark.parametrize("name", ["ARCHITECTURE.md", "MODULES.md", "DECISIONS.md", "API.md", "PYTORCH.md"])
def test_every_path_the_design_pages_name_exists(name):
    """Files and folders named in backticks (`csrc/graphs.h`, `fastattn/torch/`) exist: a
    module renamed or removed fails here until its page follows."""
    text = (DOCS / name).read_text()
    named = set(re.findall(r"`((?:fastattn|csrc|tests|tools|benchmarks)/[\w./-]*)`", text))
    assert named and [p for p in sorted(named) if not (ROOT / p).exists()] == []
