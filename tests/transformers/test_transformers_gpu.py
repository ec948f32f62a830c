"""GPU: tiny random-weight transformers models (from configs, no downloads) with
attn_implementation="fastattn" against the same weights with "sdpa" (bfloat16), or "eager"
in float32 where sdpa lacks the feature (Gemma 2's softcap, gpt-oss's sinks): logits of a
left-padded batch, a training step's loss and gradients, and greedy generate of 32 tokens
from a left-padded batch of 4 prompts of different lengths, token for token.

What the references are, and why (measured on the H200):
- Gradients against float32 eager, not bf16 sdpa: PyTorch 2.11's SDPA (its cuDNN
  backend) gives NaN in every gradient of a left-padded training step, and bf16 eager
  is within 0.8-1.5% of float32 eager, so float32 eager is the reference that can fail
  us and not itself.
- The loss leaves out the positions predicted from a padding row (a row that sees no
  key): frameworks disagree on what such a row outputs (eager: the mean of its padding
  values; sdpa and fastattn: zeros), and a left-padded batch's last padding row predicts
  the first real token. With it in the loss, fastattn's gradients were 20% from eager's
  while both were right by their own definition.
- gpt-oss with one expert: with two, a bf16 near-tie in the router sends a token to the
  other expert, and that token's whole logit row differs (855 of 131072 elements, in
  two rows, with every attention output within tolerance).
- generate against float32 eager, token for token up to the first difference, which is
  allowed only where the reference's top two logits are within TIE of each other (a
  bf16 near-tie: sdpa in bf16 breaks the same ties differently, too)."""

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")
transformers = pytest.importorskip("transformers", reason="transformers is an optional extra")

import fastattn.integrations.transformers  # noqa: E402,F401  (registers "fastattn")
from helpers.gpu import softcap_with_lengths_refused  # noqa: E402

DEV = "cuda"
KINDS = {
    "llama-d64": dict(model_type="llama", head_dim=64, num_attention_heads=8, num_key_value_heads=2),
    "llama-d128": dict(model_type="llama", head_dim=128, num_attention_heads=4, num_key_value_heads=2),
    "mistral": dict(model_type="mistral", head_dim=64, num_attention_heads=8, num_key_value_heads=2,
                    sliding_window=24),
    "qwen2": dict(model_type="qwen2", num_attention_heads=8, num_key_value_heads=2, use_sliding_window=True,
                  sliding_window=24, max_window_layers=0, layer_types=["sliding_attention"] * 2),
    "gemma2": dict(model_type="gemma2", head_dim=64, num_attention_heads=8, num_key_value_heads=4, sliding_window=24,
                   attn_logit_softcapping=50.0, final_logit_softcapping=None, query_pre_attn_scalar=64),
    "gemma3": dict(model_type="gemma3_text", head_dim=64, num_attention_heads=8, num_key_value_heads=4,
                   sliding_window=24, query_pre_attn_scalar=64, layer_types=["sliding_attention", "full_attention"]),
    "gpt_oss": dict(model_type="gpt_oss", head_dim=64, num_attention_heads=8, num_key_value_heads=2,
                    sliding_window=24, num_local_experts=1, num_experts_per_tok=1,
                    layer_types=["sliding_attention", "full_attention"]),
}
EAGER = {"gemma2", "gpt_oss"}  # sdpa has no softcap / sinks: float32 eager is the reference


def _model(kind, attn, dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**{**dict(vocab_size=512, hidden_size=512, intermediate_size=768,
                                         num_hidden_layers=2, max_position_embeddings=512), **KINDS[kind]})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32).to(DEV, dtype)


def _pair(kind):
    """(fastattn bf16, the logits' reference, float32 eager), one set of weights."""
    ours = _model(kind, "fastattn", torch.bfloat16)
    ref = _model(kind, "eager" if kind in EAGER else "sdpa", torch.float32 if kind in EAGER else torch.bfloat16)
    ref.load_state_dict(ours.state_dict())
    exact = _model(kind, "eager", torch.float32)
    exact.load_state_dict(ours.state_dict())
    return ours, ref, exact


