"""Stored bytes past what fastattn reads: numbers no float holds (a 401-digit integer in
"created", meta.build_seconds or a verdict), times outside any calendar, entry files of
gigabytes. Each is damage: a miss for the store, DAMAGED for `cache ls`, "damaged" for
`cache verify`, a refused bundle for `cache import`; never an exception or exit 5.

cuDNN is tests/fake_core.py. Generated numbers are in test_store_properties.py.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile

import pytest

import fastattn
from fastattn import cli, runtime, store
from fastattn.store import entry as entry_mod
from fastattn.verdict import Check, Verdict, VerdictError
from helpers.cli import run
from helpers.redis import FakeRedis

BASE = dict(batch=1, heads_q=8, head_dim_qk=64, mask="causal")
HUGE = 10**400  # json.dumps writes it; no float holds it
VERDICT = Verdict.judge([Check("random", "o", 1e-3, 1.0, 0)], 91900, 6.25e-2, 0.02).to_dict()


def entry_bytes(key: str, header_text: str, blobs: bytes = b"") -> bytes:
    """An entry with a valid checksum around `header_text`, byte for byte."""
    raw = header_text.encode()
    return (entry_mod._FIXED.pack(entry_mod.MAGIC, store.FORMAT_VERSION, len(raw)) + raw
            + hashlib.sha256(raw + blobs).digest() + blobs)


def header(key: str, **changes) -> dict:
    h = {"key": key, "kind": "plan", "description": {"config": dict(BASE, seqlen_q=128)}, "created": 1.0,
         "blobs": [["forward", 1]], "meta": {}}
    for path, value in changes.items():
        target = h
        *folders, last = path.split("__")
        for part in folders:
            target = target[part]
        target[last] = value
    return h


def verdict_with(path: tuple, value) -> dict:
    v = json.loads(json.dumps(VERDICT))
    target = v
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = value
    return v


# Each a header no reader may use: what it holds cannot be read as a number or a time.
DAMAGE = {
    "created a 401-digit integer": header("01" + "a" * 62, created=HUGE),
    "created 1e308": header("02" + "a" * 62, created=1e308),
    "created -1e308": header("03" + "a" * 62, created=-1e308),
    "created before 1970": header("04" + "a" * 62, created=-1.0),
    "created after the year 9999": header("0a" + "a" * 62, created=253402300800.0),
    "build_seconds a 401-digit integer": header("05" + "a" * 62, meta={"build_seconds": HUGE}),
    "a verdict's seconds a 401-digit integer": header("06" + "a" * 62,
                                                      meta={"verdict": verdict_with(("seconds",), HUGE)}),
    "a verdict's error a 401-digit integer": header(
        "07" + "a" * 62, meta={"verdict": verdict_with(("checks", 0, "max_abs_error"), HUGE)}),
    "a compute capability of 401 digits": header("08" + "a" * 62,
                                                 description={"gpu": {"name": "x", "compute_capability": [HUGE]}}),
    "a workspace size of 401 digits": header("09" + "a" * 62, meta={"forward_workspace_size": HUGE}),
}


@pytest.mark.parametrize("what", list(DAMAGE))
def test_an_unreadable_number_is_an_entry_error(what):
    h = DAMAGE[what]
    data = entry_bytes(h["key"], json.dumps(h), b"x")
    with pytest.raises(entry_mod.EntryError):
        entry_mod.decode(data, expected_key=h["key"])
    with pytest.raises(entry_mod.EntryError):
        entry_mod.read_header(data)
    with pytest.raises(entry_mod.EntryError):
        entry_mod.read_header_from_file(io.BytesIO(data))


@pytest.mark.parametrize("path", [("seconds",), ("tolerance",), ("cudnn",), ("checks", 0, "scale"),
                                  ("checks", 0, "excess"), ("checks", 0, "nonfinite")])
def test_a_verdict_with_a_huge_number_is_a_verdict_error(path):
    for value in (HUGE, -HUGE):
        with pytest.raises(VerdictError):
            Verdict.from_dict(verdict_with(path, value))


def test_times_within_the_calendar_decode():
    for created in (0, 0.0, 1.0, 1.7e9, 253402300799.0):
        h = header("0b" + "a" * 62, created=created)
        assert entry_mod.decode(entry_bytes(h["key"], json.dumps(h), b"x")).created == created


def write_damage(root) -> list[str]:
    for h in DAMAGE.values():
        path = os.path.join(root, h["key"][:2], h["key"] + ".entry")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(entry_bytes(h["key"], json.dumps(h), b"x"))
    return [h["key"] for h in DAMAGE.values()]


def test_the_cache_commands_list_them_as_damaged(env, capsys):
    fastattn.plan({**BASE, "seqlen_q": 128})
    keys = write_damage(env / "cache")
    code, out, _ = run(["cache", "ls", "--json"], capsys)
    rows = {r["key"]: r for r in json.loads(out)["entries"]}
    assert code == cli.EXIT_OK and len(rows) == len(keys) + 1
    assert {k for k, r in rows.items() if r["damaged"]} == set(keys)
    code, text, _ = run(["cache", "ls"], capsys)
    assert code == cli.EXIT_OK and text.count("DAMAGED") == len(keys)
    assert all(len(line) < 400 for line in text.splitlines())  # no 300-digit age
    code, out, _ = run(["cache", "verify", "--json"], capsys)
    body = json.loads(out)
    assert code == cli.EXIT_FAILED and body["bad"] == len(keys)
    for key in keys:
        code, out, _ = run(["cache", "show", key[:12], "--json"], capsys)
        assert code == cli.EXIT_OK and json.loads(out)["damaged"], key
    # A miss for the store, counted as corrupt; the valid entry still serves.
    disk = store.DiskStore(str(env / "cache"))
    assert all(disk.get(k) is None for k in keys) and disk.counters["corrupt"] == len(keys)
    runtime.clear()
    fastattn.plan({**BASE, "seqlen_q": 128})
    assert fastattn.stats()["disk_hits"] == 1 and fastattn.stats()["builds"] == 0


@pytest.mark.parametrize("what", list(DAMAGE))
def test_a_bundle_holding_one_is_refused(env, capsys, monkeypatch, what):
    h = DAMAGE[what]
    key, data = h["key"], entry_bytes(h["key"], json.dumps(h), b"x")
    manifest = {"format": 1, "created": 0,
                "entries": [{"key": key, "sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}]}
    path = env / "b.tgz"
    with tarfile.open(path, "w:gz") as tar:
        for name, blob in (("manifest.json", json.dumps(manifest).encode()), (f"entries/{key}.entry", data)):
            info = tarfile.TarInfo(name)
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    monkeypatch.setenv("FASTATTN_CACHE_DIR", str(env / "target"))
    monkeypatch.setenv("FASTATTN_CACHE_TRUSTED", "1")  # (unsigned: refused for its entry, not its signature)
    runtime.clear()
    code, _, err = run(["cache", "import", str(path), "--force"], capsys)
    assert code == cli.EXIT_BAD_INPUT and f"refusing bundle: entries/{key}.entry: " in err, err
    assert not (env / "target").exists()


@pytest.mark.parametrize("what", list(DAMAGE))
def test_the_remote_tier_misses_on_one(what):
    from fastattn.store.remote import RemoteSettings, RemoteStore
    from fastattn.store.signing import wrap

    h = DAMAGE[what]
    r = RemoteStore(RemoteSettings("redis://localhost:1/0", trusted=True), None)
    r._client, r._errors = FakeRedis({"fastattn:" + h["key"]: wrap(None, h["key"], entry_bytes(
        h["key"], json.dumps(h), b"x"))}), (OSError,)
    assert r.get(h["key"]) is None and r.counters["remote_rejected"] == 1


# -- entry files of gigabytes ----------------------------------------------------------------------

_SIZE_PROBE = """
import json, sys
from fastattn import store
disk = store.DiskStore(sys.argv[1])
got = disk.get(sys.argv[2])
print(json.dumps({"got": got is not None, "counters": disk.counters, "holds": disk.holds(sys.argv[2])}))
"""


def _limited(argv, cwd, env):
    """argv run with 1 GiB of address space: enough for fastattn, not for reading 3 GiB."""
    import resource
    import subprocess
    import sys

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    return subprocess.run([sys.executable, *argv], cwd=cwd, env=env, preexec_fn=limit, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture
def sparse_entry(tmp_path):
    """A 3 GiB sparse entry file whose first bytes are a valid header (its blobs are
    not what the header says): an entry no reader may read whole."""
    key = "bb" * 32
    h = header(key)
    path = tmp_path / "ce" / key[:2] / f"{key}.entry"
    path.parent.mkdir(parents=True)
    with open(path, "wb") as f:
        f.write(entry_bytes(key, json.dumps(h), b"x"))
        f.truncate(3 << 30)
    env = {**os.environ, "FASTATTN_CACHE_DIR": str(tmp_path / "ce"),
           "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(fastattn.__file__)),
                                          os.environ.get("PYTHONPATH", "")])}
    env.pop("FASTATTN_REMOTE_CACHE", None)
    return tmp_path, key, env


def test_an_entry_file_of_gigabytes_is_a_miss_never_read_whole(sparse_entry):
    tmp_path, key, env = sparse_entry
    r = _limited(["-c", _SIZE_PROBE, str(tmp_path / "ce"), key], tmp_path, env)
    assert r.returncode == 0, r.stderr
    body = json.loads(r.stdout)
    assert body["got"] is False and body["holds"] is False
    assert body["counters"]["misses"] == 1 and body["counters"]["corrupt"] == 1
    assert "over the" in r.stderr  # the warning says why


def test_the_cache_commands_refuse_an_entry_file_of_gigabytes(sparse_entry):
    tmp_path, key, env = sparse_entry
    r = _limited(["-m", "fastattn", "cache", "verify", "--json"], tmp_path, env)
    assert r.returncode == cli.EXIT_FAILED, r.stdout + r.stderr
    (row,) = json.loads(r.stdout)["entries"]
    assert row["status"] == "damaged" and "over the" in row["reason"]
    r = _limited(["-m", "fastattn", "cache", "export", "--all", "--json", str(tmp_path / "b.tgz")], tmp_path, env)
    assert r.returncode == cli.EXIT_OK and json.loads(r.stdout)["exported"] == 0, r.stdout + r.stderr
    r = _limited(["-m", "fastattn", "cache", "ls", "--json"], tmp_path, env)
    (row,) = json.loads(r.stdout)["entries"]
    assert r.returncode == cli.EXIT_OK and "over the" in row["damaged"], r.stdout + r.stderr


def test_entries_over_the_cap_are_neither_decoded_nor_written(tmp_path, monkeypatch):
    monkeypatch.setattr(entry_mod, "MAX_ENTRY_BYTES", 1 << 10)
    big = store.Entry("cd" * 32, "plan", {}, {"forward": b"x" * 2048}, {}, 1.0)
    with pytest.raises(entry_mod.EntryError, match="over the"):
        entry_mod.decode(entry_mod.encode(big))
    disk = store.DiskStore(str(tmp_path / "c"))
    assert not disk.put(big) and not os.path.exists(disk.path_for(big.key))
    with pytest.raises(entry_mod.EntryError, match="over the"):
        disk.publish(big)
    small = store.Entry("ce" * 32, "plan", {}, {"forward": b"x" * 16}, {}, 1.0)
    assert disk.put(small) and disk.get(small.key) == small
