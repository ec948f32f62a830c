"""Bundles: a cache shipped as one archive to machines with the same GPU and cuDNN.

A bundle is a gzipped tar whose first member is manifest.json, followed by
entries/<key>.entry files. The manifest lists every entry with its sha256, size, GPU
and cuDNN version. Import publishes entries through DiskStore.publish, which derives
every path from a validated key: whatever names the archive holds, nothing is written
outside the cache directory. A bundle with any member other than the manifest and
the entries it lists, or whose sizes, checksums or keys disagree with it, is refused
whole.

Export writes the bundle as entries are written: 0600, atomically, and only where no
file or a regular one is (fastattn.files: a FIFO or a device node there is refused,
not replaced). With a signing secret (store.signing), export signs the manifest
(which holds every entry's sha256). It refuses, before writing anything, a bundle that
import would refuse (a manifest, entries or a file over import's limits), and holds at
most one entry in memory: a first pass reads and checks the entries and makes the
manifest, a second streams the archive into the bundle file, each entry read again and
checked against the manifest.

What import takes is store.signing's Policy, the Redis tier's too: with a secret, a
bundle signed with it; without one, any bundle when FASTATTN_CACHE_TRUSTED=1; else
none. The report says which applied.

Memory is bounded before anything is trusted. The manifest is read first, and no
more than _MAX_MANIFEST bytes of it; its signature (or the policy's refusal) is
decided before any entry is read; from then on the archive is decompressed no further
than the manifest declares (each member's size, their total, a few blocks of headers
each): a member whose size is not the one declared is refused at its header, before
it is read, and a header that would need more (a tar extension header of gigabytes) is
refused before it is decompressed. Entries are checked in a first pass over the
archive, one at a time, and published in a second, so that at most one entry is
held in memory, and nothing is published from a bundle that a check refuses.

A bundle is untrusted bytes: whatever it holds (a truncated gzip stream, a tar cut
mid-member, a manifest of the wrong shape, entries with valid checksums and nonsense
headers), import raises InvalidArgumentError naming the file and the reason, or
imports; it raises nothing else. When the cache cannot be written, it raises
BundleWriteError (an OSError) after importing what it could.
"""

from __future__ import annotations

import bz2
import contextlib
import gzip
import hashlib
import io
import json
import lzma
import os
import re
import tarfile
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Callable, Iterable, Iterator

from .. import files
from ..files import shown
from ..errors import InvalidArgumentError
from .disk import DiskStore
from .entry import KEY_PATTERN, MAX_ENTRY_BYTES, EntryError, decode, key_problem
from .keys import canonical_json, environment_of
from .signing import Policy, sign

__all__ = ["BUNDLE_FORMAT", "BundleWriteError", "CacheChangedError", "export_bundle", "import_bundle", "ImportReport"]

BUNDLE_FORMAT = 1
MANIFEST = "manifest.json"
_ENTRY_NAME = re.compile(r"^entries/([0-9a-f]{64})\.entry$")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_MAX_MEMBER = MAX_ENTRY_BYTES  # an entry is never larger
_MAX_MANIFEST = 32 << 20  # about 40000 entries' lines; parsed, a few times that in memory
_MAX_TOTAL = 4 << 30  # what a manifest may declare in all
_MAX_BUNDLE = _MAX_TOTAL  # the file itself: compressed, its members take no more
# Bytes of tar headers allowed around each member (a 512-byte header, and an extension
# header for a long name), and at the archive's start and end.
_HEADERS = 4 << 10
_SLACK = 64 << 10
_BLOCK = tarfile.BLOCKSIZE
_CHUNK = 1 << 20  # what one read decompresses at most
# What tarfile and its decompressors raise on damaged input while members are read
# (not only at open): a gzip stream cut short is EOFError, a bad deflate block
# zlib.error, a bad gzip header gzip.BadGzipFile (an OSError).
_READ_ERRORS = (OSError, EOFError, tarfile.TarError, zlib.error, lzma.LZMAError, ValueError, RecursionError)


class BundleWriteError(OSError):
    """The cache directory could not take a bundle's entries (the message says which
    directory and why); the entries before the failure were imported."""


class CacheChangedError(OSError):
    """An entry changed or went between export's two passes (another process rebuilt or
    removed it): the bundle is not written."""


