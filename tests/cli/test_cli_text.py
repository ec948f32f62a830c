"""What the commands print says what happened: a warm
without a GPU says so once, lists keep their lines, a timeout is the one asked for,
matrix draws no heatmap without a GPU, bundles are private, every option has help."""

from __future__ import annotations

import argparse
import os
import stat
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fastattn.warm
from fastattn import AttentionConfig, cli, runtime, config_files, warm
from fastattn.cli import _common
from fastattn.warm import WarmItem, WarmReport

from conftest import _gpu_unavailable_reason
from helpers.cli import parser_actions, run  # noqa: E402

NO_GPU = ("fastattn cannot use the GPU:\n  - libcublasLt was not found (DynamicLibNotFoundError: no such library); "
          "pip install nvidia-cublas (a dependency of nvidia-cudnn-cu13), or set FASTATTN_CUBLASLT_PATH\n  - the "
          "NVIDIA driver library libcuda.so.1 could not be loaded (libcuda.so.1: cannot open shared object file); "
          "install the NVIDIA driver")


def _no_gpu_warm(configs, **kwargs):
    items = [WarmItem(c, status="failed", error_type="LibraryError", reason=NO_GPU) for c in configs]
    return WarmReport(items, 0.5, 2, {"loaded": 0, "built": 0, "unsupported": 0, "failed": len(items)}, 2)


# -- warm without a GPU: the reason once, as a list, and a closing line that says so ----------


def _assert_no_gpu_text(text: str, total: int) -> None:
    lines = text.splitlines()
    assert text.count("fastattn cannot use the GPU") == 1 and "(the same as above)" not in text, text
    assert len(lines) < 12, text
    bullets = [line.strip() for line in lines if line.strip().startswith("- ")]
    assert len(bullets) >= 2 and bullets[0].startswith("- lib"), text  # a list, not one wrapped line
    assert "no usable GPU" in lines[-1] and f"{total} configs" in lines[-1], lines[-1]


def test_warm_without_a_gpu_says_it_once(cache_dir, capsys, monkeypatch):
    monkeypatch.setattr(fastattn.warm, "warm", _no_gpu_warm)
    code, out, text = run(["warm", "--no-torch-ops"], capsys)
    assert code == cli.EXIT_NO_GPU and out == ""  # the reason is a diagnostic: stderr
    _assert_no_gpu_text(text, len(config_files.builtin_configs()))


@pytest.mark.skipif(not _gpu_unavailable_reason(), reason="this machine has a usable GPU")
def test_the_readme_first_run_without_a_gpu(cache_dir, capsys):
    # The real workers (fastattn as installed, or as PYTHONPATH says), on this machine.
    code, out, text = run(["warm", "--no-torch-ops"], capsys)
    assert code == cli.EXIT_NO_GPU and out == "", text
    lines = text.splitlines()
    assert "(the same as above)" not in text and len(lines) < 12, text
    assert "no usable GPU" in lines[-1] and f"{len(config_files.builtin_configs())} configs" in lines[-1]


_word = st.text(alphabet="abcxyz0123(),;:'=/.", min_size=1, max_size=14)
_line = st.tuples(st.sampled_from(["", "  ", "- ", "  - "]), st.lists(_word, min_size=1, max_size=30)).map(
    lambda t: t[0] + " ".join(t[1]))


@settings(max_examples=150, deadline=None, derandomize=True)
@given(lines=st.lists(_line, min_size=1, max_size=6), indent=st.sampled_from(["", "  ", " " * 22]),
       width=st.integers(40, 120))
def test_wrap_keeps_every_line_and_word(lines, indent, width):
    """A reason over lines: each of its lines starts a line of its own (a list stays a
    list), every word stays whole and in order, and no line is longer than the width
    unless one word is."""
    out = _common.wrap("\n".join(lines), indent=indent, width=width)
    at = 0
    for line in lines:
        words, got = line.split(), []
        while len(got) < len(words):
            got += out[at].split()
            at += 1
        assert got == words, (line, out)
    assert at == len(out)
    for o in out:
        assert o.startswith(indent) and (len(o) <= width or len(o.split()) == 1 or
                                         len(o.strip().removeprefix("- ").split()) == 1), o


def test_wrap_hangs_a_bullet_under_its_text():
    out = _common.wrap("head:\n  - " + "word " * 40, indent="  ", width=60)
    assert out[0] == "  head:" and out[1].startswith("    - word") and out[2].startswith("      word")


# -- the timeout a worker is killed after is the one asked for ---------------------------------


def test_a_timeout_is_reported_as_given(fake_workers):
    report = warm.warm([AttentionConfig(batch=1, heads_q=8, seqlen_q=128, head_dim_qk=80)], workers=1, timeout=1.5)
    item = report.items[0]
    assert item.error_type == "timeout" and "no answer after 1.5 s" in item.reason, item.reason
    assert item.seconds < 2.5  # killed at its deadline, not at the next poll


# -- matrix --png: no heatmap (nor matplotlib, nor its font cache) without a GPU ---------------


def test_matrix_png_without_a_gpu_is_exit_3_before_plotting(cache_dir, capsys, monkeypatch, tmp_path):
    fake = tmp_path / "fakempl" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("import os\nopen(os.environ['FAKE_MPL_IMPORTED'], 'w').close()\n"
                                      "def use(name): pass\n")
    monkeypatch.syspath_prepend(str(tmp_path / "fakempl"))
    monkeypatch.setenv("FAKE_MPL_IMPORTED", str(tmp_path / "imported"))
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(fastattn.warm, "warm", _no_gpu_warm)
    png = tmp_path / "grid.png"
    code, out, err = run(["matrix", "--head-dims", "64", "--masks", "none", "--png", str(png)], capsys)
    assert code == cli.EXIT_NO_GPU and "no usable GPU" in out + err, out + err
    assert not png.exists() and not (tmp_path / "imported").exists()


# -- bundles are private, as entries are -----------------------------------------------------


def test_bundles_are_written_0600(cache_dir, capsys):
    old = os.umask(0o022)
    try:
        bundle = cache_dir / "b.tgz"
        assert run(["cache", "export", str(bundle), "--all"], capsys)[0] == cli.EXIT_OK
        assert stat.S_IMODE(os.stat(bundle).st_mode) == 0o600
        os.chmod(bundle, 0o644)
        assert run(["cache", "export", str(bundle), "--all", "--force"], capsys)[0] == cli.EXIT_OK
        assert stat.S_IMODE(os.stat(bundle).st_mode) == 0o600
        assert [p.name for p in cache_dir.iterdir() if p.name != "cache"] == ["b.tgz"]  # no temporary left
    finally:
        os.umask(old)


# -- every option and argument has help ----------------------------------------------------------


def _actions():
    return [(" ".join(path), a.option_strings or [a.dest], a.help) for path, a in parser_actions()]


def test_every_option_has_help():
    missing = [(path, names) for path, names, help_ in _actions() if not help_ or help_ == argparse.SUPPRESS]
    assert missing == []

