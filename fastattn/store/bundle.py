"""Bundles: a cache shipped as one archive to machines with the same GPU and cuDNN.

A bundle is a gzipped tar holding manifest.json and entries/<key>.entry files. The
manifest lists every entry with its sha256, size, GPU and cuDNN version. Import reads
members into memory and publishes them through DiskStore.put, which derives every
path from a validated key: whatever names the archive holds, nothing is written
outside the cache directory. A bundle with any member other than the manifest and
well-named entries, or whose checksums or keys disagree, is refused whole.

Export writes the bundle as entries are written: 0600, atomically, and only where no
file or a regular one is (fastattn.files: a FIFO or a device node there is refused,
not replaced). With a signing
secret (store.signing), export signs the manifest (which holds every
entry's sha256) and import refuses a bundle that is unsigned or signed otherwise.

A bundle is untrusted bytes: whatever it holds (a truncated gzip stream, a tar cut
mid-member, a manifest of the wrong shape, entries with valid checksums and nonsense
headers), import raises InvalidArgumentError naming the file and the reason, or
imports; it raises nothing else. When the cache cannot be written, it raises
BundleWriteError (an OSError) after importing what it could.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import lzma
import os
import re
import stat
import tarfile
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from .. import files
from ..errors import InvalidArgumentError
from .disk import DiskStore
from .entry import MAX_ENTRY_BYTES, EntryError, decode
from .keys import canonical_json, environment_of
from .signing import sign

__all__ = ["BUNDLE_FORMAT", "BundleWriteError", "export_bundle", "import_bundle", "ImportReport"]

BUNDLE_FORMAT = 1
_ENTRY_NAME = re.compile(r"^entries/([0-9a-f]{64})\.entry$")
_MAX_MEMBER = MAX_ENTRY_BYTES  # an entry (or the manifest) is never larger
_MAX_TOTAL = 4 << 30  # a decompression bomb stops here, not when memory runs out
_MAX_BUNDLE = _MAX_TOTAL  # the file itself: compressed, its members take no more
_MAX_MEMBERS = 1 << 20  # members of no size still cost a header's decompression and memory each
# What tarfile and its decompressors raise on damaged input while members are read
# (not only at open): a gzip stream cut short is EOFError, a bad deflate block
# zlib.error, a bad gzip header gzip.BadGzipFile (an OSError).
_READ_ERRORS = (OSError, EOFError, tarfile.TarError, zlib.error, lzma.LZMAError, ValueError, RecursionError)


class BundleWriteError(OSError):
    """The cache directory could not take a bundle's entries (the message says which
    directory and why); the entries before the failure were imported."""


def _manifest_mac(secret: bytes, manifest: dict[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != "signature"}
    return sign(secret, "bundle", canonical_json(body).encode()).hex()


def export_bundle(stores: Iterable[DiskStore], path: str, *,
                  keep: Callable[[dict[str, Any]], bool] | None = None, secret: bytes | None = None) -> int:
    """Writes the valid entries of `stores` (those `keep(description)` accepts) to a
    bundle at `path`, signed when `secret` is given; returns how many. Damaged entries
    are left out, and so is anything in the directories that is not an entry (a FIFO,
    a link: DiskStore.scan)."""
    manifest: dict[str, Any] = {"format": BUNDLE_FORMAT, "created": time.time(), "entries": []}
    seen: set[str] = set()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for store in stores:
            for info in store.entries(with_headers=False):
                if info.key in seen:
                    continue
                try:
                    data = store.read(info.path)  # never a link's target, never a wait on a FIFO
                    entry = decode(data, expected_key=info.key)
                except (OSError, EntryError):
                    continue
                if keep is not None and not keep(entry.description):
                    continue
                seen.add(info.key)
                _add(tar, f"entries/{info.key}.entry", data)
                manifest["entries"].append({
                    "key": info.key,
                    "sha256": hashlib.sha256(data).hexdigest(),
                    "size": len(data),
                    "kind": entry.kind,
                    "environment": environment_of(entry.description),
                    "config": entry.description.get("config"),
                })
        if secret is not None:
            manifest["signature"] = _manifest_mac(secret, manifest)
        _add(tar, "manifest.json", json.dumps(manifest, indent=1, sort_keys=True).encode())
    # 0600, as entries are (native code, and a credential's work when signed), and
    # atomically: a reader, or a bundle being replaced, sees the old file or the new one.
    # Only over a regular file: files.NotRegularFileError (an OSError) for anything else.
    files.write_file(path, buf.getvalue(), private=True)
    return len(manifest["entries"])


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o600
    tar.addfile(info, io.BytesIO(data))


@dataclass
class ImportReport:
    imported: int = 0
    already_present: int = 0
    mismatched: list[str] = field(default_factory=list)  # keys whose GPU or cuDNN differ from this machine's


def _read_members(path: str) -> dict[str, bytes]:
    """Every member's bytes; InvalidArgumentError for anything but a well-formed bundle
    archive. The whole read is guarded: tarfile.open reads only the first header, and
    damage further on surfaces while iterating or reading members."""
    members: dict[str, bytes] = {}
    total = 0
    try:
        with _open_regular(path) as f, tarfile.open(fileobj=f, mode="r:*") as tar:
            for m in tar:
                name = m.name
                if len(members) >= _MAX_MEMBERS:
                    raise InvalidArgumentError(f"{path}: refusing bundle: more than {_MAX_MEMBERS} members")
                if name != "manifest.json" and not _ENTRY_NAME.match(name):
                    raise InvalidArgumentError(f"{path}: refusing bundle: unexpected member {name[:200]!r}")
                if not m.isfile():
                    raise InvalidArgumentError(f"{path}: refusing bundle: member {name!r} is not a regular file")
                total += m.size
                if m.size > _MAX_MEMBER or total > _MAX_TOTAL or name in members:
                    raise InvalidArgumentError(f"{path}: refusing bundle: member {name!r} is too large or repeated")
                f = tar.extractfile(m)
                data = f.read() if f else b""
                if len(data) != m.size:
                    raise EOFError(f"member {name!r} is cut short")
                members[name] = data
    except InvalidArgumentError:
        raise
    except _READ_ERRORS as e:
        why = str(e) or type(e).__name__
        raise InvalidArgumentError(f"{path}: not a readable bundle ({why})") from None
    return members


def _open_regular(path: str):
    """`path` open for reading, when it is a regular file of at most _MAX_BUNDLE bytes;
    InvalidArgumentError naming it otherwise. Opened without blocking and checked on
    the descriptor (fstat), so that a FIFO put there after the command checked its
    argument is not waited on, nor a device such as /dev/zero read forever."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise InvalidArgumentError(f"{path}: {files.kind(st.st_mode)}, not a regular file: not read")
    if st.st_size > _MAX_BUNDLE:
        os.close(fd)
        raise InvalidArgumentError(f"{path}: refusing bundle: {st.st_size} bytes, over the {_MAX_BUNDLE >> 30} GiB "
                                   "a bundle may hold")
    os.set_blocking(fd, True)  # (a regular file's reads never block; this keeps them plain)
    return os.fdopen(fd, "rb")


