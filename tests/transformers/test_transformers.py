"""fastattn.integrations.transformers on the CPU: tiny random-weight models built from
configs (no downloads) with attn_implementation="fastattn" against the same weights with
transformers' own "sdpa" or "eager" path, float32, where fastattn.torch's entry points are
replaced by a float64 model of their documented semantics (bshd; causal masks and
windows at either corner, per-sequence lengths, a bias of cuDNN's shapes, sinks, softcap,
packed sequences) that also refuses what cuDNN refuses here (sinks with one query). What this checks: the mask function's forms (no padding, right padding
as lengths, left padding as a key bias, packed sequences, KV-cache decoding at the bottom
right, sliding windows, transformers' own mask otherwise), the arguments each layer
passes, the fallback, registration through the classes. What it cannot: cuDNN
(test_transformers_gpu.py)."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")
transformers = pytest.importorskip("transformers", reason="transformers is an optional extra")

from fastattn import NotSupportedError, bounded  # noqa: E402
from fastattn.integrations import transformers as fa_tf  # noqa: E402


def _keep(sq, skv, causal, bottom_right, window, lq=None, lk=None):
    i = torch.arange(sq)[:, None]
    j = torch.arange(skv)[None, :]
    lq = sq if lq is None else lq
    lk = skv if lk is None else lk
    shift = (lk - lq) if bottom_right else 0
    keep = (i < lq) & (j < lk)
    left, right = (-1, -1) if window is None else window
    if causal:
        right = 0
    if right >= 0:
        keep &= j <= i + shift + right
    if left >= 0:
        keep &= j >= i + shift - left
    return keep


def _core(q, k, v, keep, scale, bias, sinks, softcap):
    """bhsd float64 attention with fastattn's conventions: rows without keys are 0."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias.double()
    s = s.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double().reshape(1, -1, 1, 1).expand(*s.shape[:3], 1)], -1)
    p = torch.nan_to_num(s.softmax(-1), nan=0.0)
    if sinks is not None:
        p = p[..., :-1]
    return p @ v


class Calls(list):
    pass


def make_attention(calls):
    def attention(q, k, v, *, causal=False, causal_bottom_right=False, window=None, scale=None, layout="bshd",
                  deterministic=False, seq_lens_q=None, seq_lens_kv=None, alibi=False, bias=None, dropout_p=0.0,
                  sinks=None, alignment="top_left", return_lse=False, softcap=0.0):
        assert layout == "bshd" and not alibi and not return_lse and dropout_p == 0.0
        b, sq, hq, d = q.shape
        skv = k.shape[1]
        if bias is not None:
            assert bias.dtype == q.dtype and bias.is_contiguous() and bias.dim() == 4
            assert bias.shape[2] in (1, sq) and bias.shape[3] == skv
            if bias.shape[2] == 1 and sq > 1 and torch.is_grad_enabled() and q.requires_grad:
                raise AssertionError("a one-row bias broadcast over the queries with gradients")  # (as the core)
            if torch.is_grad_enabled() and q.requires_grad:
                # A row whose every key the bias masks has a log-sum-exp near finfo.min,
                # where cuDNN 9.19's SM90 backward gives NaN: the adapter must
                # not hand one to a backward. (Causal masks leave key 0 to every row.)
                low = torch.finfo(bias.dtype).min
                seen = bias > low / 2
                if causal and alignment == "top_left":
                    seen = seen & torch.ones(sq, skv, dtype=torch.bool).tril()
                if not seen.any(-1).all():
                    raise AssertionError("a row that sees no key in a backward (cuDNN 9.19's NaN)")
        if sinks is not None:
            assert sinks.dtype == torch.float32 and sinks.shape == (hq,)
            if sq == 1:
                raise NotSupportedError("sinks with one query")
        calls.append(dict(causal=causal, alignment=alignment, window=window, lens=seq_lens_q is not None,
                          bias=None if bias is None else tuple(bias.shape), sinks=sinks is not None, softcap=softcap,
                          sq=sq, skv=skv))
        out = torch.zeros(b, hq, sq, v.shape[-1], dtype=torch.float64)
        qb, kb, vb = (t.transpose(1, 2).double() for t in (q, k, v))
        for n in range(b):
            lq = None if seq_lens_q is None else int(seq_lens_q[n])
            lk = None if seq_lens_kv is None else int(seq_lens_kv[n])
            keep = _keep(sq, skv, causal, alignment == "bottom_right", window, lq, lk)
            out[n] = _core(qb[n:n + 1], kb[n:n + 1], vb[n:n + 1], keep, scale,
                           None if bias is None else bias[n if bias.shape[0] > 1 else 0], sinks, softcap)[0]
        return out.transpose(1, 2).to(q.dtype)

    def attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, causal=False, alignment="top_left", window=None,
                         scale=None, dropout_p=0.0, softcap=0.0, sinks=None):
        assert cu_q.dtype == torch.int32 and isinstance(max_q, int) and max_q >= int((cu_q[1:] - cu_q[:-1]).max())
        assert all(t.is_contiguous() for t in (q, k, v))  # as attention_varlen requires (gpt-oss's q is not, as given)
        if sinks is not None:  # (one query too: attention_varlen declares its plan for two)
            assert sinks.dtype == torch.float32 and sinks.shape == (q.shape[1],)
        calls.append(dict(varlen=True, n=cu_q.numel() - 1, causal=causal, window=window, sinks=sinks is not None,
                          sq=int((cu_q[1:] - cu_q[:-1]).max()), skv=int((cu_k[1:] - cu_k[:-1]).max())))
        out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
        for n in range(cu_q.numel() - 1):
            a, e = int(cu_q[n]), int(cu_q[n + 1])
            ak, ek = int(cu_k[n]), int(cu_k[n + 1])
            keep = _keep(e - a, ek - ak, causal, alignment == "bottom_right", window)
            qs, ks, vs = (t.transpose(0, 1)[None].double() for t in (q[a:e], k[ak:ek], v[ak:ek]))
            out[a:e] = _core(qs, ks, vs, keep, scale, None, sinks, softcap)[0].transpose(0, 1)
        return out.to(q.dtype)

    return attention, attention_varlen


