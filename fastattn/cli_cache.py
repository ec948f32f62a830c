"""`fastattn warm`, `fastattn matrix` and `fastattn cache ...`: pre-warming, support
grids and cache management.

Each handler returns (exit code, result dict); "_text" in the dict is the human form.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from . import runtime, store, sweep
from .cli import EXIT_FAILED, EXIT_NO_GPU, EXIT_OK, EXIT_UNSUPPORTED
from .config import AttentionConfig
from .errors import CudaError, InvalidArgumentError, LibraryError
from .store import bundle
from .store.entry import decode
from .warm import WarmItem, warm


def _exit_code(report) -> int:
    """No GPU stack at all, some configs failed, some refused, or all good."""
    failed = [i for i in report.items if i.status == "failed"]
    if failed and len(failed) == len(report.items) and all(i.error_type in ("LibraryError", "CudaError")
                                                           for i in failed):
        return EXIT_NO_GPU
    if failed:
        return EXIT_FAILED
    return EXIT_UNSUPPORTED if report.counts["unsupported"] else EXIT_OK


# -- warm ---------------------------------------------------------------------------------


def _progress_bar():
    """A one-line bar on stderr, only on a terminal (logs and pipes get the table alone)."""
    if not sys.stderr.isatty():
        return None
    counts: dict[str, int] = {}

    def draw(done: int, total_: int, item: WarmItem) -> None:
        counts[item.status] = counts.get(item.status, 0) + 1
        width = 30
        filled = int(width * done / max(total_, 1))
        summary = " ".join(f"{k} {v}" for k, v in sorted(counts.items()))
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total_} {summary}   ")
        if done == total_:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return draw


def warm_command(args) -> tuple[int, dict[str, Any]]:
    configs = sweep.load_configs(args.file) if args.file else sweep.builtin_configs()
    report = warm(configs, workers=args.workers, device=args.device, timeout=args.timeout,
                  progress=None if args.no_progress or args.json else _progress_bar())
    out = report.to_dict()
    out["source"] = args.file or "built-in model shapes"
    if args.report:
        import json

        try:
            with open(args.report, "w") as f:
                json.dump(out, f, indent=2, sort_keys=True)
        except OSError as e:
            raise InvalidArgumentError(f"--report {args.report!r}: {e.strerror}") from None
    c = report.counts
    lines = [f"{'status':<12} {'seconds':>8}  config", "-" * 72]
    previous = None
    for item in report.items:
        lines.append(f"{item.status:<12} {item.seconds:8.3f}  {sweep.describe_config(item.config)}")
        if item.status in ("unsupported", "failed"):
            why = f"{item.error_type + ': ' if item.error_type else ''}{item.reason[:300]}"
            lines.append(f"{'':<22}{'(the same as above)' if why == previous else why}")
            previous = why
    lines.append("-" * 72)
    lines.append(f"{len(report.items)} configs in {report.seconds:.1f} s, {report.processes} worker processes "
                 f"(at most {report.workers}): "
                 f"loaded {c['loaded']}, built {c['built']}, unsupported {c['unsupported']}, failed {c['failed']}")
    out["_text"] = "\n".join(lines)
    return _exit_code(report), out


# -- matrix -------------------------------------------------------------------------------


def matrix_command(args) -> tuple[int, dict[str, Any]]:
    import itertools

    from .cli import MATRIX_FEATURES

    configs, axes, invalid = [], [], []
    for d, mask, dtype, ratio, s, feature in itertools.product(args.head_dims, args.masks, args.dtypes, args.gqa,
                                                               args.seqlens, args.features):
        if args.heads % ratio:
            raise InvalidArgumentError(f"--gqa {ratio}: --heads {args.heads} is not a multiple of it")
        axis = {"head_dim": d, "mask": mask, "dtype": dtype, "gqa": ratio, "seqlen": s, "feature": feature}
        try:
            cfg = AttentionConfig(batch=args.batch, heads_q=args.heads, heads_kv=args.heads // ratio, seqlen_q=s,
                                  head_dim_qk=d, dtype=dtype, mask=mask, training=args.training,
                                  **MATRIX_FEATURES[feature][0])
        except InvalidArgumentError as e:  # fastattn's own rules (paged is forward only, ...): no cuDNN question
            invalid.append({**axis, "status": "invalid", "reason": str(e), "forward_engine": None,
                            "backward_engine": None})
            continue
        configs.append(cfg)
        axes.append(axis)
    report = warm(configs, workers=args.workers, device=args.device)
    rows = [{**a, "status": i.status, "reason": i.reason, "forward_engine": i.forward_engine,
             "backward_engine": i.backward_engine} for a, i in zip(axes, report.items)] + invalid
    ok = {"built", "loaded"}
    status_mark = {"unsupported": "no", "invalid": "n/a"}
    cols = sorted({(r["mask"], r["dtype"], r["gqa"], r["seqlen"], r["feature"]) for r in rows},
                  key=lambda c: (args.masks.index(c[0]), args.dtypes.index(c[1]), c[2], c[3],
                                 args.features.index(c[4])))
    mark = {r_key: ("yes" if r["status"] in ok else status_mark.get(r["status"], "FAIL"))
            for r in rows for r_key in [(r["head_dim"], r["mask"], r["dtype"], r["gqa"], r["seqlen"], r["feature"])]}
    header = "head_dim " + " ".join(_column(c).rjust(22) for c in cols)
    lines = [header]
    for d in args.head_dims:
        lines.append(f"{d:>8} " + " ".join(mark[(d, *c)].rjust(22) for c in cols))
    reasons = sorted({r["reason"][:200] for r in rows if r["status"] not in ok})
    if reasons:
        lines.append("reasons:")
        lines.extend(f"  {r}" for r in reasons)
    if args.png:
        _heatmap(args.png, args.head_dims, cols, mark)
        lines.append(f"heatmap written to {args.png}")
    out = {"configs": rows, "counts": report.counts, "_text": "\n".join(lines)}
    code = _exit_code(report)
    return (EXIT_OK if code == EXIT_UNSUPPORTED else code), out  # refusals are the grid's answer, not a failure


def _column(c) -> str:
    m, t, g, s, f = c
    return f"{m[:6]}/{t}/g{g}/s{s}" + ("" if f == "dense" else f"/{f}")


def _heatmap(path: str, head_dims, cols, mark) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InvalidArgumentError("--png needs matplotlib (pip install matplotlib)") from None
    value = {"yes": 1.0, "no": 0.0, "FAIL": 0.5, "n/a": 0.25}
    grid = [[value[mark[(d, *c)]] for c in cols] for d in head_dims]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(cols) + 2), 0.5 * len(head_dims) + 2))
    ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(len(cols)), [f"{m}\n{t} gqa{g}\ns{s}" + ("" if f == "dense" else f"\n{f}")
                                     for m, t, g, s, f in cols], fontsize=7)
    ax.set_yticks(range(len(head_dims)), [str(d) for d in head_dims])
    ax.set_ylabel("head dim")
    for y, d in enumerate(head_dims):
        for x, c in enumerate(cols):
            ax.text(x, y, mark[(d, *c)], ha="center", va="center", fontsize=7)
    ax.set_title("cuDNN support on this GPU (green: supported)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# -- cache --------------------------------------------------------------------------------


def _this_environment() -> dict[str, Any] | None:
    """This machine's GPU and versions, or None when there is no usable GPU."""
    try:
        return runtime.cache_environment()
    except (LibraryError, CudaError):
        return None


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def _summary(header: dict | None) -> str:
    if not header:
        return "(unreadable header)"
    desc = header.get("description") or {}
    try:
        cfg = sweep.describe_config(AttentionConfig.from_dict(desc["config"]))
    except (KeyError, TypeError, InvalidArgumentError):
        cfg = "(unknown config)"
    gpu = (desc.get("gpu") or {}).get("name", "?")
    return f"{header.get('kind', '?'):<11} {cfg}  [{gpu}, cuDNN {desc.get('cudnn', '?')}]"


