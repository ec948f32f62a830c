"""A bundle's memory is bounded before anything in it is trusted: the manifest comes
first and is read no further than its bound; from then on nothing is decompressed past
what it declares (each member's size at its header, their total), and at most one
entry is held at a time. Decompression bombs (a few hundred kilobytes that expand to
hundreds of megabytes: entries without a manifest, members larger than declared, a
tar extension header of megabytes) are refused with a bounded peak (tracemalloc), and
the structure of a bundle (member order, missing, extra or repeated members, sizes
that lie) imports whole or is refused whole (Hypothesis).
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastattn
from fastattn import store
from fastattn.store import bundle as bundle_mod
from fastattn.store import entry as entry_mod
from fastattn.store.keys import key_of

MiB = 1 << 20
BOMB = 64 * MiB  # each bomb member, decompressed


class Zeros(io.RawIOBase):
    """`n` zero bytes, never held: what tarfile copies into a bomb member."""

    def __init__(self, n: int):
        self.left = n

    def readable(self):
        return True

    def readinto(self, b):
        k = min(len(b), self.left)
        b[:k] = bytes(k)
        self.left -= k
        return k


def description(i: int) -> dict:
    return {"config": {"batch": 1, "seqlen_q": i}}


def key(i: int) -> str:
    """Entry i's key: its description's hash, as every entry's is (import refuses another)."""
    return key_of(description(i))


def entry_data(i: int) -> bytes:
    e = store.Entry(key(i), "plan", description(i), {"forward": b"plan" * (i + 1)}, {"forward_engine": "e"}, 1.0)
    return entry_mod.encode(e)


def manifest(items: list[tuple[str, int, str]], **extra) -> bytes:
    """A manifest listing (key, size, sha256) items."""
    return json.dumps({"format": bundle_mod.BUNDLE_FORMAT, "created": 1.0, **extra,
                       "entries": [{"key": k, "size": n, "sha256": d} for k, n, d in items]}).encode()


def write_tar(path, members, *, mode="w:gz", pax=None):
    """members: (name, size, source) with source bytes or a readable stream."""
    kw = {"compresslevel": 1} if mode == "w:gz" else {}
    with tarfile.open(path, mode, format=tarfile.PAX_FORMAT, **kw) as tar:
        for n, (name, size, source) in enumerate(members):
            info = tarfile.TarInfo(name)
            info.size = size
            if pax and n == 0:
                info.pax_headers = pax
            tar.addfile(info, io.BytesIO(source) if isinstance(source, bytes) else source)
    return str(path)


def peak_of_import(path, target, **kw) -> tuple[int, str]:
    """(tracemalloc's peak while importing, the refusal's message)."""
    tracemalloc.start()
    try:
        with pytest.raises(fastattn.InvalidArgumentError) as e:
            bundle_mod.import_bundle(str(path), target, environment=None, force=True, **kw)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak, str(e.value)


@pytest.fixture(scope="module")
def bombs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bombs")
    zeros_sha = hashlib.sha256(bytes(BOMB)).hexdigest()
    out = {}
    # 4 x 64 MiB of zeros named as entries, no manifest (the case, smaller).
    out["no_manifest"] = write_tar(root / "no_manifest.tgz",
                                   [(f"entries/{key(i)}.entry", BOMB, Zeros(BOMB)) for i in range(4)])
    # A manifest first that declares 100 bytes each; the members are 64 MiB.
    small = manifest([(key(i), 100, zeros_sha) for i in range(4)])
    out["larger_than_declared"] = write_tar(
        root / "larger.tgz", [("manifest.json", len(small), small)]
        + [(f"entries/{key(i)}.entry", BOMB, Zeros(BOMB)) for i in range(4)])
    # A manifest that declares the true sizes and a wrong checksum: refused at the first.
    lying = manifest([(key(i), BOMB, "0" * 64) for i in range(4)])
    out["bad_checksum"] = write_tar(
        root / "checksum.tgz", [("manifest.json", len(lying), lying)]
        + [(f"entries/{key(i)}.entry", BOMB, Zeros(BOMB)) for i in range(4)])
    # A tar extension (pax) header of 64 MiB before the manifest.
    out["pax"] = write_tar(root / "pax.tgz", [("manifest.json", len(small), small)], pax={"comment": "x" * BOMB})
    return out


def test_entries_without_a_manifest_are_refused_before_they_are_read(bombs, tmp_path):
    peak, why = peak_of_import(bombs["no_manifest"], store.DiskStore(str(tmp_path / "c")), trusted=True)
    assert peak < 4 * MiB, peak
    assert "no manifest.json first" in why