@pytest.fixture
def calls(monkeypatch):
    c = Calls()
    attention, varlen = make_attention(c)
    monkeypatch.setattr(fa_tf, "attention", attention)
    monkeypatch.setattr(fa_tf, "attention_varlen", varlen)
    return c


def _model(kind, attn, **extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)
    kinds = {
        "llama": dict(model_type="llama", head_dim=16),
        "mistral": dict(model_type="mistral", head_dim=16, sliding_window=5),
        "qwen2": dict(model_type="qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=0,
                      layer_types=["sliding_attention", "sliding_attention"]),
        "gemma2": dict(model_type="gemma2", head_dim=16, sliding_window=4, attn_logit_softcapping=20.0,
                       final_logit_softcapping=None, query_pre_attn_scalar=16),
        "gpt_oss": dict(model_type="gpt_oss", head_dim=16, sliding_window=4, num_local_experts=2,
                        num_experts_per_tok=1, layer_types=["sliding_attention", "full_attention"]),
        # Gemma 3's text model: alternating sliding and full layers, a query scalar, no softcap
        "gemma3": dict(model_type="gemma3_text", head_dim=16, sliding_window=4, query_pre_attn_scalar=16,
                       layer_types=["sliding_attention", "full_attention"]),
    }
    cfg = AutoConfig.for_model(**{**common, **kinds[kind], **extra})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32).eval()
    return model


def _pair(kind, reference="sdpa"):
    ours = _model(kind, "fastattn")
    theirs = _model(kind, reference)
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def _batch(lengths, total, left=True, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 97, (len(lengths), total), generator=g)
    mask = torch.zeros(len(lengths), total, dtype=torch.long)
    for n, length in enumerate(lengths):
        if left:
            mask[n, total - length:] = 1
        else:
            mask[n, :length] = 1
    return ids, mask


def test_registered_through_the_classes_so_every_instance_and_model_sees_it():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert AttentionInterface()["fastattn"] is fa_tf.attention_forward
    assert AttentionMaskInterface()["fastattn"] is fa_tf.attention_mask
    assert "fastattn" in AttentionMaskInterface._global_mapping


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "gemma3"])
def test_prefill_without_padding_is_causal_at_the_top_left_with_the_window(calls, kind):
    ours, theirs = _pair(kind)
    ids = torch.randint(3, 97, (2, 11))
    torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, atol=1e-4, rtol=1e-4)
    assert all(c["causal"] and c["alignment"] == "top_left" and not c["lens"] and c["bias"] is None for c in calls)
    windows = {"llama": [None], "mistral": [(4, 0)], "qwen2": [(3, 0)], "gemma3": [(3, 0), None]}[kind]
    assert [c["window"] for c in calls[:len(windows)]] == windows and all(c["window"] in windows for c in calls)


