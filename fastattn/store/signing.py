"""Signed entries and the trust policy of shared sources (the Redis tier, bundles).

Deserializing a plan loads native code, so a store that other machines write to, or a
bundle made elsewhere, is a way in. One rule (Policy) decides for both what this
process takes from them:

- with a signing secret: only what is signed with it (an HMAC-SHA256 over an entry's
  key and bytes, or over a bundle's manifest, which holds every entry's sha256):
  "signed and checked";
- without one, only where the user states that the source is trusted
  (FASTATTN_CACHE_TRUSTED=1): whatever it holds, signed or not, its signature
  unchecked;
- without either, nothing: the Redis tier stays off, a bundle is refused.

The checksum inside an entry catches damage; only the signature catches an entry that
someone wrote on purpose.

The secret: FASTATTN_CACHE_HMAC_KEY (the secret itself, as text) or
FASTATTN_CACHE_HMAC_KEY_FILE (a small regular file holding it as UTF-8 text, read when
the first is not set; surrounding whitespace is ignored).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field

from .. import env as _env
from .. import files
from ..errors import InvalidArgumentError

__all__ = ["MAX_KEY_FILE_BYTES", "SIGNED_MAGIC", "TRUST_VARIABLE", "Policy", "load_secret", "policy_from_env", "sign",
           "unwrap", "wrap"]

SIGNED_MAGIC = b"FASIGN01"  # then a 32-byte HMAC, then the entry's bytes
_MAC = 32
MAX_KEY_FILE_BYTES = 4096  # a secret is tens of bytes; a larger file is not a key file
TRUST_VARIABLE = "FASTATTN_CACHE_TRUSTED"
_SECRET_VARIABLES = "FASTATTN_CACHE_HMAC_KEY or FASTATTN_CACHE_HMAC_KEY_FILE"


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


@dataclass(frozen=True)
class Policy:
    """What this process takes from a shared source (the Redis tier, a bundle): with a
    `secret`, what is signed with it; without one, everything when the user declared
    the sources `trusted` (FASTATTN_CACHE_TRUSTED=1), else nothing."""

    secret: bytes | None = field(default=None, repr=False)  # never printed
    trusted: bool = False

    def refusal(self) -> str:
        """Why nothing from a shared source may be used here, or "" when the policy
        lets some of it be."""
        if self.secret is None and not self.trusted:
            return (f"no signing secret ({_SECRET_VARIABLES}) to check it, and no {TRUST_VARIABLE}=1 to take it "
                    "unchecked: loading a plan loads native code")
        return ""

    def check(self, key: str, data: bytes, mac: bytes | None) -> str:
        """"" when `data`, stored under `key` with the signature `mac` (None: unsigned),
        may be used; else why not ("unsigned", "bad signature", or the refusal)."""
        if self.secret is None:
            return self.refusal()
        if mac is None:
            return "unsigned"
        if len(mac) != _MAC or not hmac.compare_digest(mac, sign(self.secret, key, data)):
            return "bad signature"
        return ""

    def applied(self, signed: bool | None = None) -> str:
        """How what passed check() was taken (signed: whether it was; None: several
        things, signed or not), in words, for a command to print."""
        if self.secret is not None:
            return "signed and checked"
        what = {True: "signed, unchecked (no secret here)", False: "unsigned", None: "signed or not, unchecked"}[signed]
        return f"{what}, trusted by {TRUST_VARIABLE}=1"


def policy_from_env(secret: bytes | None, environ: Mapping[str, str] | None = None) -> Policy:
    """The policy of this environment: `secret` (load_secret's) and FASTATTN_CACHE_TRUSTED
    (an InvalidArgumentError naming it when it is not a boolean)."""
    return Policy(secret, _env.get(TRUST_VARIABLE, environ))


def sign(secret: bytes, key: str, data: bytes) -> bytes:
    """The HMAC of `data` stored under `key`: binding the key stops a valid entry from
    being replayed under another key."""
    return hmac.new(secret, key.encode("ascii") + b"\0" + data, hashlib.sha256).digest()


def wrap(secret: bytes | None, key: str, data: bytes) -> bytes:
    """What goes into a shared store: signed when there is a secret, else as is."""
    if secret is None:
        return data
    return SIGNED_MAGIC + sign(secret, key, data) + data


def unwrap(policy: Policy, key: str, value: bytes) -> tuple[bytes | None, str]:
    """(entry bytes, "") when the stored `value` may be used under `policy`, else (None,
    why)."""
    if value.startswith(SIGNED_MAGIC):
        mac: bytes | None = value[len(SIGNED_MAGIC) : len(SIGNED_MAGIC) + _MAC]
        data = value[len(SIGNED_MAGIC) + _MAC :]
    else:
        mac, data = None, value
    why = policy.check(key, data, mac)
    return (None, why) if why else (data, "")
