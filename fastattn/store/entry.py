"""The on-disk entry: one file per key, validating itself.

Layout (integers little-endian):

    magic            8 bytes   b"FASTATTN"
    format version   u32       keys.FORMAT_VERSION
    header length    u32       H
    header           H bytes   UTF-8 JSON: key, description, kind, created, blob sizes, metadata
    checksum         32 bytes  sha256 over header and blobs
    blobs                      concatenated, sizes in the header

A header readable with `head -c` is deliberate: `fastattn cache show` and a person
debugging a cache can see what an entry is without cuDNN. Any deviation (short file,
other magic, other version, bad JSON, wrong sizes, checksum mismatch, a key that is
not the file's) is an EntryError: the store treats it as a miss.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from typing import Any

from .keys import FORMAT_VERSION

__all__ = ["MAGIC", "Entry", "EntryError", "encode", "decode", "read_header", "read_header_from_file"]

MAGIC = b"FASTATTN"
_FIXED = struct.Struct("<8sII")
_CHECKSUM = 32
_MAX_HEADER = 1 << 20


class EntryError(ValueError):
    """An entry file that must not be used (the reason is in the message)."""


@dataclass
class Entry:
    """What one key maps to: a plan (named blobs) or a refusal (kind "unsupported").

    kind: "plan" or "unsupported".
    blobs: name -> bytes, in a fixed order ("forward", then "backward").
    meta: JSON-able facts stored beside the blobs (engine names, workspace sizes,
      cuDNN's reason for a refusal, build time).
    description: the key's description (see keys.describe).
    created: seconds since the epoch when it was written.
    """

    key: str
    kind: str
    description: dict[str, Any]
    blobs: dict[str, bytes] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    created: float = 0.0


def encode(entry: Entry) -> bytes:
    header = json.dumps(
        {
            "key": entry.key,
            "kind": entry.kind,
            "description": entry.description,
            "created": entry.created,
            "blobs": [[name, len(data)] for name, data in entry.blobs.items()],
            "meta": entry.meta,
        },
        sort_keys=True,
        separators=(",", ":"),
    ).encode("utf-8")
    digest = hashlib.sha256(header)
    for data in entry.blobs.values():
        digest.update(data)
    return b"".join([_FIXED.pack(MAGIC, FORMAT_VERSION, len(header)), header, digest.digest(), *entry.blobs.values()])


def _split(data: bytes) -> tuple[dict[str, Any], bytes, int]:
    """(header, header bytes, offset of the checksum)."""
    if len(data) < _FIXED.size:
        raise EntryError(f"truncated: {len(data)} bytes")
    magic, version, header_len = _FIXED.unpack_from(data)
    if magic != MAGIC:
        raise EntryError(f"not a fastattn entry (magic {magic!r})")
    if version != FORMAT_VERSION:
        raise EntryError(f"format version {version}, this fastattn reads {FORMAT_VERSION}")
    if header_len > _MAX_HEADER or _FIXED.size + header_len > len(data):
        raise EntryError(f"truncated header ({header_len} bytes announced, {len(data)} in file)")
    raw = data[_FIXED.size : _FIXED.size + header_len]
    try:
        header = json.loads(raw.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("header is not an object")
    except (UnicodeDecodeError, ValueError) as e:
        raise EntryError(f"unreadable header: {e}") from None
    return header, raw, _FIXED.size + header_len


def read_header(data: bytes) -> dict[str, Any]:
    """The header alone (no checksum check): for listing entries cheaply."""
    return _split(data)[0]


def read_header_from_file(f) -> dict[str, Any]:
    """The header of an open entry file, reading only the header's bytes."""
    fixed = f.read(_FIXED.size)
    if len(fixed) == _FIXED.size:
        _, _, header_len = _FIXED.unpack(fixed)
        if header_len <= _MAX_HEADER:
            fixed += f.read(header_len)
    return _split(fixed)[0]


def decode(data: bytes, expected_key: str | None = None) -> Entry:
    header, raw, at = _split(data)
    try:
        sizes = [(str(name), int(size)) for name, size in header["blobs"]]
        key, kind = str(header["key"]), str(header["kind"])
        description, meta, created = header["description"], header["meta"], float(header["created"])
    except (KeyError, TypeError, ValueError) as e:
        raise EntryError(f"malformed header: {e!r}") from None
    if expected_key is not None and key != expected_key:
        raise EntryError(f"entry is for key {key[:16]}..., not {expected_key[:16]}...")
    if kind not in ("plan", "unsupported"):
        raise EntryError(f"unknown kind {kind!r}")
    end = at + _CHECKSUM + sum(size for _, size in sizes)
    if any(size < 0 for _, size in sizes) or end != len(data):
        raise EntryError(f"size mismatch: header says {end} bytes, file has {len(data)}")
    checksum = data[at : at + _CHECKSUM]
    digest = hashlib.sha256(raw)
    blobs, pos = {}, at + _CHECKSUM
    for name, size in sizes:
        blobs[name] = data[pos : pos + size]
        digest.update(blobs[name])
        pos += size
    if digest.digest() != checksum:
        raise EntryError("checksum mismatch")
    return Entry(key=key, kind=kind, description=description, blobs=blobs, meta=meta, created=created)
