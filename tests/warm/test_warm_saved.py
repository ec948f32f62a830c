"""A warm that persists nothing says so: where the cache
directory cannot be written (a read-only filesystem, /proc, a regular file) or keeps
nothing (FASTATTN_CACHE_MAX_BYTES=1, FASTATTN_CACHE_MODE=off), `fastattn warm` counts
the entries not saved in its table and its JSON, passes on the workers' warnings, and
exits 4. Worker processes on tests/fake_core.py: no GPU needed."""

from __future__ import annotations

import json

import pytest

from fastattn import cli, warm

CONFIGS = '[[configs]]\nbatch = 1\nheads_q = 8\nseqlen_q = [128, 256]\nhead_dim_qk = [64, 1024]\n'  # 2 built, 2 refused


def run(argv, capsys):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def _unwritable(kind, tmp_path, monkeypatch):
    """Points FASTATTN_CACHE_DIR (or the variables) at a cache that cannot keep entries."""
    if kind == "read-only filesystem":
        root = tmp_path / "ro-cache"
        root.mkdir()
        monkeypatch.setenv("FASTATTN_CACHE_DIR", str(root))
        # What a read-only mount answers, in the workers (tests/fake_site/sitecustomize.py):
        # chmod alone does not stop root.
        monkeypatch.setenv("FASTATTN_TEST_READONLY_FS", str(root))
    elif kind == "/proc":
        monkeypatch.setenv("FASTATTN_CACHE_DIR", "/proc/fastattn-test-cache")
    elif kind == "a regular file":
        path = tmp_path / "cache-file"
        path.write_text("not a directory")
        monkeypatch.setenv("FASTATTN_CACHE_DIR", str(path))
    elif kind == "max bytes 1":
        monkeypatch.setenv("FASTATTN_CACHE_MAX_BYTES", "1")
    elif kind == "cache off":
        monkeypatch.setenv("FASTATTN_CACHE_MODE", "off")


KINDS = ["read-only filesystem", "/proc", "a regular file", "max bytes 1", "cache off"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_warm_that_saves_nothing_says_so_and_exits_4(kind, fake_workers, capsys, monkeypatch):
    _unwritable(kind, fake_workers, monkeypatch)
    f = fake_workers / "w.toml"
    f.write_text(CONFIGS)
    code, out, err = run(["warm", str(f), "--workers", "2", "--json", "--no-torch-ops"], capsys)
    body = json.loads(out)
    assert code == cli.EXIT_FAILED, (body, err)
    assert body["counts"] == {"built": 2, "loaded": 0, "unsupported": 2, "failed": 0}
    assert body["not_saved"] == 4 and body["not_saved_reason"], body  # refusals are entries too
    assert {i["saved"] for i in body["items"]} == {False}
    if kind in ("read-only filesystem", "/proc", "a regular file"):  # the workers' own words reach the user
        assert any("cannot write" in w for w in body["warnings"]), body["warnings"]
        assert "fastattn: warning: " in err and "cannot write" in err
    if kind == "max bytes 1":
        assert "FASTATTN_CACHE_MAX_BYTES" in body["not_saved_reason"]
    if kind == "cache off":
        assert "FASTATTN_CACHE_MODE=off" in body["not_saved_reason"]
    code, text, err = run(["warm", str(f), "--workers", "2", "--no-torch-ops"], capsys)
    assert code == cli.EXIT_FAILED
    summary = [line for line in text.splitlines() if "configs in" in line]
    assert len(summary) == 1 and "not saved 4" in summary[0], text
    assert "not saved:" in text and body["not_saved_reason"].split(" ")[0] in text
    assert not any(line.startswith("built ") for line in text.splitlines()), text


def test_a_warm_that_saves_everything_says_nothing_of_it(fake_workers, capsys):
    f = fake_workers / "w.toml"
    f.write_text(CONFIGS)
    code, out, err = run(["warm", str(f), "--workers", "2", "--json", "--no-torch-ops"], capsys)
    body = json.loads(out)
    assert code == cli.EXIT_UNSUPPORTED and body["not_saved"] == 0 and body["warnings"] == []
    assert {i["saved"] for i in body["items"]} == {True}
    assert "not saved" not in run(["warm", str(f), "--no-torch-ops"], capsys)[1]


def test_warm_reports_unsaved_entries_through_the_api(fake_workers, monkeypatch):
    monkeypatch.setenv("FASTATTN_CACHE_MAX_BYTES", "1")
    from fastattn import AttentionConfig

    report = warm.warm([AttentionConfig(batch=1, heads_q=8, seqlen_q=s, head_dim_qk=64) for s in (64, 128)],
                       workers=1)
    assert report.counts["built"] == 2 and report.not_saved == 2
    assert report.to_dict()["not_saved"] == 2 and "FASTATTN_CACHE_MAX_BYTES=1" in report.not_saved_reason