def cache_command(args) -> tuple[int, dict[str, Any]]:
    cache = runtime._the_cache()
    handler = {"ls": _ls, "show": _show, "verify": _verify, "prune": _prune, "clear": _clear,
               "export": _export, "import": _import, "push": _push, "pull": _pull}[args.cache_command]
    return handler(args, cache)


def _ls(args, cache) -> tuple[int, dict[str, Any]]:
    now = time.time()
    rows = []
    for tier, info in cache.entries():
        rows.append({"key": info.key, "directory": tier.root, "size": info.size, "created": info.created,
                     "last_used": info.last_used, "kind": (info.header or {}).get("kind"),
                     "config": ((info.header or {}).get("description") or {}).get("config"),
                     "summary": _summary(info.header)})
    lines = [f"{'key':<16} {'size':>9} {'age':>5} {'used':>5}  kind        config"]
    for r in rows:
        lines.append(f"{r['key'][:16]} {r['size']:>9} {_age(now - r['created']):>5} {_age(now - r['last_used']):>5}"
                     f"  {r['summary']}")
    total = sum(r["size"] for r in rows)
    lines.append(f"{len(rows)} entries, {total} bytes, in {', '.join(t.root for t in cache.tiers) or '(cache off)'}")
    return EXIT_OK, {"entries": rows, "total_bytes": total, "_text": "\n".join(lines)}


