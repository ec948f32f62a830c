"""fastattn.flash without a GPU: flash_attn_varlen_func's block_table and seqused_k, and
flash_attn_with_kvcache's rotary embedding and cache_leftpad: argument errors naming the
argument, which path each call takes and what it hands fastattn.torch, the gathers, the
rotation against an independent formula (complex multiplication). Numerics against a
float64 reference are in test_flash_paged_gpu.py and test_flash_kvcache_gpu.py (and run
here through test_flash_model.py's model)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")

from fastattn import flash  # noqa: E402
from fastattn.errors import InvalidArgumentError, NotSupportedError  # noqa: E402
from fastattn.integrations.flash import _common, _interface, _rotary  # noqa: E402

from helpers.torch import rotary_reference  # noqa: E402
from test_flash import _recorded  # noqa: E402  (the keywords a call hands a fastattn.torch entry point)

I32 = dict(dtype=torch.int32)


def paged_varlen(b=3, per_seq=4, page=8, hq=4, hk=2, d=16, lens_q=(3, 9, 5), lens_k=(20, 9, 1)):
    """CPU inputs: packed q, a shuffled pool of b * per_seq + 2 pages, cumulative lengths."""
    torch.manual_seed(0)
    pool = b * per_seq + 2
    q = torch.randn(sum(lens_q), hq, d)
    k, v = torch.randn(pool, page, hk, d), torch.randn(pool, page, hk, d)
    table = torch.randperm(pool)[:b * per_seq].to(torch.int32).reshape(b, per_seq)
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], **I32) for n in (lens_q, lens_k))
    return q, k, v, cu_q, cu_k, table


# -- paged varlen and seqused_k -----------------------------------------------------------------

def test_block_table_without_gradients_runs_cudnns_paged_plan_on_the_unpacked_queries(monkeypatch):
    q, k, v, cu_q, cu_k, table = paged_varlen()
    kw = _recorded(monkeypatch, "attention_paged", flash.flash_attn_varlen_func, q, k, v, cu_q, cu_k, 9, 20,
                   causal=True, block_table=table)
    assert kw["q"].shape == (3, 16, 4, 16)  # (batch, max_seqlen_q rounded up to a power of two, ...)
    assert torch.equal(kw["q"][1, :9], q[3:12]) and torch.all(kw["q"][0, 3:] == 0)
    assert kw["k"] is k and kw["v"] is v and kw["args"][0] is table
    assert kw["args"][1].tolist() == [20, 9, 1] and kw["seq_lens_q"].tolist() == [3, 9, 5]
    assert kw["alignment"] == "bottom_right" and kw["causal"] is True
    used = torch.tensor([11, 2, 0], **I32)  # seqused_k: each sequence's length instead
    kw = _recorded(monkeypatch, "attention_paged", flash.flash_attn_varlen_func, q, k, v, cu_q, cu_k, 9, 20,
                   block_table=table, seqused_k=used)
    assert kw["args"][1].tolist() == [11, 2, 0]


def test_paged_rows_that_see_no_key_are_zero_and_the_output_is_packed_back(monkeypatch):
    q, k, v, cu_q, cu_k, table = paged_varlen()
    monkeypatch.setattr(_common, "attention_paged", lambda q, *a, **kw: torch.ones(*q.shape[:3], v.shape[-1]))
    used = torch.tensor([20, 0, 1], **I32)  # the second sequence has no key; the third one for 5 queries
    out = flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 20, causal=True, block_table=table, seqused_k=used)
    assert out.shape == q.shape
    rows = out[:, 0, 0].tolist()
    assert rows == [1.0] * 3 + [0.0] * 9 + [0.0] * 4 + [1.0]  # causal at the bottom right: the last query only
    out = flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 20, block_table=table, seqused_k=used)
    assert out[:, 0, 0].tolist() == [1.0] * 3 + [0.0] * 9 + [1.0] * 5  # no mask: only the keyless sequence


@pytest.mark.parametrize("extra", [dict(return_attn_probs=True), dict(grad=True), dict(dropout_p=0.1),
                                   dict(alibi_slopes=torch.full((4,), 0.25)), dict(d=12)],
                         ids=("lse", "grad", "dropout", "alibi", "d12"))
def test_what_the_paged_plan_has_not_gathers_the_pages_into_packed_keys(monkeypatch, extra):
    extra = dict(extra)
    d = extra.pop("d", 16)
    q, k, v, cu_q, cu_k, table = paged_varlen(d=d)
    if extra.pop("grad", False):
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    name = "attention" if "alibi_slopes" in extra else "attention_varlen"  # ALiBi: varlen's padded dense call
    kw = _recorded(monkeypatch, name, flash.flash_attn_varlen_func, q, k, v, cu_q, cu_k, 9, 20, block_table=table,
                   **extra)
    if name == "attention_varlen":
        assert kw["k"].shape == (3 * 4 * 8, 2, -(-d // 8) * 8)  # batch * pages per sequence * page size tokens
        assert kw["args"][1].tolist() == [0, 20, 29, 30] and kw["alignment"] == "top_left"  # (no mask asked)
    else:
        assert kw["k"].shape == (3, 32, 2, 16) and kw["seq_lens_kv"].tolist() == [20, 9, 1]


def test_seqused_k_without_block_table_gathers_each_sequences_prefix(monkeypatch):
    q = torch.randn(17, 4, 16)
    k, v = torch.randn(30, 2, 16), torch.randn(30, 2, 16)
    cu_q, cu_k = torch.tensor([0, 3, 12, 17], **I32), torch.tensor([0, 20, 29, 30], **I32)
    used = torch.tensor([4, 9, 0], **I32)
    kw = _recorded(monkeypatch, "attention_varlen", flash.flash_attn_varlen_func, q, k, v, cu_q, cu_k, 9, 20,
                   causal=True, seqused_k=used)
    assert kw["args"][1].tolist() == [0, 4, 13, 13] and kw["alignment"] == "bottom_right"
    assert torch.equal(kw["k"][:4], k[:4]) and torch.equal(kw["k"][4:13], k[20:29]) and torch.all(kw["k"][13:] == 0)


def test_gather_keys_follows_the_block_table_and_its_gradient_reaches_only_used_pages():
    q, k, v, cu_q, cu_k, table = paged_varlen()
    k.requires_grad_()
    lens = torch.tensor([20, 9, 1], **I32)
    gk, gv, cu = _interface.gather_keys(k, v, cu_k, table, lens)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 20, 29, 30] and gk.shape == (96, 2, 16)
    for n, (a, m) in enumerate(zip(cu.tolist(), lens.tolist())):
        expected = k[table[n].long()].reshape(-1, 2, 16)[:m]
        assert torch.equal(gk[a:a + m], expected) and torch.equal(gv[a:a + m], v[table[n].long()].reshape(-1, 2, 16)[:m])
    assert torch.all(gk[30:] == 0) and torch.all(gv[30:] == 0)
    (grad,) = torch.autograd.grad(gk, (k,), torch.ones_like(gk))  # every gathered token: 1 where it came from
    used = torch.zeros(k.shape[:2], dtype=torch.bool)
    for n, m in enumerate(lens.tolist()):
        for j in range(m):
            used[table[n, j // 8], j % 8] = True
    assert torch.all(grad[used] == 1) and torch.all(grad[~used] == 0)  # (the tokens past the lengths: none)


@pytest.mark.parametrize("call,match", [
    (lambda q, k, v, cu_q, cu_k, t: flash.flash_attn_varlen_func(q, k[0], v[0], cu_q, cu_k, 9, 20, block_table=t),
     r"^k: expected a torch.Tensor \(num_blocks, page_block_size, nheads_k, headdim\) with block_table, got \(8, 2"),
    (lambda q, k, v, cu_q, cu_k, t: flash.flash_attn_varlen_func(q, k, v[:, :4], cu_q, cu_k, 9, 20, block_table=t),
     r"^k \(14, 8, 2, 16\) and v \(14, 4, 2, 16\) differ in blocks, block size or heads"),
    (lambda q, k, v, cu_q, cu_k, t: flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 20, block_table=t.long()),
     r"^block_table: expected an int32 tensor of shape \(3, 4\) \(batch, max_num_blocks_per_seq\), got torch.int64"),
    (lambda q, k, v, cu_q, cu_k, t: flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 20, block_table=t[:2]),
     r"^block_table: expected an int32 tensor of shape \(3, 4\) .* got torch.int32 \(2, 4\)"),
    (lambda q, k, v, cu_q, cu_k, t: flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 20, block_table=t[0]),
     r"^block_table: expected an int32 tensor \(3, max_num_blocks_per_seq\), got torch.int32 \(4,\)"),
    (lambda q, k, v, cu_q, cu_k, t: flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k[:3], 9, 20, block_table=t),
     r"^cu_seqlens_k: expected an int32 tensor of shape \(4,\) .* got torch.int32 \(3,\)"),
    (lambda q, k, v, cu_q, cu_k, t: flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 20, block_table=t,
                                                                 seqused_k=torch.zeros(3)),
     r"^seqused_k: expected an int32 tensor of shape \(3,\) \(each sequence's number of keys used\), got "
     r"torch.float32"),
    (lambda q, k, v, cu_q, cu_k, t: flash.flash_attn_varlen_func(q, k[0], v[0], cu_q, cu_k, 9, 20,
                                                                 seqused_k=torch.zeros(2, **I32)),
     r"^seqused_k: expected an int32 tensor of shape \(3,\) .* got torch.int32 \(2,\)"),
    (lambda q, k, v, cu_q, cu_k, t: flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9.0, 20, block_table=t),
     r"^max_seqlen_q=9.0: must be an int"),
])
def test_paged_varlen_arguments_are_named(call, match):
    with pytest.raises(InvalidArgumentError, match=match):
        call(*paged_varlen())


# -- rotary ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("interleaved", (True, False))
@pytest.mark.parametrize("r", (4, 8))
@pytest.mark.parametrize("per_row", (True, False))
def test_rotate_is_flash_attentions_rotary_embedding(interleaved, r, per_row):
    torch.manual_seed(1)
    x = torch.randn(3, 5, 2, 8).double()  # (float32's values: the rows left unrotated come back exactly)
    angle = torch.rand(12, r // 2, dtype=torch.float64) * 6.3
    cos, sin = angle.cos(), angle.sin()
    start = torch.tensor([0, 4, 10], **I32)  # the last runs past the table: rows there are not rotated
    got = _rotary.rotate(x, cos, sin, start, per_row, interleaved)
    positions = start[:, None] + (torch.arange(5)[None, :] if per_row else torch.zeros(1, 5, dtype=torch.int64))
    expected = rotary_reference(x, cos, sin, positions, interleaved)
    # float32 arithmetic (FlashAttention's), then x's float64
    assert got.dtype == x.dtype and torch.allclose(got, expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[..., r:], x[..., r:])
    if per_row:
        assert torch.equal(got[2, 2:], x[2, 2:])  # positions 12 .. 14: past the table's 12
    other = _rotary.rotate(x, cos, sin, start, per_row, not interleaved)
    assert not torch.allclose(other, expected, atol=1e-3)  # the pairing matters


def kvcache_inputs(b=2, sq=2, new=2, s=16, hq=4, hk=2, d=16, batch_cache=None):
    torch.manual_seed(2)
    q = torch.randn(b, sq, hq, d)
    k_cache, v_cache = (torch.randn(batch_cache or b, s, hk, d) for _ in range(2))
    k, v = (torch.randn(b, new, hk, d) for _ in range(2)) if new else (None, None)
    angle = torch.rand(s, 4) * 6.3
    return q, k_cache, v_cache, k, v, angle.cos(), angle.sin()


@pytest.mark.parametrize("causal,window,per_row", [(False, (-1, -1), False), (True, (-1, -1), True),
                                                   (False, (3, 2), True), (False, (100, 100), False)])
def test_kvcache_rotates_q_and_the_appended_keys_at_flash_attentions_positions(monkeypatch, causal, window, per_row):
    # q's rows at cache_seqlens + i with causal or a window (one that the cache's length
    # does not make unbounded), else all at cache_seqlens; the new keys at cache_seqlens + i,
    # written rotated into the cache; v as it is.
    q, k_cache, v_cache, k, v, cos, sin = kvcache_inputs()
    before = k_cache.clone()
    lens = torch.tensor([3, 9], **I32)
    kw = _recorded(monkeypatch, "attention", flash.flash_attn_with_kvcache, q, k_cache, v_cache, k, v, cos, sin, lens,
                   causal=causal, window_size=window, rotary_interleaved=False)
    rows = torch.arange(2)[None, :] if per_row else torch.zeros(1, 2, dtype=torch.int64)
    assert torch.allclose(kw["q"].double(), rotary_reference(q, cos, sin, lens[:, None] + rows, False), atol=1e-5)
    k_rot = rotary_reference(k, cos, sin, lens[:, None] + torch.arange(2)[None, :], False)
    for n, m in enumerate(lens.tolist()):
        assert torch.allclose(k_cache[n, m:m + 2].double(), k_rot[n], atol=1e-5)
        assert torch.equal(v_cache[n, m:m + 2], v[n]) and torch.equal(k_cache[n, :m], before[n, :m])
    assert kw["seq_lens_kv"].tolist() == [5, 11]


def test_kvcache_leftpad_shifts_each_sequence_to_start_at_its_pad(monkeypatch):
    q, k_cache, v_cache, k, v, cos, sin = kvcache_inputs(batch_cache=4)
    rows, pad, lens = torch.tensor([3, 1], **I32), torch.tensor([2, 0], **I32), torch.tensor([5, 9], **I32)
    kw = _recorded(monkeypatch, "attention", flash.flash_attn_with_kvcache, q, k_cache, v_cache, k, v, cos, sin, lens,
                   rows, pad, causal=True)
    assert kw["seq_lens_kv"].tolist() == [5 + 2 - 2, 9 + 2]  # cache_seqlens + new - cache_leftpad
    assert kw["alignment"] == "bottom_right" and kw["k"].shape == (2, 16, 2, 16)
    assert torch.equal(kw["k"][0, :14], k_cache[3, 2:]) and torch.equal(kw["v"][1], v_cache[1])
    # The new keys were appended at cache_seqlens (where the sequence ends), rotated there.
    k_rot = rotary_reference(k, cos, sin, lens[:, None] + torch.arange(2)[None, :], True)
    assert torch.allclose(k_cache[3, 5:7].double(), k_rot[0], atol=1e-5)
    q_rot = rotary_reference(q, cos, sin, lens[:, None] + torch.arange(2)[None, :], True)
    assert torch.allclose(kw["q"].double(), q_rot, atol=1e-5)


def test_kvcache_paged_lse_gathers_the_pages_into_a_dense_cache(monkeypatch):
    q = torch.randn(2, 1, 4, 16)
    pool = torch.randn(8, 4, 2, 16)
    table = torch.tensor([[3, 1], [7, 6]], **I32)
    kw = _recorded(monkeypatch, "attention", flash.flash_attn_with_kvcache, q, pool, pool,
                   cache_seqlens=torch.tensor([5, 8], **I32), block_table=table, return_softmax_lse=True)
    assert kw["return_lse"] is True and torch.equal(kw["k"], pool[table.long()].flatten(1, 2))


@pytest.mark.parametrize("call,match,error", [
    (lambda q, kc, vc, k, v, cos, sin: flash.flash_attn_with_kvcache(q, kc, vc, k, v, cos, None, 3),
     r"^rotary_cos and rotary_sin: give both", InvalidArgumentError),
    (lambda q, kc, vc, k, v, cos, sin: flash.flash_attn_with_kvcache(q, kc, vc, None, None, cos, sin, 3),
     r"^rotary_cos, rotary_sin without k, v: ", InvalidArgumentError),
    (lambda q, kc, vc, k, v, cos, sin: flash.flash_attn_with_kvcache(q, kc, vc, k, v, cos, sin[:, :2], 3),
     r"^rotary_cos has shape \(16, 4\), rotary_sin \(16, 2\): expected one shape", InvalidArgumentError),
    (lambda q, kc, vc, k, v, cos, sin: flash.flash_attn_with_kvcache(q, kc, vc, k, v, cos[:8], sin[:8], 3),
     r"^rotary_cos has 8 positions: expected at least the cache's 16", InvalidArgumentError),
    (lambda q, kc, vc, k, v, cos, sin: flash.flash_attn_with_kvcache(q, kc, vc, k, v, cos.repeat(1, 3),
                                                                     sin.repeat(1, 3), 3),
     r"^rotary_cos has shape \(16, 12\): rotary_dim = 2 \* 12 must be in \[2, headdim = 16\]", InvalidArgumentError),
    (lambda q, kc, vc, k, v, cos, sin: flash.flash_attn_with_kvcache(q, kc, vc, k, v, cos.int(), sin, 3),
     r"^rotary_cos: expected a floating-point tensor \(seqlen_ro, rotary_dim / 2\), got torch.int32",
     InvalidArgumentError),
    (lambda q, kc, vc, k, v, cos, sin: flash.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=3,
                                                                     cache_leftpad=torch.zeros(2)),
     r"^cache_leftpad: expected an int32 tensor of shape \(2,\), got torch.float32 \(2,\)", InvalidArgumentError),
    (lambda q, kc, vc, k, v, cos, sin: flash.flash_attn_with_kvcache(q, kc.view(8, 4, 2, 16), vc.view(8, 4, 2, 16),
                                                                     cache_seqlens=3, cache_leftpad=torch.zeros(2, **I32),
                                                                     block_table=torch.zeros(2, 4, **I32)),
     r"^cache_leftpad with block_table: .*FlashAttention refuses this too", NotSupportedError),
])
def test_kvcache_rotary_and_leftpad_arguments_are_named(call, match, error):
    with pytest.raises(error, match=match):
        call(*kvcache_inputs())


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scale", [None, 0.125])
@pytest.mark.parametrize("lengths", ["tensor", "int", "none"])
def test_a_plain_paged_decode_step_runs_what_the_full_body_runs(monkeypatch, causal, scale, lengths):
    # The decode step's fast path (_interface._paged_decode) hands fastattn.torch the same
    # tensors and options as the full body's attention_paged call (and so the same plan).
    from fastattn.torch import _paged as torch_paged

    seen = []
    record = lambda name: lambda *a: seen.append((name, a)) or a[0]  # noqa: E731
    monkeypatch.setattr(_common, "paged_run", record("fast"))
    monkeypatch.setattr(torch_paged, "run", record("full"))
    q = torch.randn(2, 1, 4, 16, dtype=torch.bfloat16)
    pool = torch.randn(6, 8, 2, 16, dtype=torch.bfloat16)
    table = torch.tensor([[0, 3], [5, 1]], **I32)
    lens = {"tensor": torch.tensor([9, 16], **I32), "int": 11, "none": None}[lengths]
    flash.flash_attn_with_kvcache(q, pool, pool, cache_seqlens=lens, block_table=table, softmax_scale=scale,
                                  causal=causal)
    flash.flash_attn_with_kvcache(q, pool, pool, cache_seqlens=lens, block_table=table, softmax_scale=scale,
                                  causal=causal, window_size=None)  # (not the default tuple: the full body)
    (fast, a), (full, b) = seen
    assert (fast, full) == ("fast", "full") and a[-1] == b[-1] and a[:3] == b[:3] and a[3] is b[3]
    assert a[5] is None and b[5] is None and torch.equal(a[4], b[4]) and a[4].dtype == torch.int32
