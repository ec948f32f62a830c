"""`fastattn matrix`: probe a grid of configs and show which cuDNN supports on this GPU."""

from __future__ import annotations

from typing import Any

from .. import _fields, dtypes, files
from ..config import DTYPES, FIELDS, MASKS, AttentionConfig
from ..errors import InvalidArgumentError
from ..config_files import MAX_CONFIGS
from ._common import (EXIT_NO_GPU, EXIT_OK, EXIT_UNSUPPORTED, add_json_flag, choices, echo, exit_code, integer, ints,
                      output_file, wrap)

# fastattn matrix --features: name -> (config fields it sets, what it means), from the
# field registry (each feature field's `feature`).
MATRIX_FEATURES = _fields.features(FIELDS)
# Column headers name masks in full but for this one, whose full name would crowd the grid.
_MASK_LABELS = {"causal_bottom_right": "causal_br"}


def add_parser(sub) -> None:
    matrix = sub.add_parser("matrix", help="probe a grid of configs and show which cuDNN supports on this GPU",
                            description="Probe a grid of configs (every combination of the values given) and show "
                            "which cuDNN supports on this GPU, with its reasons. Exit codes: 0 the grid was made "
                            "(refusals included), 2 bad flags, a flag value none of whose configs is valid "
                            f"(--features bias_grad without --training), or a grid of more than {MAX_CONFIGS} "
                            "cells, 3 no usable GPU (with --png: checked first), 4 some configs failed.")
    matrix.add_argument("--head-dims", type=ints, default=[64, 96, 128, 192, 256], metavar="D,D,...",
                        help="head_dim_qk values (head_dim_v the same)")
    matrix.add_argument("--masks", type=choices(MASKS), default=list(MASKS), metavar="M,M,...",
                        help=f"masks, of {', '.join(MASKS)} (default: all)")
    # FP8 columns on request (--dtypes bf16,fp8_e4m3): the default grid stays the 16-bit one.
    matrix.add_argument("--dtypes", type=choices(DTYPES), default=list(dtypes.SIXTEEN_BIT), metavar="T,T,...",
                        help=f"q/k/v dtypes, of {', '.join(DTYPES)} (default {','.join(dtypes.SIXTEEN_BIT)})")
    matrix.add_argument("--gqa", type=ints, default=[1, 4], metavar="R,R,...",
                        help="heads_q / heads_kv ratios (1: MHA); each must divide --heads")
    matrix.add_argument("--seqlens", type=ints, default=[1024], metavar="S,S,...",
                        help="seqlen_q values (seqlen_kv the same; default 1024)")
    matrix.add_argument("--features", type=choices(tuple(MATRIX_FEATURES)), default=["dense"], metavar="F,F,...",
                        help="what each column adds: " + ", ".join(f"{n} ({d})" for n, (_, d) in
                                                                    MATRIX_FEATURES.items()))
    matrix.add_argument("--heads", type=integer(1), default=8, help="heads_q (default 8)")
    matrix.add_argument("--batch", type=integer(1), default=1, help="batch (default 1)")
    matrix.add_argument("--training", action="store_true", help="also build backward graphs")
    matrix.add_argument("--workers", type=integer(1), default=None,
                        help="worker processes, as for fastattn warm (default: min(8, CPUs))")
    matrix.add_argument("--device", type=integer(0), default=None, help="CUDA device (default: current)")
    matrix.add_argument("--png", type=output_file, help="also draw a heatmap to this PNG file (needs matplotlib)")
    add_json_flag(matrix, help="print every cell (config, status, reason, engines) as JSON")


def run(args) -> tuple[int, dict[str, Any]]:
    import itertools

    from ..warm import warm

    _check_grid_size(args)
    for ratio in args.gqa:  # before any work: a grid with a hole is no answer
        if args.heads % ratio:
            raise InvalidArgumentError(f"--gqa {ratio}: --heads {args.heads} is not a multiple of it")
    if args.png:  # no heatmap without a GPU (exit 3), said before asking for matplotlib (exit 2)
        _check_gpu(args.device)
        _check_matplotlib()
    configs, axes, invalid = [], [], []
    for d, mask, dtype, ratio, s, feature in itertools.product(args.head_dims, args.masks, args.dtypes, args.gqa,
                                                               args.seqlens, args.features):
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
    _refuse_values_without_configs(args, axes, invalid)
    report = warm(configs, workers=args.workers, device=args.device)
    code = exit_code(report)
    rows = [{**a, "status": i.status, "reason": i.reason, "forward_engine": i.forward_engine,
             "backward_engine": i.backward_engine} for a, i in zip(axes, report.items)] + invalid
    ok = {"built", "loaded"}
    status_mark = {"unsupported": "no", "invalid": "n/a"}
    cols = sorted({(r["mask"], r["dtype"], r["gqa"], r["seqlen"], r["feature"]) for r in rows},
                  key=lambda c: (args.masks.index(c[0]), args.dtypes.index(c[1]), c[2], c[3],
                                 args.features.index(c[4])))
    mark = {r_key: ("yes" if r["status"] in ok else status_mark.get(r["status"], "FAIL"))
            for r in rows for r_key in [(r["head_dim"], r["mask"], r["dtype"], r["gqa"], r["seqlen"], r["feature"])]}
    width = max([len(_column(c)) for c in cols] + [4])  # headers whole, never cut
    lines = ["head_dim " + " ".join(_column(c).rjust(width) for c in cols)]
    for d in dict.fromkeys(args.head_dims):
        lines.append(f"{d:>8} " + " ".join(mark[(d, *c)].rjust(width) for c in cols))
    reasons = sorted({r["reason"] for r in rows if r["status"] not in ok})
    if code == EXIT_NO_GPU:  # a grid of FAIL cells answers nothing: the reason, once (stderr), and no heatmap
        lines = ["fastattn matrix: no usable GPU here, so nothing was probed:"]
        for r in reasons:
            lines.extend(wrap(r))
        if args.png:
            lines.append(f"no heatmap written to {files.shown(args.png)}: no usable GPU")
        return code, {"configs": rows, "counts": report.counts, "_text": "", "_stderr": "\n".join(lines)}
    if reasons:
        lines.append("reasons:")
        for r in reasons:
            lines.extend(wrap(r))
    if args.png:
        _heatmap(_pyplot(), args.png, list(dict.fromkeys(args.head_dims)), cols, mark)
        lines.append(f"heatmap written to {files.shown(args.png)}")
    out = {"configs": rows, "counts": report.counts, "_text": "\n".join(lines)}
    return (EXIT_OK if code == EXIT_UNSUPPORTED else code), out  # refusals are the grid's answer, not a failure