def _labels(ids, mask):
    """Labels whose every prediction is made from a real token (see the module)."""
    keep = mask.bool()
    labels = ids.masked_fill(~keep, -100)
    labels[:, 1:] = labels[:, 1:].masked_fill(~keep[:, :-1], -100)
    return labels


def _batch(lengths, total):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 512, (len(lengths), total), generator=g)
    mask = torch.zeros(len(lengths), total, dtype=torch.long)
    for n, length in enumerate(lengths):
        mask[n, total - length:] = 1
    return ids.to(DEV), mask.to(DEV)


def _close(a, b, tol):
    a, b = a.float(), b.float()
    scale = b.abs().max().item()
    torch.testing.assert_close(a, b, atol=tol * scale, rtol=tol)


@pytest.mark.parametrize("kind", list(KINDS))
def test_logits_and_a_training_step(kind):
    ours, ref, exact = _pair(kind)
    ids, mask = _batch([64, 40, 57, 33], 64)
    with torch.no_grad():
        a, b = ours(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits
    _close(a[mask.bool()], b[mask.bool()], 3e-2)
    with torch.no_grad():  # no padding: causal at the top left, no bias
        _close(ours(ids).logits, ref(ids).logits, 3e-2)
    ours.train()
    exact.train()
    labels = _labels(ids, mask)
    la = ours(ids, attention_mask=mask, labels=labels).loss
    lb = exact(ids, attention_mask=mask, labels=labels).loss
    torch.testing.assert_close(la.float(), lb.float(), atol=2e-2, rtol=2e-2)
    la.backward()
    lb.backward()
    for (name, pa), pb in zip(ours.named_parameters(), exact.parameters()):
        if pb.grad is None:
            continue
        ga, gb = pa.grad.float(), pb.grad.float()
        err = (ga - gb).norm() / gb.norm().clamp(min=1e-12)
        assert err < 6e-2, (name, err.item())


@pytest.mark.parametrize("kind,how", [(k, "position_ids") for k in KINDS if k != "gpt_oss"]
                         + [(k, "flash_kwargs") for k in ("llama-d64", "gemma2", "gpt_oss")])
def test_packed_sequences_in_one_row_attend_each_on_its_own(kind, how):
    # A padding-free batch: one row, position_ids restarting at each sequence (transformers
    # packs from them without a cache; gpt-oss 5.17 builds its masks without them), or the
    # cu_seq_lens_* / max_length_* DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    # hands on. The packed path (attention_varlen) against float32 eager on each sequence
    # alone. gpt-oss's q is head-major: its packed view was not contiguous (attention_varlen
    # refused it) until the adapter made it so.
    ours, _, exact = _pair(kind)
    lengths = (7, 30, 19)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 512, (1, sum(lengths)), generator=g).to(DEV)
    pos = torch.cat([torch.arange(n) for n in lengths])[None].to(DEV)
    cu = torch.tensor([0, 7, 37, 56], dtype=torch.int32, device=DEV)
    flash = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=30, max_length_k=30) if how == "flash_kwargs" else {}
    before = _fallback_reasons()
    with torch.no_grad():
        got = ours(ids, position_ids=pos, use_cache=False, **flash).logits[0]
        want = torch.cat([exact(part[None]).logits[0] for part in ids[0].split(lengths)])
    _close(got, want, 3e-2)
    if kind != "gpt_oss":  # (sinks at the top left of packed sequences: cuDNN's verdict not probed yet)
        _assert_served(before, kind)


TIE = 2e-2  # top-two gap of the float32 reference's logits (~1.3 here) that bf16 may resolve either way


def _fallback_reasons() -> dict[str, int]:
    import fastattn

    return dict(fastattn.stats()["fallbacks"].get("transformers", {}))


def _assert_served(before: dict[str, int], kind: str) -> None:
    """Every attention call since `before` ran on fastattn's kernels, except those the
    loaded cuDNN refuses for a known gap (softcap with per-sequence lengths on some
    releases: fastattn.defects.GAPS), which fall back counted under a reason naming it."""
    new = {r: n - before.get(r, 0) for r, n in _fallback_reasons().items() if n != before.get(r, 0)}
    gap = softcap_with_lengths_refused() if KINDS[kind].get("attn_logit_softcapping") else None
    assert not [r for r in new if not (gap and r.endswith(f"(known cuDNN gap {gap})"))], new


