"""PyTorch's own SDPA tests against the SDPA mode, on the GPU machine: the chosen tests of
test/test_transformers.py, of the release of the installed torch and unchanged, run twice at
once, each in its own pytest process: with the mode off (the baseline: PyTorch's kernels on
this machine) and with fastattn.torch.enable_sdpa() on (tools/sdpa_mode_plugin.py). Then the
two runs' JUnit files are compared: the tests that pass off and fail on (the regressions,
each with its failure's first lines), those that fail off and pass on, the counts, and the
calls the mode served and passed on (fastattn.stats()["sdpa"]).

    python3 tools/pytorch_sdpa_tests.py [--sample 0.02] [--classes ...] [--timeout 360]
    python3 tools/pytorch_sdpa_tests.py --compare OFF.xml ON.xml [--stats ON.json]

Run it inside tools/gpu_run.sh's set-up (the extension built or carried, the op library
built by `fastattn warm`, the carried wheels on PYTHONPATH), as its ALSO command: the one
device call is in docs/INSTALL.md. Results go to $OUT (junit-off.xml, junit-on.xml,
pytest-off.log, pytest-on.log, stats-on.json, summary.txt, summary.json).

PyTorch's test files are PyTorch's code: never committed here. They live in the git-ignored
.pytorch-tests/<major.minor>/, brought from the release tag RELEASES names, and travel to
the device with `carry: [".pytorch-tests"]`.

Exit status: 0 both runs completed and nothing that passes off fails on, apart from the
tests docs/INTEGRATIONS.md lists as comparing dropout masks bitwise against PyTorch's
kernels (read from that page, between its dropout-mask-comparisons markers); 1 such a
regression; 2 refused or a run gave no results (a test file missing or not the release's,
expecttest missing, a crash before pytest wrote its JUnit file); 3 a run reached the time
limit (the comparison covers the tests both runs finished) and no regression among them.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEST_DIR = ROOT / ".pytorch-tests"
INTEGRATIONS = ROOT / "docs" / "INTEGRATIONS.md"

# The files each release line runs, from PyTorch's repository at the release's tag (the
# commit is the release wheel's torch.version.git_version), with each file's sha256 once
# brought: a file that differs is refused, as it is not the release's. None: not recorded
# yet (the run prints the sha256 of the file it ran, to record here).
RELEASES = {
    "2.11": {
        "tag": "v2.11.0",
        "commit": "70d99e998b4955e0049d13a98d77ae1b14db1f45",
        "files": {"test/test_transformers.py": None},
    },
}
# The classes the issue's run chose: the generic SDPA tests, the failure modes, the
# attention-bias tests, and a sample of the CUDA-only ones (thousands of parametrized cases).
CLASSES = ("TestSDPAFailureModesCUDA", "TestSDPACUDA", "TestAttnBiasCUDA", "TestSDPACudaOnlyCUDA")
SAMPLED = "TestSDPACudaOnlyCUDA"
# Tests of the sampled class kept whatever the sample: cuDNN's own, what the mode replaces.
ALWAYS = ("cudnn",)
MARK_BEGIN = "<!-- dropout-mask-comparisons -->"
MARK_END = "<!-- /dropout-mask-comparisons -->"

OK, REGRESSED, REFUSED, TIMED_OUT = 0, 1, 2, 3
# Seconds a run may go on in its last test after the time limit before it is interrupted.
GRACE = 45


class Refused(Exception):
    """Why the run cannot start or give results, in words for the person running it."""


def allowed_patterns(page: Path | None = None) -> list[str]:
    """The tests docs/INTEGRATIONS.md lists as comparing dropout masks bitwise against
    PyTorch's kernels without restricting the backend: each `- \\`PATTERN\\`` line between
    the page's markers (fnmatch patterns of a test's name, or of CLASS::NAME). The page is
    the one declaration; Refused where the markers are gone, so that an edit of the page
    cannot silently allow nothing or everything."""
    page = page or INTEGRATIONS
    text = page.read_text()
    if text.count(MARK_BEGIN) != 1 or text.count(MARK_END) != 1 or text.index(MARK_BEGIN) > text.index(MARK_END):
        raise Refused(f"{page}: expected one {MARK_BEGIN} ... {MARK_END} section (the allowed dropout-mask tests)")
    section = text[text.index(MARK_BEGIN) + len(MARK_BEGIN):text.index(MARK_END)]
    return re.findall(r"^- `([^`]+)`", section, flags=re.M)


def is_allowed(test_id: str, patterns: list[str]) -> bool:
    name = test_id.partition("::")[2]
    return any(fnmatch.fnmatchcase(test_id if "::" in p else name, p) for p in patterns)


def read_junit(path: Path) -> dict[str, tuple[str, str]]:
    """{CLASS::NAME: (outcome, first lines)} of a pytest JUnit file: outcome "passed",
    "failed" (a failure or an error, setup and teardown included) or "skipped" (xfail
    too); first lines: the failure's message, else its text, three lines at most."""
    results: dict[str, tuple[str, str]] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name', '')}"
        outcome, lines = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
                text = (child.get("message") or child.text or "").strip()
                lines = "\n".join(text.splitlines()[:3])
                break
            if child.tag == "skipped":
                outcome = "skipped"
        # A test reported twice (its call passed, its teardown errored) takes the worse.
        if results.get(test_id, ("",))[0] != "failed":
            results[test_id] = (outcome, lines)
    return results


