"""The remote tier: entries shared by a fleet through Redis, behind the local directories.

A lookup that misses locally asks Redis; a plan built here is published there. Redis
can only ever cost a short timeout: connection errors, timeouts and a server that goes
away mid-run are misses (one warning per outage, counted), and the tier stays quiet
for `retry_after` seconds before it tries again, so a dead server does not charge its
timeout to every lookup.

Fleet single flight: before building a missing plan a process takes a Redis lock with
an expiry (SET NX PX); the others wait up to `wait` seconds for the builder's entry
to appear, then build anyway. A builder that dies leaves the lock to expire.

Configuration: the FASTATTN_REMOTE_* variables (fastattn.env's table, which docs/ENVIRONMENT.md
shows): FASTATTN_REMOTE_CACHE, a redis://, rediss:// or unix:// URL checked up front
(scheme, host, port, database), turns the tier on.

What the tier takes from Redis is store.signing's Policy, the one bundles follow too:
with a secret (FASTATTN_CACHE_HMAC_KEY(_FILE)), entries signed with it; without one,
anything when FASTATTN_CACHE_TRUSTED=1; without either, the tier stays off, with a
warning that says so.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from .. import env as _env
from ..env import redact
from .disk import EntryInfo
from .entry import KEY_PATTERN, MAX_ENTRY_BYTES, Entry, EntryError, decode, encode, key_problem, read_header
from .signing import SIGNED_MAGIC, Policy, unwrap, wrap

__all__ = ["RemoteSettings", "RemoteStore", "remote_settings_from_env"]

# The most a stored value may hold (an entry at its cap, signed): a longer one is read
# only up to here, one byte past (GETRANGE), and rejected, never downloaded whole.
MAX_VALUE_BYTES = MAX_ENTRY_BYTES + len(SIGNED_MAGIC) + 32

log = logging.getLogger("fastattn")

COUNTERS = ("remote_hits", "remote_misses", "remote_errors", "remote_rejected", "remote_published", "remote_waits",
            "remote_waited_hits")

# Deletes the lock only if it is still ours (it may have expired and been retaken).
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end"


_warned_off: set[str] = set()


@dataclass(frozen=True)
class RemoteSettings:
    url: str
    prefix: str = "fastattn:"
    timeout: float = 0.25
    wait: float = 10.0
    retry_after: float = 5.0
    trusted: bool = False  # FASTATTN_CACHE_TRUSTED: see store.signing.Policy


def remote_settings_from_env(environ: Mapping[str, str] | None = None) -> RemoteSettings | None:
    """The tier's settings from the FASTATTN_REMOTE_* variables (None: no tier); a bad
    value is an InvalidArgumentError naming the variable."""
    url = _env.get("FASTATTN_REMOTE_CACHE", environ)
    if url is None:
        return None
    return RemoteSettings(
        url=url,
        prefix=_env.get("FASTATTN_REMOTE_PREFIX", environ),
        timeout=_env.get("FASTATTN_REMOTE_TIMEOUT", environ),
        wait=_env.get("FASTATTN_REMOTE_WAIT", environ),
        retry_after=_env.get("FASTATTN_REMOTE_RETRY", environ),
        trusted=_env.get("FASTATTN_CACHE_TRUSTED", environ),
    )


class RemoteStore:
    """Entries in Redis under prefix + key; locks under prefix + "lock:" + key. A tier
    (store.Tier) of kind "remote"."""

    kind = "remote"

    def __init__(self, settings: RemoteSettings, secret: bytes | None):
        self.settings = settings
        self.secret = secret
        self.policy = Policy(secret, settings.trusted)
        self.name = redact(settings.url)  # how messages name this tier: never with its password
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.state = "not connected yet"
        # Said at the first use (_conn), not here: a command that refuses an off tier
        # (`cache push`) says it once, in its own error, and a process that never asks
        # the tier is not warned about it.
        self.disabled = self.policy.refusal()
        self._client = None
        self._errors: tuple = ()
        self._down_until = 0.0
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    # -- connection ---------------------------------------------------------------

    def _conn(self):
        """The client, or None while the tier is off or resting after a failure."""
        if self.disabled:
            if self.name not in _warned_off:  # once per process and URL, however many caches are made
                _warned_off.add(self.name)
                log.warning("fastattn remote cache %s is off: %s", self.name, self.disabled)
            return None
        if time.monotonic() < self._down_until:
            return None
        if self._client is None:
            with self._lock:
                if self._client is None:
                    try:
                        import redis
                    except ImportError:
                        self.disabled = "the redis client is not installed (pip install 'fastattn[redis]')"
                        return self._conn()  # (warns, once)
                    t = self.settings.timeout
                    # OverflowError: what the socket raises for a timeout past the OS's
                    # clock (fastattn.env caps FASTATTN_REMOTE_TIMEOUT well below it).
                    self._errors = (redis.RedisError, OSError, OverflowError)
                    try:
                        self._client = redis.Redis.from_url(self.settings.url, socket_timeout=t,
                                                            socket_connect_timeout=t, retry_on_timeout=False,
                                                            health_check_interval=0)
                    except (ValueError, TypeError) as e:
                        # The URL is checked up front (fastattn.env); a client that still
                        # refuses it turns the tier off: the cache never makes real work fail.
                        self.disabled = f"the redis client refuses the URL ({type(e).__name__}: {e})"
                        return self._conn()  # (warns, once)
        return self._client

    def _failed(self, e: BaseException) -> None:
        self.counters["remote_errors"] += 1
        self._down_until = time.monotonic() + self.settings.retry_after
        if not self.state.startswith("down"):
            log.warning("fastattn remote cache %s is unreachable (%s): plans come from this machine alone; this "
                        "process asks it again after %.0f s", self.name, e,
                        self.settings.retry_after)
        self.state = f"down ({type(e).__name__}: {e})"

    def _ok(self) -> None:
        if self.state.startswith("down"):
            log.warning("fastattn remote cache %s: reachable again", self.name)
        self.state = "connected"

    def _warn_once(self, what: str, message: str, *args) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(message, *args)

    # -- entries --------------------------------------------------------------------

    def get(self, key: str) -> Entry | None:
        """The entry for `key` if Redis has one that verifies, else None."""
        c = self._conn()
        if c is None:
            return None
        try:
            value = self._read(c, key)
        except self._errors as e:
            self._failed(e)
            return None
        self._ok()
        if value is None:
            self.counters["remote_misses"] += 1
            return None
        return self._verify(key, value)

    def _read(self, c, key: str) -> bytes | None:
        """The value under key (None: none, or an empty one), at most MAX_VALUE_BYTES + 1
        bytes of it: its length and its head in one round trip."""
        name = self.settings.prefix + key
        pipe = c.pipeline(transaction=False)
        pipe.strlen(name)
        pipe.getrange(name, 0, MAX_VALUE_BYTES)  # (the end is inclusive)
        n, value = pipe.execute()
        return value if n else None

    def _verify(self, key: str, value: bytes) -> Entry | None:
        # Whatever another machine (or an intruder) stored: an entry that verifies, or None.
        if not KEY_PATTERN.fullmatch(key):
            data, why = None, "not a cache key"
        elif len(value) > MAX_VALUE_BYTES:
            data, why = None, f"over {MAX_VALUE_BYTES} bytes (not read further)"
        else:
            data, why = unwrap(self.policy, key, value)
        if data is not None:
            try:
                entry = decode(data, expected_key=key)
            except EntryError as e:
                why = str(e)
            else:  # (a header for another plan under a valid checksum: damaged, as verify says)
                why = key_problem(key, entry.description)
                if not why:
                    return self._hit(entry)
        self.counters["remote_rejected"] += 1
        self._warn_once("rejected:" + key, "fastattn remote cache %s: ignoring entry %s: %s", self.name, key[:16],
                        why)
        return None

    def _hit(self, entry: Entry) -> Entry:
        self.counters["remote_hits"] += 1
        return entry

    def put(self, entry: Entry) -> bool:
        """Publishes `entry` (signed when there is a secret). False when it could not."""
        c = self._conn()
        if c is None:
            return False
        try:
            c.set(self.settings.prefix + entry.key, wrap(self.secret, entry.key, encode(entry)))
        except self._errors as e:
            self._failed(e)
            return False
        self._ok()
        self.counters["remote_published"] += 1
        return True

    @contextlib.contextmanager
    def flight(self, key: str) -> Iterator[Entry | None]:
        """Fleet single flight around a build of `key`. Yields an entry another process
        published while this one waited (use it), or None (build, publish, then leave
        the block, which releases the lock)."""
        c = self._conn()
        if c is None:
            yield None
            return
        lock_key, token = self.settings.prefix + "lock:" + key, uuid.uuid4().hex
        # The lock outlives a slow build by far; a dead builder's expires.
        ttl_ms = int(max(60.0, 6 * self.settings.wait) * 1000)
        try:
            mine = bool(c.set(lock_key, token, nx=True, px=ttl_ms))
        except self._errors as e:
            self._failed(e)
            yield None
            return
        if mine:
            try:
                yield None
            finally:
                try:
                    c.eval(_RELEASE, 1, lock_key, token)
                except self._errors as e:
                    self._failed(e)
            return
        self.counters["remote_waits"] += 1
        deadline = time.monotonic() + self.settings.wait
        found = None
        while found is None and time.monotonic() < deadline:
            time.sleep(0.05)  # two small commands per waiter and poll: light even for a large fleet
            found = self.get(key)
            if found is not None:
                self.counters["remote_waited_hits"] += 1
                break
            try:
                if self._conn() is None or not c.exists(lock_key):
                    # Down, or the builder let go without publishing (it failed): build.
                    found = self.get(key)
                    break
            except self._errors as e:
                self._failed(e)
                break
        yield found

    def keys(self) -> Iterator[str]:
        """Every entry key in the store (not the locks). Raises the client's error when
        Redis cannot be reached: listing is an explicit request."""
        c = self._conn()
        if c is None:
            raise ConnectionError(self.disabled or self.state)
        prefix = self.settings.prefix
        for raw in c.scan_iter(match=_glob_escape(prefix) + "*", count=500):
            name = raw.decode("utf-8", "replace")[len(prefix) :]
            # Locks, and anything else someone put under the prefix, are not entries.
            if KEY_PATTERN.fullmatch(name):
                yield name

    def entries(self) -> Iterator[EntryInfo]:
        """Every entry in the store that verifies (signature, checksum, header), as
        DiskStore.entries() gives them; path is "<url>/<key>". Reads every value:
        listing Redis is an explicit request (`cache pull`). Raises ConnectionError
        (or the client's error) when Redis cannot be reached."""
        for key in list(self.keys()):
            entry = self.fetch(key)
            if entry is None:
                continue
            data = encode(entry)
            yield EntryInfo(key, f"{self.name}/{key}", len(data), entry.created, entry.created, read_header(data))

    def fetch(self, key: str) -> Entry | None:
        """get() that raises instead of resting after a failure: for push and pull."""
        c = self._conn()
        if c is None:
            raise ConnectionError(self.disabled or self.state)
        value = self._read(c, key)
        self._ok()
        if value is None:
            return None
        return self._verify(key, value)

    def publish(self, entry: Entry) -> None:
        """put() that raises: for push."""
        c = self._conn()
        if c is None:
            raise ConnectionError(self.disabled or self.state)
        c.set(self.settings.prefix + entry.key, wrap(self.secret, entry.key, encode(entry)))
        self._ok()
        self.counters["remote_published"] += 1

    def status(self, check: bool = False) -> dict:
        """What `fastattn info` shows; check=True first asks the server (one PING)."""
        c = self._conn() if check else None
        if c is not None:
            try:
                c.ping()
                self._ok()
            except self._errors as e:
                self._failed(e)
        return {"url": self.name, "prefix": self.settings.prefix, "signed": self.secret is not None,
                "trusted": self.settings.trusted, "state": self.disabled and f"off: {self.disabled}" or self.state,
                "timeout_seconds": self.settings.timeout, "counters": dict(self.counters)}


def _glob_escape(text: str) -> str:
    return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in text)