@pytest.mark.parametrize("left", [True, False])
def test_padded_batches_left_as_a_key_bias_right_as_lengths(calls, left):
    ours, theirs = _pair("llama")
    ids, mask = _batch([9, 4, 7], 9, left=left)
    with torch.no_grad():  # (with gradients a key bias is expanded over the queries: the training test)
        a, b = ours(ids, attention_mask=mask).logits, theirs(ids, attention_mask=mask).logits
    kept = mask.bool()
    torch.testing.assert_close(a[kept], b[kept], atol=1e-4, rtol=1e-4)
    if left:
        assert all(c["bias"] == (3, 1, 1, 9) and not c["lens"] for c in calls), calls
    else:
        assert all(c["lens"] and c["bias"] is None for c in calls)


@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma3"])
def test_greedy_generate_from_a_left_padded_batch_token_for_token(calls, kind):
    ours, theirs = _pair(kind)
    ids, mask = _batch([6, 3, 8, 5], 8)
    kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    a = ours.generate(ids, attention_mask=mask, **kw)
    b = theirs.generate(ids, attention_mask=mask, **kw)
    assert torch.equal(a, b)
    decode = [c for c in calls if c["sq"] == 1]
    # (a key bias while padding is among the keys; a sliding window's cache can leave it behind)
    assert decode and all(c["alignment"] == "bottom_right" for c in decode)
    assert any(c["bias"] is not None for c in decode)


def test_a_cache_without_padding_decodes_at_the_bottom_right_without_a_mask(calls):
    ours, theirs = _pair("mistral")
    ids = torch.randint(3, 97, (2, 7))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, **kw), theirs.generate(ids, **kw))
    decode = [c for c in calls if c["sq"] == 1]
    assert decode and all(c["alignment"] == "bottom_right" and c["bias"] is None and c["window"] == (4, 0)
                          for c in decode)


def test_softcap_runs_on_fastattn_also_beside_a_bias(calls):
    # (cuDNN takes its score modifier beside a bias: the H200 ran Gemma 2's left-padded
    # generate with no fallback call: docs/BENCHMARKS.md, "left-padded generate".)
    ours, theirs = _pair("gemma2", reference="eager")
    ids = torch.randint(3, 97, (2, 9))
    torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, atol=1e-4, rtol=1e-4)
    assert calls and all(c["softcap"] == 20.0 for c in calls)
    calls.clear()
    ids, mask = _batch([9, 5], 9)
    a, b = ours(ids, attention_mask=mask).logits, theirs(ids, attention_mask=mask).logits
    torch.testing.assert_close(a[mask.bool()], b[mask.bool()], atol=1e-4, rtol=1e-4)
    assert calls and all(c["softcap"] == 20.0 and c["bias"] is not None for c in calls)


def test_a_refused_call_falls_back_exactly_counted_by_reason_and_logged_once(calls, caplog, monkeypatch):
    import fastattn
    from fastattn import runtime

    # cuDNN's refusal of every call with a bias, in the stand-in: what a refused call does
    # is the same whatever the reason.
    stand_in = fa_tf.attention

    def refusing(q, k, v, *, bias=None, **kw):
        if bias is not None:
            raise NotSupportedError("a reason cuDNN gives\nits second line")
        return stand_in(q, k, v, **kw)

    monkeypatch.setattr(fa_tf, "attention", refusing)
    monkeypatch.setattr(runtime, "_fallbacks", {})
    monkeypatch.setattr(runtime, "_warned", bounded.Table("warnings"))
    ours, theirs = _pair("gemma2", reference="eager")
    ids, mask = _batch([9, 5], 9)
    with caplog.at_level("WARNING", logger="fastattn"):
        for _ in range(3):
            a = ours(ids, attention_mask=mask).logits
    b = theirs(ids, attention_mask=mask).logits
    torch.testing.assert_close(a[mask.bool()], b[mask.bool()], atol=1e-4, rtol=1e-4)  # the exact fallback
    assert fastattn.stats()["fallbacks"]["transformers"] == {"a reason cuDNN gives": 3 * ours.config.num_hidden_layers}
    logged = [r for r in caplog.records if "outside fastattn's kernels" in r.getMessage()]
    assert len(logged) == 1 and "a reason cuDNN gives" in logged[0].getMessage()
    ours(ids)  # no padding: no bias, no refusal, nothing counted
    assert fastattn.stats()["fallbacks"]["transformers"] == {"a reason cuDNN gives": 3 * ours.config.num_hidden_layers}


def test_sinks_in_prefill_and_in_decode_steps_of_one_query(calls):
    ours, theirs = _pair("gpt_oss", reference="eager")
    ids = torch.randint(3, 97, (2, 9))
    torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, atol=1e-4, rtol=1e-4)
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, **kw), theirs.generate(ids, **kw))
    decode = [c for c in calls if c["skv"] > c["sq"]]
    assert decode and all(c["sinks"] and c["sq"] == 2 for c in decode)  # two copies of the one query


