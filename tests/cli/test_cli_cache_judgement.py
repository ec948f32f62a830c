"""One judgement of an entry file: `cache show` calls damaged what `cache verify` calls
damaged (the whole file checked, not its header alone), and an entry whose header
describes another plan than its key (a valid checksum over another config's
description) is damaged everywhere: verify, show and ls say so, and the runtime does
not serve it. cuDNN is tests/fake_core.py (the `env` fixture)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastattn
from fastattn import cli, runtime, store
from fastattn.store import entry as entry_mod

from helpers.cli import BASE, fill, run


def run_json(argv, capsys):
    code, out, err = run(argv + ["--json"], capsys)
    return code, json.loads(out)


def _verdicts(capsys) -> dict[str, str]:
    code, body = run_json(["cache", "verify"], capsys)
    return {row["key"]: row["status"] for row in body["entries"]}


def test_show_says_damaged_where_verify_does(env, capsys):
    fill()
    victim = next(runtime.plan_cache().store.main.entries())
    with open(victim.path, "r+b") as f:  # the blobs: the header stays readable
        f.seek(victim.size - 3)
        f.write(b"zzz")
    assert _verdicts(capsys)[victim.key] == "damaged"
    code, shown = run_json(["cache", "show", victim.key], capsys)
    assert code == cli.EXIT_OK and shown["damaged"] and "checksum" in shown["damaged"], shown


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_show_and_verify_agree_on_any_damage(env, capsys, data):
    runtime.clear()
    fastattn.plan(dict(BASE, seqlen_q=128))
    info = next(runtime.plan_cache().store.main.entries())
    with open(info.path, "rb") as f:
        original = f.read()
    at = data.draw(st.integers(0, len(original) - 1))
    value = data.draw(st.integers(0, 255))
    cut = data.draw(st.booleans())
    damaged = original[:at] if cut else original[:at] + bytes([value]) + original[at + 1:]
    try:
        with open(info.path, "wb") as f:
            f.write(damaged)
        verdict = _verdicts(capsys).get(info.key)
        code, shown = run_json(["cache", "show", info.key], capsys)
        if verdict is None:  # not fastattn's any more (its magic gone, outside a fastattn cache): listed as such
            assert code == cli.EXIT_BAD_INPUT
        else:
            assert code == cli.EXIT_OK and bool(shown["damaged"]) == (verdict == "damaged"), (verdict, shown)
    finally:
        with open(info.path, "wb") as f:
            f.write(original)


@pytest.fixture
def swapped(env):
    """An entry at config A's key whose header (checksum valid) describes config B."""
    a, b = dict(BASE, seqlen_q=128), dict(BASE, seqlen_q=256)
    fastattn.plan(a)
    fastattn.plan(b)
    cache = runtime.plan_cache()
    key_a, key_b = cache.key(fastattn.AttentionConfig(**a)), cache.key(fastattn.AttentionConfig(**b))
    main = cache.store.main
    other = main.get(key_b)
    forged = store.Entry(key_a, other.kind, other.description, other.blobs, other.meta, other.created)
    with open(main.path_for(key_a), "wb") as f:
        f.write(entry_mod.encode(forged))
    runtime.clear()
    return a, key_a


def test_verify_calls_an_entry_for_another_config_damaged(swapped, capsys):
    a, key = swapped
    code, body = run_json(["cache", "verify"], capsys)
    row = next(r for r in body["entries"] if r["key"] == key)
    assert code == cli.EXIT_FAILED and row["status"] == "damaged" and "describes" in row["reason"], row
    code, shown = run_json(["cache", "show", key], capsys)
    assert code == cli.EXIT_OK and "describes" in (shown["damaged"] or ""), shown
    code, listed = run_json(["cache", "ls"], capsys)
    assert [r["damaged"] for r in listed["entries"] if r["key"] == key][0], listed


def test_the_runtime_never_serves_an_entry_for_another_config(swapped, monkeypatch):
    # Real cuDNN would load the other config's plan and run it on this config's
    # tensors (fake_core refuses blobs that are not the config's own): the entry is
    # never handed to the core at all.
    import fake_core

    a, key = swapped
    loads = []
    real = fake_core.load_plan
    monkeypatch.setattr(fake_core, "load_plan", lambda cfg, *args, **kw: loads.append(cfg) or real(cfg, *args, **kw))
    result = fastattn.probe(a)
    assert result.source == "built" and fastattn.stats()["builds"] == 1 and loads == []
    assert runtime.plan_cache().store.main.get(key).description["config"]["seqlen_q"] == 128  # overwritten
