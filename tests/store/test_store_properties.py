"""Property-based tests: cache entries, their headers, remote values, bundles
and manifests, mutated byte by byte, truncated at every length class, with generated
JSON in every field. Each asserts that the reader gives its documented error or a
well-formed result; that `fastattn cache ls | verify | import` exit with a documented
code and no traceback; that nothing is written outside the cache directory; and that
valid entries beside damaged ones still list, verify and load.

Bounded and derandomized: the same examples every run, a few seconds in all.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import shutil
import tarfile
import tempfile

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import fastattn
from fastattn import cli, runtime, store
from fastattn.store import bundle as bundle_mod
from fastattn.store import entry as entry_mod

import fake_core
from helpers.redis import FakeRedis

BASE = dict(batch=1, heads_q=8, head_dim_qk=64, mask="causal")
GOOD_CFG = fastattn.AttentionConfig(**BASE, seqlen_q=128, training=True)
OTHER_CFG = fastattn.AttentionConfig(**BASE, seqlen_q=256)
CLI_CODES = {cli.EXIT_OK, cli.EXIT_BAD_INPUT, cli.EXIT_FAILED}


def fast(n: int):
    return settings(max_examples=n, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


# -- what the examples start from --------------------------------------------------------------


class Valid(dict):
    def __repr__(self) -> str:  # falsifying examples print their arguments: not 10 kB of entry
        return f"<a valid entry for key {self['key'][:16]}... and its bundle>"


@pytest.fixture(scope="module")
def valid(tmp_path_factory):
    """A real entry (made by the runtime with the fake core), its key, the key of
    another config, and a bundle holding the entry."""
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("valid")
    mp.setenv("FASTATTN_CACHE_DIR", str(root / "cache"))
    mp.setattr(runtime, "_core", lambda: fake_core)
    mp.setattr(fake_core, "GPU_NAME", ["NVIDIA H200"])
    runtime.clear()
    fastattn.plan(GOOD_CFG)
    cache = runtime.plan_cache()
    key, other_key = cache.key(GOOD_CFG), cache.key(OTHER_CFG)
    with open(cache.store.main.path_for(key), "rb") as f:
        data = f.read()
    path = str(root / "good.tar.gz")
    bundle_mod.export_bundle([cache.store.main], path)
    with open(path, "rb") as f:
        bundle = f.read()
    yield Valid(key=key, other_key=other_key, data=data, bundle=bundle)
    runtime.clear()
    mp.undo()


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(runtime, "_core", lambda: fake_core)
    monkeypatch.setattr(fake_core, "GPU_NAME", ["NVIDIA H200"])
    yield
    runtime.clear()


class Sandbox:
    """A fresh directory per example: the cache in it, the rest watched for writes."""

    def __init__(self, monkeypatch):
        self.root = tempfile.mkdtemp(prefix="fastattn-prop-")
        self.cache = os.path.join(self.root, "cache")
        monkeypatch.setenv("FASTATTN_CACHE_DIR", self.cache)
        runtime.clear()

    def write_entry(self, key: str, data: bytes) -> str:
        path = os.path.join(self.cache, key[:2], key + ".entry")
        store.DiskStore(self.cache)._mkdir(os.path.dirname(path))  # made by fastattn: its damaged entries are its own
        with open(path, "wb") as f:
            f.write(data)
        return path

    def outside(self) -> set[str]:
        """Every path under the sandbox but outside the cache directory."""
        found = set()
        for folder, dirs, files in os.walk(self.root):
            for name in dirs + files:
                path = os.path.join(folder, name)
                if not (path + os.sep).startswith(self.cache + os.sep):
                    found.add(path)
        return found

    def close(self):
        shutil.rmtree(self.root, ignore_errors=True)


def run_cli(argv, capsys) -> tuple[int, dict]:
    code = cli.main(argv + ["--json"])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err, out + err
    assert code in CLI_CODES, (argv, code, err)
    return code, json.loads(out)


# -- strategies --------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)

# Where a generated value goes: top-level header fields and the fields readers look into.
HEADER_PATHS = [("key",), ("kind",), ("created",), ("blobs",), ("meta",), ("description",),
                ("description", "config"), ("description", "gpu"), ("description", "gpu", "name"),
                ("description", "gpu", "compute_capability"), ("description", "cudnn"),
                ("description", "env"), ("description", "policy"), ("meta", "reason"),
                ("meta", "forward_engine"), ("meta", "backward_engine"), ("meta", "forward_workspace_size"),
                ("description", "config", "window"), ("description", "config", "seqlen_q")]

edits = st.lists(st.tuples(st.sampled_from(HEADER_PATHS), st.one_of(json_values, st.just(KeyError))),
                 min_size=1, max_size=3)


def split(data: bytes):
    fixed = entry_mod._FIXED
    _, _, n = fixed.unpack_from(data)
    return json.loads(data[fixed.size : fixed.size + n]), data[fixed.size + n + 32 :]


def with_header(header: dict, blobs: bytes) -> bytes:
    """An entry with a valid checksum around whatever `header` holds."""
    raw = json.dumps(header).encode()
    fixed = entry_mod._FIXED
    return fixed.pack(entry_mod.MAGIC, store.FORMAT_VERSION, len(raw)) + raw + hashlib.sha256(raw + blobs).digest() + blobs


def edited(header: dict, changes) -> dict:
    header = json.loads(json.dumps(header))
    for path, value in changes:
        target = header
        for part in path[:-1]:
            if not isinstance(target, dict):
                break
            target = target.setdefault(part, {})
        if not isinstance(target, dict):
            continue
        if value is KeyError:
            target.pop(path[-1], None)
        else:
            target[path[-1]] = value
    return header


def length_classes(n: int):
    """A cut in each part of an entry of n bytes: empty, magic, fixed part, header,
    checksum, blobs, one short."""
    return st.one_of(st.integers(0, 7), st.integers(8, 15), st.integers(16, max(16, n - 40)),
                     st.integers(max(0, n - 40), n - 1))


def mutations(data: bytes):
    n = len(data)
    flip = st.tuples(st.just("flip"), st.integers(0, n - 1), st.integers(1, 255))
    cut = st.tuples(st.just("cut"), length_classes(n), st.just(0))
    insert = st.tuples(st.just("insert"), st.integers(0, n), st.integers(0, 255))
    return st.lists(st.one_of(flip, cut, insert), min_size=1, max_size=3)


def mutate(data: bytes, ops) -> bytes:
    b = bytearray(data)
    for op, at, v in ops:
        if op == "flip" and at < len(b):
            b[at] ^= v
        elif op == "cut":
            del b[at:]
        elif op == "insert":
            b[at:at] = bytes([v])
    return bytes(b)


def well_formed(e: store.Entry) -> None:
    assert entry_mod.KEY_PATTERN.fullmatch(e.key) and e.kind in ("plan", "unsupported")
    assert isinstance(e.description, dict) and isinstance(e.meta, dict) and math.isfinite(e.created)
    assert all(isinstance(k, str) and isinstance(v, bytes) for k, v in e.blobs.items())


# -- entries -----------------------------------------------------------------------------------


@fast(300)
@given(data=st.data())
def test_mutated_entries_decode_only_unchanged(valid, data):
    original = valid["data"]
    bad = mutate(original, data.draw(mutations(original)))
    try:
        e = entry_mod.decode(bad, expected_key=valid["key"])
    except entry_mod.EntryError:
        assert bad != original
    else:
        assert bad == original  # the checksum covers every byte after the fixed part
        well_formed(e)
    try:
        header = entry_mod.read_header_from_file(io.BytesIO(bad))
    except entry_mod.EntryError:
        pass
    else:
        assert isinstance(header["description"], dict) and math.isfinite(header["created"])


@fast(150)
@given(changes=edits)
def test_generated_headers_give_a_well_formed_entry_or_entry_error(valid, changes):
    header, blobs = split(valid["data"])
    data = with_header(edited(header, changes), blobs)
    for read in (lambda: entry_mod.decode(data), lambda: entry_mod.read_header(data)):
        try:
            got = read()
        except entry_mod.EntryError:
            continue
        if isinstance(got, store.Entry):
            well_formed(got)
        else:
            assert isinstance(got["description"], dict) and isinstance(got["meta"], dict)


@fast(40)
@given(changes=edits, at_config_key=st.booleans())
def test_cache_commands_and_plan_with_a_generated_header_beside_a_valid_entry(valid, fake_gpu, monkeypatch, capsys,
                                                                              changes, at_config_key):
    box = Sandbox(monkeypatch)
    try:
        box.write_entry(valid["key"], valid["data"])
        header, blobs = split(valid["data"])
        odd_key = valid["other_key"] if at_config_key else "ee" + "0" * 62
        header["key"] = odd_key
        box.write_entry(odd_key, with_header(edited(header, changes), blobs))
        code, ls = run_cli(["cache", "ls"], capsys)
        rows = {r["key"]: r for r in ls["entries"]}
        assert code == cli.EXIT_OK and set(rows) == {valid["key"], odd_key}
        assert rows[valid["key"]]["damaged"] is None and rows[valid["key"]]["config"]["seqlen_q"] == 128
        code, verify = run_cli(["cache", "verify"], capsys)
        status = {r["key"]: r["status"] for r in verify["entries"]}
        assert status[valid["key"]] == "ok"
        assert code == (cli.EXIT_FAILED if status[odd_key] == "damaged" else cli.EXIT_OK)
        if rows[odd_key]["damaged"]:
            assert status[odd_key] == "damaged"
        run_cli(["cache", "show", odd_key[:12]], capsys)
        # The valid entry loads; the other config loads or is rebuilt, never raises.
        runtime.clear()
        assert fastattn.probe(GOOD_CFG).source == "disk"
        fastattn.probe(OTHER_CFG)
        assert box.outside() == set()
    finally:
        box.close()


@fast(60)
@given(data=st.data())
def test_mutated_entry_files_are_listed_verified_and_missed(valid, fake_gpu, monkeypatch, capsys, data):
    box = Sandbox(monkeypatch)
    try:
        original = valid["data"]
        bad = mutate(original, data.draw(mutations(original)))
        assume(bad != original)
        box.write_entry(valid["key"], bad)
        code, ls = run_cli(["cache", "ls"], capsys)
        assert code == cli.EXIT_OK and len(ls["entries"]) == 1
        code, verify = run_cli(["cache", "verify"], capsys)
        assert code == cli.EXIT_FAILED and verify["entries"][0]["status"] == "damaged"
        runtime.clear()
        assert fastattn.probe(GOOD_CFG).source == "built"  # a miss, rebuilt and replaced
        assert fastattn.stats()["cache"]["corrupt"] == 1
        assert box.outside() == set()
    finally:
        box.close()


# -- remote values -------------------------------------------------------------------------------


@fast(150)
@given(data=st.data(), signed=st.booleans())
def test_remote_values_verify_or_miss(valid, data, signed):
    from fastattn.store.remote import RemoteSettings, RemoteStore
    from fastattn.store.signing import wrap

    secret = b"s3cret" if signed else None
    r = RemoteStore(RemoteSettings("redis://localhost:1/0", trusted=not signed), secret)
    good = wrap(secret, valid["key"], valid["data"])
    value = data.draw(st.one_of(st.binary(max_size=64), st.builds(mutate, st.just(good), mutations(good)),
                                st.just(good)))
    key = data.draw(st.one_of(st.just(valid["key"]), st.text(max_size=70)))
    r._client, r._errors = FakeRedis({"fastattn:" + key: value}), (OSError,)
    got = r.get(key)
    if got is not None:
        well_formed(got)
        assert got.key == key and value == good
    # (an empty value is no entry: a miss)
    assert r.counters["remote_hits"] + r.counters["remote_rejected"] == (0 if not value else 1)


@fast(100)
@given(data=st.data(), cap=st.integers(0, 3000))
def test_remote_values_past_the_size_cap_are_rejected_having_read_one_byte_past_it(valid, data, cap):
    from fastattn.store import remote as remote_mod
    from fastattn.store.signing import wrap

    good = wrap(None, valid["key"], valid["data"])
    value = data.draw(st.one_of(st.just(good), st.binary(min_size=0, max_size=4000),
                                st.builds(lambda n: good + b"\0" * n, st.integers(0, 100))))
    fake = FakeRedis({"fastattn:" + valid["key"]: value})
    read = []
    old = remote_mod.MAX_VALUE_BYTES
    remote_mod.MAX_VALUE_BYTES = cap
    try:
        r = remote_mod.RemoteStore(remote_mod.RemoteSettings("redis://localhost:1/0", trusted=True), None)
        r._client, r._errors = fake, (OSError,)
        real = r._read
        r._read = lambda c, key: read.append(real(c, key)) or read[-1]
        got = r.get(valid["key"])
    finally:
        remote_mod.MAX_VALUE_BYTES = old
    if not value:
        assert got is None and read == [None] and r.counters["remote_misses"] == 1
    elif len(value) > cap:
        assert got is None and len(read[0]) == cap + 1 and r.counters["remote_rejected"] == 1
    else:
        assert read == [value] and (got is not None) == (value == good)


# -- bundles and manifests ---------------------------------------------------------------------


def bundle_length_classes(n: int):
    """Cuts in the gzip header, the deflate stream, and the trailer."""
    return st.one_of(st.integers(0, 9), st.integers(10, n - 9), st.integers(n - 8, n - 1))


@fast(80)
@given(data=st.data())
def test_mutated_bundles_import_or_are_bad_input(valid, data, tmp_path_factory):
    root = tmp_path_factory.mktemp("bundle")
    original = valid["bundle"]
    ops = data.draw(st.one_of(
        mutations(original),
        st.lists(st.tuples(st.just("cut"), bundle_length_classes(len(original)), st.just(0)), min_size=1, max_size=1)))
    bad = mutate(original, ops)
    (root / "b.tgz").write_bytes(bad)
    target = store.DiskStore(str(root / "cache"))
    try:
        report = bundle_mod.import_bundle(str(root / "b.tgz"), target, environment=None, force=True, trusted=True)
    except fastattn.InvalidArgumentError as e:
        assert str(root / "b.tgz") in str(e)
        assert not (root / "cache").exists()
    else:
        assert report.imported == 1
        assert target.get(valid["key"]) is not None  # only entries that decode are imported
    assert sorted(os.listdir(root)) == ["b.tgz"] + (["cache"] if (root / "cache").exists() else [])


def tar_gz(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, blob in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    return buf.getvalue()


manifest_edits = st.lists(st.tuples(
    st.sampled_from([("format",), ("entries",), ("signature",), ("entries", 0), ("entries", 0, "key"),
                     ("entries", 0, "sha256"), ("entries", 0, "size")]),
    st.one_of(json_values, st.just(KeyError))), min_size=1, max_size=3)


def edit_manifest(manifest: dict, changes) -> object:
    for path, value in changes:
        target = manifest
        for part in path[:-1]:
            try:
                target = target[part]
            except (KeyError, IndexError, TypeError):
                target = None
                break
        if isinstance(target, dict) or (isinstance(target, list) and isinstance(path[-1], int)
                                        and path[-1] < len(target)):
            if value is KeyError:
                if isinstance(target, dict):
                    target.pop(path[-1], None)
            else:
                target[path[-1]] = value
    return manifest


@fast(40)
@given(changes=manifest_edits, whole=st.one_of(st.none(), json_values), signed=st.booleans())
def test_generated_manifests_through_cache_import(valid, fake_gpu, monkeypatch, capsys, changes, whole, signed):
    box = Sandbox(monkeypatch)
    try:
        if signed:
            monkeypatch.setenv("FASTATTN_CACHE_HMAC_KEY", "s3cret")
        else:
            monkeypatch.delenv("FASTATTN_CACHE_HMAC_KEY", raising=False)
            monkeypatch.setenv("FASTATTN_CACHE_TRUSTED", "1")  # unsigned: taken only where trust is stated
        with tarfile.open(fileobj=io.BytesIO(valid["bundle"])) as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar}
        manifest = edit_manifest(json.loads(members["manifest.json"]), changes) if whole is None else whole
        members["manifest.json"] = json.dumps(manifest).encode()
        path = os.path.join(box.root, "b.tgz")
        with open(path, "wb") as f:
            f.write(tar_gz(members))
        code, out = run_cli(["cache", "import", path, "--force"], capsys)
        assert code in (cli.EXIT_OK, cli.EXIT_BAD_INPUT)
        if code == cli.EXIT_OK:
            assert out["imported"] + out["already_present"] == 1
            assert run_cli(["cache", "verify"], capsys)[0] == cli.EXIT_OK
        else:
            assert not os.path.exists(box.cache)
        assert box.outside() == {path}
    finally:
        box.close()


@fast(25)
@given(data=st.data())
def test_mutated_bundles_through_cache_import(valid, fake_gpu, monkeypatch, capsys, data):
    box = Sandbox(monkeypatch)
    try:
        monkeypatch.delenv("FASTATTN_CACHE_HMAC_KEY", raising=False)
        monkeypatch.setenv("FASTATTN_CACHE_TRUSTED", "1")  # unsigned: taken only where trust is stated
        original = valid["bundle"]
        path = os.path.join(box.root, "b.tgz")
        with open(path, "wb") as f:
            f.write(mutate(original, data.draw(mutations(original))))
        code, out = run_cli(["cache", "import", path], capsys)  # checked against this (fake) GPU
        assert code in (cli.EXIT_OK, cli.EXIT_BAD_INPUT)
        code_twice, again = run_cli(["cache", "import", path], capsys)
        assert code_twice == code
        if code == cli.EXIT_OK:
            assert again["imported"] == 0 and again["already_present"] == 1
        assert box.outside() == {path}
    finally:
        box.close()


# -- numbers -----------------------------------------------------------------------------------

# Every JSON number a header can hold, and bools (an int to Python): integers of every size,
# past what a float holds too (10**400: json.dumps writes it), floats of every size.
numbers = st.one_of(st.integers(), st.integers(min_value=2**1023, max_value=10**1000),
                    st.integers(min_value=-(10**1000), max_value=-(2**1023)), st.just(int(1.7976931348623157e308)),
                    st.floats(), st.booleans())

# Where a header holds a number (a verdict's, in the verdict added to meta).
NUMBER_PATHS = [("created",), ("blobs", 0, 1), ("description", "format"), ("description", "cudnn"),
                ("description", "gpu", "sm_count"), ("description", "gpu", "compute_capability", 0),
                ("description", "config", "batch"), ("description", "config", "seqlen_q"),
                ("description", "config", "scale"), ("meta", "build_seconds"), ("meta", "forward_workspace_size"),
                ("meta", "verdict", "seconds"), ("meta", "verdict", "tolerance"), ("meta", "verdict", "cudnn"),
                ("meta", "verdict", "checks", 0, "max_abs_error"), ("meta", "verdict", "checks", 0, "scale"),
                ("meta", "verdict", "checks", 0, "excess"), ("meta", "verdict", "checks", 0, "nonfinite")]


def with_number(header: dict, path: tuple, value) -> dict:
    from fastattn.verdict import Check, Verdict

    header = json.loads(json.dumps(header))
    header["meta"]["verdict"] = Verdict.judge([Check("random", "o", 1e-3, 1.0, 0)], 91900, 6.25e-2, 0.02).to_dict()
    header["description"].setdefault("gpu", {}).setdefault("compute_capability", [9, 0])
    target = header
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = value
    return header


@fast(300)
@given(changes=st.lists(st.tuples(st.sampled_from(NUMBER_PATHS), numbers), min_size=1, max_size=3))
def test_headers_with_any_json_number_decode_or_raise_entry_error(valid, tmp_path_factory, changes):
    from fastattn.cli import cache as cache_cli

    header, blobs = split(valid["data"])
    for path, value in changes:
        header = with_number(header, path, value)
    try:
        data = with_header(header, blobs)
    except ValueError:  # a NaN: json.dumps writes it, and json cannot; an int past 4300 digits
        assume(False)
    for read in (lambda: entry_mod.decode(data, expected_key=valid["key"]), lambda: entry_mod.read_header(data),
                 lambda: entry_mod.read_header_from_file(io.BytesIO(data))):
        try:
            got = read()
        except entry_mod.EntryError:
            continue
        if isinstance(got, store.Entry):
            well_formed(got)
            assert 0 <= got.created < 253402300800  # a time in the calendar: `cache ls` shows its age
        else:
            assert math.isfinite(float(got["created"])) and isinstance(got["meta"], dict)
    # What `cache ls` and the store make of it: a row (damaged or not) and a hit or a miss.
    root = tmp_path_factory.mktemp("numbers")
    disk = store.DiskStore(str(root))
    os.makedirs(os.path.dirname(disk.path_for(valid["key"])))
    with open(disk.path_for(valid["key"]), "wb") as f:
        f.write(data)
    (info,) = disk.entries()
    assert isinstance(cache_cli._summary(info), str) and isinstance(cache_cli._age(0.0 - info.created), str)
    got = disk.get(valid["key"])
    assert got is None or got.key == valid["key"]
    assert (got is None) == (disk.counters["corrupt"] == 1)