@pytest.mark.parametrize("kind,how", [(k, "position_ids") for k in ("llama", "mistral", "qwen2", "gemma2", "gemma3")]
                         + [(k, "flash_kwargs") for k in ("llama", "gemma2", "gpt_oss")])
def test_packed_sequences_run_as_varlen_each_on_its_own(calls, kind, how):
    # One row of packed sequences, as transformers recognizes them from restarting position
    # ids (its mask functions, without a cache; gpt-oss 5.17 builds its masks without the
    # position ids, so not there), or as DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    # hands them on (cu_seq_lens_*, max_length_*): each sequence as it would attend alone.
    # gpt-oss's q is head-major: its packed view was not contiguous until the adapter made it so.
    ours, theirs = _pair(kind, reference="eager" if kind in ("gemma2", "gpt_oss") else "sdpa")
    parts = [torch.randint(3, 97, (1, n)) for n in (5, 3, 6)]
    packed = torch.cat(parts, 1)
    position_ids = torch.cat([torch.arange(p.shape[1]) for p in parts])[None]
    cu = torch.tensor([0, 5, 8, 14], dtype=torch.int32)
    flash = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=6, max_length_k=6) if how == "flash_kwargs" else {}
    with torch.no_grad():
        got = ours(packed, position_ids=position_ids, use_cache=False, **flash).logits
        want = torch.cat([theirs(p).logits for p in parts], 1)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert calls and all(c.get("varlen") and c["n"] == 3 for c in calls)


def test_a_training_step_has_sdpas_loss_and_gradients(calls):
    ours, theirs = _pair("llama")
    ours.train()
    theirs.train()
    ids, mask = _batch([8, 6], 8)
    labels = ids.masked_fill(mask == 0, -100)
    la = ours(ids, attention_mask=mask, labels=labels).loss
    lb = theirs(ids, attention_mask=mask, labels=labels).loss
    torch.testing.assert_close(la, lb, atol=1e-5, rtol=1e-5)
    la.backward()
    lb.backward()
    for (name, pa), pb in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, atol=1e-4, rtol=1e-3, msg=name)
    assert all(c["bias"] == (2, 1, 8, 8) for c in calls)  # one row expanded over the queries for the backward


def _fallback_counts() -> dict:
    import fastattn

    return dict(fastattn.stats()["fallbacks"].get("transformers", {}))


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "gemma2", "gemma3", "gpt_oss"])
def test_continuous_batching_runs_paged_fastattn_with_paged_eagers_tokens(calls, monkeypatch, kind):
    # transformers' continuous batching (generate_batch: a paged KV cache, requests of
    # different lengths scheduled together) switches a "fastattn" model to "paged|fastattn".
    # On the CPU it sizes its cache from a GPU memory reading of 0 bytes: given 1 GiB here.
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching import cache as cb_cache

    monkeypatch.setattr(cb_cache.PagedAttentionMemoryHandler, "get_available_memory", lambda self: 1 << 30)
    ours, theirs = _pair(kind, "eager")
    gen = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=64)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (3, 9, 20, 33)]
    from transformers import AttentionInterface

    registered, masks = AttentionInterface._global_mapping["paged|fastattn"], []
    monkeypatch.setitem(AttentionInterface._global_mapping, "paged|fastattn",
                        lambda module, q, k, v, mask, *a, **kw: masks.append(mask) or registered(module, q, k, v, mask,
                                                                                                 *a, **kw))
    before = _fallback_counts()
    a = ours.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb, warmup=False)
    fallbacks = {r: n - before.get(r, 0) for r, n in _fallback_counts().items() if n != before.get(r, 0)}
    assert masks and all(m is None for m in masks)  # transformers builds no mask for this name
    b = theirs.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb, warmup=False)
    tokens = [a[r].generated_tokens for r in sorted(a)]
    assert all(len(t) == 6 for t in tokens) and tokens == [b[r].generated_tokens for r in sorted(b)]
    varlen = [c for c in calls if c.get("varlen")]
    assert fallbacks == {}
    assert all(c["sinks"] == (kind == "gpt_oss") for c in varlen)  # gpt-oss's sinks on attention_varlen
    # Several requests in one call (continuous batching's packing), and decode steps (one
    # query per request against its cache) among the calls.
    assert max(c["n"] for c in varlen) > 1 and all(c["causal"] for c in varlen)
    assert any(c["sq"] == 1 and c["skv"] > 1 for c in varlen)  # decode steps: one query against the cache
    windowed = {"mistral": (4, 0), "qwen2": (3, 0), "gemma2": (3, 0), "gemma3": (3, 0)}
    assert {c["window"] for c in varlen} >= ({windowed[kind]} if kind in windowed else {None})