def _read_bundle(path: str) -> tuple[dict[str, Any], dict[str, bytes]]:
    members = _read_members(path)
    if "manifest.json" not in members:
        raise InvalidArgumentError(f"{path}: refusing bundle: no manifest.json")
    try:
        manifest = json.loads(members.pop("manifest.json"))
        if not isinstance(manifest, dict):
            raise ValueError("it is not a JSON object")
        if manifest.get("format") != BUNDLE_FORMAT or not isinstance(manifest.get("entries"), list):
            raise ValueError(f"format {manifest.get('format')!r}")
    except (ValueError, RecursionError) as e:
        raise InvalidArgumentError(f"{path}: refusing bundle: bad manifest ({str(e)[:200]})") from None
    return manifest, members


def import_bundle(path: str, store: DiskStore, *, environment: dict[str, Any] | None, force: bool = False,
                  secret: bytes | None = None) -> ImportReport:
    """Checks a bundle (with a `secret`, its signature; manifest, checksums, keys; and,
    unless `force`, that every entry was made for `environment`, this machine's GPU
    and versions) and publishes its entries into `store`. Raises InvalidArgumentError
    and imports nothing when any check fails. environment=None means "unknown" (no GPU
    here): only `force` imports. `force` never overrides the signature."""
    manifest, members = _read_bundle(path)
    if secret is not None:
        mac = manifest.get("signature")
        if not isinstance(mac, str) or not mac.isascii():
            raise InvalidArgumentError(f"{path}: refusing bundle: it is not signed, and a signing secret is set")
        try:
            expected = _manifest_mac(secret, manifest)
        except (ValueError, RecursionError):  # NaN or nesting json.loads took and canonical JSON refuses
            expected = ""
        if not hmac.compare_digest(mac, expected):
            raise InvalidArgumentError(f"{path}: refusing bundle: its signature does not match this secret")
    listed = {}
    for item in manifest["entries"]:
        key = item.get("key") if isinstance(item, dict) else None
        digest = item.get("sha256") if isinstance(item, dict) else None
        if not isinstance(key, str) or not isinstance(digest, str):
            raise InvalidArgumentError(f"{path}: refusing bundle: manifest entry without key or sha256")
        name = f"entries/{key}.entry"
        data = members.get(name)
        if data is None:
            raise InvalidArgumentError(f"{path}: refusing bundle: {name[:100]!r} is listed but missing")
        if hashlib.sha256(data).hexdigest() != digest:
            raise InvalidArgumentError(f"{path}: refusing bundle: {name} does not match its checksum")
        try:
            entry = decode(data, expected_key=key)
        except EntryError as e:
            raise InvalidArgumentError(f"{path}: refusing bundle: {name}: {e}") from None
        listed[key] = entry
    unlisted = set(members) - {f"entries/{k}.entry" for k in listed}
    if unlisted:
        raise InvalidArgumentError(f"{path}: refusing bundle: {sorted(unlisted)[0]} is not in the manifest")
    report = ImportReport()
    report.mismatched = [k for k, e in listed.items() if environment_of(e.description) != environment]
    if report.mismatched and not force:
        if environment is None:
            raise InvalidArgumentError(f"{path}: no usable GPU here to check the bundle against; use --force to "
                                       "import anyway")
        sample = environment_of(listed[report.mismatched[0]].description)
        raise InvalidArgumentError(
            f"{path}: refusing bundle: {len(report.mismatched)} of {len(listed)} entries were made for another GPU "
            f"or cuDNN (e.g. {sample.get('gpu')} with cuDNN {sample.get('cudnn')}; this machine: "
            f"{environment.get('gpu')} with cuDNN {environment.get('cudnn')}); use --force to import anyway")
    for key, entry in listed.items():
        if store.holds(key):
            report.already_present += 1
            continue
        try:
            written = store.publish(entry)
        except OSError as e:
            raise BundleWriteError(f"cannot write to the cache directory {store.root} ({e.strerror or e}); "
                                   f"imported {report.imported} of {len(listed)} entries before that") from None
        if not written:
            raise BundleWriteError(f"cannot write to the cache directory {store.root} (read-only, or an earlier "
                                   f"write failed); imported "
                                   f"{report.imported} of {len(listed)} entries before that")
        report.imported += 1
    return report