def _manifest_mac(secret: bytes, manifest: dict[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != "signature"}
    return sign(secret, "bundle", canonical_json(body).encode()).hex()


def export_bundle(stores: Iterable[DiskStore], path: str, *,
                  keep: Callable[[dict[str, Any]], bool] | None = None, secret: bytes | None = None) -> int:
    """Writes the valid entries of `stores` (those `keep(description)` accepts) to a
    bundle at `path`, signed when `secret` is given; returns how many. Damaged entries
    are left out, and so is anything in the directories that is not an entry (a FIFO,
    a link: DiskStore.scan). Raises InvalidArgumentError, writing nothing, when import
    would refuse the bundle (its limits); CacheChangedError when an entry changes while
    it is exported; OSError when the bundle cannot be written (no file is left)."""
    manifest: dict[str, Any] = {"format": BUNDLE_FORMAT, "created": time.time(), "entries": []}
    seen: set[str] = set()
    sources: list[tuple[DiskStore, str]] = []
    total = 0
    for store in stores:
        for info in store.entries(with_headers=False):
            if info.key in seen:
                continue
            try:
                data = store.read(info.path)  # never a link's target, never a wait on a FIFO
                entry = decode(data, expected_key=info.key)
            except (OSError, EntryError):
                continue
            if key_problem(info.key, entry.description):  # damaged, as verify says: import would refuse it
                continue
            if keep is not None and not keep(entry.description):
                continue
            seen.add(info.key)
            total += len(data)
            if total > _MAX_TOTAL:  # known before the rest is read, and before anything is written
                raise _refused(f"the entries to export hold more than the {_MAX_TOTAL >> 30} GiB of entries")
            sources.append((store, info.path))
            manifest["entries"].append({
                "key": info.key,
                "sha256": hashlib.sha256(data).hexdigest(),
                "size": len(data),
                "kind": entry.kind,
                "environment": environment_of(entry.description),
                "config": entry.description.get("config"),
            })
            del data, entry
    if secret is not None:
        manifest["signature"] = _manifest_mac(secret, manifest)
    text = json.dumps(manifest, indent=1, sort_keys=True).encode()
    if len(text) > _MAX_MANIFEST:
        raise _refused(f"its manifest would be {len(text)} bytes ({len(sources)} entries), over the {_MAX_MANIFEST} "
                       "bytes a manifest may hold")
    largest = _largest_file([len(text)] + [item["size"] for item in manifest["entries"]])
    if largest > _MAX_BUNDLE:
        raise _refused(f"the bundle file could take up to {largest} bytes, over the {_MAX_BUNDLE >> 30} GiB a "
                       "bundle may hold")
    # 0600, as entries are (native code, and a credential's work when signed), and
    # atomically: a reader, or a bundle being replaced, sees the old file or the new one.
    # Only over a regular file: files.NotRegularFileError (an OSError) for anything else.
    with files.replacing(path, private=True) as f, tarfile.open(fileobj=f, mode="w:gz") as tar:
        _add(tar, MANIFEST, len(text), io.BytesIO(text))
        for (store, source), item in zip(sources, manifest["entries"]):
            try:
                data = store.read(source)
            except (FileNotFoundError, EntryError):
                data = b""
            if hashlib.sha256(data).hexdigest() != item["sha256"]:
                raise CacheChangedError(f"entry {item['key'][:16]}... changed or was removed while it was exported "
                                        "(another process at work on the cache); nothing was written")
            _add(tar, f"entries/{item['key']}.entry", item["size"], io.BytesIO(data))
            del data
    return len(manifest["entries"])


def _refused(why: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"cache export: {why}, and cache import refuses such a bundle; export fewer "
                                "entries (without --all, this GPU's only), or prune the cache first")


def _largest_file(sizes: list[int]) -> int:
    """The most bytes export's gzipped tar of members of `sizes` can take: each member's
    header and its padding to a block, the end blocks and tarfile's record padding, and
    deflate's worst case (stored blocks: 5 bytes per 16 KiB) with gzip's header and
    trailer."""
    tar = sum(_BLOCK + -(-size // _BLOCK) * _BLOCK for size in sizes) + 2 * _BLOCK
    tar = -(-tar // tarfile.RECORDSIZE) * tarfile.RECORDSIZE
    return tar + 5 * (tar // 16384 + 1) + 64


def _add(tar: tarfile.TarFile, name: str, size: int, source: BinaryIO) -> None:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode = 0o600
    tar.addfile(info, source)  # (reads `size` bytes from where `source` stands)


@dataclass
class ImportReport:
    imported: int = 0
    already_present: int = 0
    mismatched: list[str] = field(default_factory=list)  # keys whose GPU or cuDNN differ from this machine's
    listed: int = 0  # entries the bundle holds
    policy: str = ""  # how it was taken (signing.Policy.applied): "signed and checked", ...
    not_kept: list[str] = field(default_factory=list)  # its keys the store does not hold at the end of the import


class _TooMuch(Exception):
    """The archive would be decompressed past what its manifest declares."""


class _Bounded(io.RawIOBase):
    """A decompressed stream that may be read (and seeked) no further than `limit`
    bytes from its start: a read or a seek past it raises _TooMuch before anything past
    it is decompressed, however much tarfile asks for at once."""

    def __init__(self, inner: BinaryIO, limit: int):
        self.inner = inner
        self.limit = limit
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def read(self, n: int | None = -1) -> bytes:
        if n is None or n < 0:
            n = self.limit - self.pos + 1  # (tarfile always says how much)
        if self.pos + n > self.limit:
            raise _TooMuch(self.limit)
        data = self.inner.read(n)
        self.pos += len(data)
        return data

    def readinto(self, b) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        target = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos}.get(whence)
        if target is None:
            raise io.UnsupportedOperation("seek from the end")  # (tarfile never does, reading)
        target += offset
        if target > self.limit:
            raise _TooMuch(self.limit)
        self.pos = self.inner.seek(target)
        return self.pos


def _decompressed(f: BinaryIO) -> BinaryIO:
    """The tar stream inside the bundle file: gzip (what export writes), bzip2, xz, or
    none, told by the first bytes, as tarfile's "r:*" does."""
    f.seek(0)
    magic = f.read(6)
    f.seek(0)
    if magic.startswith(b"\x1f\x8b"):
        return gzip.GzipFile(fileobj=f, mode="rb")
    if magic.startswith(b"BZh"):
        return bz2.BZ2File(f)
    if magic.startswith(b"\xfd7zXZ\x00"):
        return lzma.LZMAFile(f)
    return f


@dataclass(frozen=True)
class _Listed:
    key: str
    sha256: str
    size: int


class _Archive:
    """One pass over a bundle's archive: the manifest (read first, bounded), then its
    entries, each checked against the manifest as it comes (name, kind, size at its
    header; then checksum)."""

    def __init__(self, path: str, f: BinaryIO):
        self.path = path
        self.stream = _Bounded(_decompressed(f), _SLACK + _MAX_MANIFEST)
        self.tar = tarfile.open(fileobj=self.stream, mode="r:")
        self.manifest_bytes = self._manifest()

    def refuse(self, why: str) -> InvalidArgumentError:
        return InvalidArgumentError(f"{shown(self.path)}: refusing bundle: {why}")

    def _manifest(self) -> bytes:
        first = self.tar.next()  # (tarfile read it at open, and gives it once more)
        if first is None or first.name != MANIFEST:
            shown = "nothing" if first is None else repr(first.name[:200])
            raise self.refuse(f"no manifest.json first (its first member is {shown}): a bundle lists its entries "
                              "before them")
        if not first.isfile():
            raise self.refuse(f"member {MANIFEST!r} is not a regular file")
        if first.size > _MAX_MANIFEST:
            raise self.refuse(f"its manifest is {first.size} bytes, over the {_MAX_MANIFEST} a manifest may hold")
        return self._read(first, first.size)

    def _read(self, member: tarfile.TarInfo, size: int, sha256: str | None = None) -> bytes:
        """The member's `size` bytes (its header says as much), read in chunks into one
        buffer, hashed as they come: a member that does not match `sha256` is refused
        having been held once, never copied."""
        f = self.tar.extractfile(member)
        buf = bytearray(size)
        view, pos, digest = memoryview(buf), 0, hashlib.sha256()
        with view:
            while pos < size and f is not None:
                n = f.readinto(view[pos : pos + _CHUNK])
                if not n:
                    break
                digest.update(view[pos : pos + n])
                pos += n
        if pos != size:
            raise EOFError(f"member {member.name!r} is cut short")
        if sha256 is not None and digest.hexdigest() != sha256:
            raise self.refuse(f"{member.name} does not match its checksum")
        return bytes(buf)

    def entries(self, listed: dict[str, _Listed]) -> Iterator[tuple[str, bytes]]:
        """(key, bytes) of each entry, in archive order, each as the manifest lists it;
        the decompressed stream is bounded by what `listed` declares from here on."""
        declared = sum(-(-item.size // _BLOCK) * _BLOCK + _HEADERS for item in listed.values())
        self.stream.limit = self.stream.pos + declared + _SLACK
        seen = {MANIFEST}
        while True:
            member = self.tar.next()
            if member is None:
                break
            name = member.name
            if name != MANIFEST and not _ENTRY_NAME.match(name):
                raise self.refuse(f"unexpected member {name[:200]!r}")
            if not member.isfile():
                raise self.refuse(f"member {name!r} is not a regular file")
            if name in seen:
                raise self.refuse(f"member {name!r} is repeated")
            item = listed.get(name)
            if item is None:
                raise self.refuse(f"{name} is not in the manifest")
            if member.size != item.size:
                raise self.refuse(f"{name} is {member.size} bytes; the manifest says {item.size}")
            seen.add(name)
            yield item.key, self._read(member, item.size, item.sha256)
        missing = sorted(set(listed) - seen)
        if missing:
            raise self.refuse(f"{missing[0][:100]!r} is listed but missing")


@contextlib.contextmanager
def _guard(path: str) -> Iterator[None]:
    """Around every read of a bundle: what tarfile and the decompressors raise on
    damaged input (not only at open: damage further on surfaces while members are
    iterated or read) is an InvalidArgumentError naming the file."""
    try:
        yield
    except (InvalidArgumentError, BundleWriteError):
        raise
    except _TooMuch as e:
        raise InvalidArgumentError(f"{shown(path)}: refusing bundle: it holds more than its manifest declares (read no "
                                   f"further than {e.args[0]} bytes of its tar stream)") from None
    except _READ_ERRORS as e:
        why = str(e) or type(e).__name__
        raise InvalidArgumentError(f"{shown(path)}: not a readable bundle ({why})") from None


def _open_regular(path: str) -> BinaryIO:
    """`path` open for reading, when it is a regular file of at most _MAX_BUNDLE bytes;
    InvalidArgumentError naming it otherwise (files.open_regular: a FIFO put there after
    the command checked its argument is not waited on, nor a device read forever)."""
    try:
        f = files.open_regular(path)
    except files.NotRegularFileError as e:
        raise InvalidArgumentError(f"{shown(path)}: {e.strerror}") from None
    size = os.fstat(f.fileno()).st_size
    if size > _MAX_BUNDLE:
        f.close()
        raise InvalidArgumentError(f"{shown(path)}: refusing bundle: {size} bytes, over the {_MAX_BUNDLE >> 30} GiB "
                                   "a bundle may hold")
    return f


def _parse_manifest(archive: _Archive) -> tuple[dict[str, Any], dict[str, _Listed]]:
    """The manifest, and what it lists by member name; a manifest of the wrong shape is
    refused, before any entry is read."""
    try:
        manifest = json.loads(archive.manifest_bytes)
        if not isinstance(manifest, dict):
            raise ValueError("it is not a JSON object")
        if manifest.get("format") != BUNDLE_FORMAT or not isinstance(manifest.get("entries"), list):
            raise ValueError(f"format {manifest.get('format')!r}")
    except (ValueError, RecursionError) as e:
        raise archive.refuse(f"bad manifest ({str(e)[:200]})") from None
    listed: dict[str, _Listed] = {}
    total = 0
    for n, item in enumerate(manifest["entries"]):
        key = item.get("key") if isinstance(item, dict) else None
        digest = item.get("sha256") if isinstance(item, dict) else None
        size = item.get("size") if isinstance(item, dict) else None
        if not isinstance(key, str) or not isinstance(digest, str):
            raise archive.refuse("manifest entry without key or sha256")
        if not KEY_PATTERN.fullmatch(key) or not _SHA256.fullmatch(digest):
            raise archive.refuse(f"manifest entry {n}: its key or sha256 is not 64 hex digits")
        if type(size) is not int or not 0 <= size <= _MAX_MEMBER:
            raise archive.refuse(f"manifest entry {n}: its size is not a number of bytes up to {_MAX_MEMBER}")
        name = f"entries/{key}.entry"
        if name in listed:
            raise archive.refuse(f"{name} is listed twice")
        total += size
        if total > _MAX_TOTAL:
            raise archive.refuse(f"its manifest declares more than {_MAX_TOTAL >> 30} GiB of entries")
        listed[name] = _Listed(key, digest, size)
    return manifest, listed


def _check_signature(archive: _Archive, manifest: dict[str, Any], policy: Policy) -> str:
    """How the bundle is taken (Policy.applied), or InvalidArgumentError: what the
    policy refuses is refused here, before any entry is read."""
    signature = manifest.get("signature")
    signed = signature is not None
    mac = None
    if signed:
        try:
            mac = bytes.fromhex(signature) if isinstance(signature, str) else b""
        except ValueError:
            mac = b""
    try:
        body = canonical_json({k: v for k, v in manifest.items() if k != "signature"}).encode()
    except (ValueError, RecursionError):  # nesting json.loads took and canonical JSON refuses
        body = None
    if body is None and policy.secret is not None:
        why = "unsigned" if mac is None else "bad signature"  # (no secret signs what cannot be written)
    else:
        why = policy.check("bundle", body or b"", mac)
    if why == "unsigned":
        raise archive.refuse("it is not signed, and a signing secret is set: only bundles signed with it are "
                             "imported")
    if why == "bad signature":
        raise archive.refuse("its signature does not match this secret")
    if why:
        raise archive.refuse(f"it is {'signed' if signed else 'not signed'}, and {why}")
    return policy.applied(signed)


def import_bundle(path: str, store: DiskStore, *, environment: dict[str, Any] | None, force: bool = False,
                  secret: bytes | None = None, trusted: bool = False) -> ImportReport:
    """Checks a bundle (its signature under the policy of `secret` and `trusted`, see
    store.signing.Policy; manifest, sizes, checksums, keys; and, unless `force`, that
    every entry was made for `environment`, this machine's GPU and versions) and
    publishes its entries into `store`. Raises InvalidArgumentError and imports nothing
    when any check fails. environment=None means "unknown" (no GPU here): only `force`
    imports. `force` never overrides the policy. The report's not_kept: the bundle's
    keys the store does not hold at the end (a store whose max_bytes prunes them at
    once)."""
    policy = Policy(secret, trusted)
    report = ImportReport()
    with _guard(path), _open_regular(path) as f:
        archive = _Archive(path, f)
        manifest, listed = _parse_manifest(archive)
        report.policy = _check_signature(archive, manifest, policy)
        report.listed = len(listed)
        # First pass: every entry checked, one at a time; only their environments kept.
        environments = {}
        for key, data in archive.entries(listed):
            try:
                entry = decode(data, expected_key=key)
            except EntryError as e:
                raise archive.refuse(f"entries/{key}.entry: {e}") from None
            problem = key_problem(key, entry.description)  # a header for another plan, under a valid checksum
            if problem:
                raise archive.refuse(f"entries/{key}.entry: {problem}")
            environments[key] = environment_of(entry.description)
        report.mismatched = [k for k, env in environments.items() if env != environment]
        if report.mismatched and not force:
            if environment is None:
                raise InvalidArgumentError(f"{shown(path)}: no usable GPU here to check the bundle against; use --force to "
                                           "import anyway")
            sample = environments[report.mismatched[0]]
            raise InvalidArgumentError(
                f"{shown(path)}: refusing bundle: {len(report.mismatched)} of {len(listed)} entries were made for another GPU "
                f"or cuDNN (e.g. {sample.get('gpu')} with cuDNN {sample.get('cudnn')}; this machine: "
                f"{environment.get('gpu')} with cuDNN {environment.get('cudnn')}); use --force to import anyway")
        # Second pass: the same open file again, through the same checks (a file changed
        # since the first pass is refused, after what was published before the change).
        again = _Archive(path, f)
        if again.manifest_bytes != archive.manifest_bytes:
            raise again.refuse("it changed while it was imported")
        for key, data in again.entries(listed):
            try:
                entry = decode(data, expected_key=key)
            except EntryError as e:
                raise again.refuse(f"it changed while it was imported ({e})") from None
            if store.holds(key):
                report.already_present += 1
                continue
            try:
                written = store.publish(entry)
            except OSError as e:
                raise BundleWriteError(f"cannot write to the cache directory {shown(store.root)} ({e.strerror or e}); "
                                       f"imported {report.imported} of {len(listed)} entries before that") from None
            if not written:
                raise BundleWriteError(f"cannot write to the cache directory {shown(store.root)} (read-only, or an earlier "
                                       f"write failed); imported "
                                       f"{report.imported} of {len(listed)} entries before that")
            report.imported += 1
    # What the directory holds now, where the next process looks: an entry pruned at
    # once (FASTATTN_CACHE_MAX_BYTES) was imported and is not there.
    report.not_kept = [item.key for item in listed.values() if store.signature(item.key) is None]
    return report