def test_a_mask_function_it_does_not_know_takes_transformers_own_mask():
    from transformers import masking_utils as mu

    chunked = mu.chunked_causal_mask_function(3, torch.zeros(2, dtype=torch.long))
    form = fa_tf.attention_mask(2, 6, 6, mask_function=chunked)
    want = mu.sdpa_mask(batch_size=2, q_length=6, kv_length=6, mask_function=chunked, allow_is_causal_skip=False)
    assert form.full is not None and torch.equal(form.full, want)
    assert fa_tf._pattern(mu.sliding_window_causal_mask_function(7), fa_tf._codes()) == \
        {"causal": True, "window": 7, "packed": None}


@pytest.mark.parametrize("window", [None, 3])
def test_the_rows_that_see_no_key_are_found_in_every_form_of_one_query(window):
    # A decode step (one query at the bottom right) sees its last key; a query at the top
    # left sees the first only. The rows that see no key (zeroed after, as sdpa's) must be
    # found where the mask hides that key, and only counted where it can.
    from transformers import masking_utils as mu

    fn = mu.causal_mask_function if window is None else mu.sliding_window_causal_mask_function(window)
    left_padded = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]).bool()  # as transformers hands it
    form = fa_tf.attention_mask(2, 1, 6, q_offset=5, mask_function=fn, attention_mask=left_padded)
    assert form.bias is not None and form.empty is None  # every step of a left-padded generate
    # The last key hidden: the row sees no key where every key its window reaches is hidden.
    reached = [1, 1, 1, 0, 0, 0] if window == 3 else [0] * 6
    hidden = torch.tensor([reached, [1, 1, 1, 1, 1, 0]]).bool()
    form = fa_tf.attention_mask(2, 1, 6, q_offset=5, mask_function=fn, attention_mask=hidden)
    assert form.empty.tolist() == [[True], [False]]
    first_hidden = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]).bool()
    form = fa_tf.attention_mask(2, 1, 6, q_offset=0, kv_offset=0, mask_function=fn, attention_mask=first_hidden)
    assert not form.bottom_right and form.empty.tolist() == [[True], [False]]  # top left: sees key 0 alone


@st.composite
def _mask_calls(draw):
    """One mask function call as transformers makes it in prefill, a chunk of prefill over a
    cache, a decode step or a static cache's step, with any 2-D padding mask (left, right,
    holes, rows of none) or sequences packed by their position ids."""
    b, kv = draw(st.integers(1, 3)), draw(st.integers(1, 9))
    step = draw(st.sampled_from(["prefill", "chunk", "decode", "static"]))
    q = {"prefill": kv, "decode": 1, "chunk": draw(st.integers(1, kv)), "static": draw(st.integers(1, kv))}[step]
    # a static cache: the queries sit before the end of the keys (its unwritten tail)
    offset = draw(st.integers(0, kv - q)) if step == "static" else kv - q
    window = draw(st.sampled_from([None, None, 1, 2, 4]))
    pattern = draw(st.sampled_from(["none", "ones", "left", "right", "holes", "packed"]))
    packed = None
    if pattern == "packed":  # sequences packed into each row, from restarting position ids (prefill)
        q = kv
        rows = []
        for _ in range(b):
            cuts = sorted(draw(st.sets(st.integers(1, kv - 1), max_size=3))) if kv > 1 else []
            rows.append(torch.cat([torch.arange(e - a) for a, e in zip([0, *cuts], [*cuts, kv])]))
        packed = torch.stack(rows)
        pattern = "none"
    rows = []
    for _ in range(b):
        n = draw(st.integers(0, kv))
        if pattern == "left":
            rows.append([0] * (kv - n) + [1] * n)
        elif pattern == "right":
            rows.append([1] * n + [0] * (kv - n))
        elif pattern == "holes":
            rows.append(draw(st.lists(st.integers(0, 1), min_size=kv, max_size=kv)))
        else:
            rows.append([1] * kv)
    padding = None if pattern == "none" else torch.tensor(rows, dtype=torch.bool)  # (as transformers hands it)
    return dict(b=b, q=q, kv=kv, q_offset=offset if packed is None else 0, window=window, padding=padding,
                position_ids=packed,
                grad=draw(st.booleans()),
                softcap=draw(st.sampled_from([0.0, 0.0, 2.0])), sinks=draw(st.booleans()))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(c=_mask_calls())
