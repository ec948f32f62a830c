"""`fastattn cache ...`: inspect and manage the persistent plan cache.

Through the process's PlanCache (fastattn.runtime.plan_cache()) and its tiers alone.
Entries are untrusted bytes: a damaged one is listed and verified as damaged (verify
exits 4), never a traceback. Whatever else is named like an entry (a FIFO, a link, a
folder, a misplaced file) is listed as not fastattn's and left alone (store.disk); a
cache directory that is not a directory is bad input (exit 2), naming it. Import and
pull fail with exit 4 and say so when the cache directory cannot be written, import
when the directory does not keep what it imported (pruned at once), pull when Redis
held entries and every one was rejected, and clear and prune when entries could not be
removed (how many, and why). Import, pull, clear and prune refuse a cache that is
read-only or off by configuration (exit 2). An entry another process removed while a
command walked the directory is gone, not damaged: not listed, or in verify "removed
meanwhile". What needs this GPU's identity
(export and push/pull without --all, import without --force, verify --load) is exit 3
where there is no usable GPU, as everywhere.
"""

from __future__ import annotations

import os
import time
from typing import Any

from .. import files, runtime, store, config_files
from ..errors import CorruptPlanError, InvalidArgumentError
from ..plan_cache import PlanCache, config_of
from ..store import bundle
from ..store.entry import decode
from ..verdict import Verdict
from ._common import (DURATION_HELP, EXIT_FAILED, EXIT_OK, MAX_AGE, Parser, add_json_flag, duration, echo,
                      gpu_environment, input_path, not_zero, output_file, printable, say, size)
from ._common import this_environment as _this_environment


# Each subcommand's exit codes (its --help says them; the README's table is the whole set).
_EXITS = {
    "ls": "Exit codes: 0 listed, 2 bad flags.",
    "show": "Exit codes: 0 shown, 2 no entry, or several, match the key.",
    "verify": "Exit codes: 0 every entry is good, 3 --load without a usable GPU, 4 damaged entries (with --load, "
              "also entries that do not load).",
    "prune": "Exit codes: 0 pruned, 2 neither --max-bytes nor --max-age, or a cache that is not writable by "
             "configuration (read-only or off), 4 entries that could not be removed (each reason and how many).",
    "clear": "Exit codes: 0 cleared, 2 a cache that is not writable by configuration (read-only or off), 4 entries "
             "that could not be removed (each reason and how many).",
    "export": "Exit codes: 0 written, 2 a bad path or an existing file (without --force), or entries that make a "
              "bundle cache import refuses (over its limits), 3 no usable GPU to choose this GPU's entries by "
              "(without --all), 4 the bundle cannot be written (a full disk, a file size limit) or the cache changed "
              "while it was exported.",
    "import": "Exit codes: 0 imported, 2 a refused bundle (also one that the trust policy refuses: without a "
              "signing secret, only with FASTATTN_CACHE_TRUSTED=1) or a cache that is not writable by configuration, 3 "
              "no usable GPU to check the bundle against (without --force), 4 the cache directory cannot be written, "
              "or does not keep what was imported (FASTATTN_CACHE_MAX_BYTES prunes it at once).",
    "push": "Exit codes: 0 pushed, 2 no remote tier, 3 no usable GPU to choose this GPU's entries by (without "
            "--all), 4 Redis unreachable.",
    "pull": "Exit codes: 0 pulled, 2 no remote tier or a cache that is not writable by configuration, 3 no usable "
            "GPU to choose this GPU's entries by (without --all), 4 Redis unreachable, the cache directory cannot be "
            "written, or every entry Redis holds was rejected (unsigned, signed with another secret, damaged).",
}


# 0 is zero, here as in every FASTATTN_* variable: a prune to it is a clear, which is
# refused rather than done, since "0 = no limit" is what some other tools mean by it.
_ZERO_PRUNES_ALL = ("would remove every entry: fastattn cache clear does that (0 is zero, never \"no limit\": "
                    "leave the flag out for no limit)")