def _find(cache, prefix: str):
    prefix = prefix.lower()
    matches = [(t, i) for t, i in cache.entries() if i.key.startswith(prefix)]
    keys = {i.key for _, i in matches}
    if not prefix or len(keys) != 1:
        what = "no entry" if not keys else f"{len(keys)} entries"
        raise InvalidArgumentError(f"key {prefix!r}: {what} match; give more of the key (fastattn cache ls)")
    return matches[0]


def _show(args, cache) -> tuple[int, dict[str, Any]]:
    tier, info = _find(cache, args.key)
    import json

    out = {"key": info.key, "path": info.path, "size": info.size, "header": info.header}
    return EXIT_OK, {**out, "_text": json.dumps(out, indent=2, sort_keys=True)}


def _verify(args, cache) -> tuple[int, dict[str, Any]]:
    env = _this_environment() if args.load else None
    if args.load and env is None:
        raise LibraryError("cache verify --load needs a usable GPU; run without --load to check checksums only")
    rows = []
    for tier, info in cache.entries():
        row = {"key": info.key, "path": info.path, "status": "ok", "reason": ""}
        try:
            with open(info.path, "rb") as f:
                entry = decode(f.read(), expected_key=info.key)
        except (OSError, store.EntryError) as e:
            row.update(status="damaged", reason=str(e))
            rows.append(row)
            continue
        if args.load and entry.kind == "plan":
            if store.environment_of(entry.description) != env:
                row.update(status="skipped", reason="made for another GPU or cuDNN")
            else:
                row.update(_load(entry))
        rows.append(row)
    bad = [r for r in rows if r["status"] in ("damaged", "does not load")]
    lines = [f"{r['key'][:16]} {r['status']:<14} {r['reason']}" for r in rows]
    lines.append(f"{len(rows)} entries: {len(rows) - len(bad)} good, {len(bad)} bad")
    return (EXIT_FAILED if bad else EXIT_OK), {"entries": rows, "bad": len(bad), "_text": "\n".join(lines)}


def _load(entry) -> dict[str, str]:
    from .errors import CorruptPlanError

    try:
        cfg = AttentionConfig.from_dict(entry.description["config"])
        runtime._core().load_plan(cfg, runtime._resolve_device(None), entry.blobs.get("forward", b""),
                                  entry.blobs.get("backward"))
    except (CorruptPlanError, InvalidArgumentError, KeyError) as e:
        return {"status": "does not load", "reason": str(e)}
    return {"status": "ok (loads)"}


def _prune(args, cache) -> tuple[int, dict[str, Any]]:
    if cache.main is None:
        raise InvalidArgumentError("the cache is off (FASTATTN_CACHE_MODE=off)")
    if args.max_bytes is None and args.max_age is None:
        raise InvalidArgumentError("cache prune needs --max-bytes or --max-age")
    removed = cache.main.prune(max_bytes=args.max_bytes, max_age=args.max_age)
    return EXIT_OK, {"removed": removed, "_text": f"removed {removed} entries from {cache.main.root}"}


def _clear(args, cache) -> tuple[int, dict[str, Any]]:
    if cache.main is None:
        raise InvalidArgumentError("the cache is off (FASTATTN_CACHE_MODE=off)")
    removed = cache.main.clear()
    return EXIT_OK, {"removed": removed, "_text": f"removed {removed} entries from {cache.main.root}"}