def compare(off: dict[str, tuple[str, str]], on: dict[str, tuple[str, str]], patterns: list[str]) -> dict:
    """The two runs side by side, over the tests both ran."""
    both = sorted(set(off) & set(on))
    regressions, allowed, fixed, skipped_on = [], [], [], []
    for t in both:
        was, now = off[t][0], on[t][0]
        if was == "passed" and now == "failed":
            (allowed if is_allowed(t, patterns) else regressions).append({"test": t, "failure": on[t][1]})
        elif was == "failed" and now == "passed":
            fixed.append(t)
        elif was == "passed" and now == "skipped":
            skipped_on.append(t)

    def counts(run):
        c = {"passed": 0, "failed": 0, "skipped": 0}
        for outcome, _ in run.values():
            c[outcome] += 1
        return c

    return {"off": counts(off), "on": counts(on), "regressions": regressions, "allowed": allowed,
            "fixed": fixed, "skipped_only_on": skipped_on,
            "only_off": sorted(set(off) - set(on)), "only_on": sorted(set(on) - set(off))}


def render(result: dict, stats: dict | None, notes: list[str]) -> str:
    out = [f"mode off: {_line(result['off'])}", f"mode on:  {_line(result['on'])}"]
    if stats is not None:
        sdpa = stats.get("sdpa") or {}
        passed_on = sdpa.get("passed_on", {})
        out.append(f"the mode ({stats.get('kernels')} kernels) served {sdpa.get('served', 0)} calls and passed "
                   f"{sum(passed_on.values())} on")
        for reason, n in sorted(passed_on.items(), key=lambda kv: -kv[1])[:8]:
            out.append(f"  passed on {n}: {reason[:160]}")
    out.append(f"pass off, fail on: {len(result['regressions'])} (+ {len(result['allowed'])} documented "
               "dropout-mask comparisons)")
    for r in result["regressions"]:
        out.append(f"  REGRESSION {r['test']}")
        out.extend(f"      {line}" for line in r["failure"].splitlines())
    for r in result["allowed"]:
        out.append(f"  allowed {r['test']}: {r['failure'].splitlines()[0] if r['failure'] else ''}")
    out.append(f"fail off, pass on: {len(result['fixed'])}")
    out.extend(f"  {t}" for t in result["fixed"])
    if result["skipped_only_on"]:
        out.append(f"pass off, skipped on: {len(result['skipped_only_on'])}")
        out.extend(f"  {t}" for t in result["skipped_only_on"][:20])
    if result["only_off"] or result["only_on"]:
        out.append(f"ran in one run only: {len(result['only_off'])} off, {len(result['only_on'])} on")
    out.extend(notes)
    # Last, for a reader of only the log's tail (tools/gpu_run.sh prints an ALSO command's last lines).
    served = (stats or {}).get("sdpa", {}).get("served") if stats is not None else None
    out.append(f"verdict: {len(result['regressions'])} regressions ({len(result['allowed'])} allowed), "
               f"{len(result['fixed'])} fixed; off {_line(result['off'])}; on {_line(result['on'])}; "
               f"served {served if served is not None else 'unknown'}")
    return "\n".join(out)


