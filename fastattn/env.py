"""Every FASTATTN_* environment variable: one table and one parser (public: the store,
the CLI and fastattn.torch read their variables here, and a user can check an
environment with check_all()).

VARIABLES declares each variable once: its kind (how its text is read: the numbers by
fastattn.parsing, as the command's flags of the same kind are), its default,
its help. Everything else comes from it: every read in fastattn goes through get(),
so a variable means the same on every path (the API, the CLI, warm's workers, the
torch entry points); docs/ENVIRONMENT.md's table is markdown() (tests/runtime/test_env.py checks that
the two agree; `python -c 'from fastattn import env; print(env.markdown())'` prints it).

One rule per kind, the same for every variable of that kind:

- unset or empty (only spaces) is the default; a secret that is set must not be empty;
- bool: 1, true, yes, on / 0, false, no, off, in any case;
- choice: one of the names, in any case;
- seconds: a duration, a number (decimal, optionally with an exponent: 0.25, 1e3) with
  a unit s, m, h, d or w, or bare (seconds), at least the minimum and at most
  MAX_SECONDS (1e6 s, 11.6 days: far larger ones overflow the clients' and the OS's
  timers, redis-py's among them);
- size: bytes, an integer, or a number with a K, M, G or T suffix (powers of 1024),
  below 8 EiB; `none` (no limit) where the variable says so;
- count: an integer, at most MAX_COUNT;
- 0 is zero in every numeric variable, never "no limit": where zero would make a
  setting empty something (a cache or a table that keeps nothing), it is refused,
  naming what to write instead;
- numbers (seconds, size, count, a URL's database, classes) are ASCII digits: Python's int()
  and float() also take other scripts' digits (١٢) and underscores (1_000), which no
  other program reading the same environment would;
- url: a Redis URL, checked up front (scheme, host, port, database);
- path, paths (os.pathsep-separated), text: taken as written.

A bad value is an InvalidArgumentError (a ValueError) whose message starts with
NAME=value (a URL's password and a secret are never shown): from the API as is, exit 2
from the CLI.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import parse_qs, urlsplit, urlunsplit

from . import parsing
from ._fields import show
from .errors import InvalidArgumentError

__all__ = ["VARIABLES", "Var", "get", "is_set", "check_all", "markdown", "redact", "TRUE", "FALSE"]

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")
_PORTS = (1, 65535)
_INT32 = 2**31
MAX_SECONDS = 1e6  # every "seconds" variable's largest value (see the module's doc)
MAX_COUNT = 2**31 - 1  # every "count" variable's largest value, as the command's count flags (cli._common.INT_MAX)


@dataclass(frozen=True)
class Var:
    """One variable. kind: a key of _PARSERS. default: the value when unset (a
    function: computed when needed). show_default: how docs/ENVIRONMENT.md writes it (None:
    the default itself). minimum (seconds): the least value; above: the minimum is
    excluded. scope: "runtime" (fastattn reads it), "tests" (its test suite),
    "build" (setup.py, before fastattn can be imported)."""

    name: str
    kind: str
    default: Any
    help: str
    show_default: str | None = None
    choices: tuple[str, ...] = ()
    minimum: float = 0.0
    above: bool = False
    scope: str = "runtime"
    unlimited: bool = False  # size: `none` is taken, as no limit
    zero: str = ""  # size, count: why 0 is refused here (what to write instead), where zero would empty something


def _bad(var: Var, raw: str, why: str) -> InvalidArgumentError:
    shown = "***" if var.kind == "secret" else redact(raw) if var.kind == "url" else raw
    return InvalidArgumentError(f"{var.name}={show(shown)}: {why}")


# -- the parsers: (variable, its text, stripped and not empty) -> value ------------------


def _bool(var: Var, raw: str) -> bool:
    text = raw.strip().lower()
    if text in TRUE:
        return True
    if text in FALSE:
        return False
    raise _bad(var, raw, f"must be a boolean: {'/'.join(TRUE)} or {'/'.join(FALSE)}")


def _choice(var: Var, raw: str) -> str:
    text = raw.strip().lower()
    if text not in var.choices:
        raise _bad(var, raw, f"must be one of {', '.join(var.choices)}")
    return text


def _seconds(var: Var, raw: str) -> float:
    try:
        return parsing.duration(raw, MAX_SECONDS, above=var.minimum if var.above else None)
    except ValueError as e:
        raise _bad(var, raw, str(e)) from None


def _size(var: Var, raw: str) -> int | None:
    if var.unlimited and raw.strip(parsing.SPACES).lower() == "none":
        return None
    try:
        value = parsing.size(raw)
    except ValueError as e:
        raise _bad(var, raw, str(e)) from None
    if value == 0 and var.zero:
        raise _bad(var, raw, var.zero)
    return value


def _count(var: Var, raw: str) -> int:
    try:
        value = parsing.integer(raw, 0, MAX_COUNT)
    except ValueError as e:
        raise _bad(var, raw, str(e)) from None
    if value == 0 and var.zero:
        raise _bad(var, raw, var.zero)
    return value


def _path(var: Var, raw: str) -> str:
    return raw


def _paths(var: Var, raw: str) -> tuple[str, ...]:
    return tuple(p for p in raw.split(os.pathsep) if p.strip())


def _text(var: Var, raw: str) -> str:
    return raw


def _secret(var: Var, raw: str) -> bytes:
    return raw.strip().encode("utf-8", "surrogateescape")


def _classes(var: Var, raw: str):
    from .shape_classes import parse  # (shape_classes imports nothing heavy)

    try:
        return parse(raw, var.name)
    except InvalidArgumentError as e:
        raise _bad(var, raw, str(e).split(": ", 1)[-1]) from None


def redact(url: str) -> str:
    """The URL without its password, for messages."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return url.split("@", 1)[-1] if "@" in url else url
    if password is None:
        return url
    netloc = parts.netloc.replace(":" + password + "@", ":***@")
    return urlunsplit(parts._replace(netloc=netloc))