def add_parser(sub) -> None:
    cache = sub.add_parser("cache", help="inspect and manage the persistent plan cache")
    csub = cache.add_subparsers(dest="cache_command", required=True, parser_class=Parser)
    for name, text in (("ls", "list entries"), ("show", "print one entry's header"),
                       ("verify", "check every entry's checksum (and, with --load, that it deserializes here)"),
                       ("prune", "remove least-recently-used or old entries"), ("clear", "remove every entry"),
                       ("export", "write entries to a bundle"), ("import", "add a bundle's entries"),
                       ("push", "publish the local entries to the Redis tier (FASTATTN_REMOTE_CACHE)"),
                       ("pull", "fetch the Redis tier's entries for this GPU and cuDNN into the local cache")):
        c = csub.add_parser(name, help=text, description=f"{text[0].upper()}{text[1:]}. {_EXITS[name]}")
        add_json_flag(c)
        if name == "show":
            c.add_argument("key", help="an entry's key or a unique prefix of it")
        if name == "verify":
            c.add_argument("--load", action="store_true", help="also deserialize plans made for this GPU")
        if name == "prune":
            c.add_argument("--max-bytes", type=not_zero(size, _ZERO_PRUNES_ALL), metavar="SIZE",
                           help="keep at most this much (e.g. 500M, 1.5G: bytes, or with K, M, G, T; not 0)")
            c.add_argument("--max-age", type=not_zero(duration(MAX_AGE), _ZERO_PRUNES_ALL), metavar="AGE",
                           help=f"remove entries unused for this long (e.g. 12h, 30d: {DURATION_HELP}; at most "
                                f"{MAX_AGE / 86400:.0f}d; not 0)")
        if name == "export":
            c.add_argument("bundle", type=output_file, help="the bundle file to write (never `-`)")
            c.add_argument("--all", action="store_true", help="every entry, not only this GPU's and cuDNN's")
            c.add_argument("--force", action="store_true", help="replace the bundle file if it exists")
        if name == "import":
            c.add_argument("bundle", type=input_path, help="the bundle file to read (never `-`)")
            c.add_argument("--force", action="store_true",
                           help="import entries made for another GPU or cuDNN (or without a GPU to check them)")
        if name in ("push", "pull"):
            c.add_argument("--all", action="store_true", help="every entry, not only this GPU's and cuDNN's")


def _age(seconds: float) -> str:
    if seconds < 0:  # a time after now: another clock's, or set by hand (touch -d)
        return "ahead"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds + 0.0:.0f}s"  # (+ 0.0: -0.0 reads 0s)


def _header_problem(info: store.EntryInfo) -> str:
    """What its header alone says is wrong with an entry ("" when nothing): what `ls`
    can tell without reading the whole file."""
    if info.header is None:
        return info.problem or "unreadable header"
    return store.entry.key_problem(info.key, info.header["description"])


def _judge(tier, info: store.EntryInfo):
    """(entry, "") for a good entry, (None, why) for a damaged one: the whole file read
    and checked (checksum, sizes, that its header is its key's), the one judgement of
    `verify` and `show`. FileNotFoundError when it went since it was listed."""
    try:
        entry = decode(tier.read(info.path), expected_key=info.key)
    except FileNotFoundError:
        raise
    except (OSError, store.EntryError) as e:
        return None, str(e) or type(e).__name__
    problem = store.entry.key_problem(info.key, entry.description)
    return (None, problem) if problem else (entry, "")


def _summary(info: store.EntryInfo) -> str:
    header = info.header
    problem = _header_problem(info)
    if problem:
        return printable(f"DAMAGED     {problem}")
    desc = header["description"]  # shapes checked by the entry decoder
    cfg = config_of(desc)
    gpu = desc.get("gpu", {}).get("name", "?")
    avoided = desc.get("defects") or []  # fastattn.defects: the remedies its graphs carry
    verdict = header["meta"].get("verdict")  # its shape checked by the entry decoder
    shown = f" verified {Verdict.from_dict(verdict).summary()}" if verdict is not None else ""
    # One line of the listing whatever the header's strings hold (a newline, an escape).
    return printable(f"{header['kind']:<11} {config_files.describe_config(cfg) if cfg else '(unknown config)'}  "
                     f"[{gpu}, cuDNN {desc.get('cudnn', '?')}]" + (f" avoids {', '.join(avoided)}" if avoided else "")
                     + shown)


