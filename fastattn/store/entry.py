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
other magic, other version, bad JSON, a header field of the wrong shape, wrong sizes,
more than MAX_ENTRY_BYTES in all, checksum mismatch, a key that is not the file's) is
an EntryError: the store treats it as a miss.

Entry bytes are untrusted (a bundle from elsewhere, a shared volume, Redis, a disk
that flipped a bit), and the header is read without its checksum when listing. So
the header's shape is checked here, in the one decoder every reader goes through:
whatever the bytes, a reader gets a well-formed header or an EntryError, never a
header whose "created" is a string or whose "gpu" is a list.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass, field
from typing import Any

from .. import verdict as _verdict
from .keys import FORMAT_VERSION, key_of

__all__ = ["MAGIC", "KEY_PATTERN", "MAX_ENTRY_BYTES", "Entry", "EntryError", "encode", "decode", "key_problem",
           "read_header", "read_header_from_file"]

MAGIC = b"FASTATTN"
_FIXED = struct.Struct("<8sII")
_CHECKSUM = 32
_MAX_HEADER = 1 << 20
# The most bytes an entry may hold, blobs included. Plans are kilobytes to a few
# megabytes; a file (or a Redis value, a bundle member) past this is damage, refused
# before it is read whole: a 3 GiB sparse file named like an entry must not cost 3 GiB
# of memory, or a MemoryError, to find that out.
MAX_ENTRY_BYTES = 256 << 20
KEY_PATTERN = re.compile(r"[0-9a-f]{64}")  # keys.key_of: a sha256 in hex; also what file names are made of
KINDS = ("plan", "unsupported")
# "created" is a time.time() when the entry was written: at or after 1970 and before the
# year 10000 (UTC). Anything else was never written by fastattn, and `cache ls` would
# show its age as hundreds of digits.
_LAST_TIME = 253402300800.0


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
    created: seconds since the epoch when it was written (a stored one outside
      [1970, 10000) is damage).
    """

    key: str
    kind: str
    description: dict[str, Any]
    blobs: dict[str, bytes] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    created: float = 0.0


def too_large(size: int) -> EntryError | None:
    """The EntryError for an entry of `size` bytes, when that is over MAX_ENTRY_BYTES."""
    if size <= MAX_ENTRY_BYTES:
        return None
    return EntryError(f"{size} bytes, over the {MAX_ENTRY_BYTES >> 20} MiB an entry may hold")


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
    error = too_large(len(data))
    if error is not None:
        raise error
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
        header = json.loads(raw.decode("utf-8"), parse_constant=_no_constant, parse_float=_finite_float,
                            parse_int=_float_sized_int)
        if not isinstance(header, dict):
            raise ValueError("header is not an object")
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise EntryError(f"unreadable header: {e}") from None
    _check_header(header)
    return header, raw, _FIXED.size + header_len


def _no_constant(name: str):
    # NaN and Infinity are not JSON: `cache show --json` would pass them on.
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:20]} is out of range")
    return value


def _float_sized_int(text: str) -> int:
    # Readers take a header's numbers as floats ("created", build_seconds, a verdict's
    # errors: float(), math.isfinite), and a float holds no integer past 1.8e308: such
    # a number is damage here, for every field at once, not an OverflowError in the
    # reader that meets it. (int() itself refuses more than 4300 digits: a ValueError.)
    value = int(text)
    try:
        float(value)
    except OverflowError:
        raise ValueError(f"the integer {text[:20]}... ({len(text)} digits) is out of range") from None
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


# The fields keys.describe writes, with the shape each must have when present. Tests
# and older writers may leave some out; none may be of another type, because readers
# (cache ls, export's GPU filter, preload) use them without asking again.
_DESCRIPTION_FIELDS = {
    "format": _is_int,
    "fastattn": lambda v: isinstance(v, str),
    "cudnn_frontend": lambda v: isinstance(v, str),
    "cudnn": _is_int,
    "policy": lambda v: isinstance(v, str),
    "config": lambda v: isinstance(v, dict),
    "defects": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    "env": lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values()),
    "gpu": lambda v: (isinstance(v, dict) and isinstance(v.get("name", ""), str)
                      and _is_int(v.get("sm_count", 0))
                      and isinstance(v.get("compute_capability", []), list)
                      and all(_is_int(x) for x in v.get("compute_capability", []))),
}
_META_FIELDS = {
    "reason": lambda v: isinstance(v, str),
    "forward_engine": lambda v: isinstance(v, str),
    "backward_engine": lambda v: v is None or isinstance(v, str),
    "forward_workspace_size": lambda v: _is_int(v) and v >= 0,
    "backward_workspace_size": lambda v: _is_int(v) and v >= 0,
    "build_seconds": _is_number,
    # fastattn.verdict's own shape check (its status must be what its numbers give).
    "verdict": _verdict.is_valid,
}


def _check_header(header: dict[str, Any]) -> None:
    """Raises EntryError unless every field has the shape encode() gives it."""

    def bad(what: str, value: Any) -> EntryError:
        text = json.dumps(value)
        return EntryError(f"malformed header: {what} is {text[:60] + '...' if len(text) > 60 else text}")

    for name in ("key", "kind", "description", "created", "blobs", "meta"):
        if name not in header:
            raise EntryError(f"malformed header: no {name!r}")
    if not isinstance(header["key"], str) or not KEY_PATTERN.fullmatch(header["key"]):
        raise bad("key", header["key"])
    if header["kind"] not in KINDS:
        raise bad("kind", header["kind"])
    if not (_is_number(header["created"]) and 0 <= header["created"] < _LAST_TIME):
        raise bad("created", header["created"])
    blobs = header["blobs"]
    if not (isinstance(blobs, list)
            and all(isinstance(b, list) and len(b) == 2 and isinstance(b[0], str) and _is_int(b[1]) and b[1] >= 0
                    for b in blobs)
            and len({b[0] for b in blobs}) == len(blobs)):
        raise bad("blobs", blobs)
    for name, fields in (("description", _DESCRIPTION_FIELDS), ("meta", _META_FIELDS)):
        value = header[name]
        if not isinstance(value, dict):
            raise bad(name, value)
        for field_name, ok in fields.items():
            if field_name in value and not ok(value[field_name]):
                raise bad(f"{name}.{field_name}", value[field_name])
    # A plan entry serves: it never carries a failed verdict (a failed plan is stored as
    # a refusal), and a refusal carries no passed one.
    status = (header["meta"].get("verdict") or {}).get("status")
    if (header["kind"] == "plan" and status == "failed") or (header["kind"] == "unsupported" and status == "passed"):
        raise bad("meta.verdict.status", status)


def key_problem(key: str, description: Any) -> str:
    """Why an entry stored under `key` with `description` in its header is not that
    key's ("" when it is): a key is the hash of its description (keys.key_of), so a
    header that describes another plan (another config, GPU or version) under a valid
    checksum is an entry for another key. Readers that serve or judge an entry (the
    runtime, `cache verify`, `show`, `ls`) ask; the decoder does not, so that a test can
    store an entry under any key."""
    try:
        described = key_of(description)
    except (TypeError, ValueError, RecursionError):
        return "its header's description cannot be hashed"
    if described == key:
        return ""
    return f"its header describes another plan than its key (that plan's key is {described[:16]}...)"


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
    """The entry in `data` (checksum checked; with `expected_key`, it must be that key's),
    or EntryError, whatever the bytes."""
    header, raw, at = _split(data)  # the header's shape is checked there
    sizes = [(name, size) for name, size in header["blobs"]]
    key, kind = header["key"], header["kind"]
    description, meta, created = header["description"], header["meta"], float(header["created"])
    if expected_key is not None and key != expected_key:
        raise EntryError(f"entry is for key {key[:16]}..., not {str(expected_key)[:16]}...")
    end = at + _CHECKSUM + sum(size for _, size in sizes)
    if end != len(data):
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