_URL_FORMS = "redis://[user:password@]host[:port][/db], rediss://... (TLS) or unix://[user:password@]/socket[?db=N]"


def _db(var: Var, raw: str, text: str) -> None:
    if not re.fullmatch(r"[0-9]{1,10}", text) or int(text) >= _INT32:
        raise _bad(var, raw, f"the database must be a number from 0 (got {show(text)}); expected {_URL_FORMS}")


def _url(var: Var, raw: str) -> str:
    """A Redis URL that redis-py takes as meant: checked here, not at the first
    connection (where a port out of range is a ValueError from inside the client)."""
    url = raw.strip()
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:  # a port that is not a number or out of range, a broken [IPv6] host
        raise _bad(var, raw, f"{e}; expected {_URL_FORMS}") from None
    scheme = parts.scheme
    if scheme not in ("redis", "rediss", "unix") or not url.startswith(scheme + "://"):
        raise _bad(var, raw, f"expected {_URL_FORMS}")
    if parts.fragment:
        raise _bad(var, raw, f"a URL fragment (#...) means nothing here; expected {_URL_FORMS}")
    query = parse_qs(parts.query, keep_blank_values=True) if parts.query else {}
    if scheme == "unix":
        if parts.hostname or port is not None or not parts.path.startswith("/") or parts.path == "/":
            raise _bad(var, raw, f"a unix:// URL names the socket's absolute path; expected {_URL_FORMS}")
        if set(query) - {"db"} or any(len(v) != 1 for v in query.values()):
            raise _bad(var, raw, f"the only query a unix:// URL takes is ?db=N; expected {_URL_FORMS}")
        if "db" in query:
            _db(var, raw, query["db"][0])
        return url
    if not parts.hostname or not parts.hostname.isprintable() or any(c.isspace() for c in parts.hostname):
        raise _bad(var, raw, f"no host, or not a host name; expected {_URL_FORMS}")
    if port is not None and not _PORTS[0] <= port <= _PORTS[1]:
        raise _bad(var, raw, f"port {port} is out of range {_PORTS[0]}-{_PORTS[1]}")
    if parts.query:
        raise _bad(var, raw, f"query parameters are not taken (timeouts: FASTATTN_REMOTE_TIMEOUT); expected "
                             f"{_URL_FORMS}")
    path = parts.path
    if path not in ("", "/"):
        _db(var, raw, path[1:])
    return url