_shown = files.shown  # every path a message names: one line, whatever the name holds


def _check_dirs(tiers) -> None:
    """A cache directory that is a file, a FIFO or a broken link is bad input naming it
    (not "0 entries"); one not made yet is an empty cache."""
    for tier in tiers:
        problem = tier.root_problem()
        if problem:
            raise InvalidArgumentError(f"cache directory {_shown(tier.root)}: {problem}")


def _strays(tiers) -> list[dict[str, str]]:
    return [{"directory": t.name, "path": s.path, "why": s.why} for t in tiers for s in t.strays()]


def _stray_lines(strays: list[dict[str, str]]) -> list[str]:
    return [f"not fastattn's, left alone: {_shown(s['path'])} ({s['why']})" for s in strays]


def run(args) -> tuple[int, dict[str, Any]]:
    cache = runtime.plan_cache()
    if args.cache_command in ("prune", "clear"):
        _check_dirs([cache.store.main] if cache.store.main else [])
    elif args.cache_command != "import":  # (import and pull check what they write to as they write)
        _check_dirs(cache.store.tiers)
    handler = {"ls": _ls, "show": _show, "verify": _verify, "prune": _prune, "clear": _clear,
               "export": _export, "import": _import, "push": _push, "pull": _pull}[args.cache_command]
    return handler(args, cache)


def _ls(args, cache: PlanCache) -> tuple[int, dict[str, Any]]:
    now = time.time()
    rows = []
    for tier, info in cache.store.entries():
        header = info.header or {}
        rows.append({"key": info.key, "directory": tier.name, "path": info.path, "size": info.size,
                     "created": info.created,
                     "last_used": info.last_used, "kind": header.get("kind"),
                     "config": header.get("description", {}).get("config"),
                     "defects": header.get("description", {}).get("defects", []),
                     "verdict": header.get("meta", {}).get("verdict"),
                     "damaged": _header_problem(info) or None,
                     "summary": _summary(info)})
    lines = [f"{'key':<16} {'size':>9} {'age':>5} {'used':>5}  kind        config"]
    for r in rows:
        lines.append(f"{r['key'][:16]} {r['size']:>9} {_age(now - r['created']):>5} {_age(now - r['last_used']):>5}"
                     f"  {r['summary']}")
    total = sum(r["size"] for r in rows)
    damaged = sum(1 for r in rows if r["damaged"])
    strays = _strays(cache.store.tiers)
    lines.extend(_stray_lines(strays))
    lines.append(f"{len(rows)} entries{f' ({damaged} damaged: fastattn cache verify)' if damaged else ''}, "
                 f"{total} bytes, in {', '.join(_shown(t.name) for t in cache.store.tiers) or '(cache off)'}"
                 + (f"; {len(strays)} other things named like entries, not fastattn's" if strays else ""))
    return EXIT_OK, {"entries": rows, "total_bytes": total, "damaged": damaged, "not_ours": strays,
                     "_text": "\n".join(lines)}


def _find(cache: PlanCache, prefix: str):
    prefix = prefix.lower()
    matches = [(t, i) for t, i in cache.store.entries() if i.key.startswith(prefix)]
    keys = {i.key for _, i in matches}
    if not prefix:
        raise InvalidArgumentError("an empty key: give an entry's key or a unique prefix of it (fastattn cache ls)")
    if not keys:
        raise InvalidArgumentError(f"key {echo(prefix)}: no entry matches (fastattn cache ls lists the keys)")
    if len(keys) > 1:
        raise InvalidArgumentError(f"key {echo(prefix)}: {len(keys)} entries match; give more of the key")
    return matches[0]


def _show(args, cache: PlanCache) -> tuple[int, dict[str, Any]]:
    tier, info = _find(cache, args.key)
    import json

    try:
        damaged = _judge(tier, info)[1]
    except FileNotFoundError:  # removed since it was listed (another process's clear)
        raise InvalidArgumentError(f"key {echo(args.key)}: no entry matches (removed meanwhile)") from None
    out = {"key": info.key, "path": info.path, "size": info.size, "header": info.header, "damaged": damaged or None}
    return EXIT_OK, {**out, "_text": json.dumps(out, indent=2, sort_keys=True)}


