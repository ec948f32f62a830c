"""Which of a transformers model's SDPA calls the SDPA mode serves, and why not the others:
a 2-layer GQA Llama and Qwen2 (16 query heads, 4 key-value heads, bf16,
random weights, attn_implementation="sdpa") with fastattn.torch.enable_sdpa(), in prefill
(unpadded and left-padded) and greedy generate (left-padded), each call of
torch.nn.functional.scaled_dot_product_attention recorded with its arguments' shapes,
strides, dtypes, mask kind, is_causal and enable_gqa, and PyTorch's backend choice for it
(torch._fused_sdp_choice: 0 math, 1 flash, 2 efficient, 3 cudnn); then the mode's route
table (fastattn.torch._sdpa_mode.sdpa_routes(): served by fastattn, or the reason not) and
its per-call counts (fastattn.stats()["sdpa"]: served, passed on by reason).

    python benchmarks/probe_sdpa_routes.py [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import json

import torch
import torch.nn.functional as F
from _common import require_cuda, write_json  # (benchmarks/ on sys.path)


def _describe(t):
    if t is None:
        return None
    return {"shape": list(t.shape), "stride": list(t.stride()), "dtype": str(t.dtype)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    args = ap.parse_args()
    require_cuda("probe_sdpa_routes.py")
    from transformers import AutoConfig, AutoModelForCausalLM

    import fastattn
    import fastattn.torch as fat
    from fastattn.torch import _sdpa_mode

    original = F.scaled_dot_product_attention
    seen: collections.Counter = collections.Counter()
    choices: collections.Counter = collections.Counter()

    def recording(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        mask = None if attn_mask is None else f"{attn_mask.dtype} {list(attn_mask.shape)}"
        seen[json.dumps({"q": _describe(query), "k": _describe(key), "mask": mask, "is_causal": is_causal,
                         "enable_gqa": enable_gqa}, sort_keys=True)] += 1
        try:
            choices[int(torch._fused_sdp_choice(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                                enable_gqa=enable_gqa))] += 1
        except Exception as e:  # (a torch without the keyword)
            choices[f"{type(e).__name__}: {e}"[:120]] += 1
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, enable_gqa=enable_gqa)

    F.scaled_dot_product_attention = recording
    out, lines = {}, []
    fat.enable_sdpa()
    try:
        for kind in ("llama", "qwen2"):
            cfg = AutoConfig.for_model(model_type=kind, vocab_size=512, hidden_size=1024, intermediate_size=1024,
                                       num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=4,
                                       max_position_embeddings=1024)
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa",
                                                     dtype=torch.bfloat16).to("cuda").eval()
            ids = torch.randint(3, 512, (4, 64), device="cuda")
            mask = torch.ones_like(ids)
            for n, pad in enumerate((0, 10, 30, 5)):
                mask[n, :pad] = 0
            seen.clear()
            choices.clear()
            _sdpa_mode._routes.clear()
            fastattn.clear()  # (zeroes the mode's call counts: this model's calls alone below)
            with torch.no_grad():
                model(ids)
                model(ids, attention_mask=mask)
                model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
            routes = _sdpa_mode.sdpa_routes()
            out[kind] = {"calls": [{"count": n, **json.loads(k)} for k, n in seen.items()],
                         "pytorch_backend_choice": {str(k): n for k, n in choices.items()},
                         "routes": [{"served": r.startswith("fastattn"), "route": r, "key": str(key)[:400]}
                                    for key, r in routes.items()]}
            # The Python route table holds only the signatures new to the op library's own
            # table: the calls are counted per call (fastattn.stats()["sdpa"]).
            counted = fastattn.stats()["sdpa"]
            out[kind]["sdpa_calls"] = counted
            lines.append(f"  {kind}: {sum(seen.values())} SDPA calls, PyTorch's backend choices {dict(choices)}, "
                         f"the mode served {counted['served']}, passed on {sum(counted['passed_on'].values())}")
            lines.extend(f"    not served: {r['route'][:300]}" for r in out[kind]["routes"] if not r["served"])
    finally:
        F.scaled_dot_product_attention = original
        fat.disable_sdpa()
    print(json.dumps(write_json(out, args.json), indent=1)[:6000])
    print("summary:", *lines, sep="\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