def _export(args, cache) -> tuple[int, dict[str, Any]]:
    keep = None
    if not args.all:
        env = _this_environment()
        if env is None:
            raise InvalidArgumentError("no usable GPU here to choose entries by: use --all to export every entry")
        keep = lambda description: store.environment_of(description) == env  # noqa: E731
    try:
        count = bundle.export_bundle(cache.tiers, args.bundle, keep=keep, secret=cache.settings.secret)
    except OSError as e:
        raise InvalidArgumentError(f"{args.bundle}: {e.strerror}") from None
    return EXIT_OK, {"exported": count, "bundle": args.bundle, "_text": f"exported {count} entries to {args.bundle}"}


def _import(args, cache) -> tuple[int, dict[str, Any]]:
    if cache.main is None or not cache.main.writable:
        raise InvalidArgumentError(f"the cache is not writable (FASTATTN_CACHE_MODE={cache.settings.mode})")
    report = bundle.import_bundle(args.bundle, cache.main, environment=_this_environment(), force=args.force,
                                  secret=cache.settings.secret)
    out = {"imported": report.imported, "already_present": report.already_present,
           "mismatched_forced": len(report.mismatched) if args.force else 0}
    out["_text"] = (f"imported {report.imported} entries into {cache.main.root}"
                    + (f" ({len(report.mismatched)} made for another GPU or cuDNN, forced)" if report.mismatched else ""))
    return EXIT_OK, out


def _remote(cache):
    if cache.remote is None:
        raise InvalidArgumentError("no remote tier: set FASTATTN_REMOTE_CACHE=redis://host:port/db")
    if cache.remote.disabled:
        raise InvalidArgumentError(f"the remote tier is off: {cache.remote.disabled}")
    return cache.remote


def _keep_for(args):
    """Which entries to move: this GPU's and cuDNN's, or with --all every one."""
    if args.all:
        return lambda description: True
    env = _this_environment()
    if env is None:
        raise InvalidArgumentError("no usable GPU here to choose entries by: use --all to move every entry")
    return lambda description: store.environment_of(description) == env


def _push(args, cache) -> tuple[int, dict[str, Any]]:
    remote = _remote(cache)
    keep = _keep_for(args)
    pushed, skipped, seen = 0, 0, set()
    try:
        for tier, info in cache.entries():
            if info.key in seen:
                continue
            seen.add(info.key)
            try:
                with open(info.path, "rb") as f:
                    entry = decode(f.read(), expected_key=info.key)
            except (OSError, store.EntryError):
                skipped += 1  # damaged: `fastattn cache verify` reports it
                continue
            if not keep(entry.description):
                continue
            remote.publish(entry)
            pushed += 1
    except (OSError, *_redis_errors()) as e:
        raise ConnectionError(f"remote cache {remote.root}: {e}") from None
    return EXIT_OK, {"pushed": pushed, "damaged": skipped, "remote": remote.root,
                     "_text": f"pushed {pushed} entries to {remote.root}" + (f" ({skipped} damaged, skipped)"
                                                                           if skipped else "")}


def _pull(args, cache) -> tuple[int, dict[str, Any]]:
    remote = _remote(cache)
    if cache.main is None or not cache.main.writable:
        raise InvalidArgumentError(f"the cache is not writable (FASTATTN_CACHE_MODE={cache.settings.mode})")
    keep = _keep_for(args)
    pulled, present, rejected = 0, 0, 0
    try:
        for key in list(remote.keys()):
            if cache.main.signature(key) is not None:
                present += 1
                continue
            entry = remote.fetch(key)
            if entry is None:
                rejected += 1  # unsigned, wrongly signed or damaged: counted and warned about
                continue
            if keep(entry.description) and cache.main.put(entry):
                pulled += 1
    except (OSError, *_redis_errors()) as e:
        raise ConnectionError(f"remote cache {remote.root}: {e}") from None
    return EXIT_OK, {"pulled": pulled, "already_present": present, "rejected": rejected, "remote": remote.root,
                     "_text": f"pulled {pulled} entries from {remote.root} into {cache.main.root}"
                              + (f" ({present} already here)" if present else "")
                              + (f"; {rejected} rejected (see the warnings)" if rejected else "")}


def _redis_errors() -> tuple:
    try:
        import redis
    except ImportError:
        return ()
    return (redis.RedisError,)