def _verify(args, cache: PlanCache) -> tuple[int, dict[str, Any]]:
    env = gpu_environment("cache verify --load needs a usable GPU (without --load it checks checksums only)") \
        if args.load else None
    rows = []
    for tier, info in cache.store.entries():
        row = {"key": info.key, "path": info.path, "status": "ok", "reason": ""}
        try:
            entry, problem = _judge(tier, info)
        except FileNotFoundError:  # listed, then removed by another process (a clear): gone, not damaged
            row.update(status=_GONE)
            rows.append(row)
            continue
        if entry is None:
            row.update(status="damaged", reason=problem)
            rows.append(row)
            continue
        if args.load and entry.kind == "plan":
            if store.environment_of(entry.description) != env:
                row.update(status="skipped", reason="made for another GPU or cuDNN")
            else:
                row.update(_load(cache, entry))
        rows.append(row)
    bad = [r for r in rows if r["status"] in ("damaged", "does not load")]
    gone = sum(1 for r in rows if r["status"] == _GONE)
    strays = _strays(cache.store.tiers)
    lines = [f"{r['key'][:16]} {r['status']:<14} {printable(r['reason'])}" for r in rows] + _stray_lines(strays)
    lines.append(f"{len(rows) - gone} entries: {len(rows) - gone - len(bad)} good, {len(bad)} bad"
                 + (f"; {gone} removed meanwhile (by another process)" if gone else "")
                 + (f"; {len(strays)} other things named like entries, not fastattn's (not checked)" if strays else ""))
    return (EXIT_FAILED if bad else EXIT_OK), {"entries": rows, "bad": len(bad), "removed_meanwhile": gone,
                                               "not_ours": strays, "_text": "\n".join(lines)}


_GONE = "removed meanwhile"


def _load(cache: PlanCache, entry) -> dict[str, str]:
    try:
        cache.load_entry(entry)
    except (CorruptPlanError, InvalidArgumentError) as e:
        return {"status": "does not load", "reason": str(e)}
    return {"status": "ok (loads)"}


def _prune(args, cache: PlanCache) -> tuple[int, dict[str, Any]]:
    if args.max_bytes is None and args.max_age is None:
        raise InvalidArgumentError("cache prune needs --max-bytes or --max-age")
    main = _writable_main(cache, "cache prune")
    return _removed(main, main.prune(max_bytes=args.max_bytes, max_age=args.max_age))


def _removed(main: store.DiskStore, pruned: store.Pruned) -> tuple[int, dict[str, Any]]:
    """What a clear or prune did; exit 4, saying how many entries stay and why, when
    some could not be removed (a read-only mount, an immutable folder)."""
    left = len(pruned.strays)
    why = [{"reason": reason, "count": len(paths), "example": paths[0]} for reason, paths in pruned.failed.items()]
    also = [{"path": path, "what": what} for path, what in pruned.also_removed]
    out = {"removed": pruned.removed, "not_removed": pruned.not_removed, "not_removed_because": why,
           "left_alone": left, "also_removed": also,
           "_text": f"removed {pruned.removed} entries from {_shown(main.root)}"
                    + (f"; could not remove {pruned.not_removed}" if pruned.not_removed else "")
                    + (f"; left alone {left} things named like entries that are not fastattn's (fastattn cache ls "
                       "lists them)" if left else "")
                    + "".join(f"\nalso removed {_shown(a['path'])} ({a['what']})" for a in also)}
    if not pruned.not_removed:
        return EXIT_OK, out
    message = (f"could not remove {pruned.not_removed} entries from {_shown(main.root)}: "
               + "; ".join(f"{w['reason']} ({w['count']}, e.g. {_shown(w['example'])})" for w in why))
    say(f"fastattn: {message}")
    return EXIT_FAILED, {**out, "error": "NotRemoved", "message": message}