def test_a_member_larger_than_declared_is_refused_at_its_header(bombs, tmp_path):
    peak, why = peak_of_import(bombs["larger_than_declared"], store.DiskStore(str(tmp_path / "c")), trusted=True)
    assert peak < 4 * MiB, peak
    assert f"is {BOMB} bytes; the manifest says 100" in why


def test_members_as_large_as_declared_are_held_one_at_a_time(bombs, tmp_path):
    peak, why = peak_of_import(bombs["bad_checksum"], store.DiskStore(str(tmp_path / "c")), trusted=True)
    assert peak < BOMB + 8 * MiB, peak  # one member, never the four
    assert "does not match its checksum" in why


def test_a_header_of_megabytes_is_refused_before_it_is_decompressed(bombs, tmp_path):
    peak, why = peak_of_import(bombs["pax"], store.DiskStore(str(tmp_path / "c")), trusted=True)
    assert peak < 4 * MiB, peak
    assert "holds more than its manifest declares" in why


def test_a_bundle_the_policy_refuses_is_refused_before_its_entries_are_read(bombs, tmp_path):
    peak, why = peak_of_import(bombs["bad_checksum"], store.DiskStore(str(tmp_path / "c")))
    assert peak < 4 * MiB, peak
    assert "not signed" in why and "FASTATTN_CACHE_TRUSTED=1" in why


def test_a_manifest_over_its_bound_is_refused_unread(tmp_path, monkeypatch):
    monkeypatch.setattr(bundle_mod, "_MAX_MANIFEST", 1000)
    big = manifest([(key(i), 1, "0" * 64) for i in range(40)])
    path = write_tar(tmp_path / "b.tgz", [("manifest.json", len(big), big)])
    with pytest.raises(fastattn.InvalidArgumentError, match=f"manifest is {len(big)} bytes, over the 1000"):
        bundle_mod.import_bundle(path, store.DiskStore(str(tmp_path / "c")), environment=None, force=True,
                                 trusted=True)


def test_what_a_manifest_declares_in_all_is_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(bundle_mod, "_MAX_TOTAL", 1000)
    m = manifest([(key(i), 600, "0" * 64) for i in range(2)])
    path = write_tar(tmp_path / "b.tgz", [("manifest.json", len(m), m)])
    with pytest.raises(fastattn.InvalidArgumentError, match="declares more than"):
        bundle_mod.import_bundle(path, store.DiskStore(str(tmp_path / "c")), environment=None, force=True,
                                 trusted=True)


def test_export_writes_the_manifest_first_and_import_takes_it(tmp_path):
    src = store.DiskStore(str(tmp_path / "src"))
    for i in range(3):
        src.publish(entry_mod.decode(entry_data(i), expected_key=key(i)))
    path = str(tmp_path / "b.tgz")
    assert bundle_mod.export_bundle([src], path) == 3
    with tarfile.open(path) as tar:
        names = tar.getnames()
    assert names[0] == "manifest.json" and sorted(names[1:]) == [f"entries/{key(i)}.entry" for i in range(3)]
    report = bundle_mod.import_bundle(path, store.DiskStore(str(tmp_path / "dst")), environment=None, force=True,
                                      trusted=True)
    assert report.imported == 3 and report.not_kept == [] and report.policy.startswith("unsigned")


def test_an_entry_whose_header_describes_another_plan_than_its_key_refuses_the_bundle(tmp_path):
    # A valid checksum over another plan's header (entry 1's description under entry 0's key):
    # the importing machine's runtime would never serve it, and verify calls it damaged.
    swapped = entry_mod.encode(store.Entry(key(0), "plan", description(1), {"forward": b"plan"},
                                           {"forward_engine": "e"}, 1.0))
    good = entry_data(2)
    listed = manifest([(key(2), len(good), hashlib.sha256(good).hexdigest()),
                       (key(0), len(swapped), hashlib.sha256(swapped).hexdigest())])
    path = write_tar(tmp_path / "b.tgz", [("manifest.json", len(listed), listed),
                                          (f"entries/{key(2)}.entry", len(good), good),
                                          (f"entries/{key(0)}.entry", len(swapped), swapped)])
    dst = store.DiskStore(str(tmp_path / "dst"))
    with pytest.raises(fastattn.InvalidArgumentError, match=f"entries/{key(0)}.entry: its header describes another "
                                                            "plan than its key"):
        bundle_mod.import_bundle(path, dst, environment=None, force=True, trusted=True)
    assert not dst.holds(key(2))  # refused whole: nothing imported
    # Export leaves such an entry out, as it leaves out a damaged one: what it writes imports.
    src = store.DiskStore(str(tmp_path / "src"))
    src.publish(entry_mod.decode(swapped, expected_key=key(0)))
    src.publish(entry_mod.decode(good, expected_key=key(2)))
    assert bundle_mod.export_bundle([src], str(tmp_path / "out.tgz")) == 1
    assert bundle_mod.import_bundle(str(tmp_path / "out.tgz"), dst, environment=None, force=True,
                                    trusted=True).imported == 1 and dst.holds(key(2))