def _line(c: dict) -> str:
    return f"{c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped"


def release_of_torch() -> str:
    import torch

    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def check_files(release: str, test_dir: Path) -> tuple[Path, list[str]]:
    """The release's test_transformers.py, its companions checked; Refused where one is
    missing or differs from the recorded sha256, naming where to put it."""
    if release not in RELEASES:
        raise Refused(f"no PyTorch test files are declared for torch {release}: add its tag, commit and files to "
                      f"RELEASES in {Path(__file__).relative_to(ROOT)}")
    spec = RELEASES[release]
    notes = []
    for name, digest in spec["files"].items():
        path = test_dir / release / Path(name).name
        if not path.is_file():
            raise Refused(f"{path} is missing: put PyTorch's {name} of {spec['tag']} (commit {spec['commit']}) "
                          f"there, unchanged, e.g. `git -C PYTORCH_CHECKOUT show {spec['tag']}:{name} > {path}`; "
                          "a device call carries the folder with carry [\".pytorch-tests\"]")
        actual = hashlib.sha256(path.read_bytes()).hexdigest()
        if digest is not None and actual != digest:
            raise Refused(f"{path} is not {spec['tag']}'s {name}: its sha256 is {actual}, the release's {digest}")
        notes.append(f"{name}: sha256 {actual}" + ("" if digest else f" (not recorded in RELEASES: check it is "
                                                                      f"{spec['tag']}'s, then record it)"))
    return test_dir / release / "test_transformers.py", notes


def pytest_command(test_file: Path, mode: str, out: Path, classes, sample: float, always, deadline: float) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", *(f"{test_file}::{c}" for c in classes),
           "-p", "sdpa_mode_plugin", "--sdpa-mode", mode, "--sdpa-stats", str(out / f"stats-{mode}.json"),
           "--sdpa-deadline", f"{deadline:.3f}",
           "--junitxml", str(out / f"junit-{mode}.xml"), "-p", "no:cacheprovider", "-q", "-rfE", "--tb=short",
           # This checkout's own pytest settings (tests/ on sys.path, its options) are not
           # PyTorch's tests' business.
           "-o", "addopts=", "-o", "pythonpath="]
    if SAMPLED in classes and sample < 1.0:
        cmd += ["--sdpa-sample", f"{SAMPLED}={sample}", *(a for s in always for a in ("--sdpa-always", s))]
    return cmd