def _clear(args, cache: PlanCache) -> tuple[int, dict[str, Any]]:
    main = _writable_main(cache, "cache clear")
    return _removed(main, main.clear())


def _export(args, cache: PlanCache) -> tuple[int, dict[str, Any]]:
    if os.path.lexists(args.bundle) and not args.force:
        raise InvalidArgumentError(f"{_shown(args.bundle)}: the file exists; --force replaces it")
    keep = None
    if not args.all:
        env = gpu_environment("cache export chooses this GPU's entries, and there is no usable GPU here "
                              "(--all exports every entry)")
        keep = lambda description: store.environment_of(description) == env  # noqa: E731
    try:
        count = bundle.export_bundle(cache.store.tiers, args.bundle, keep=keep, secret=cache.settings.secret)
    except files.NotRegularFileError as e:  # put there since the path was checked: the path is the problem
        raise InvalidArgumentError(f"{_shown(args.bundle)}: {e.strerror}") from None
    except bundle.CacheChangedError as e:
        return _cannot_write(str(e), {"exported": None, "bundle": args.bundle})
    except OSError as e:  # the path was checked before the work: what fails now is the writing (ENOSPC, EFBIG, EIO)
        return _cannot_write(f"cannot write the bundle {_shown(args.bundle)} ({e.strerror or e}); nothing was "
                             "written", {"exported": None, "bundle": args.bundle})
    signed = cache.settings.secret is not None
    return EXIT_OK, {"exported": count, "bundle": args.bundle, "signed": signed,
                     "_text": f"exported {count} entries to {_shown(args.bundle)} "
                              f"({'signed' if signed else 'unsigned'})"}


def _writable_main(cache: PlanCache, command: str) -> store.DiskStore:
    """The main directory, for a command that writes to it or removes from it; a usage
    error (exit 2) where the configuration makes the cache read-only or off, before
    anything is touched."""
    main = cache.store.main
    mode = cache.settings.mode
    if main is None or mode != "read-write":
        state = "off" if mode == "off" else "read-only"
        raise InvalidArgumentError(f"the cache is {state} (FASTATTN_CACHE_MODE={mode}): {command} changes it; "
                                   "set FASTATTN_CACHE_MODE=read-write for it")
    return main