# (kind, prefill_chunk_size): chunked prefill is a left-padded batch's queries against a cache
# of its earlier chunks (a bottom-right diagonal beside the padding's key bias).
@pytest.mark.parametrize("kind,chunk", [("llama-d64", None), ("qwen2", None), ("gemma3", None), ("mistral", None),
                                        ("gpt_oss", None), ("gemma2", None), ("llama-d64", 8), ("qwen2", 8),
                                        ("gemma2", 8)])
def test_greedy_generate_of_32_tokens_from_a_left_padded_batch(kind, chunk):
    ours = _model(kind, "fastattn", torch.bfloat16)
    ref = _model(kind, "eager", torch.float32)
    ref.load_state_dict(ours.state_dict())
    ids, mask = _batch([20, 9, 31, 14], 31)
    kw = dict(max_new_tokens=32, do_sample=False, pad_token_id=0, prefill_chunk_size=chunk)
    before = _fallback_reasons()
    a = ours.generate(ids, attention_mask=mask, **kw)
    # Every call on fastattn's kernels: the prefill (top-left causal beside the padding's
    # key bias), the chunks and the decode steps (a bottom-right diagonal beside it, which
    # cuDNN takes in its top-left form: AttentionConfig's alignment).
    _assert_served(before, kind)
    b = ref.generate(ids, attention_mask=mask, output_scores=True, return_dict_in_generate=True, **kw)
    assert a.shape == b.sequences.shape
    for row in range(a.shape[0]):
        differ = (a[row, ids.shape[1]:] != b.sequences[row, ids.shape[1]:]).nonzero()
        if len(differ) == 0:
            continue
        step = int(differ[0])
        top = b.scores[step][row].float().topk(2).values
        gap = float(top[0] - top[1])
        assert gap < TIE, f"row {row} differs at new token {step}, where the reference's top two are {gap:.4f} apart"


@pytest.mark.parametrize(("kind", "graphs"), [(k, False) for k in ("llama-d64", "qwen2", "gemma2", "gemma3", "mistral",
                                                                    "gpt_oss")]
                         + [("llama-d64", True), ("qwen2", True), ("gpt_oss", True)])
def test_continuous_batching_on_paged_fastattn_gives_each_prompts_greedy_tokens(kind, graphs):
    # generate_batch (transformers' continuous batching: a paged KV cache, requests of different
    # lengths scheduled together, prefill and decode packed in one call) on "paged|fastattn",
    # against float32 eager's greedy generate of each prompt alone, token for token up to ties.
    # graphs: with transformers' CUDA graphs asked for (its warm-up, then each padded batch shape
    # run once eagerly, captured, and replayed), which it leaves off by default for this name.
    # gpt_oss: sinks on attention_varlen, decode steps (one query) included.
    from transformers import ContinuousBatchingConfig, GenerationConfig

    ours = _model(kind, "fastattn", torch.bfloat16)
    if graphs and kind == "gpt_oss":
        # transformers' default experts kernel (grouped_mm) cannot be captured: its torch.histc
        # copies from the host ("Cannot copy between CPU and CUDA tensors during CUDA graph
        # capture", whatever the attention). batched_mm has no host step.
        ours.set_experts_implementation("batched_mm")
    ref = _model(kind, "eager", torch.float32)
    ref.load_state_dict(ours.state_dict())
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (7, 30, 61, 90)]
    gen = GenerationConfig(max_new_tokens=16, do_sample=False, eos_token_id=-1, pad_token_id=0)
    before = _fallback_reasons()
    cb = ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=256, use_cuda_graph=graphs or None)
    out = ours.generate_batch(prompts, generation_config=gen, warmup=graphs, continuous_batching_config=cb)
    _assert_served(before, kind)
    got = [out[r].generated_tokens for r in sorted(out, key=lambda r: int(r.split("_")[1]))]
    for row, prompt in enumerate(prompts):
        b = ref.generate(torch.tensor([prompt], device=DEV), max_new_tokens=16, do_sample=False, pad_token_id=0,
                         eos_token_id=-1, output_scores=True, return_dict_in_generate=True)
        want = b.sequences[0, len(prompt):].tolist()
        assert len(got[row]) == len(want)
        differ = [i for i, (x, y) in enumerate(zip(got[row], want)) if x != y]
        if differ:
            top = b.scores[differ[0]][0].float().topk(2).values
            gap = float(top[0] - top[1])
            assert gap < TIE, f"prompt {row} differs at new token {differ[0]}, where the top two are {gap:.4f} apart"
    del ours
    torch.cuda.empty_cache()


