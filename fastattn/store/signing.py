"""Signed entries: an HMAC-SHA256 over an entry's key and bytes, with a shared secret.

Deserializing a plan loads native code, so a store that other machines write to is a
way in. An entry fetched from a shared store is used only when its signature verifies
with this process's secret (or when the user declared the store trusted and set no
secret). The checksum inside an entry catches damage; only the signature catches an
entry that someone wrote on purpose.

The secret: FASTATTN_CACHE_HMAC_KEY (the secret itself, as text) or
FASTATTN_CACHE_HMAC_KEY_FILE (a file holding it, read when the first is not set;
surrounding whitespace is ignored).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

from .. import env as _env
from ..errors import InvalidArgumentError

__all__ = ["SIGNED_MAGIC", "load_secret", "sign", "unwrap", "wrap"]

SIGNED_MAGIC = b"FASIGN01"  # then a 32-byte HMAC, then the entry's bytes
_MAC = 32


def load_secret(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The shared secret from the environment, or None when none is configured. A key
    file that cannot be read, or an empty secret, is an InvalidArgumentError naming
    the variable: signing with a secret nobody meant is worse than failing."""
    secret = _env.get("FASTATTN_CACHE_HMAC_KEY", environ)
    if secret is not None:
        return secret
    path = _env.get("FASTATTN_CACHE_HMAC_KEY_FILE", environ)
    if path is None:
        return None
    name = "FASTATTN_CACHE_HMAC_KEY_FILE"
    try:
        with open(path, "rb") as f:
            raw = f.read().strip()
    except OSError as e:
        raise InvalidArgumentError(f"{name}={path!r}: cannot read it ({e.strerror})") from None
    except ValueError:  # open() refuses a path with a NUL byte before asking the system
        raise InvalidArgumentError(f"{name}={path!r}: not a path (it holds a NUL byte)") from None
    if not raw:
        raise InvalidArgumentError(f"{name}={path!r}: the file is empty")
    return raw


def sign(secret: bytes, key: str, data: bytes) -> bytes:
    """The HMAC of `data` stored under `key`: binding the key stops a valid entry from
    being replayed under another key."""
    return hmac.new(secret, key.encode("ascii") + b"\0" + data, hashlib.sha256).digest()


def wrap(secret: bytes | None, key: str, data: bytes) -> bytes:
    """What goes into a shared store: signed when there is a secret, else as is."""
    if secret is None:
        return data
    return SIGNED_MAGIC + sign(secret, key, data) + data


def unwrap(secret: bytes | None, key: str, value: bytes) -> tuple[bytes | None, str]:
    """(entry bytes, "") when `value` may be used, else (None, why). With a secret, only
    values signed with it for this key pass; without one (a store declared trusted),
    signed and unsigned values pass, their signature unchecked."""
    signed = value.startswith(SIGNED_MAGIC)
    if signed:
        mac = value[len(SIGNED_MAGIC) : len(SIGNED_MAGIC) + _MAC]
        data = value[len(SIGNED_MAGIC) + _MAC :]
    else:
        mac, data = b"", value
    if secret is None:
        return data, ""
    if not signed:
        return None, "unsigned"
    if len(mac) != _MAC or not hmac.compare_digest(mac, sign(secret, key, data)):
        return None, "bad signature"
    return data, ""
