"""Which softcap graphs the loaded cuDNN builds on this GPU, mask by mask: cuDNN's verdict
(fastattn.probe builds the very graphs) for softcap beside each diagonal and window fastattn
sends it, forward alone and with the backward, bf16, a few shapes. cuDNN 9.24 and 9.28 on
SM90 were seen refusing softcap with a bottom-right causal mask or a window that 9.19 builds
(docs/INSTALL.md, "Tested versions"): this maps where, on each cuDNN
(`tools/other_cudnn.sh run VERSION -- python3 benchmarks/probe_softcap_masks.py`), and the
same graphs without softcap, so that a refusal is known to be softcap's.

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
    "window_bottom_right": {"window": (64, 0), "mask": "causal", "alignment": "bottom_right"},
}
SHAPES = ((1, 8, 512, 512, 128), (2, 8, 128, 640, 64), (1, 4, 1, 256, 128))  # (b, h, s_q, s_kv, d)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    require_cuda("probe_softcap_masks.py")
    import fastattn
    from fastattn import AttentionConfig

    rows = []
    for (b, h, sq, skv, d), (mask, fields), softcap, training in itertools.product(
            SHAPES, MASKS.items(), (None, 30.0), (False, True)):
        try:
            cfg = AttentionConfig(batch=b, heads_q=h, seqlen_q=sq, seqlen_kv=skv, head_dim_qk=d, dtype="bf16",
                                  layout="bhsd", softcap=softcap, training=training, **fields)
        except fastattn.InvalidArgumentError as e:  # a mask this shape cannot have: fastattn's own refusal
            rows.append({"shape": [b, h, sq, skv, d], "mask": mask, "softcap": softcap, "training": training,
                         "supported": None, "reason": f"config: {e}"})
            continue
        r = fastattn.probe(cfg)
        rows.append({"shape": [b, h, sq, skv, d], "mask": mask, "softcap": softcap, "training": training,
                     "supported": r.supported, "forward_engine": r.forward_engine,
                     "reason": (r.reason or "").splitlines()[0][:200] if not r.supported else None})
    res = {**header(), "rows": rows}
    refused = [x for x in rows if x["supported"] is False]
    print(f"cuDNN {fastattn.versions()['cudnn_loaded']}: {len(refused)} of {len(rows)} graphs refused")
    for x in refused:
        print(f"  refused: {x['shape']} {x['mask']} softcap={x['softcap']} training={x['training']}: {x['reason']}")
    only_softcap = {(tuple(x["shape"]), x["mask"], x["training"]) for x in refused if x["softcap"]} - {
        (tuple(x["shape"]), x["mask"], x["training"]) for x in refused if not x["softcap"]}
    print(f"summary: refused with softcap and built without it: {sorted(only_softcap)}")
    write_json(res, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