# -- the structure of a bundle, generated --------------------------------------------------------

ENTRIES = [(key(i), entry_data(i)) for i in range(3)]


def members_strategy():
    """(members in archive order, manifest items, what is valid): a valid bundle of 1-3
    entries, then one or more of: members reordered, one dropped, one repeated, one
    added (listed or not), a size that lies, a key listed twice."""
    return st.tuples(st.integers(1, 3), st.lists(st.sampled_from(
        ["shuffle", "drop", "repeat", "extra_unlisted", "extra_listed", "size_lie", "listed_twice", "manifest_late",
         "manifest_twice", "none"]), min_size=1, max_size=3), st.randoms(use_true_random=False))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=members_strategy(), signed=st.booleans())
def test_bundles_of_generated_structure_import_whole_or_are_refused_whole(tmp_path_factory, spec, signed):
    count, edits, rnd = spec
    entries = ENTRIES[:count]
    items = [(k, len(d), hashlib.sha256(d).hexdigest()) for k, d in entries]
    body = [(f"entries/{k}.entry", d) for k, d in entries]
    manifest_at = 0
    repeat_manifest = False
    for edit in edits:
        if edit == "shuffle":
            rnd.shuffle(body)
        elif edit == "drop" and body:
            body.pop(rnd.randrange(len(body)))
        elif edit == "repeat" and body:
            body.insert(rnd.randrange(len(body) + 1), body[rnd.randrange(len(body))])
        elif edit == "extra_unlisted":
            body.insert(rnd.randrange(len(body) + 1), (f"entries/{key(7)}.entry", entry_data(7)))
        elif edit == "extra_listed":
            data = entry_data(8)
            items.append((key(8), len(data), hashlib.sha256(data).hexdigest()))
            body.insert(rnd.randrange(len(body) + 1), (f"entries/{key(8)}.entry", data))
        elif edit == "size_lie":
            n = rnd.randrange(len(items))
            k, size, digest = items[n]
            items[n] = (k, max(0, size + rnd.choice([-1, 1, 512, -size])), digest)
        elif edit == "listed_twice":
            items.append(items[rnd.randrange(len(items))])
        elif edit == "manifest_late" and body:
            manifest_at = rnd.randrange(1, len(body) + 1)
        elif edit == "manifest_twice":
            repeat_manifest = True
    secret = b"s3cret" if signed else None
    doc = json.loads(manifest(items))
    if signed:
        doc["signature"] = bundle_mod._manifest_mac(secret, doc)
    m = json.dumps(doc).encode()
    members = [(n, d) for n, d in body]
    members.insert(manifest_at, ("manifest.json", m))
    if repeat_manifest:
        members.append(("manifest.json", m))
    root = tmp_path_factory.mktemp("structure")
    path = write_tar(root / "b.tgz", [(n, len(d), d) for n, d in members])

    names = [n for n, _ in body]
    listed = {f"entries/{k}.entry": (size, digest) for k, size, digest in items}
    actual = dict(body)
    valid = (manifest_at == 0 and not repeat_manifest and len(set(names)) == len(names)
             and len({k for k, _, _ in items}) == len(items) and set(names) == set(listed)
             and all(len(actual[n]) == size and hashlib.sha256(actual[n]).hexdigest() == digest
                     for n, (size, digest) in listed.items()))
    target = store.DiskStore(str(root / "cache"))
    try:
        report = bundle_mod.import_bundle(path, target, environment=None, force=True, secret=secret,
                                          trusted=not signed)
    except fastattn.InvalidArgumentError as e:
        assert not valid, f"a valid bundle was refused: {e}"
        assert path in str(e)
        assert list(target.entries()) == []  # refused whole
    else:
        assert valid, f"imported: {edits}"
        assert report.imported == len(listed) and report.not_kept == []
        assert {i.key for i in target.entries()} == {k for k, _, _ in items}
        assert report.policy == ("signed and checked" if signed else
                                 "unsigned, trusted by FASTATTN_CACHE_TRUSTED=1")