def _cannot_write(message: str, out: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """Exit 4 with the reason: the request was fine, the work was not done. The message
    goes to stderr, as every failure's does; stdout holds results only."""
    say(f"fastattn: {message}")
    return EXIT_FAILED, {**out, "error": "CannotWrite", "message": message, "_text": ""}  # stdout: results only


def _import(args, cache: PlanCache) -> tuple[int, dict[str, Any]]:
    main = _writable_main(cache, "cache import")
    try:
        env = _this_environment() if args.force else gpu_environment(
            "cache import checks a bundle's entries against this GPU, and there is no usable GPU here "
            "(--force imports without checking)")
        report = bundle.import_bundle(args.bundle, main, environment=env, force=args.force,
                                      secret=cache.settings.secret, trusted=cache.settings.trusted)
    except bundle.BundleWriteError as e:
        return _cannot_write(str(e), {"imported": None, "already_present": None})
    out = {"imported": report.imported, "already_present": report.already_present,
           "mismatched_forced": len(report.mismatched) if args.force else 0, "policy": report.policy,
           "not_kept": len(report.not_kept), "not_kept_reason": ""}
    out["_text"] = (f"imported {report.imported} entries into {_shown(main.root)}"
                    + (f", {report.already_present} already present" if report.already_present else "")
                    + (f" ({len(report.mismatched)} made for another GPU or cuDNN, forced)" if report.mismatched else "")
                    + f"; the bundle: {report.policy}")
    if report.not_kept:
        # As `warm` counts answers it built that the cache does not hold at its end: the
        # work was done and is lost, so the next run does it again.
        limit = cache.settings.max_bytes
        why = (f"pruned at once by FASTATTN_CACHE_MAX_BYTES={limit}, or removed by another process"
               if limit is not None else "removed by another process")
        message = (f"not kept: {len(report.not_kept)} of the bundle's {report.listed} entries are not in "
                   f"{_shown(main.root)} at the end of the import ({why})")
        say(f"fastattn: {message}")
        out.update(not_kept_reason=why, error="NotKept", message=message)
        return EXIT_FAILED, out
    return EXIT_OK, out


def _remote(cache: PlanCache):
    remote = cache.store.remote
    if remote is None:
        raise InvalidArgumentError("no remote tier: set FASTATTN_REMOTE_CACHE=redis://host:port/db")
    if remote.disabled:
        raise InvalidArgumentError(f"the remote tier is off: {remote.disabled}")
    return remote


def _keep_for(args):
    """Which entries to move: this GPU's and cuDNN's, or with --all every one."""
    if args.all:
        return lambda description: True
    env = gpu_environment(f"cache {args.cache_command} chooses this GPU's entries, and there is no usable GPU here "
                          "(--all moves every entry)")
    return lambda description: store.environment_of(description) == env


def _push(args, cache: PlanCache) -> tuple[int, dict[str, Any]]:
    remote = _remote(cache)
    keep = _keep_for(args)
    pushed, skipped, seen = 0, 0, set()
    try:
        for tier, info in cache.store.entries():
            if info.key in seen:
                continue
            seen.add(info.key)
            try:
                entry = decode(tier.read(info.path), expected_key=info.key)
            except FileNotFoundError:
                continue  # removed by another process since the listing: nothing to push
            except (OSError, store.EntryError):
                skipped += 1  # damaged: `fastattn cache verify` reports it
                continue
            if store.entry.key_problem(info.key, entry.description):
                skipped += 1  # damaged too (verify says so): another machine would reject it
                continue
            if not keep(entry.description):
                continue
            remote.publish(entry)
            pushed += 1
    except (OSError, *_redis_errors()) as e:
        raise ConnectionError(f"remote cache {remote.name}: {e}") from None
    return EXIT_OK, {"pushed": pushed, "damaged": skipped, "remote": remote.name,
                     "_text": f"pushed {pushed} entries to {remote.name}" + (f" ({skipped} damaged, skipped)"
                                                                           if skipped else "")}


def _pull(args, cache: PlanCache) -> tuple[int, dict[str, Any]]:
    remote = _remote(cache)
    main = _writable_main(cache, "cache pull")
    keep = _keep_for(args)
    pulled, present, rejected = 0, 0, 0
    try:
        keys = list(remote.keys())
        for key in keys:
            if main.signature(key) is not None:
                present += 1
                continue
            entry = remote.fetch(key)
            if entry is None:
                rejected += 1  # unsigned, wrongly signed or damaged: counted and warned about
                continue
            if keep(entry.description):
                try:
                    written = main.publish(entry)
                except OSError as e:
                    return _cannot_write(f"cannot write to the cache directory {_shown(main.root)} ({e.strerror or e}); "
                                         f"pulled {pulled} entries before that", {"pulled": pulled})
                pulled += written
    except (OSError, *_redis_errors()) as e:
        raise ConnectionError(f"remote cache {remote.name}: {e}") from None
    out = {"pulled": pulled, "already_present": present, "rejected": rejected, "remote": remote.name,
           "_text": f"pulled {pulled} entries from {remote.name} into {_shown(main.root)}"
                    + (f" ({present} already here)" if present else "")
                    + (f"; {rejected} rejected (see the warnings)" if rejected else "")
                    + f"; entries taken: {remote.policy.applied()}", "policy": remote.policy.applied()}
    if rejected and rejected == len(keys):
        # Nothing Redis holds is usable here: most likely another signing secret
        # (FASTATTN_CACHE_HMAC_KEY) than the machines that pushed. Not a success.
        message = (f"every entry of {remote.name} was rejected ({rejected}: unsigned, signed with another secret, "
                   "or damaged; see the warnings)")
        say(f"fastattn: {message}")
        return EXIT_FAILED, {**out, "error": "AllRejected", "message": message}
    return EXIT_OK, out


def _redis_errors() -> tuple:
    try:
        import redis
    except ImportError:
        return ()
    return (redis.RedisError,)