# Hypothesis's find: one query with gradients beside a sequence of padding alone (its row
# kept every key's finfo.min bias into the backward, where cuDNN 9.19 gives NaN).
@example(c=dict(b=2, q=1, kv=2, q_offset=1, window=None, padding=torch.tensor([[False, False], [True, True]]),
                position_ids=None, grad=True, softcap=0.0, sinks=False))
# and: sinks (the exact fallback) with sequences packed into more than one row (an IndexError)
@example(c=dict(b=2, q=3, kv=3, q_offset=0, window=None, padding=None, position_ids=torch.tensor([[0, 1, 0], [0, 0, 1]]),
                grad=False, softcap=0.0, sinks=True))
# and: one row of packed sequences from head-major tensors, whose flattened (tokens, heads,
# dim) view is not contiguous (attention_varlen refused it)
@example(c=dict(b=1, q=5, kv=5, q_offset=0, window=None, padding=None, position_ids=torch.tensor([[0, 1, 2, 0, 1]]),
                grad=True, softcap=0.0, sinks=False))
def test_any_padding_and_step_attends_to_what_transformers_own_mask_keeps(calls, c):
    # The mask function's form, run by the attention function (the float64 model for
    # fastattn's kernels), against attention over transformers' own boolean mask (sdpa_mask)
    # in float64: equal on every row of a real token that keeps a key, zeros on every row
    # that keeps none. A padding token's row that keeps keys (right padding) is finite: no
    # output of a real token reads it; fastattn's lengths give it zeros, as transformers'
    # flash path does, where its sdpa path attends over the real keys.
    from types import SimpleNamespace

    from transformers import masking_utils as mu

    fn = mu.causal_mask_function if c["window"] is None else mu.sliding_window_causal_mask_function(c["window"])
    if c.get("position_ids") is not None:  # as transformers' create_causal_mask does for packed sequences
        found = mu.find_packed_sequence_indices(c["position_ids"])
        if found is not None:
            fn = mu.and_masks(fn, mu.packed_sequence_mask_function(found))
    b, sq, skv = c["b"], c["q"], c["kv"]
    form = fa_tf.attention_mask(b, sq, skv, q_offset=c["q_offset"], mask_function=fn, attention_mask=c["padding"])
    want = mu.sdpa_mask(batch_size=b, q_length=sq, kv_length=skv, q_offset=c["q_offset"], mask_function=fn,
                        attention_mask=c["padding"], allow_is_causal_skip=False)
    g = torch.Generator().manual_seed(sq * 100 + skv)
    q = torch.randn(b, 4, sq, 16, generator=g).requires_grad_(c["grad"])
    k, v = (torch.randn(b, 2, skv, 16, generator=g).requires_grad_(c["grad"]) for _ in range(2))
    event("form: " + ("packed" if form.cu_seqlens is not None else "transformers' mask" if form.full is not None
                      else "key bias" if form.bias is not None else "lengths" if form.seq_lens is not None
                      else "no mask"))
    sinks = torch.randn(4, generator=g) if c["sinks"] else None
    out, _ = fa_tf.attention_forward(SimpleNamespace(is_causal=True), q, k, v, form, scaling=0.25,
                                     softcap=c["softcap"], s_aux=sinks)
    keep = want.expand(b, 4, sq, skv)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = _core(*leaves, keep, 0.25, None, sinks, c["softcap"]).transpose(1, 2)
    seen = keep.any(-1).transpose(1, 2)  # (b, sq, heads)
    real = torch.ones(b, sq, 1, dtype=torch.bool) if c["padding"] is None else c["padding"][:, -sq:, None]
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double()[seen & real], ref[seen & real], atol=1e-5, rtol=1e-5)
    assert (out.double()[~seen] == 0).all()  # rows that keep no key: zeros
    if c["grad"]:  # a loss over the real tokens' rows: the same gradients
        weight = torch.randn(out.shape, generator=g, dtype=torch.float64) * (seen & real)[..., None]
        grads = torch.autograd.grad((out.double() * weight).sum(), (q, k, v))
        want_grads = torch.autograd.grad((ref * weight).sum(), leaves)
        for ours, theirs in zip(grads, want_grads):
            torch.testing.assert_close(ours.double(), theirs, atol=1e-5, rtol=1e-5)


class _PackedCache:
    """transformers' paged cache as paged_attention_forward meets it: update() returns every
    sequence's keys and values, packed (here the ones the test made)."""

    def __init__(self, k, v):
        self.k, self.v = k, v

    def update(self, key_states, value_states, layer_idx, read_index, write_index):
        return self.k, self.v


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lens=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 4)), min_size=1, max_size=4),
       window=st.sampled_from([None, None, 1, 3]), softcap=st.sampled_from([0.0, 3.0]), sinks=st.booleans())
