"""Exit codes of the CLI for odd values that fastattn's config, env and path layers now
refuse or report (the tests of the refusals themselves are in tests/config and
tests/runtime): bad input is exit 2, never exit 5 (a bug) nor a traceback."""

from __future__ import annotations

import pytest

from fastattn import cli

from helpers.cli import run

BIG = "1" + "0" * 5000  # past Python's 4300-digit limit for str <-> int


def odd_run(argv, capsys):
    code, out, err = run(argv, capsys)
    assert "a bug in fastattn" not in out + err
    return code, out + err


@pytest.mark.parametrize("name,text", [
    ("c.json", '{"batch": %s, "heads_q": 8, "seqlen_q": 128, "head_dim_qk": 64}'),
    ("c.toml", 'batch = %s\nheads_q = 8\nseqlen_q = 128\nhead_dim_qk = 64\n'),
    ("c.jsonl", '{"batch": 1, "heads_q": 8, "seqlen_q": 128, "head_dim_qk": 64}\n{"batch": %s}\n'),
])
def test_a_huge_integer_in_a_config_file_is_bad_input(tmp_path, capsys, no_work, name, text):
    path = tmp_path / name
    path.write_text(text % BIG)
    for argv in (["probe", "--config", str(path)], ["warm", str(path), "--no-torch-ops"]):
        code, output = odd_run(argv, capsys)
        assert code == cli.EXIT_BAD_INPUT and "integer of 5001 digits" in output, output


def test_a_huge_integer_in_config_text_is_bad_input(capsys, no_work):
    text = '{"batch": %s, "heads_q": 8, "seqlen_q": 128, "head_dim_qk": 64}' % BIG
    code, output = odd_run(["probe", "--config", text], capsys)
    assert code == cli.EXIT_BAD_INPUT and "integer of 5001 digits" in output


@pytest.mark.parametrize("name,value", [("FASTATTN_REMOTE_TIMEOUT", "1e10"), ("FASTATTN_REMOTE_WAIT", "1e10"),
                                        ("FASTATTN_CACHE_MAX_BYTES", "١٢"), ("FASTATTN_REMOTE_TIMEOUT", "١")])
def test_a_number_out_of_its_kind_in_the_environment_is_bad_input(cache_dir, capsys, monkeypatch, name, value):
    monkeypatch.setenv("FASTATTN_REMOTE_CACHE", "redis://127.0.0.1:1/0")  # (1e10 s overflowed its socket: exit 5)
    monkeypatch.setenv("FASTATTN_CACHE_TRUSTED", "1")
    monkeypatch.setenv(name, value)
    code, output = odd_run(["info"], capsys)
    assert code == cli.EXIT_BAD_INPUT and f"{name}={value!r}: must be" in output, output


@pytest.mark.parametrize("variable", ["FASTATTN_CACHE_DIR", "FASTATTN_TORCH_OPS_DIR"])
def test_info_reports_a_directory_whose_name_is_too_long(cache_dir, capsys, monkeypatch, variable):
    pytest.importorskip("torch", reason="PyTorch is an optional extra (info's torch section)")
    from fastattn.torch import _native

    monkeypatch.setattr(_native, "_state", {})  # (the path not decided yet, as in a fresh `fastattn info`)
    monkeypatch.setenv(variable, str(cache_dir / ("y" * 300)))  # (ENAMETOOLONG was exit 5)
    code, output = odd_run(["info"], capsys)
    assert code in (cli.EXIT_OK, cli.EXIT_NO_GPU) and "cannot be read (File name too long)" in output, output
