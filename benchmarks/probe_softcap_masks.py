"""Which softcap graphs the loaded cuDNN builds on this GPU: cuDNN's verdict (fastattn.probe
builds the very graphs) for softcap beside each mask and window fastattn sends it, dense,
padded and packed, forward alone and with the backward, bf16, a few shapes; the same
graphs without softcap, so that a refusal is known to be softcap's. cuDNN 9.24 and 9.28
on SM90 were seen refusing softcap graphs that 9.19 builds (docs/INSTALL.md, "Tested
versions"): this maps which, on each cuDNN
(`tools/other_cudnn.sh run VERSION -- python3 benchmarks/probe_softcap_masks.py`).

Each bottom-right mask also goes in as the top-left band it equals on a dense batch
(window (left - shift, right + shift), shift = seqlen_kv - seqlen_q), the rewrite
AttentionConfig already makes beside a bias: where cuDNN builds that one, it is a remedy.

Needs a CUDA GPU; exits 2 with one line where there is none.

    python3 benchmarks/probe_softcap_masks.py [--json FILE]
"""

from __future__ import annotations

import argparse
import itertools

from _common import header, require_cuda, write_json  # (benchmarks/ on sys.path)

MASKS = {
    # name: AttentionConfig fields of the mask
    "none": {},
    "causal": {"mask": "causal"},
    "causal_bottom_right": {"mask": "causal_bottom_right"},
    "window_left": {"window": (64, 0), "mask": "causal"},
    "window_both": {"window": (64, 64)},
    "window_left_bottom_right": {"window": (64, 0), "mask": "causal", "alignment": "bottom_right"},
    "window_both_bottom_right": {"window": (64, 16), "alignment": "bottom_right"},
}
# (b, h_q, h_kv, s_q, s_kv, d): square, more keys than queries, more queries than keys, decode
SHAPES = ((1, 8, 8, 512, 512, 128), (2, 8, 2, 128, 640, 64), (2, 8, 2, 186, 170, 64), (4, 4, 1, 2, 256, 64))
BATCHES = {"dense": {}, "padded": {"padding": True}, "packed": {"padding": True, "ragged": True}}


def top_left_equivalent(fields: dict, s_q: int, s_kv: int) -> dict | None:
    """The top-left band a bottom-right mask equals on a dense batch; None where there is none."""
    if fields.get("mask") != "causal_bottom_right" and fields.get("alignment") != "bottom_right":
        return None
    shift = s_kv - s_q
    left, right = fields.get("window", (-1, -1))
    if fields.get("mask") in ("causal", "causal_bottom_right"):
        right = 0
    if right + shift < 0 or 0 <= left < shift:
        return None  # rows that see no key, or a left bound no top-left band has
    return {"window": (left - shift if left >= 0 else -1, right + shift), "alignment": "top_left"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    require_cuda("probe_softcap_masks.py")
    import fastattn
    from fastattn import AttentionConfig

    rows = []

    def probe(shape, batch, mask, fields, softcap, training):
        b, hq, hkv, sq, skv, d = shape
        row = {"shape": list(shape), "batch": batch, "mask": mask, "softcap": softcap, "training": training}
        try:
            cfg = AttentionConfig(batch=b, heads_q=hq, heads_kv=hkv, seqlen_q=sq, seqlen_kv=skv, head_dim_qk=d,
                                  dtype="bf16", softcap=softcap, training=training, **BATCHES[batch], **fields)
        except fastattn.InvalidArgumentError as e:  # a mask this shape cannot have: fastattn's own refusal
            rows.append({**row, "supported": None, "reason": f"config: {str(e).splitlines()[0][:160]}"})
            return
        r = fastattn.probe(cfg)
        rows.append({**row, "stored_as": {"mask": cfg.mask, "window": list(cfg.window), "alignment": cfg.alignment},
                     "supported": r.supported, "forward_engine": r.forward_engine,
                     "reason": None if r.supported else " | ".join(
                         ln.strip() for ln in (r.reason or "").splitlines() if "Reason" in ln or ln.startswith(
                             ("forward", "backward")))[:300]})

    for shape, batch, (mask, fields), softcap, training in itertools.product(
            SHAPES, BATCHES, MASKS.items(), (None, 30.0), (False, True)):
        probe(shape, batch, mask, fields, softcap, training)
        tl = top_left_equivalent(fields, shape[3], shape[4])
        if tl is not None and batch == "dense":
            probe(shape, batch, mask + "=top_left_band", {**fields, **tl, "mask": "none"}, softcap, training)
    res = {**header(), "rows": rows}
    refused = [x for x in rows if x["supported"] is False]
    print(f"cuDNN {fastattn.versions()['cudnn_loaded']}: {len(refused)} of {len(rows)} graphs refused")
    key = lambda x: (tuple(x["shape"]), x["batch"], x["mask"], x["training"])  # noqa: E731
    refused_plain = {key(x) for x in refused if not x["softcap"]}
    for x in refused:
        if x["softcap"] and key(x) not in refused_plain:
            print(f"  softcap only: {x['shape']} {x['batch']} {x['mask']} training={x['training']} "
                  f"(stored {x['stored_as']}): {x['reason']}")
    for x in refused:
        if key(x) in refused_plain and x["softcap"] is None:
            print(f"  refused without softcap too: {x['shape']} {x['batch']} {x['mask']} training={x['training']}: "
                  f"{x['reason']}")
    write_json(res, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