def test_continuous_batchings_packed_steps_attend_as_each_sequence_would(calls, lens, window, softcap, sinks):
    # One continuous-batching step: each sequence's new queries (0 to 5, decode or a chunk of
    # prefill) are the last of its keys (cached ones before them); against float64
    # attention per sequence, causal at the bottom right, with the layer's window, softcap
    # and sinks.
    from types import SimpleNamespace

    q_lens = [a for a, _ in lens]
    k_lens = [a + cached for a, cached in lens]
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()])
    g = torch.Generator().manual_seed(sum(k_lens) * 7 + len(lens))
    q = torch.randn(1, 4, int(cu_q[-1]), 16, generator=g)
    k, v = (torch.randn(int(cu_k[-1]), 2, 16, generator=g) for _ in range(2))
    s_aux = torch.randn(4, generator=g) if sinks else None
    module = SimpleNamespace(layer_idx=0, sliding_window=window, scaling=0.25)
    out, _ = fa_tf.paged_attention_forward(module, q, torch.empty(0), torch.empty(0), None, _PackedCache(k, v),
                                           cu_q, cu_k, max(q_lens), max(k_lens), read_index=None, write_index=None,
                                           softcap=softcap, s_aux=s_aux)
    assert out.shape == (int(cu_q[-1]), 4, 16) and torch.isfinite(out).all()
    for n, (lq, lk) in enumerate(zip(q_lens, k_lens)):
        if lq == 0:
            continue
        keep = _keep(lq, lk, True, True, None if window is None else (window - 1, 0))
        qs = q[:, :, int(cu_q[n]):int(cu_q[n + 1])].double()
        ks, vs = (t[int(cu_k[n]):int(cu_k[n + 1])].transpose(0, 1)[None].double() for t in (k, v))
        ref = _core(qs, ks, vs, keep, 0.25, None, s_aux, softcap)[0].transpose(0, 1)
        torch.testing.assert_close(out[int(cu_q[n]):int(cu_q[n + 1])].double(), ref, atol=1e-5, rtol=1e-5)


def test_a_refusal_in_a_continuous_batching_capture_is_named_and_uncounted(calls, monkeypatch):
    # A step cuDNN refuses runs on the exact fallback, which reads the sequences' bounds on
    # the host: inside transformers' CUDA-graph capture that synchronization would break the
    # capture with CUDA's own error. The capture is simulated (there is none on the CPU);
    # outside one the same step runs on the fallback and is counted.
    from types import SimpleNamespace

    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    q = torch.randn(1, 4, 2, 16)
    k, v = torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    module = SimpleNamespace(layer_idx=0, sliding_window=None, scaling=0.25)
    step = dict(read_index=None, write_index=None, s_aux=torch.randn(4))
    def refused(*args, **kwargs):
        raise NotSupportedError("a reason cuDNN gives\nits details")

    monkeypatch.setattr(fa_tf, "attention_varlen", refused)
    before = _fallback_counts()
    monkeypatch.setattr(fa_tf, "_capturing", lambda t: True)
    with pytest.raises(NotSupportedError, match=r"inside a CUDA-graph capture: a reason cuDNN gives; .*"
                                                r"use_cuda_graph=False"):
        fa_tf.paged_attention_forward(module, q, k, v, None, _PackedCache(k, v), cu, cu, 1, 1, **step)
    assert _fallback_counts() == before
    monkeypatch.setattr(fa_tf, "_capturing", lambda t: False)
    out, _ = fa_tf.paged_attention_forward(module, q, k, v, None, _PackedCache(k, v), cu, cu, 1, 1, **step)
    assert out.shape == (2, 4, 16) and torch.isfinite(out).all()
    assert _fallback_counts().get("a reason cuDNN gives", 0) == before.get("a reason cuDNN gives", 0) + 1


# -- benchmarks/bench_transformers.py -----------------------------------------------------------