_PARSERS: dict[str, Callable[[Var, str], Any]] = {
    "bool": _bool, "choice": _choice, "seconds": _seconds, "size": _size, "count": _count, "path": _path,
    "paths": _paths, "text": _text, "secret": _secret, "url": _url, "classes": _classes,
}
# How docs/ENVIRONMENT.md names each kind's values.
_KIND_TEXT = {"bool": "boolean",
              "seconds": f"a duration (90s, 5m; a bare number is seconds; at most {MAX_SECONDS:.0f} s)",
              "size": "bytes (500M, 4G)", "count": f"an integer (at most {MAX_COUNT})",
              "path": "path", "paths": "paths, `:`-separated", "text": "text", "secret": "secret text", "url": "Redis URL",
              "classes": "`auto` / `off` / lengths, `,`-separated"}


def _platform_cache_dir() -> str:
    import platformdirs

    return platformdirs.user_cache_dir("fastattn", appauthor=False)


_V = Var
_TABLE = (
    # The GPU stack (fastattn._loader).
    _V("FASTATTN_CUDNN_PATH", "path", None, "load this libcudnn instead of searching the NVIDIA wheels and the system",
       "searched"),
    _V("FASTATTN_CUBLASLT_PATH", "path", None, "the same for cuBLASLt", "searched"),
    _V("FASTATTN_NVRTC_PATH", "path", None, "the same for NVRTC", "searched"),
    _V("FASTATTN_CUDART_PATH", "path", None, "the same for the CUDA runtime", "searched"),
    # The persistent plan cache (fastattn.store).
    _V("FASTATTN_CACHE_DIR", "path", _platform_cache_dir, "the persistent plan cache's directory",
       "the platform's user cache dir, e.g. `~/.cache/fastattn`"),
    _V("FASTATTN_CACHE_MODE", "choice", "read-write", "whether the cache is read and written, only read, or not used",
       choices=("read-write", "read-only", "off")),
    _V("FASTATTN_CACHE_EXTRA_DIRS", "paths", (), "read-only cache directories searched after the main one: a cache "
       "baked into an image, a shared volume", "none"),
    _V("FASTATTN_CACHE_SHARED", "bool", False, "group-writable cache files and directories (0664/2775), for a "
       "directory shared between users; otherwise private (0600/0700)"),
    _V("FASTATTN_CACHE_MAX_BYTES", "size", 4 << 30, "prune least-recently-used entries above this size; `none`: no "
       "limit (0 is refused: a cache of 0 bytes keeps nothing; FASTATTN_CACHE_MODE=off turns the cache off)", "`4G`",
       unlimited=True, zero="a cache of 0 bytes keeps nothing: write none for no limit, or set FASTATTN_CACHE_MODE=off "
       "to turn the cache off"),
    _V("FASTATTN_CACHE_HMAC_KEY", "secret", None, "the shared secret that signs and checks entries in Redis and "
       "bundles; when set, it must not be empty", "none"),
    _V("FASTATTN_CACHE_HMAC_KEY_FILE", "path", None, "a file holding that secret as UTF-8 text (surrounding "
       "whitespace ignored), read when FASTATTN_CACHE_HMAC_KEY is not set: a regular file of at most 4096 bytes (a "
       "FIFO, a device, a folder, an empty or larger file is refused)", "none"),
    _V("FASTATTN_CACHE_TRUSTED", "bool", False, "`1`: without a signing secret, take plans from the Redis tier and "
       "from bundles (`fastattn cache import`) unchecked, signed or not; unset, without a secret the Redis tier is off "
       "and bundles are refused (loading a plan loads native code). With a secret, only what it signs is taken "
       "either way"),
    # The Redis tier (fastattn.store.remote).
    _V("FASTATTN_REMOTE_CACHE", "url", None, "the Redis tier behind the disk cache: "
       "`redis://[user:password@]host[:port][/db]`, `rediss://` for TLS, `unix://[user:password@]/socket[?db=N]`",
       "none"),
    _V("FASTATTN_REMOTE_PREFIX", "text", "fastattn:", "key prefix in Redis"),
    _V("FASTATTN_REMOTE_TIMEOUT", "seconds", 0.25, "per Redis operation and connection (> 0)", above=True),
    _V("FASTATTN_REMOTE_WAIT", "seconds", 10.0, "how long to wait for another machine's build of a missing plan"),
    _V("FASTATTN_REMOTE_RETRY", "seconds", 5.0, "how long to leave Redis alone after a failure"),
    # What a process asked for (fastattn._record).
    _V("FASTATTN_RECORD", "path", None, "append each distinct config this process asks a plan for (through any "
       "entry point; `fastattn warm`'s own workers excepted) to this file, one JSON object a line, for `fastattn warm "
       "FILE` to build elsewhere; a file that cannot be written warns once", "none"),
    # fastattn.torch.
    _V("FASTATTN_TORCH_PATH", "choice", "auto", "fastattn.torch's per-call path: `auto` (the native op library where "
       "`fastattn warm` built it, else the Python path; a library that is built but fails to load warns once), "
       "`native` (built at the first call if missing; an error where it is unavailable) or `python`; read when "
       "fastattn.torch is imported and when its first CUDA call decides the path",
       choices=("auto", "native", "python")),
    _V("FASTATTN_SDPA", "bool", False, "serve torch.nn.functional.scaled_dot_product_attention's calls on "
       "fastattn (`fastattn.torch.enable_sdpa()`) from the moment fastattn.torch is imported; unset, nothing is "
       "changed until enable_sdpa() is called"),
    _V("FASTATTN_WARM_UP", "choice", "plans", "what a process that imports fastattn.torch (or an integration, "
       "which imports it) loads in a background thread before its first call: `plans` (cuDNN, its sub-libraries "
       "and the op library at once; then, once the process itself has made a CUDA context, the plans this GPU's "
       "cache used most recently, up to FASTATTN_WARM_UP_MAX_BYTES: never a build, never a context of its own), "
       "`libraries` (the first part alone) or `off`; read when fastattn.torch is imported",
       choices=("plans", "libraries", "off")),
    _V("FASTATTN_WARM_UP_MAX_BYTES", "size", 32 << 20, "the warm-up loads the most recently used cache entries "
       "up to this many bytes of entry files (and 64 plans at most; 0: none); read when fastattn.torch is imported",
       "`32M`"),
    _V("FASTATTN_WARM_UP_KERNELS_MAX_BYTES", "size", 256 << 20, "the warm-up also loads each plan's kernels (CUDA "
       "loads them at a plan's first launch otherwise, about a millisecond on the first call that uses it) by launching "
       "it once on zeroed scratch tensors of its config's sizes, on a stream of its own, freed at once; for plans "
       "whose larger graph (forward or backward) takes at most this many bytes of tensors and workspace (0: loads no "
       "kernels); read when fastattn.torch is "
       "imported", "`256M`"),
    _V("FASTATTN_SHAPE_CLASSES", "classes", lambda: _classes(VARIABLES["FASTATTN_SHAPE_CLASSES"], "off"), "fastattn.torch.attention()'s shape classes (its "
       "`shape_classes=` keyword overrides it per call): `off` (an exact plan per shape), `auto` (the classes "
       "`benchmarks/bench_shape_classes.py` measured on this GPU and cuDNN version in "
       "`fastattn/_measured/shape_classes.json`; `off` where none were measured) or ascending class bounds such "
       "as `256,1024,4096` (lengths in (256, 1024] share the plan declared for 1024); read when fastattn.torch "
       "is imported", "`off`"),
    _V("FASTATTN_TORCH_OPS_DIR", "path", None, "where fastattn.torch's op library is built and found",
       "`torch-ops/` in the cache directory"),
    # The in-memory tables (fastattn.bounded).
    _V("FASTATTN_MEMORY_MAX_ENTRIES", "count", 4096, "the most entries each in-memory table keyed by shape holds "
       "(fastattn/bounded.py lists them): the runtime's plans per config, fastattn.torch's plans per call signature "
       "(its Python table and the op library's C++ one), the SDPA mode's routes, kept length arrays; past it a table "
       "drops an eighth of its entries, the least recently used first, counted in `fastattn.stats()['evictions']`. "
       "A dropped plan is loaded again (memory, cache) at its next call; one in use, or captured in a CUDA graph, "
       "stays valid. Read once per process, at its first use (0 is refused: a table of 0 entries keeps nothing)",
       zero="a table of 0 entries keeps nothing, so every call would load its plan again: write a number >= 1"),
    # The test suite.
    _V("FASTATTN_REQUIRE_GPU", "bool", False, "GPU tests fail instead of skipping when no GPU is usable (set by "
       "`tools/gpu_run.sh`)", scope="tests"),
    _V("FASTATTN_REQUIRE_REDIS", "bool", False, "the Redis tests fail instead of skipping when `redis-server` or the "
       "`redis` client is missing (set by `.ci/run`)", scope="tests"),
    _V("FASTATTN_TEST_FAKE_CORE", "bool", False, "a Python process started with `tests/fake_site` on PYTHONPATH "
       "runs on `tests/fake_core.py` instead of cuDNN (the CPU tests' worker processes)", scope="tests"),
    _V("FASTATTN_TEST_ORDER", "text", "", "the order the collected tests run in, in one process: `reverse`, "
       "`shuffle:SEED`, or `list:FILE` (FILE's node ids, one a line, in its order; default: file order)", "file order", scope="tests"),
    _V("FASTATTN_TEST_READONLY_FS", "path", None, "with `tests/fake_site` on PYTHONPATH, writes under this "
       "directory fail as on a read-only mount (EROFS), which a test running as root cannot otherwise make",
       "none", scope="tests"),
    # setup.py (read there directly: fastattn is not importable before it is built).
    *(_V(f"FASTATTN_{name}_INCLUDE", "path", None, f"build time: the {what} header directory, overriding the wheels "
         "(`CUDA_HOME` is the last resort)", "the wheels'", scope="build")
      for name, what in (("CUDNN_FRONTEND", "cudnn-frontend"), ("CUDNN", "cuDNN"), ("CUDA", "CUDA runtime"),
                         ("CUDA_CRT", "CUDA CRT"), ("CCCL", "CCCL"), ("NVRTC", "NVRTC"))),
)
VARIABLES: dict[str, Var] = {v.name: v for v in _TABLE}
assert len(VARIABLES) == len(_TABLE), "a variable is declared twice"
assert all(v.kind in _PARSERS for v in _TABLE)


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The value of variable `name` in `environ` (default os.environ), parsed by its
    kind; its default when unset. Raises InvalidArgumentError naming the variable and
    the value; KeyError for a name that is not in the table (a mistake in fastattn)."""
    var = VARIABLES[name]
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None or (not raw.strip() and var.kind != "secret"):
        return var.default() if callable(var.default) else var.default
    if var.kind == "secret" and not raw.strip():
        raise InvalidArgumentError(f"{name} is set but empty")
    return _PARSERS[var.kind](var, raw)


def is_set(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether `name` has a value (set and, but for a secret, not empty)."""
    raw = (os.environ if environ is None else environ).get(name)
    return raw is not None and (bool(raw.strip()) or VARIABLES[name].kind == "secret")


def check_all(environ: Mapping[str, str] | None = None) -> None:
    """Parses every runtime variable that is set: the first bad one raises."""
    env = os.environ if environ is None else environ
    for var in _TABLE:
        if var.scope == "runtime" and var.name in env:
            get(var.name, env)


def _show(var: Var) -> str:
    if var.show_default is not None:
        return var.show_default
    d = var.default
    if isinstance(d, bool):
        return "`1`" if d else "`0`"
    if isinstance(d, float):
        return f"`{d:g}`"
    return f"`{d}`"


def markdown() -> str:
    """docs/ENVIRONMENT.md's table of variables."""
    lines = ["| variable | value | default | meaning |", "| --- | --- | --- | --- |"]
    for v in _TABLE:
        value = " / ".join(f"`{c}`" for c in v.choices) if v.kind == "choice" else _KIND_TEXT[v.kind]
        lines.append(f"| `{v.name}` | {value} | {_show(v)} | {v.help} |")
    return "\n".join(lines)