@pytest.mark.parametrize("kind", ["llama-d64", "qwen2", "gemma3"])
def test_the_sdpa_mode_serves_every_attention_call_of_an_sdpa_model(kind):
    # With enable_sdpa(), transformers' "sdpa" path (GQA through enable_gqa, boolean
    # masks of a left-padded batch, sliding windows) runs on fastattn, every call.
    import fastattn
    import fastattn.torch

    ours = _model(kind, "sdpa", torch.bfloat16)
    ref = _model(kind, "eager", torch.float32)
    ref.load_state_dict(ours.state_dict())
    ids, mask = _batch([20, 9, 31, 14], 31)
    kw = dict(max_new_tokens=16, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        off = ours(ids, attention_mask=mask).logits
    fastattn.torch.enable_sdpa()
    try:
        before = fastattn.stats()["sdpa"]
        with torch.no_grad():
            on = ours(ids, attention_mask=mask).logits
        a = ours.generate(ids, attention_mask=mask, **kw)
        after = fastattn.stats()["sdpa"]
    finally:
        fastattn.torch.disable_sdpa()
    layers = ours.config.num_hidden_layers
    assert after["passed_on"] == before["passed_on"], after["passed_on"]
    assert after["served"] - before["served"] == layers * (1 + 16), after  # the forward, the prefill, 15 decode steps
    _close(on[mask.bool()], off[mask.bool()], 3e-2)
    b = ref.generate(ids, attention_mask=mask, output_scores=True, return_dict_in_generate=True, **kw)
    for row in range(a.shape[0]):
        differ = (a[row, ids.shape[1]:] != b.sequences[row, ids.shape[1]:]).nonzero()
        if len(differ):
            step = int(differ[0])
            top = b.scores[step][row].float().topk(2).values
            assert float(top[0] - top[1]) < TIE, (row, step)


@pytest.mark.parametrize("sq", [1, 8])
def test_a_sequence_of_padding_alone_leaves_every_gradient_finite(sq):
    # A batch with one sequence that is all padding, with gradients: its rows see no key.
    # A row whose every score is finfo.min makes cuDNN 9.19's SM90 backward give NaN in
    # every gradient of the batch; the adapter opens such rows for the backward
    # and zeroes their outputs, with one query too.
    from types import SimpleNamespace

    from transformers import masking_utils as mu

    padding = torch.tensor([[False] * 64, [True] * 64], device=DEV)
    form = fastattn.integrations.transformers.attention_mask(2, sq, 64, q_offset=64 - sq,
                                                             mask_function=mu.causal_mask_function,
                                                             attention_mask=padding)
    g = torch.Generator(device=DEV).manual_seed(0)
    q = torch.randn(2, 8, sq, 64, device=DEV, dtype=torch.bfloat16, generator=g).requires_grad_()
    k, v = (torch.randn(2, 2, 64, 64, device=DEV, dtype=torch.bfloat16, generator=g).requires_grad_()
            for _ in range(2))
    out, _ = fastattn.integrations.transformers.attention_forward(SimpleNamespace(is_causal=True), q, k, v, form)
    assert (out[0] == 0).all()  # the padding sequence's rows: zeros
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    assert all(torch.isfinite(t).all() for t in grads)
    below = torch.ones(sq, 64, dtype=torch.bool, device=DEV).tril(64 - sq)  # causal at the bottom right
    ref = torch.nn.functional.scaled_dot_product_attention(*(t[1:].detach().double() for t in (q, k, v)),
                                                           attn_mask=below, enable_gqa=True)
    torch.testing.assert_close(out[1:].double(), ref.transpose(1, 2), atol=2e-2, rtol=2e-2)
