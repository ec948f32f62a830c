"""Readers of untrusted bytes (bundles, cache entries, their headers)
give their documented error or succeed; `cache ls | verify | import` report damage
with a documented exit code and no traceback; the cache's directories are private.

One test per defect of the issue (4, 5, 6, 9, 12); the generated inputs are in
test_store_properties.py. cuDNN is tests/fake_core.py.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import stat
import tarfile

import pytest

import fastattn
from fastattn import cli, runtime, store
from fastattn.store import bundle as bundle_mod
from fastattn.store import entry as entry_mod


BASE = dict(batch=1, heads_q=8, head_dim_qk=64, mask="causal")


def new_process(cache_dir, monkeypatch):
    monkeypatch.setenv("FASTATTN_CACHE_DIR", str(cache_dir))
    monkeypatch.setenv("FASTATTN_CACHE_TRUSTED", "1")  # the bundles here are unsigned: trust is stated
    runtime.clear()


def run(argv, capsys):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def run_json(argv, capsys):
    code, out, err = run(argv + ["--json"], capsys)
    return code, json.loads(out)


def export(env, capsys, n=2) -> str:
    for s in range(n):
        fastattn.plan({**BASE, "seqlen_q": 128 * (s + 1)})
    path = str(env / "good.tar.gz")
    assert run_json(["cache", "export", path], capsys)[1]["exported"] == n
    return path


def members_of(path) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar}


def write_bundle(path, members: dict[str, bytes], mode="w:gz") -> str:
    with tarfile.open(path, mode) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return str(path)


def odd_entry(entry_key: str, **header) -> bytes:
    """An entry whose checksum is right and whose header is not what encode() makes
    of an Entry: fields of the wrong type, as a buggy or hostile writer would leave."""
    entry = store.Entry(entry_key, "plan", {"config": dict(BASE, seqlen_q=128)}, {"forward": b"x" * 10}, {}, 1.0)
    data = entry_mod.encode(entry)
    fixed = entry_mod._FIXED
    _, _, n = fixed.unpack_from(data)
    h = json.loads(data[fixed.size : fixed.size + n])
    h.update(header)
    raw = json.dumps(h).encode()
    blobs = data[fixed.size + n + 32 :]
    return fixed.pack(entry_mod.MAGIC, store.FORMAT_VERSION, len(raw)) + raw + hashlib.sha256(raw + blobs).digest() + blobs


# -- defect 4: a truncated bundle -------------------------------------------------------------


@pytest.mark.parametrize("mode", ["w:gz", "w"])
def test_truncated_bundles_are_bad_input_not_a_traceback(env, capsys, monkeypatch, mode):
    good = write_bundle(env / "plain.tar", members_of(export(env, capsys)), mode)
    data = open(good, "rb").read()
    new_process(env / "target", monkeypatch)
    for cut in (300, 600, len(data) // 2):
        bad = env / f"cut-{cut}.tgz"
        bad.write_bytes(data[:cut])
        code, out, err = run(["cache", "import", str(bad), "--force"], capsys)
        assert code == cli.EXIT_BAD_INPUT, (cut, err)
        assert "bundle" in err and str(bad) in err
    assert not (env / "target").exists()
    # Cut within the archive's zero padding or the gzip trailer, every member may still
    # be whole: then the import succeeds, with every entry intact.
    for cut in (len(data) - 700, len(data) - 1):
        bad = env / f"cut-{cut}.tgz"
        bad.write_bytes(data[:cut])
        code, out, err = run(["cache", "import", str(bad), "--force"], capsys)
        assert code in (cli.EXIT_OK, cli.EXIT_BAD_INPUT), (cut, err)
        if code == cli.EXIT_OK:
            assert run_json(["cache", "verify"], capsys)[0] == cli.EXIT_OK


def test_truncated_bundle_raises_only_invalid_argument(tmp_path):
    src = write_bundle(tmp_path / "b.tgz", {"manifest.json": b"{}" * 5000, "entries/" + "a" * 64 + ".entry": b"x" * 5000})
    data = open(src, "rb").read()
    for cut in range(0, len(data), max(1, len(data) // 40)):
        (tmp_path / "t.tgz").write_bytes(data[:cut])
        with pytest.raises(fastattn.InvalidArgumentError):
            bundle_mod.import_bundle(str(tmp_path / "t.tgz"), store.DiskStore(str(tmp_path / "c")),
                                     environment=None, force=True)
    assert not (tmp_path / "c").exists()


# -- defect 5: an entry with valid checksums and a description of the wrong type ---------------


@pytest.mark.parametrize("description", ["a string", [1, 2], 3, None, {"gpu": "NVIDIA H200"},
                                         {"config": "batch=1"}, {"gpu": {"name": 7}}])
def test_bundle_entry_with_odd_description_is_refused(env, capsys, monkeypatch, description):
    key = "c" * 64
    data = odd_entry(key, description=description)
    manifest = {"format": 1, "created": 0, "entries": [{"key": key, "sha256": hashlib.sha256(data).hexdigest(),
                                                                "size": len(data)}]}
    path = write_bundle(env / "odd.tgz", {"manifest.json": json.dumps(manifest).encode(),
                                          f"entries/{key}.entry": data})
    new_process(env / "target", monkeypatch)
    code, out, err = run(["cache", "import", path, "--force"], capsys)
    assert code == cli.EXIT_BAD_INPUT and "refusing bundle" in err and "description" in err, err
    assert not (env / "target").exists()


# -- defect 6: damaged headers in the cache ---------------------------------------------------


ODD_HEADERS = [
    {"created": "yesterday"}, {"created": None}, {"created": True}, {"description": "a string"},
    {"description": {"gpu": "NVIDIA H200"}}, {"description": {"config": [1]}}, {"meta": []},
    {"blobs": [["forward", -1]]}, {"kind": "maybe"}, {"key": "../../etc/passwd"},
]


def test_damaged_headers_are_listed_and_verified_as_damaged(env, capsys):
    good = fastattn.plan({**BASE, "seqlen_q": 128})
    cache = store.DiskStore(str(env / "cache"))
    keys = []
    for i, header in enumerate(ODD_HEADERS):
        key = f"{i:02x}" + "d" * 62
        header = {"key": key, **header}
        os.makedirs(os.path.dirname(cache.path_for(key)), exist_ok=True)
        with open(cache.path_for(key), "wb") as f:
            f.write(odd_entry(key, **header))
        keys.append(key)
    code, body = run_json(["cache", "ls"], capsys)
    assert code == cli.EXIT_OK and len(body["entries"]) == len(ODD_HEADERS) + 1
    damaged = {e["key"] for e in body["entries"] if e["damaged"]}
    assert damaged == set(keys) and body["damaged"] == len(keys)
    code, text, _ = run(["cache", "ls"], capsys)
    assert "DAMAGED" in text and "b1 8h s128 d64" in text  # the valid entry is still listed in full
    code, body = run_json(["cache", "verify"], capsys)
    assert code == cli.EXIT_FAILED and body["bad"] == len(keys)
    assert {e["key"] for e in body["entries"] if e["status"] == "damaged"} == set(keys)
    code, _, _ = run(["cache", "show", keys[0][:8]], capsys)
    assert code == cli.EXIT_OK
    # The valid entry still loads in a new process; the damaged ones are never used.
    runtime.clear()
    assert fastattn.plan({**BASE, "seqlen_q": 128}).output() == good.output()
    assert fastattn.stats()["disk_hits"] == 1 and fastattn.stats()["builds"] == 0
    assert runtime.plan_cache().configs() == [fastattn.AttentionConfig(**BASE, seqlen_q=128)]


def test_a_damaged_entry_is_a_miss_for_plan(env):
    cfg = fastattn.AttentionConfig(**BASE, seqlen_q=256)
    key = runtime.plan_cache().key(cfg)
    path = store.DiskStore(str(env / "cache")).path_for(key)
    os.makedirs(os.path.dirname(path))
    with open(path, "wb") as f:
        f.write(odd_entry(key, created="yesterday"))
    fastattn.plan(cfg)
    s = fastattn.stats()
    assert s["builds"] == 1 and s["cache"]["corrupt"] == 1
    runtime.clear()
    fastattn.plan(cfg)  # the rebuild replaced it
    assert fastattn.stats()["builds"] == 0


# -- defect 9: import into an unwritable cache; importing twice ---------------------------------


def test_import_into_an_unwritable_cache_is_exit_4(env, capsys, monkeypatch):
    path = export(env, capsys)
    new_process(env / "target", monkeypatch)

    def refuse(*a, **k):  # the tests run as root, whom chmod does not stop
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr("tempfile.mkstemp", refuse)
    code, out, err = run(["cache", "import", path], capsys)
    assert code == cli.EXIT_FAILED and "cannot write" in out + err and "imported 2" not in out + err
    runtime.clear()  # a new process
    code, body = run_json(["cache", "import", path], capsys)
    assert code == cli.EXIT_FAILED and "cannot write" in body["message"]
    code, _, err = run(["cache", "import", path], capsys)  # the same process, after a failed write
    assert code == cli.EXIT_FAILED and "cannot write" in err


def test_importing_twice_reports_already_present(env, capsys, monkeypatch):
    path = export(env, capsys)
    new_process(env / "target", monkeypatch)
    assert run_json(["cache", "import", path], capsys)[1]["imported"] == 2
    code, body = run_json(["cache", "import", path], capsys)
    assert code == 0 and body["imported"] == 0 and body["already_present"] == 2
    # A damaged copy is replaced, not counted as present.
    info = next(iter(store.DiskStore(str(env / "target")).entries()))
    with open(info.path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"?")
    code, body = run_json(["cache", "import", path], capsys)
    assert body["imported"] == 1 and body["already_present"] == 1


# -- defect 12: directory modes ---------------------------------------------------------------


@pytest.mark.parametrize("umask", [0o022, 0o000, 0o077])
def test_a_new_cache_root_is_private_whatever_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        s = store.DiskStore(str(tmp_path / "parent" / "cache"))
        assert s.put(store.Entry("ab" + "0" * 62, "plan", {}, {"forward": b"x"}, {}, 1.0))
        with s.lock("ab" + "0" * 62):
            pass
        shared = store.DiskStore(str(tmp_path / "shared"), shared=True)
        assert shared.put(store.Entry("ab" + "0" * 62, "plan", {}, {"forward": b"x"}, {}, 1.0))
    finally:
        os.umask(old)
    mode = lambda p: stat.S_IMODE(os.stat(p).st_mode)  # noqa: E731
    for folder in (s.root, os.path.join(s.root, "ab"), os.path.join(s.root, "locks")):
        assert mode(folder) == 0o700, folder
    for folder in (shared.root, os.path.join(shared.root, "ab")):
        assert mode(folder) == 0o2775, folder


def test_keys_that_are_not_keys_never_name_a_path(tmp_path):
    s = store.DiskStore(str(tmp_path / "c"))
    for key in ("../../evil", "/etc/passwd", "AB" + "0" * 62, "ab"):
        assert s.get(key) is None and s.signature(key) is None
        assert not s.put(store.Entry(key, "plan", {}, {}, {}, 1.0))
        with pytest.raises(store.EntryError):
            s.publish(store.Entry(key, "plan", {}, {}, {}, 1.0))
    assert not os.path.exists(tmp_path / "evil") and not os.path.exists(tmp_path / "c")


def test_a_valid_local_build_of_a_key_counts_as_present(env, capsys, monkeypatch):
    path = export(env, capsys)  # seqlen 128 and 256
    new_process(env / "target", monkeypatch)
    fastattn.plan({**BASE, "seqlen_q": 128})  # built here: same key, other bytes (its own timestamps)
    local = store.DiskStore(str(env / "target"))
    before = open(next(iter(local.entries())).path, "rb").read()
    code, body = run_json(["cache", "import", path], capsys)
    assert code == 0 and body["imported"] == 1 and body["already_present"] == 1
    key = runtime.plan_cache().key(fastattn.AttentionConfig(**BASE, seqlen_q=128))
    assert open(local.path_for(key), "rb").read() == before  # kept, not overwritten
