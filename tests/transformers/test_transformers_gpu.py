"""GPU: tiny random-weight transformers models (from configs, no downloads) with
attn_implementation="fastattn" against the same weights with "sdpa" (bfloat16), or "eager"
in float32 where sdpa lacks the feature (Gemma 2's softcap, gpt-oss's sinks): logits of a
left-padded batch, a training step's loss and gradients, and greedy generate of 32 tokens
from a left-padded batch of 4 prompts of different lengths, token for token."""

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")
transformers = pytest.importorskip("transformers", reason="transformers is an optional extra")

import fastattn.integrations.transformers  # noqa: E402,F401  (registers "fastattn")

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
    "gpt_oss": dict(model_type="gpt_oss", head_dim=64, num_attention_heads=8, num_key_value_heads=2,
                    sliding_window=24, num_local_experts=2, num_experts_per_tok=1,
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
    ours = _model(kind, "fastattn", torch.bfloat16)
    ref = _model(kind, "eager" if kind in EAGER else "sdpa", torch.float32 if kind in EAGER else torch.bfloat16)
    ref.load_state_dict(ours.state_dict())
    return ours, ref


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
    ours, ref = _pair(kind)
    ids, mask = _batch([64, 40, 57, 33], 64)
    with torch.no_grad():
        a, b = ours(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits
    _close(a[mask.bool()], b[mask.bool()], 3e-2)
    with torch.no_grad():  # no padding: causal at the top left, no bias
        _close(ours(ids).logits, ref(ids).logits, 3e-2)
    ours.train()
    ref.train()
    labels = ids.masked_fill(mask == 0, -100)
    la = ours(ids, attention_mask=mask, labels=labels).loss
    lb = ref(ids, attention_mask=mask, labels=labels).loss
    torch.testing.assert_close(la.float(), lb.float(), atol=2e-2, rtol=2e-2)
    la.backward()
    lb.backward()
    for (name, pa), pb in zip(ours.named_parameters(), ref.parameters()):
        if pb.grad is None:
            continue
        ga, gb = pa.grad.float(), pb.grad.float()
        err = (ga - gb).norm() / gb.norm().clamp(min=1e-12)
        assert err < 6e-2, (name, err.item())


@pytest.mark.parametrize("kind", ["llama-d64", "qwen2"])
def test_greedy_generate_of_32_tokens_from_a_left_padded_batch(kind):
    ours = _model(kind, "fastattn", torch.bfloat16)
    ref = _model(kind, "sdpa", torch.bfloat16)
    ref.load_state_dict(ours.state_dict())
    ids, mask = _batch([20, 9, 31, 14], 31)
    kw = dict(max_new_tokens=32, do_sample=False, pad_token_id=0)
    a = ours.generate(ids, attention_mask=mask, **kw)
    b = ref.generate(ids, attention_mask=mask, **kw)
    assert torch.equal(a, b), (a - b).ne(0).nonzero()[:8].tolist()