def run_both(test_file: Path, out: Path, args) -> tuple[dict[str, int | None], list[str]]:
    """Both pytest processes at once. Neither starts a test after the time limit (the
    plugin's --sdpa-deadline); one still running a test GRACE seconds after it is
    interrupted (SIGINT: pytest still writes its JUnit file, where the interrupted test may
    read as passed). Returns their exit codes (None: interrupted) and notes."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "tools"), env.get("PYTHONPATH")) if p)
    env.setdefault("FASTATTN_TORCH_PATH", args.path)
    env.setdefault("FASTATTN_CACHE_DIR", tempfile.mkdtemp(prefix="fastattn-pytorch-tests-"))
    procs = {}
    deadline = time.time() + args.timeout
    for mode in ("off", "on"):
        log = open(out / f"pytest-{mode}.log", "w")
        cmd = pytest_command(test_file, mode, out, args.classes, args.sample, args.always, deadline)
        log.write(" ".join(cmd) + "\n")
        log.flush()
        procs[mode] = (subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log)
    codes: dict[str, int | None] = {}
    notes = []
    for mode, (p, log) in procs.items():
        try:
            codes[mode] = p.wait(timeout=max(0.0, deadline + GRACE - time.time()))
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGINT)
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            codes[mode] = None
            notes.append(f"mode {mode}: interrupted in a test {GRACE} s after the time limit (that test's outcome "
                         "in the JUnit file is not to be trusted)")
        log.close()
    for mode in ("off", "on"):
        stats = out / f"stats-{mode}.json"
        if stats.is_file() and json.loads(stats.read_text()).get("stopped_at_deadline"):
            notes.append(f"mode {mode}: stopped at the time limit ({args.timeout:g} s) with tests left")
    return codes, notes


def report(off_xml: Path, on_xml: Path, stats_path: Path | None, out: Path | None, notes: list[str],
           timed_out: bool = False) -> int:
    for path in (off_xml, on_xml):
        if not path.is_file():
            raise Refused(f"{path}: no JUnit file (the run crashed before pytest wrote it: see its log)")
    result = compare(read_junit(off_xml), read_junit(on_xml), allowed_patterns())
    stats = json.loads(stats_path.read_text()) if stats_path is not None and stats_path.is_file() else None
    text = render(result, stats, notes)
    print(text)
    if out is not None:
        (out / "summary.txt").write_text(text + "\n")
        (out / "summary.json").write_text(json.dumps({**result, "stats": stats, "notes": notes}, indent=1) + "\n")
    if result["regressions"]:
        return REGRESSED
    return TIMED_OUT if timed_out else OK


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compare", nargs=2, metavar=("OFF_XML", "ON_XML"),
                    help="only compare two JUnit files (mode off, mode on)")
    ap.add_argument("--stats", type=Path, help="with --compare: the on run's stats file")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "pytorch-sdpa-tests-out")),
                    help="where the results go (default: $OUT)")
    ap.add_argument("--release", help="the torch release line, e.g. 2.11 (default: the installed torch's)")
    ap.add_argument("--test-dir", type=Path, default=TEST_DIR, help="where the release folders are")
    ap.add_argument("--classes", nargs="+", default=list(CLASSES), help="the test classes to run")
    ap.add_argument("--sample", type=float, default=0.02,
                    help=f"the fraction of {SAMPLED}'s tests to run, chosen by a hash of their names (default 0.02)")
    ap.add_argument("--always", nargs="*", default=list(ALWAYS),
                    help=f"{SAMPLED}'s tests whose names hold one of these run whatever the sample")
    ap.add_argument("--timeout", type=float, default=360.0,
                    help="seconds after which neither run starts another test (default 360)")
    ap.add_argument("--path", default="native", choices=("native", "python", "auto"),
                    help="FASTATTN_TORCH_PATH of the on run where it is not set (default native: the op library)")
    args = ap.parse_args(argv)
    if not 0.0 <= args.sample <= 1.0:
        ap.error("--sample: a fraction in [0, 1]")
    try:
        if args.compare:
            if args.out:
                args.out.mkdir(parents=True, exist_ok=True)
            return report(Path(args.compare[0]), Path(args.compare[1]), args.stats, args.out, [])
        test_file, notes = check_files(args.release or release_of_torch(), args.test_dir)
        try:
            import expecttest  # noqa: F401 (torch.testing._internal.common_utils imports it)
        except ImportError:
            raise Refused("expecttest is not installed (PyTorch's test helpers import it): bring its wheel in .whl/ "
                          "(`pip download --no-deps -d .whl expecttest`), which tools/gpu_run.sh installs") from None
        args.out.mkdir(parents=True, exist_ok=True)
        codes, run_notes = run_both(test_file, args.out, args)
        notes += run_notes + [f"pytest exit: off {codes['off']}, on {codes['on']}"]
        timed_out = any("time limit" in n for n in run_notes)
        return report(args.out / "junit-off.xml", args.out / "junit-on.xml", args.out / "stats-on.json", args.out,
                      notes, timed_out=timed_out)
    except Refused as e:
        print(f"pytorch_sdpa_tests: {e}", file=sys.stderr)
        return REFUSED


if __name__ == "__main__":
    sys.exit(main())