# The grid's axes: (row key, args attribute, flag), in the order a refusal names them:
# the feature first, whose rules are fastattn's own (bias_grad needs --training, paged
# has no backward).
_AXES = (("feature", "features", "--features"), ("dtype", "dtypes", "--dtypes"), ("mask", "masks", "--masks"),
         ("gqa", "gqa", "--gqa"), ("seqlen", "seqlens", "--seqlens"), ("head_dim", "head_dims", "--head-dims"))


def _refuse_values_without_configs(args, valid: list[dict[str, Any]], invalid: list[dict[str, Any]]) -> None:
    """A flag value none of whose configs is valid (`--features bias_grad` without
    --training) asks cuDNN nothing: a usage error, before any work or GPU. An n/a cell
    is left only where values that are each valid somewhere do not combine."""
    for axis, dest, flag in _AXES:
        for value in dict.fromkeys(getattr(args, dest)):
            if not any(a[axis] == value for a in valid):
                reason = next(r["reason"] for r in invalid if r[axis] == value)
                raise InvalidArgumentError(f"{flag} {value}: no config of the grid with it is valid ({reason})")


def _check_grid_size(args) -> None:
    """A grid of more cells than a warm file may describe (fastattn.config_files.MAX_CONFIGS)
    is refused before any cell is made: a usage error naming its size and the cap."""
    from .. import config_files

    sizes = [(len(getattr(args, dest)), flag) for dest, flag in (
        ("head_dims", "--head-dims"), ("masks", "--masks"), ("dtypes", "--dtypes"), ("gqa", "--gqa"),
        ("seqlens", "--seqlens"), ("features", "--features"))]  # (the order the grid is made in)
    cells = 1
    for n, _ in sizes:
        cells *= n
    if cells > config_files.MAX_CONFIGS:
        product = " x ".join(f"{n} {flag}" for n, flag in sizes)
        raise InvalidArgumentError(f"the grid has {cells} cells ({product}), more than {config_files.MAX_CONFIGS}: "
                                   "give fewer values")


def _column(c) -> str:
    m, t, g, s, f = c
    return f"{_MASK_LABELS.get(m, m)}/{t}/g{g}/s{s}" + ("" if f == "dense" else f"/{f}")


def _check_gpu(device: int | None) -> None:
    """--png draws what this GPU supports: without a usable GPU stack, the LibraryError
    or CudaError that says why (exit 3), before any other work."""
    from .. import runtime
    from ..errors import CudaError, LibraryError

    try:
        runtime.device_info(device)
    except (LibraryError, CudaError) as e:
        raise type(e)(f"--png: no heatmap, no usable GPU here: {e}") from None


def _check_matplotlib() -> None:
    """--png needs matplotlib: checked before the grid is probed (not after), without
    importing it (an import builds its font cache, for a heatmap that may never be
    drawn: without a GPU there is none)."""
    import importlib.util

    try:
        found = importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise InvalidArgumentError("--png needs matplotlib (pip install matplotlib)")


def _pyplot():
    """matplotlib's pyplot, drawing to files only."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise InvalidArgumentError(f"--png needs matplotlib, which does not import here ({e})") from None
    return plt


def _heatmap(plt, path: str, head_dims, cols, mark) -> None:
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
    import io

    from .. import files

    image = io.BytesIO()
    try:
        fig.savefig(image, dpi=120, format="png")
    finally:
        plt.close(fig)
    try:
        files.write_file(path, image.getvalue())  # exactly the path given: no ".png" added
    except OSError as e:
        raise InvalidArgumentError(f"--png {echo(path)}: {e.strerror or e}") from None
