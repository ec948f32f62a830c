"""FASTATTN_RECORD (fastattn/_record.py): the configs a process asks plans for, one JSON
object a line, which `fastattn warm FILE` reads back (fastattn/config_files.py's JSON Lines)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastattn
from fastattn import AttentionConfig, _record, cli, config_files
from fastattn.errors import InvalidArgumentError

BASE = dict(batch=1, heads_q=8, head_dim_qk=64, mask="causal")


@pytest.fixture(autouse=True)
def _fresh_recorder():
    _record.reset()
    yield
    _record.reset()


def test_each_config_asked_for_is_recorded_once_in_order(env, monkeypatch):
    path = env / "asked.jsonl"
    monkeypatch.setenv("FASTATTN_RECORD", str(path))
    configs = [AttentionConfig(**BASE, seqlen_q=s) for s in (128, 256)]
    fastattn.plan(configs[0])
    fastattn.probe(configs[1])
    fastattn.plan(configs[0])  # a memory hit: not asked again
    refused = AttentionConfig(**{**BASE, "head_dim_qk": 1024}, seqlen_q=128)  # the fake core refuses it
    assert not fastattn.probe(refused).supported
    fastattn.runtime.clear()
    fastattn.plan(configs[1])  # asked again after clear(): this process recorded it already
    lines = path.read_text().splitlines()
    assert [AttentionConfig.from_json(line) for line in lines] == [*configs, refused]
    assert config_files.load_configs(str(path)) == [*configs, refused]


def test_preloaded_plans_are_recorded_when_first_used_not_when_loaded(env, monkeypatch):
    # preload loads ahead of use: recording what it loads would make the record the
    # whole cache; a plan is recorded when a call first asks for it (plan, probe, or
    # planned() inside a capture), however it got into memory.
    configs = [AttentionConfig(**BASE, seqlen_q=s) for s in (128, 256, 512)]
    fastattn.preload(configs)  # built (nothing stored yet): recorded by nobody
    path = env / "asked.jsonl"
    monkeypatch.setenv("FASTATTN_RECORD", str(path))
    fastattn.runtime.clear()
    assert [r.source for r in fastattn.preload(configs, threads=1)] == ["disk"] * 3
    assert not path.exists()
    fastattn.plan(configs[2])
    assert fastattn.runtime.planned(configs[0]) is not None
    fastattn.plan(configs[2])
    assert [AttentionConfig.from_json(line) for line in path.read_text().splitlines()] == [configs[2], configs[0]]


def test_a_preloaded_plans_first_use_touches_its_entry_without_computing_its_key(env, monkeypatch):
    # As the warm-up's loads (test_warm_up.py): preload keeps the key it loaded from, so the
    # first call, on the caller's path, describes nothing (the GPU, versions, environment).
    configs = [AttentionConfig(**BASE, seqlen_q=s) for s in (128, 256)]
    fastattn.preload(configs)  # built and stored
    fastattn.runtime.clear()
    assert [r.source for r in fastattn.preload(configs, threads=1)] == ["disk"] * 2
    entries = list((env / "cache").rglob("*.entry"))
    assert len(entries) == 2
    for path in entries:
        os.utime(path, (1, 1))  # each entry's last use long ago
    described = []
    real = fastattn.runtime.PlanCache.describe
    monkeypatch.setattr(fastattn.runtime.PlanCache, "describe", lambda self, *a: described.append(a) or real(self, *a))
    fastattn.plan(configs[0])
    assert described == []
    assert sorted(os.stat(p).st_atime > 1 for p in entries) == [False, True]  # its own entry, used now


def test_unset_or_blank_records_nothing(env, monkeypatch):
    monkeypatch.setenv("FASTATTN_RECORD", "  ")
    fastattn.plan(AttentionConfig(**BASE, seqlen_q=128))
    assert not list(env.glob("*.jsonl"))


def test_two_processes_append_whole_lines_to_one_file(tmp_path):
    # Each its own configs, into one file: every line whole, nothing lost.
    path = tmp_path / "asked.jsonl"
    code = ("import sys, fastattn\n"
            "from fastattn import AttentionConfig\n"
            "for s in range(int(sys.argv[1]), int(sys.argv[1]) + 40):\n"
            "    fastattn._record.note(AttentionConfig(batch=1, heads_q=8, head_dim_qk=64, seqlen_q=s))\n")
    envs = {**os.environ, "FASTATTN_RECORD": str(path)}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(start)], env=envs) for start in (1, 1000)]
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    got = sorted(AttentionConfig.from_json(line).seqlen_q for line in path.read_text().splitlines())
    assert got == [*range(1, 41), *range(1000, 1040)]


@pytest.mark.parametrize("where", ["a directory", "a missing directory", "/dev/full"])
def test_a_file_that_cannot_be_written_warns_once_and_never_fails_a_call(env, monkeypatch, where):
    target = {"a directory": str(env), "a missing directory": str(env / "no" / "such.jsonl"),
              "/dev/full": "/dev/full"}[where]
    monkeypatch.setenv("FASTATTN_RECORD", target)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in (128, 256, 384):
            fastattn.plan(AttentionConfig(**BASE, seqlen_q=s))
    texts = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(texts) == 1 and f"FASTATTN_RECORD={target} cannot be written" in texts[0], texts


def test_a_fifo_nobody_reads_warns_instead_of_blocking_the_first_call(tmp_path):
    fifo = tmp_path / "asked.jsonl"
    os.mkfifo(fifo)
    code = ("import warnings, fastattn\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            "    fastattn._record.note(fastattn.AttentionConfig(batch=1, heads_q=8, head_dim_qk=64, seqlen_q=64))\n"
            "print([str(w.message) for w in caught])\n")
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "FASTATTN_RECORD": str(fifo)},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "cannot be written" in r.stdout, r.stdout


def test_warm_builds_what_a_process_recorded(fake_workers, capsys, monkeypatch):
    path = fake_workers / "asked.jsonl"
    monkeypatch.setenv("FASTATTN_RECORD", str(fake_workers / "warm-asked.jsonl"))  # a pre-warm records nothing
    configs = [AttentionConfig(**BASE, seqlen_q=s) for s in (64, 128, 192)]
    path.write_text("".join(c.to_json() + "\n" for c in configs) + "\n")  # a blank line at the end is fine
    assert cli.main(["warm", str(path), "--workers", "2", "--json", "--no-torch-ops"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["counts"]["built"] == 3
    renamed = fake_workers / "asked.log"  # any name: the content says JSON Lines
    renamed.write_text(path.read_text())
    assert cli.main(["warm", str(renamed), "--workers", "2", "--json", "--no-torch-ops"]) == 0
    assert json.loads(capsys.readouterr().out)["counts"]["loaded"] == 3
    assert not (fake_workers / "warm-asked.jsonl").exists()


@pytest.mark.parametrize("text, message", [
    ('{"batch": 1}\n[1, 2]\n', "x.jsonl:2: each line must be an object of AttentionConfig fields, not a list"),
    ('{"batch": 1}\n{"batch": \n', "x.jsonl:2:11: not valid JSON"),
    ('{"batch": 1, "heads_q": 8, "seqlen_q": 64, "head_dim_qk": 64, "mask": "diag"}\n', "x.jsonl:1: configs[0]: "
                                                                                          "mask='diag'"),
])
def test_a_bad_line_is_named(tmp_path, text, message):
    path = tmp_path / "x.jsonl"
    path.write_text(text)
    with pytest.raises(InvalidArgumentError) as e:
        config_files.load_configs(str(path))
    assert message in str(e.value)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(st.sampled_from('{}[]":,0123456789 \nabcehqst_-.'), max_size=120))
def test_any_text_in_a_jsonl_file_is_configs_or_a_clear_error(tmp_path, text):
    path = tmp_path / "any.jsonl"
    path.write_text(text)
    try:
        configs = config_files.load_configs(str(path))
    except InvalidArgumentError as e:
        assert str(e).startswith(str(path))
    else:
        assert all(isinstance(c, AttentionConfig) for c in configs)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.builds(lambda b, h, s, d, m: AttentionConfig(batch=b, heads_q=h, seqlen_q=s, head_dim_qk=d, mask=m),
                          st.integers(1, 64), st.integers(1, 64), st.integers(1, 1 << 16), st.sampled_from((64, 128)),
                          st.sampled_from(("none", "causal", "causal_bottom_right"))), max_size=8))
def test_what_is_recorded_reads_back_as_the_same_configs(configs):
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "asked.jsonl")
        os.environ["FASTATTN_RECORD"] = path
        try:
            for c in configs:
                _record.note(c)
        finally:
            del os.environ["FASTATTN_RECORD"]
            _record.reset()
        expected = list(dict.fromkeys(configs))
        assert (config_files.load_configs(path) if os.path.exists(path) else []) == expected
