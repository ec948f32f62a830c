"""The install as the README tells it: no command after
the first builds fastattn again, and `fastattn info` names the cuDNN wheel the first GPU
call would load, its version and its path, on any machine (no GPU, nothing loaded)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re

import pytest

from fastattn import _loader, cli, runtime

from helpers.paths import DOCS, README

INSTALL = DOCS / "INSTALL.md"  # the install's details: no command there builds fastattn again either
WHEEL_LIB = os.path.join("nvidia", "cudnn", "lib", "libcudnn.so.9")


def _info(capsys) -> dict:
    code = cli.main(["info", "--json"])
    body = json.loads(capsys.readouterr().out)
    assert code in (cli.EXIT_OK, cli.EXIT_NO_GPU)
    return body


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTATTN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FASTATTN_CUDNN_PATH", raising=False)
    runtime.clear()
    yield tmp_path
    runtime.clear()


def test_info_names_the_installed_cudnn_wheel(fresh, capsys):
    try:
        version = importlib.metadata.version("nvidia-cudnn-cu13")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("nvidia-cudnn-cu13 is not installed here")
    body = _info(capsys)["cudnn_library"]
    assert body["wheel"] == "nvidia-cudnn-cu13" and body["wheel_version"] == version, body
    assert body["path"].endswith(WHEEL_LIB) and os.path.isfile(body["path"])
    assert cli.main(["info"]) in (cli.EXIT_OK, cli.EXIT_NO_GPU)
    text = capsys.readouterr().out
    assert f"wheel_version: {version}" in text and body["path"] in text


def test_info_names_the_wheel_the_loader_would_take_first(fresh, capsys, monkeypatch):
    """Two wheels on sys.path (torch's pinned one first): the one the loader takes, with
    that wheel's own version, not another's."""
    site = fresh / "site"
    (site / "nvidia" / "cudnn" / "lib").mkdir(parents=True)
    (site / WHEEL_LIB).write_bytes(b"")
    meta = site / "nvidia_cudnn_cu13-9.24.0.43.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: nvidia-cudnn-cu13\nVersion: 9.24.0.43\n")
    monkeypatch.syspath_prepend(str(site))
    # (A CUDA build of PyTorch, imported, holds its cuDNN already: that one would be taken.)
    monkeypatch.setattr(_loader, "_already_loaded", lambda soname: None)
    body = _info(capsys)["cudnn_library"]
    assert body == {"path": str(site / WHEEL_LIB), "chosen_by": "the first NVIDIA cuDNN wheel on sys.path",
                    "wheel": "nvidia-cudnn-cu13", "wheel_version": "9.24.0.43"}, body
    assert _loader.cudnn_location() == body


def test_info_names_an_override(fresh, capsys, monkeypatch):
    monkeypatch.setenv("FASTATTN_CUDNN_PATH", "/opt/cudnn/libcudnn.so.9")
    body = _info(capsys)["cudnn_library"]
    assert body["path"] == "/opt/cudnn/libcudnn.so.9" and body["chosen_by"] == "FASTATTN_CUDNN_PATH"


def test_info_without_any_cudnn_wheel_says_where_it_would_look(fresh, capsys, monkeypatch):
    monkeypatch.setattr(_loader.sys, "path", [str(fresh / "empty")])
    monkeypatch.setattr(_loader, "_already_loaded", lambda soname: None)
    body = _loader.cudnn_location()
    assert body["path"] is None and body["wheel"] is None and "cuda-pathfinder" in body["chosen_by"]


# -- the README's install commands ------------------------------------------------------------


def _shell_blocks(page=README) -> list[str]:
    """A page's code blocks without a language (its shell commands), in order."""
    blocks, current, lang = [], None, None
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            if current is None:
                current, lang = [], line[3:].strip()
            else:
                if lang in ("", "bash", "sh", "console"):
                    blocks.append("\n".join(current) + "\n")
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def _installs_the_source_tree(command: str) -> bool:
    """`pip install .`, `pip install '.[torch]'`, `pip install -e .`, `pip install ./`..."""
    if not re.search(r"\bpip install\b", command):
        return False
    args = command.split("pip install", 1)[1].split("&&")[0].split()
    return any(re.fullmatch(r"""['"]?\.(/|\[[^\]]*\])?['"]?""", a) for a in args)


def test_the_first_screen_keeps_its_two_commands():
    blocks = _shell_blocks()
    assert blocks[0].strip() == "pip install . && fastattn warm"
    assert "pip install -r tests/requirements.txt && pytest tests" in [b.strip() for b in blocks]


def test_no_readme_command_after_the_first_builds_fastattn_again():
    """The README's first command installs fastattn; none after it, in the README or in
    docs/INSTALL.md (read after it), builds it again."""
    commands = [line.strip() for page in (README, INSTALL) for block in _shell_blocks(page)
                for line in block.splitlines() if "pip install" in line]
    assert commands and _installs_the_source_tree(commands[0])
    again = [c for c in commands[1:] if _installs_the_source_tree(c)]
    assert again == [], again


def _section(page, heading: str) -> str:
    text = page.read_text()
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def test_the_torch_step_says_which_cudnn_fastattn_then_runs_on():
    for page in (README, INSTALL):
        section = _section(page, "## PyTorch")
        assert "pip install torch" in section and "fastattn info" in section and "cudnn_library" in section, page
        assert "not build fastattn again" in section, page
