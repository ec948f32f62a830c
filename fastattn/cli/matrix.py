"""`fastattn matrix`: probe a grid of configs and show which cuDNN supports on this GPU."""

from __future__ import annotations

from typing import Any

from ..config import DTYPES, MASKS, AttentionConfig
from ..errors import InvalidArgumentError
from ._common import EXIT_BAD_INPUT, EXIT_OK, EXIT_UNSUPPORTED, add_json_flag, choices, exit_code, ints

# fastattn matrix --features: name -> (config fields it sets, what it means).
MATRIX_FEATURES = {
    "dense": ({}, "no feature"),
    "padding": ({"padding": True}, "per-sequence lengths"),
    "ragged": ({"padding": True, "ragged": True}, "packed sequences"),
    "paged": ({"padding": True, "page_size": 64}, "paged KV, 64-token pages"),
    "bias": ({"bias": "1hss"}, "a 1hss bias"),
    "bias_grad": ({"bias": "1hss", "bias_grad": True}, "with its gradient; needs --training"),
    "alibi": ({"alibi": True}, "ALiBi"),
    "dropout": ({"dropout": 0.1}, "dropout 0.1"),
    "sinks": ({"sinks": True}, "attention sinks"),
}


def add_parser(sub) -> None:
    matrix = sub.add_parser("matrix", help="probe a grid of configs and show which cuDNN supports on this GPU")
    matrix.add_argument("--head-dims", type=ints, default=[64, 96, 128, 192, 256], metavar="D,D,...",
                        help="head_dim_qk values (head_dim_v the same)")
    matrix.add_argument("--masks", type=choices(MASKS), default=list(MASKS), metavar="M,M,...")
    matrix.add_argument("--dtypes", type=choices(DTYPES), default=list(DTYPES), metavar="T,T,...")
    matrix.add_argument("--gqa", type=ints, default=[1, 4], metavar="R,R,...",
                        help="heads_q / heads_kv ratios (1: MHA)")
    matrix.add_argument("--seqlens", type=ints, default=[1024], metavar="S,S,...")
    matrix.add_argument("--features", type=choices(tuple(MATRIX_FEATURES)), default=["dense"], metavar="F,F,...",
                        help="what each column adds: " + ", ".join(f"{n} ({d})" for n, (_, d) in
                                                                    MATRIX_FEATURES.items()))
    matrix.add_argument("--heads", type=int, default=8, help="heads_q")
    matrix.add_argument("--batch", type=int, default=1)
    matrix.add_argument("--training", action="store_true", help="also build backward graphs")
    matrix.add_argument("--workers", type=int, default=None)
    matrix.add_argument("--device", type=int, default=None)
    matrix.add_argument("--png", help="also draw a heatmap to this PNG file (needs matplotlib)")
    add_json_flag(matrix, help=None)


def run(args) -> tuple[int, dict[str, Any]]:
    import itertools

    from ..warm import warm

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
    code = exit_code(report)
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