def test_the_benchmark_parses_its_arguments_and_refuses_to_run_without_cuda():
    from helpers import benchmarks

    r = benchmarks.run("bench_transformers", "--help")
    assert r.returncode == 0, r.stderr
    assert all(flag in r.stdout for flag in ("--json", "--quick", "--rounds", "--steady-rounds")) and "summary:" in r.stdout
    r = benchmarks.run("bench_transformers", "--quick", cuda=False)
    assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr and "Traceback" not in r.stderr
    bench = benchmarks.load("bench_transformers")
    args = bench.parse_args(["--quick", "--prompts", "128,512"])
    assert (args.rounds, args.steady_rounds, args.new_tokens, args.prompts) == (1, 2, 8, [128, 512])
    for bad in (["--prompts", "12,x"], ["--new-tokens", "1"], ["--kv-heads", "3"], ["--prompts", "5000"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_the_benchmarks_models_are_the_configs_it_names():
    from helpers import benchmarks

    bench = benchmarks.load("bench_transformers")
    for kind in ("llama", "qwen2"):
        cfg = bench.config(kind, 4)
        assert (cfg.model_type, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (
            kind, 4, 16, 4)
        assert cfg.eos_token_id < cfg.vocab_size  # min_new_tokens masks the EOS logit
    assert set(bench.config("qwen2", 4).layer_types) == {"full_attention"}  # sdpa's flash backend takes no mask


def test_the_benchmarks_medians_ratios_and_summary():
    from helpers import benchmarks

    bench = benchmarks.load("bench_transformers")
    runs = {"fastattn_warm": [{"seconds": 0.5}, {"seconds": 0.7}, {"error": "x"}],
            "sdpa_cudnn": [{"seconds": 1.0}, {"seconds": 1.4}, {"seconds": 2.0}],
            "sdpa_flash": [{"seconds": 0.5}, {"seconds": 0.7}, {"seconds": 0.6}]}
    m = bench.medians(runs, "seconds", "fastattn_warm", ("sdpa_cudnn", "sdpa_flash"))
    assert m["fastattn_warm"]["seconds"] == pytest.approx(0.6) and m["fastattn_warm"]["errors"] == 1
    assert m["ratio_fastattn_warm_to_sdpa_cudnn"] == pytest.approx(0.6 / 1.4)
    assert m["ratio_fastattn_warm_to_sdpa_flash_paired"] == 1.0
    cold = {"prompts": [256], "fastattn_cold": {"seconds": 2.0, "path": "native"}, **m}
    for name in bench.COLD_PEERS:
        cold[name].update(import_seconds=3.0, build_seconds=0.5)
    rows = {p: [{"prefill_ms": 3.0, "decode_ms_per_token": 4.0}] for p in bench.STEADY_PEERS}
    others = [p for p in bench.STEADY_PEERS if p != "fastattn"]
    calls = bench.calls_since({"served": 5, "head_dim_padded": 1, "passed_on": {"a": 1}},
                              {"served": 71, "head_dim_padded": 3, "mask_grad": 2,
                               "passed_on": {"a": 1, "dtype torch.float32: ...": 2}})
    assert calls == {"served": 66, "head_dim_padded": 2, "mask_grad": 2, "passed_on": {"dtype torch.float32: ...": 2}}
    steady = {"batch": 4, "prompt": 256, "new_tokens": 32, "errors": {}, "path": "native", "sdpa_mode_calls": calls,
              **{k: bench.medians(rows, k, "fastattn", others) for k in ("prefill_ms", "decode_ms_per_token")}}
    text = "\n".join(bench.summary({"coldstart": cold, "steady": steady}))
    assert "fastattn_warm / sdpa_cudnn: 0.43" in text and "claim < 1" in text
    assert "sdpa_mode's SDPA calls: served 66, passed on 2 {'dtype torch.float32: ...': 2}" in text
    assert "baseline: 3.41 vs 4.07" in text and "sdpa_mode 1.00 (1.00)" in text
    rows = {"fastattn": [{"tokens_per_s": 900.0}, {"tokens_per_s": 1100.0}], "sdpa": [{"tokens_per_s": 800.0}] * 2,
            "sdpa_mode": [{"tokens_per_s": 600.0}, {"tokens_per_s": 1000.0}]}
    kinds = {kind: {"errors": {}, "fallback_calls": 0, "fallback_reasons": {}, "sdpa_mode_calls": calls,
                    **bench.padded_medians(rows)} for kind in bench.MODELS}
    kinds["qwen2"].update(fallback_calls=3, fallback_reasons={"cuDNN's reason": 3})
    padded = {"lengths": bench.PADDED_LENGTHS, "new_tokens": 128, "path": "native", **kinds}
    text = "\n".join(bench.summary({"padded": padded}))
    assert ("llama: fastattn 1000, sdpa 800, sdpa_mode 800; fastattn / sdpa 1.25 (1.25), target >= 1; "
            "fallback calls 0") in text
    assert "sdpa_mode / sdpa 1.00 (1.00); the mode served 66, passed on 2" in text
    assert bench.padded_medians({"sdpa": rows["sdpa"]}) == {}  # no fastattn, no sdpa_mode: no ratio
    assert "fallback calls 3 (target 0) {\"cuDNN's reason\": 3}" in text
