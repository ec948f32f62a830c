"""Bundles: a cache shipped as one archive to machines with the same GPU and cuDNN.

A bundle is a gzipped tar holding manifest.json and entries/<key>.entry files. The
manifest lists every entry with its sha256, size, GPU and cuDNN version. Import reads
members into memory and publishes them through DiskStore.put, which derives every
path from a validated key: whatever names the archive holds, nothing is written
outside the cache directory. A bundle with any member other than the manifest and
well-named entries, or whose checksums or keys disagree, is refused whole.

With a signing secret (store.signing), export signs the manifest (which holds every
entry's sha256) and import refuses a bundle that is unsigned or signed otherwise.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import re
import tarfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from ..errors import InvalidArgumentError
from .disk import DiskStore
from .entry import EntryError, decode
from .keys import canonical_json, environment_of
from .signing import sign

__all__ = ["BUNDLE_FORMAT", "export_bundle", "import_bundle", "ImportReport"]

BUNDLE_FORMAT = 1
_ENTRY_NAME = re.compile(r"^entries/([0-9a-f]{64})\.entry$")
_MAX_MEMBER = 256 << 20


def _manifest_mac(secret: bytes, manifest: dict[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != "signature"}
    return sign(secret, "bundle", canonical_json(body).encode()).hex()


def export_bundle(stores: Iterable[DiskStore], path: str, *,
                  keep: Callable[[dict[str, Any]], bool] | None = None, secret: bytes | None = None) -> int:
    """Writes the valid entries of `stores` (those `keep(description)` accepts) to a
    bundle at `path`, signed when `secret` is given; returns how many. Damaged entries
    are left out."""
    manifest: dict[str, Any] = {"format": BUNDLE_FORMAT, "created": time.time(), "entries": []}
    seen: set[str] = set()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for store in stores:
            for info in store.entries(with_headers=False):
                if info.key in seen:
                    continue
                try:
                    with open(info.path, "rb") as f:
                        data = f.read()
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
    with open(path, "wb") as f:
        f.write(buf.getvalue())
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


def _read_bundle(path: str) -> tuple[dict[str, Any], dict[str, bytes]]:
    try:
        tar = tarfile.open(path, mode="r:*")
    except (OSError, tarfile.TarError) as e:
        raise InvalidArgumentError(f"{path}: not a readable bundle ({e})") from None
    members: dict[str, bytes] = {}
    with tar:
        for m in tar:
            name = m.name
            if name != "manifest.json" and not _ENTRY_NAME.match(name):
                raise InvalidArgumentError(f"{path}: refusing bundle: unexpected member {name!r}")
            if not m.isfile():
                raise InvalidArgumentError(f"{path}: refusing bundle: member {name!r} is not a regular file")
            if m.size > _MAX_MEMBER or name in members:
                raise InvalidArgumentError(f"{path}: refusing bundle: member {name!r} is too large or repeated")
            f = tar.extractfile(m)
            members[name] = f.read() if f else b""
    if "manifest.json" not in members:
        raise InvalidArgumentError(f"{path}: refusing bundle: no manifest.json")
    try:
        manifest = json.loads(members.pop("manifest.json"))
        if manifest.get("format") != BUNDLE_FORMAT or not isinstance(manifest.get("entries"), list):
            raise ValueError(f"format {manifest.get('format')!r}")
    except (ValueError, AttributeError) as e:
        raise InvalidArgumentError(f"{path}: refusing bundle: bad manifest ({e})") from None
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
        if not isinstance(mac, str):
            raise InvalidArgumentError(f"{path}: refusing bundle: it is not signed, and a signing secret is set")
        if not hmac.compare_digest(mac, _manifest_mac(secret, manifest)):
            raise InvalidArgumentError(f"{path}: refusing bundle: its signature does not match this secret")
    listed = {}
    for item in manifest["entries"]:
        try:
            key, digest = str(item["key"]), str(item["sha256"])
        except (KeyError, TypeError):
            raise InvalidArgumentError(f"{path}: refusing bundle: manifest entry without key or sha256") from None
        name = f"entries/{key}.entry"
        data = members.get(name)
        if data is None:
            raise InvalidArgumentError(f"{path}: refusing bundle: {name} is listed but missing")
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
        if store.signature(key) is not None:
            report.already_present += 1
        if store.put(entry):
            report.imported += 1
    return report
