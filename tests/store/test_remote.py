"""The Redis tier and signed entries, against a real redis-server on loopback (CPU; the
plans are tests/fake_core.py's synthetic blobs).

redis-server and the redis client are needed; where either is missing these tests
skip with the reason, and FASTATTN_REQUIRE_REDIS=1 (set by .ci/run) makes that a
failure instead.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import fastattn
from fastattn import cli, runtime, store
from fastattn.store import bundle, signing
from fastattn.store.remote import RemoteSettings, RemoteStore

import fake_core
from helpers.paths import TESTS
from helpers.redis import start_server
CFG = dict(batch=1, heads_q=32, seqlen_q=512, head_dim_qk=128, mask="causal", training=True)
SECRET = b"correct horse battery staple"


@pytest.fixture
def server(tmp_path):
    s = start_server(tmp_path)
    yield s
    s.stop()


def remote(server, secret=SECRET, **kw) -> RemoteStore:
    return RemoteStore(RemoteSettings(url=server.url, **{"timeout": 0.3, "retry_after": 0.3, **kw}), secret)


def entry(name="ab", blob=b"plan-bytes" * 100) -> store.Entry:
    """An entry under its own key (its description's hash: a reader rejects any other), one
    per name."""
    from fastattn.store.keys import key_of

    described = {"config": {"batch": 1}, "name": name}
    return store.Entry(key_of(described), "plan", described, {"forward": blob}, {"forward_engine": "e"}, 1.0)


# -- the store ---------------------------------------------------------------------


def test_signed_entries_round_trip(server):
    r = remote(server)
    e = entry()
    assert r.put(e)
    raw = server.client().get("fastattn:" + e.key)
    assert raw.startswith(signing.SIGNED_MAGIC)
    got = r.get(e.key)
    assert got.blobs == e.blobs and got.meta == e.meta
    assert r.get("cd" * 32) is None
    assert r.counters["remote_hits"] == 1 and r.counters["remote_misses"] == 1 and r.counters["remote_published"] == 1


def test_unsigned_tampered_and_wrongly_signed_entries_are_ignored(server, caplog):
    r = remote(server)
    c = server.client()
    k = {n: entry(n).key for n in ("01", "02", "03", "04", "05")}
    c.set("fastattn:" + k["01"], store.entry.encode(entry("01")))  # unsigned
    c.set("fastattn:" + k["02"], signing.wrap(b"another secret", k["02"], store.entry.encode(entry("02"))))
    signed = bytearray(signing.wrap(SECRET, k["03"], store.entry.encode(entry("03"))))
    signed[-1] ^= 1  # one flipped bit in the blob
    c.set("fastattn:" + k["03"], bytes(signed))
    # A valid signed entry, replayed under another key.
    c.set("fastattn:" + k["04"], signing.wrap(SECRET, k["05"], store.entry.encode(entry("05"))))
    with caplog.at_level(logging.WARNING, logger="fastattn"):
        assert all(r.get(k[n]) is None for n in ("01", "02", "03", "04"))
    assert r.counters["remote_rejected"] == 4 and r.counters["remote_hits"] == 0
    text = caplog.text
    assert "unsigned" in text and text.count("bad signature") == 3


def test_an_entry_whose_header_describes_another_plan_is_rejected(server, caplog):
    # Signed by the fleet's secret, under a valid checksum, but its header is another plan's:
    # pull would store what this machine's runtime never serves and verify calls damaged.
    r = remote(server)
    other, key = entry("06"), entry("07").key
    swapped = store.Entry(key, other.kind, other.description, other.blobs, other.meta, other.created)
    server.client().set("fastattn:" + key, signing.wrap(SECRET, key, store.entry.encode(swapped)))
    with caplog.at_level(logging.WARNING, logger="fastattn"):
        assert r.get(key) is None and r.fetch(key) is None
    assert r.counters["remote_rejected"] >= 1 and "describes another plan than its key" in caplog.text


def test_a_trusted_store_without_a_secret_reads_plain_entries(server):
    r = remote(server, secret=None, trusted=True)
    e = entry()
    assert r.put(e)
    assert not server.client().get("fastattn:" + e.key).startswith(signing.SIGNED_MAGIC)
    assert r.get(e.key).blobs == e.blobs
    # A reader with a secret does not take what nobody signed.
    assert remote(server).get(e.key) is None


def test_no_secret_and_not_trusted_leaves_the_tier_off(server, caplog, monkeypatch):
    from fastattn.store import remote as remote_mod

    monkeypatch.setattr(remote_mod, "_warned_off", set())
    with caplog.at_level(logging.WARNING, logger="fastattn"):
        r = remote(server, secret=None)
        assert not r.put(entry()) and r.get(entry().key) is None
        assert not remote(server, secret=None).put(entry())
    assert caplog.text.count("is off") == 1 and "FASTATTN_CACHE_TRUSTED" in caplog.text
    assert server.client().dbsize() == 0 and r.status()["state"].startswith("off:")


def test_a_value_over_the_size_cap_is_rejected_without_being_read_whole(server, caplog, monkeypatch):
    from fastattn.store import remote as remote_mod

    monkeypatch.setattr(remote_mod, "MAX_VALUE_BYTES", 4000)
    r = remote(server)
    c = server.client()
    small = entry("0a", blob=b"x" * 100)
    assert r.put(small)
    c.set("fastattn:" + "0b" * 32, b"y" * 50_000)
    c.set("fastattn:" + "0c" * 32, b"")  # an empty value: no entry
    read = []
    real = r._read
    monkeypatch.setattr(r, "_read", lambda conn, key: read.append(real(conn, key)) or read[-1])
    with caplog.at_level(logging.WARNING, logger="fastattn"):
        assert r.get(small.key).blobs == small.blobs
        assert r.get("0b" * 32) is None and r.get("0c" * 32) is None
    assert len(read[1]) == 4001  # one byte past the cap, of 50,000
    assert r.counters["remote_rejected"] == 1 and r.counters["remote_misses"] == 1
    assert "over 4000 bytes" in caplog.text
    assert r.fetch("0b" * 32) is None and len(read[-1]) == 4001  # fetch (push and pull) reads the same way


def test_redis_stopped_mid_run_then_restarted(server, caplog):
    r = remote(server)
    e = entry()
    assert r.put(e) and r.get(e.key) is not None
    server.stop()
    with caplog.at_level(logging.WARNING, logger="fastattn"):
        t0 = time.monotonic()
        assert r.get(e.key) is None  # a miss, not an exception
        assert r.get(e.key) is None and not r.put(e)  # resting: no new attempt, no new warning
        assert time.monotonic() - t0 < 2
    assert r.counters["remote_errors"] == 1 and r.status()["state"].startswith("down")
    assert caplog.text.count("is unreachable") == 1
    server.start()  # same port, empty: no persistence
    time.sleep(0.35)  # past retry_after
    assert r.put(e) and r.get(e.key) is not None and r.status()["state"] == "connected"


def test_a_slow_redis_costs_its_timeout_not_a_stall(server):
    r = remote(server, timeout=0.2)
    assert r.put(entry())
    blocker = threading.Thread(target=lambda: server.client().execute_command("DEBUG", "SLEEP", "2"))
    blocker.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    assert r.get(entry().key) is None
    elapsed = time.monotonic() - t0
    blocker.join()
    assert elapsed < 1.0 and r.counters["remote_errors"] == 1


def test_settings_from_the_environment():
    env = {"FASTATTN_REMOTE_CACHE": "redis://:hunter2@cache:6379/3", "FASTATTN_REMOTE_PREFIX": "fleet-a:",
           "FASTATTN_REMOTE_TIMEOUT": "0.5", "FASTATTN_CACHE_HMAC_KEY": "s3cret", "FASTATTN_CACHE_DIR": "/tmp/x"}
    s = store.settings_from_env(env)
    assert s.remote.prefix == "fleet-a:" and s.remote.timeout == 0.5 and s.secret == b"s3cret"
    assert "s3cret" not in repr(s)
    r = RemoteStore(s.remote, s.secret)
    assert "hunter2" not in r.name and "***" in r.name
    for name, value, match in (("FASTATTN_REMOTE_CACHE", "http://x", "expected redis://"),
                               ("FASTATTN_REMOTE_TIMEOUT", "soon", "FASTATTN_REMOTE_TIMEOUT='soon'"),
                               ("FASTATTN_REMOTE_WAIT", "-1", "is negative"),
                               ("FASTATTN_CACHE_HMAC_KEY", " ", "FASTATTN_CACHE_HMAC_KEY is set but empty"),
                               ("FASTATTN_CACHE_HMAC_KEY_FILE", "/nonexistent/key", "cannot read it")):
        bad = {**env, name: value}
        if name == "FASTATTN_CACHE_HMAC_KEY_FILE":
            bad.pop("FASTATTN_CACHE_HMAC_KEY")
        with pytest.raises(fastattn.InvalidArgumentError, match=match):
            store.settings_from_env(bad)


# -- the runtime: memory, disk, Redis -------------------------------------------------


@pytest.fixture
def fleet(server, tmp_path, monkeypatch):
    """Environment for a fleet sharing `server`; the runtime uses the fake core."""
    monkeypatch.setenv("FASTATTN_REMOTE_CACHE", server.url)
    monkeypatch.setenv("FASTATTN_CACHE_HMAC_KEY", SECRET.decode())
    monkeypatch.setenv("FASTATTN_REMOTE_RETRY", "0.3")
    monkeypatch.setattr(runtime, "_core", lambda: fake_core)
    yield server
    runtime.clear()
    runtime.configure()


def fresh_process(cache_dir, monkeypatch):
    """What a new process on another machine has: its own empty disk cache, nothing in memory."""
    monkeypatch.setenv("FASTATTN_CACHE_DIR", str(cache_dir))
    runtime.clear()
    runtime.configure()


def test_a_plan_built_on_one_machine_is_loaded_by_another(fleet, tmp_path, monkeypatch):
    fresh_process(tmp_path / "a", monkeypatch)
    a = fastattn.plan(CFG)
    assert fastattn.stats()["builds"] == 1 and fastattn.stats()["cache"]["remote_published"] == 1
    fresh_process(tmp_path / "b", monkeypatch)
    r = fastattn.probe(CFG)
    s = fastattn.stats()
    assert r.source == "remote" and s["builds"] == 0 and s["cache"]["remote_hits"] == 1
    assert fastattn.plan(CFG).output() == a.output()
    # Kept on b's disk: the next process there needs no network.
    monkeypatch.setenv("FASTATTN_REMOTE_CACHE", "redis://127.0.0.1:1/0")
    fresh_process(tmp_path / "b", monkeypatch)
    assert fastattn.probe(CFG).source == "disk" and fastattn.stats()["cache"].get("remote_hits", 0) == 0


def test_refusals_travel_too(fleet, tmp_path, monkeypatch):
    refused = {**CFG, "head_dim_qk": 1024}
    fresh_process(tmp_path / "a", monkeypatch)
    assert not fastattn.probe(refused).supported
    fresh_process(tmp_path / "b", monkeypatch)
    r = fastattn.probe(refused)
    assert not r.supported and r.source == "remote" and "1024" in r.reason and fastattn.stats()["builds"] == 0


def test_redis_down_costs_one_timeout_and_one_warning(fleet, tmp_path, monkeypatch, caplog):
    # The three plans inside one retry window, however loaded the machine (the fleet's
    # 0.3 s window passed between plans on 2 busy cores: two errors): one attempt, counted.
    monkeypatch.setenv("FASTATTN_REMOTE_RETRY", "600")
    fleet.stop()
    fresh_process(tmp_path / "a", monkeypatch)
    with caplog.at_level(logging.WARNING, logger="fastattn"):
        for s in (128, 256, 384):
            assert fastattn.plan({**CFG, "seqlen_q": s})
    s = fastattn.stats()
    assert s["builds"] == 3 and s["cache"]["remote_errors"] == 1
    assert caplog.text.count("plans come from this machine alone") == 1


def _script(body: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(body)]


def _fake_env(**extra) -> dict:
    return {**os.environ, "FASTATTN_TEST_FAKE_CORE": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (str(TESTS / "fake_site"), str(TESTS),
                                                      os.environ.get("PYTHONPATH")) if p), **extra}


def test_many_machines_missing_one_key_build_it_once(server, tmp_path):
    log_path = tmp_path / "builds.log"
    body = f"""
        import json, fastattn
        r = fastattn.probe({CFG!r})
        print(json.dumps({{"source": r.source, "builds": fastattn.stats()["builds"]}}))
    """
    procs = [subprocess.Popen(_script(body), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=_fake_env(FASTATTN_CACHE_DIR=str(tmp_path / f"m{i}"), FASTATTN_REMOTE_CACHE=server.url,
                                            FASTATTN_CACHE_HMAC_KEY=SECRET.decode(), FAKE_BUILD_SECONDS="1.5",
                                            FAKE_BUILD_LOG=str(log_path)))
             for i in range(6)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert len(log_path.read_text().splitlines()) == 1
    assert sorted(r["source"] for r in results) == ["built"] + ["remote"] * 5


def test_a_builder_that_dies_leaves_the_others_to_build(fleet, tmp_path, monkeypatch):
    # Another machine took the lock and died: its lock expires, but nobody waits that long.
    monkeypatch.setenv("FASTATTN_REMOTE_WAIT", "0.5")
    fresh_process(tmp_path / "a", monkeypatch)
    key = runtime.plan_cache().key(fastattn.AttentionConfig.coerce(CFG), 0)
    fleet.client().set("fastattn:lock:" + key, "someone", px=60_000)
    t0 = time.monotonic()
    assert fastattn.probe(CFG).source == "built"
    assert 0.4 < time.monotonic() - t0 < 3 and fastattn.stats()["cache"]["remote_waits"] == 1


# -- the command ------------------------------------------------------------------------


def run(argv, capsys):
    code = cli.main(argv + ["--json"])
    return code, json.loads(capsys.readouterr().out)


def test_push_then_pull_into_an_empty_cache(fleet, tmp_path, monkeypatch, capsys):
    fresh_process(tmp_path / "a", monkeypatch)
    for s in (128, 256):
        fastattn.plan({**CFG, "seqlen_q": s})
    fleet.client().flushall()  # as if published by nobody yet
    code, out = run(["cache", "push", "--all"], capsys)
    assert code == 0 and out["pushed"] == 2 and fleet.client().dbsize() == 2
    fresh_process(tmp_path / "b", monkeypatch)
    code, out = run(["cache", "pull", "--all"], capsys)
    assert code == 0 and out["pulled"] == 2
    code, out = run(["cache", "pull", "--all"], capsys)
    assert code == 0 and out["pulled"] == 0 and out["already_present"] == 2
    code, out = run(["info"], capsys)
    assert out["cache"]["remote"]["signed"] and out["cache"]["remote"]["state"] == "connected"
    assert "correct horse" not in json.dumps(out)


def test_push_leaves_out_an_entry_whose_header_is_another_plans(fleet, tmp_path, monkeypatch, capsys):
    # Damaged as verify says, and rejected by every reader: counted as damaged, not pushed.
    fresh_process(tmp_path / "a", monkeypatch)
    fastattn.plan(CFG)
    main = runtime.plan_cache().store.main
    other = entry("08")
    main.publish(store.Entry(entry("09").key, other.kind, other.description, other.blobs, other.meta, other.created))
    fleet.client().flushall()
    code, out = run(["cache", "push", "--all"], capsys)
    assert code == 0 and out["pushed"] == 1 and out["damaged"] == 1 and fleet.client().dbsize() == 1


def test_push_with_redis_down_is_exit_4(fleet, tmp_path, monkeypatch, capsys):
    fresh_process(tmp_path / "a", monkeypatch)
    fastattn.plan(CFG)
    fleet.stop()
    runtime.configure()
    code = cli.main(["cache", "push", "--all"])
    assert code == cli.EXIT_FAILED and "remote cache" in capsys.readouterr().err


def test_push_without_a_remote_tier_is_bad_input(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("FASTATTN_REMOTE_CACHE", raising=False)
    monkeypatch.setenv("FASTATTN_CACHE_DIR", str(tmp_path))
    runtime.configure()
    try:
        assert cli.main(["cache", "pull", "--all"]) == cli.EXIT_BAD_INPUT
        assert "FASTATTN_REMOTE_CACHE" in capsys.readouterr().err
    finally:
        runtime.configure()


# -- signed bundles (no Redis needed) -----------------------------------------------------


def test_signed_bundles(tmp_path):
    src = store.DiskStore(str(tmp_path / "src"))
    src.put(entry())
    path = str(tmp_path / "b.tar.gz")
    assert bundle.export_bundle([src], path, secret=SECRET) == 1
    dst = store.DiskStore(str(tmp_path / "dst"))
    env = store.environment_of(entry().description)
    assert bundle.import_bundle(path, dst, environment=env, secret=SECRET).imported == 1
    with pytest.raises(fastattn.InvalidArgumentError, match="signature does not match"):
        bundle.import_bundle(path, dst, environment=env, secret=b"another secret")
    unsigned = str(tmp_path / "u.tar.gz")
    bundle.export_bundle([src], unsigned)
    with pytest.raises(fastattn.InvalidArgumentError, match="not signed"):
        bundle.import_bundle(unsigned, dst, environment=env, force=True, secret=SECRET)
    with pytest.raises(fastattn.InvalidArgumentError, match="not signed, and no signing secret"):
        bundle.import_bundle(unsigned, dst, environment=env)  # no secret: only where trust is stated
    assert bundle.import_bundle(unsigned, dst, environment=env, trusted=True).already_present == 1


def test_warm_answers_what_redis_holds_without_workers(fleet, tmp_path, monkeypatch):
    from fastattn import warm

    fresh_process(tmp_path / "a", monkeypatch)
    fastattn.plan(CFG)  # built on machine a, published
    fresh_process(tmp_path / "b", monkeypatch)
    monkeypatch.setattr(warm, "_Worker", lambda *a, **k: pytest.fail("a worker was started"))
    report = warm.warm([CFG], workers=2)
    assert report.counts["loaded"] == 1 and report.processes == 0
    assert store.DiskStore(str(tmp_path / "b")).signature(
        runtime.plan_cache().key(fastattn.AttentionConfig.coerce(CFG), 0)) is not None  # kept on b's disk


# -- untrusted values, the tier protocol ---------------------------------------------------


def test_both_tiers_have_the_tier_protocol(server, tmp_path):
    r, d = remote(server), store.DiskStore(str(tmp_path))
    assert isinstance(r, store.Tier) and isinstance(d, store.Tier)
    assert (r.kind, d.kind) == ("remote", "disk") and d.name == str(tmp_path) and "127.0.0.1" in r.name


def test_remote_entries_skip_what_is_not_a_valid_entry(server):
    r = remote(server)
    good = [entry("ab"), entry("cd")]
    for e in good:
        r.put(e)
    c = server.client()
    c.set("fastattn:" + "ef" * 32, b"garbage")  # a key, but not an entry
    c.set("fastattn:../../etc/passwd", r._client.get("fastattn:" + good[0].key))  # an entry under a non-key
    c.set("fastattn:caf\xe9", b"x")  # not ASCII: once a UnicodeEncodeError in the signature check
    assert sorted(r.keys()) == sorted([good[0].key, good[1].key, "ef" * 32])
    infos = list(r.entries())
    assert sorted(i.key for i in infos) == sorted(e.key for e in good)
    assert all(i.header["key"] == i.key and i.size > 0 for i in infos)
    assert r.get("caf\xe9") is None and r.get("../../etc/passwd") is None


def test_pull_skips_junk_and_fails_with_exit_4_when_the_cache_cannot_be_written(fleet, tmp_path, monkeypatch,
                                                                                capsys):
    import errno

    fresh_process(tmp_path / "a", monkeypatch)
    fastattn.plan(CFG)
    fleet.client().set("fastattn:caf\xe9", b"x")
    fresh_process(tmp_path / "b", monkeypatch)

    def refuse(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr("tempfile.mkstemp", refuse)
    code = cli.main(["cache", "pull", "--all"])
    out, err = capsys.readouterr()
    assert code == cli.EXIT_FAILED and "cannot write" in err and "Traceback" not in out + err
    monkeypatch.undo()
    fresh_process(tmp_path / "b", monkeypatch)
    monkeypatch.setenv("FASTATTN_REMOTE_CACHE", fleet.url)
    monkeypatch.setenv("FASTATTN_CACHE_HMAC_KEY", SECRET.decode())
    monkeypatch.setattr(runtime, "_core", lambda: fake_core)
    runtime.configure()
    code, out = run(["cache", "pull", "--all"], capsys)
    assert code == 0 and out["pulled"] == 1 and out["rejected"] == 0
