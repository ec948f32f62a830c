"""Signed entries: an HMAC-SHA256 over an entry's key and bytes, with a shared secret.

Deserializing a plan loads native code, so a store that other machines write to is a
way in. An entry fetched from a shared store is used only when its signature verifies
with this process's secret (or when the user declared the store trusted and set no
secret). The checksum inside an entry catches damage; only the signature catches an
entry that someone wrote on purpose.

The secret: FASTATTN_CACHE_HMAC_KEY (the secret itself, as text) or
FASTATTN_CACHE_HMAC_KEY_FILE (a small regular file holding it as UTF-8 text, read when
the first is not set; surrounding whitespace is ignored).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

from .. import env as _env
from .. import files
from ..errors import InvalidArgumentError

__all__ = ["MAX_KEY_FILE_BYTES", "SIGNED_MAGIC", "load_secret", "sign", "unwrap", "wrap"]

SIGNED_MAGIC = b"FASIGN01"  # then a 32-byte HMAC, then the entry's bytes
_MAC = 32
MAX_KEY_FILE_BYTES = 4096  # a secret is tens of bytes; a larger file is not a key file


def load_secret(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The shared secret from the environment, or None when none is configured. A key
    file that is not a small regular file of UTF-8 text (a FIFO is never waited on, a
    device never read, at most MAX_KEY_FILE_BYTES + 1 bytes are read), or an empty
    secret, is an InvalidArgumentError naming the variable and the path: signing with
    a secret nobody meant is worse than failing."""
    secret = _env.get("FASTATTN_CACHE_HMAC_KEY", environ)
    if secret is not None:
        return secret
    path = _env.get("FASTATTN_CACHE_HMAC_KEY_FILE", environ)
    if path is None:
        return None
    where = f"FASTATTN_CACHE_HMAC_KEY_FILE={path!r}"  # whole (the user must find the file), escaped
    try:
        raw = files.read_regular(path, MAX_KEY_FILE_BYTES)
    except files.NotRegularFileError as e:
        raise InvalidArgumentError(f"{where}: {e.strerror}") from None
    except files.FileTooLargeError:
        raise InvalidArgumentError(f"{where}: over {MAX_KEY_FILE_BYTES} bytes, not a key file: not read") from None
    except OSError as e:
        raise InvalidArgumentError(f"{where}: cannot read it ({e.strerror or e})") from None
    except ValueError:  # the system is never asked about a path with a NUL byte
        raise InvalidArgumentError(f"{where}: not a path (it holds a NUL byte)") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidArgumentError(f"{where}: not UTF-8 text (byte {e.start})") from None
    if not raw:
        raise InvalidArgumentError(f"{where}: the file is empty")
    if not text.strip():
        raise InvalidArgumentError(f"{where}: the file holds only whitespace")
    return text.strip().encode("utf-8")


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
