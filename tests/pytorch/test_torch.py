"""fastattn.torch without a GPU: the import boundary, input errors, the fake (meta)
implementations and tracing. Numerics are in test_torch_gpu.py."""

import subprocess
import sys
import textwrap

import threading

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")

import fastattn  # noqa: E402
from fastattn.torch import attention  # noqa: E402


def test_import_fastattn_does_not_import_torch():
    r = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import sys, fastattn
        assert "torch" not in sys.modules
        import fastattn.torch
        assert "torch" in sys.modules
    """)], capture_output=True, text=True, cwd="/")
    assert r.returncode == 0, r.stderr


def qkv(device="meta", dtype=torch.bfloat16, b=2, s=128, h=8, hkv=None, d=64, dv=None, layout="bshd", grad=False):
    hkv, dv = hkv or h, dv or d
    shapes = {"bshd": lambda hh, dd: (b, s, hh, dd), "bhsd": lambda hh, dd: (b, hh, s, dd),
              "sbhd": lambda hh, dd: (s, b, hh, dd)}[layout]
    return tuple(torch.empty(shapes(hh, dd), device=device, dtype=dtype, requires_grad=grad)
                 for hh, dd in ((h, d), (hkv, d), (hkv, dv)))


@pytest.mark.parametrize("op", ["dense", "varlen", "paged", "fp8"])
def test_every_option_becomes_a_config_field(op):
    # config_fields is the one place an option becomes AttentionConfig fields: each option
    # of each op must land in one (an option added without its mapping fails here), and
    # the "off" values must make a valid config.
    import dataclasses

    from fastattn import AttentionConfig
    from fastattn.torch import _specs

    fields = {f.name for f in dataclasses.fields(AttentionConfig)}
    cls = _specs.named_tuple(op, "Options")
    values = {o.name: o.off for o in _specs.options_of(op)}
    values.update({"layout": "bshd", "max_q": 64, "max_kv": 64, "out_dtype": "bf16", "grad_dtype": "fp8_e4m3"})
    got = _specs.config_fields(cls(**{n: values[n] for n in cls._fields}))
    assert set(got) <= fields
    # Each option is read: changing it changes the fields (layout aside: the tensors' strides).
    for o in _specs.options_of(op):
        if o.name == "layout":
            continue
        other = {"bool": True, "int": 7, "float": 0.5, "str": "fp16"}[o.kind]
        base = dict(values, training=o.name != "training")  # (deterministic is read while training)
        changed = dict(base, **{o.name: other})
        a = _specs.config_fields(cls(**{n: base[n] for n in cls._fields}))
        b = _specs.config_fields(cls(**{n: changed[n] for n in cls._fields}))
        assert a != b, o.name
    dtype = "fp8_e4m3" if op == "fp8" else "bf16"
    AttentionConfig(batch=1, heads_q=2, seqlen_q=64, seqlen_kv=64, head_dim_qk=64, dtype=dtype,
                    **{k: v for k, v in got.items() if k not in ("seqlen_q", "seqlen_kv")})


def test_cpu_tensors_are_refused_with_a_clear_error():
    q, k, v = qkv(device="cpu")
    with pytest.raises(fastattn.InvalidArgumentError, match=r"^q is on cpu: fastattn runs on CUDA tensors"):
        attention(q, k, v)


@pytest.mark.parametrize("change,match", [
    (dict(dtype=torch.float32), "dtype torch.float32"),
    (dict(hkv=3), "heads: q has 8, k 3"),
])
def test_bad_inputs(change, match):
    with pytest.raises(fastattn.InvalidArgumentError, match=match):
        attention(*qkv(**change))


def test_mismatches():
    q, k, v = qkv()
    with pytest.raises(fastattn.InvalidArgumentError, match="different dtypes"):
        attention(q, k.to(torch.float16), v)
    with pytest.raises(fastattn.InvalidArgumentError, match="expected 4 dimensions"):
        attention(q[0], k, v)
    with pytest.raises(fastattn.InvalidArgumentError, match="batch sizes differ"):
        attention(q, k[:1], v[:1])
    with pytest.raises(fastattn.InvalidArgumentError, match="k has 128 keys but v has 64"):
        attention(q, k, v[:, :64])
    with pytest.raises(fastattn.InvalidArgumentError, match="^layout='bsh'"):
        attention(q, k, v, layout="bsh")
    with pytest.raises(fastattn.InvalidArgumentError, match="exclusive"):
        attention(q, k, v, causal=True, causal_bottom_right=True)
    with pytest.raises(fastattn.InvalidArgumentError, match="^scale=0"):
        attention(q, k, v, scale=0)


@pytest.mark.parametrize("layout", ["bshd", "bhsd", "sbhd"])
def test_fake_shapes(layout):
    q, k, v = qkv(layout=layout, h=8, hkv=2, d=128, dv=64)
    o = attention(q, k, v, causal=True, layout=layout)
    expected = list(q.shape)
    expected[3] = 64
    assert list(o.shape) == expected and o.dtype == q.dtype and o.device.type == "meta"


def test_traces_forward_and_backward_as_two_ops():
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(q, k, v):
        o = attention(q, k, v, causal=True)
        (g_q, g_k, g_v) = torch.autograd.grad(o.sum(), (q, k, v))
        return o, g_q, g_k, g_v

    q, k, v = qkv(grad=True, h=8, hkv=2)
    gm = make_fx(step, tracing_mode="fake")(q, k, v)
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert "fastattn.attention_forward.default" in targets
    assert "fastattn.attention_backward.default" in targets


def test_padding_lengths_are_checked():
    q, k, v = qkv()
    lengths = torch.empty(2, dtype=torch.int32, device="meta")
    with pytest.raises(fastattn.InvalidArgumentError, match=r"^seq_lens_q has dtype torch.int64"):
        attention(q, k, v, seq_lens_q=lengths.long())
    with pytest.raises(fastattn.InvalidArgumentError, match=r"^seq_lens_kv has shape \(3,\): expected \(2,\)"):
        attention(q, k, v, seq_lens_q=lengths, seq_lens_kv=torch.empty(3, dtype=torch.int32, device="meta"))
    with pytest.raises(fastattn.InvalidArgumentError, match="seq_lens_kv given without seq_lens_q"):
        attention(q, k, v, seq_lens_kv=lengths)
    with pytest.raises(fastattn.InvalidArgumentError, match="^seq_lens_q is on cpu"):
        attention(q, k, v, seq_lens_q=torch.zeros(2, dtype=torch.int32))
    assert attention(q, k, v, causal=True, seq_lens_q=lengths).shape == q.shape


def test_padding_traces_with_its_lengths():
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(q, k, v, lengths):
        o = attention(q, k, v, seq_lens_q=lengths)
        return o, torch.autograd.grad(o.sum(), (q, k, v))

    q, k, v = qkv(grad=True)
    gm = make_fx(step, tracing_mode="fake")(q, k, v, torch.empty(2, dtype=torch.int32, device="meta"))
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and "fastattn" in str(n.target)]
    assert [str(n.target) for n in calls] == ["fastattn.attention_forward.default",
                                              "fastattn.attention_backward.default"]
    lengths = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name.startswith("lengths"))
    assert all(lengths in n.all_input_nodes for n in calls)


def test_bias_sinks_and_dropout_are_checked():
    q, k, v = qkv()
    bias = torch.empty(1, 8, 128, 128, device="meta", dtype=torch.bfloat16)
    with pytest.raises(fastattn.InvalidArgumentError, match=r"^bias: expected a torch.bfloat16 tensor"):
        attention(q, k, v, bias=bias.half())
    with pytest.raises(fastattn.InvalidArgumentError, match=r"^bias has shape \(1, 3, 128, 128\)"):
        attention(q, k, v, bias=torch.empty(1, 3, 128, 128, device="meta", dtype=torch.bfloat16))
    with pytest.raises(fastattn.InvalidArgumentError, match=r"expected \(1 or 2, 1 or 8, 1 or 128, 128\)"):
        attention(q, k, v, bias=torch.empty(1, 8, 128, 64, device="meta", dtype=torch.bfloat16))
    with pytest.raises(fastattn.InvalidArgumentError, match="bias must be contiguous"):
        attention(q, k, v, bias=bias.transpose(2, 3))
    with pytest.raises(fastattn.InvalidArgumentError, match=r"^sinks: expected a torch.float32 tensor"):
        attention(q, k, v, sinks=torch.empty(8, device="meta", dtype=torch.bfloat16))
    with pytest.raises(fastattn.InvalidArgumentError, match=r"^sinks has shape \(4,\): expected \(8,\)"):
        attention(q, k, v, sinks=torch.empty(4, device="meta"))
    with pytest.raises(fastattn.InvalidArgumentError, match=r"^dropout_p=1.0: must be in \[0, 1\)"):
        attention(q, k, v, dropout_p=1.0)
    assert attention(q, k, v, bias=bias, sinks=torch.empty(8, device="meta"), dropout_p=0.1).shape == q.shape


def test_bias_sinks_and_dropout_trace_with_their_gradients():
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(q, k, v, bias, sinks):
        o = attention(q, k, v, causal=True, bias=bias, sinks=sinks, dropout_p=0.1)
        return o, torch.autograd.grad(o.sum(), (q, k, v, bias, sinks))

    q, k, v = qkv(grad=True)
    bias = torch.empty(2, 1, 128, 128, device="meta", dtype=torch.bfloat16, requires_grad=True)
    sinks = torch.empty(8, device="meta", requires_grad=True)
    gm = make_fx(step, tracing_mode="fake")(q, k, v, bias, sinks)
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and "fastattn" in str(n.target)]
    assert [str(n.target) for n in calls] == ["fastattn.attention_forward.default",
                                              "fastattn.attention_backward.default"]
    o, grads = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    shapes = [tuple(n.meta["val"].shape) for n in (o, *grads)]
    assert shapes == [(2, 128, 8, 64)] * 4 + [(2, 1, 128, 128), (8,)]  # o, d_q, d_k, d_v, d_bias, d_sink
    assert any("randint" in str(n.target) for n in gm.graph.nodes)  # dropout's seed and offset, traced


def varlen_inputs(lengths=(100, 37, 64), hq=8, hkv=2, d=64, grad=False):
    total = sum(lengths)
    q, k, v = (torch.empty(total, h, d, device="meta", dtype=torch.bfloat16, requires_grad=grad) for h in (hq, hkv, hkv))
    cu = torch.empty(len(lengths) + 1, device="meta", dtype=torch.int32)
    return q, k, v, cu


def test_varlen_checks_its_inputs():
    from fastattn.torch import attention_varlen

    q, k, v, cu = varlen_inputs()
    assert attention_varlen(q, k, v, cu, cu, 100, 100, causal=True).shape == (201, 8, 64)
    with pytest.raises(fastattn.InvalidArgumentError, match=r"^cu_seqlens_q: expected an int32 tensor"):
        attention_varlen(q, k, v, cu.long(), cu, 100, 100)
    with pytest.raises(fastattn.InvalidArgumentError, match="cu_seqlens_q has 4 entries, cu_seqlens_kv 3"):
        attention_varlen(q, k, v, cu, cu[:3], 100, 100)
    with pytest.raises(fastattn.InvalidArgumentError, match=r"^q has shape \(201, 512\)"):
        attention_varlen(q.flatten(1), k, v, cu, cu, 100, 100)
    with pytest.raises(fastattn.InvalidArgumentError, match="q must be contiguous"):
        attention_varlen(q.transpose(0, 1).contiguous().transpose(0, 1), k, v, cu, cu, 100, 100)
    with pytest.raises(fastattn.InvalidArgumentError, match=r"^max_seqlen_kv=0: must be an int >= 1"):
        attention_varlen(q, k, v, cu, cu, 100, 0)
    with pytest.raises(fastattn.InvalidArgumentError, match="shapes do not fit"):
        attention_varlen(q, k[:, :1].contiguous(), v, cu, cu, 100, 100)
    with pytest.raises(fastattn.InvalidArgumentError, match=r"^q is on cpu"):
        attention_varlen(torch.empty(201, 8, 64, dtype=torch.bfloat16), k, v, cu, cu, 100, 100)


def test_varlen_traces_forward_and_backward_and_buckets_its_lengths():
    from torch.fx.experimental.proxy_tensor import make_fx

    from fastattn.torch import attention_varlen
    from fastattn.torch._varlen import bucket

    assert [bucket(n) for n in (1, 2, 3, 64, 65, 4096)] == [1, 2, 4, 64, 128, 4096]

    def step(q, k, v, cu):
        o = attention_varlen(q, k, v, cu, cu, 100, 100, causal=True)
        return o, torch.autograd.grad(o.sum(), (q, k, v))

    q, k, v, cu = varlen_inputs(grad=True)
    gm = make_fx(step, tracing_mode="fake")(q, k, v, cu)
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and "fastattn" in str(n.target)]
    assert [str(n.target) for n in calls] == ["fastattn.varlen_forward.default", "fastattn.varlen_backward.default"]
    assert calls[0].args[7:9] == (128, 128)  # the plan's lengths: 100 rounded up (after q, k, v, cu_q, cu_kv, sink, rng)
    o, grads = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert [tuple(n.meta["val"].shape) for n in (o, *grads)] == [(201, 8, 64), (201, 8, 64), (201, 2, 64),
                                                                  (201, 2, 64)]


def test_varlen_sinks_are_checked_traced_with_their_gradient_and_never_in_a_plan_of_one_query():
    from torch.fx.experimental.proxy_tensor import make_fx

    from fastattn.torch import attention_varlen

    q, k, v, cu = varlen_inputs()
    for bad, says in ((torch.empty(8, device="meta", dtype=torch.float16), r"^sinks: expected a torch.float32"),
                      (torch.empty(2, device="meta"), r"^sinks has shape \(2,\): expected \(8,\)"),
                      (torch.empty(8, 2, device="meta")[:, 0], r"^sinks has shape \(8,\)"),
                      ("0.5", r"^sinks: expected a torch.float32 tensor on meta, got str")):
        with pytest.raises(fastattn.InvalidArgumentError, match=says):
            attention_varlen(q, k, v, cu, cu, 100, 100, causal=True, sinks=bad)

    def step(q, k, v, cu, sinks, max_q):
        o = attention_varlen(q, k, v, cu, cu, max_q, 100, causal=True, alignment="bottom_right", sinks=sinks)
        return o, torch.autograd.grad(o.sum(), (q, k, v, sinks)) if sinks.requires_grad else ()

    q, k, v, cu = varlen_inputs(grad=True)
    for grad, max_q, plan_q in ((True, 100, 128), (False, 1, 2), (False, 2, 2), (False, 3, 4)):
        sinks = torch.empty(8, device="meta", requires_grad=grad)
        with torch.set_grad_enabled(grad):
            gm = make_fx(lambda *t, n=max_q: step(*t, n), tracing_mode="fake")(q if grad else q.detach(), k, v, cu,
                                                                             sinks)
        calls = [n for n in gm.graph.nodes if n.op == "call_function" and "fastattn" in str(n.target)]
        assert [str(n.target) for n in calls] == ["fastattn.varlen_forward.default"] + (
            ["fastattn.varlen_backward.default"] if grad else [])
        assert calls[0].args[5] is not None and calls[0].args[7] == plan_q  # the sink, then the plan's max_q
        if grad:  # the sinks' gradient: float32, one per query head
            d_sinks = next(n for n in gm.graph.nodes if n.op == "output").args[0][1][3]
            assert d_sinks.meta["val"].shape == (8,) and d_sinks.meta["val"].dtype == torch.float32


def test_small_workspaces_are_kept_per_stream_and_never_while_capturing(monkeypatch):
    from fastattn.torch import _plans as fat

    capturing = [False]
    monkeypatch.setattr(fat, "capturing", lambda: capturing[0])
    monkeypatch.setattr(fat, "workspaces", {})
    q = torch.empty(4, dtype=torch.bfloat16)
    assert fat.workspace(q, 0, 0, 7) is None
    a = fat.workspace(q, 1000, 0, 7)
    assert a.dtype == torch.uint8 and a.numel() == 1000
    assert fat.workspace(q, 600, 0, 7) is a            # same stream: the same buffer
    assert fat.workspace(q, 600, 0, 8) is not a        # another stream, its own
    assert fat.workspace(q, 600, 1, 7) is not a        # another device, its own
    other = []
    worker = threading.Thread(target=lambda: other.append(fat.workspace(q, 600, 0, 7)))
    worker.start()
    worker.join()
    assert other[0] is not a                           # another thread on the stream, its own
    b = fat.workspace(q, 2000, 0, 7)                   # grows, and replaces the kept one
    assert b.numel() == 2000 and fat.workspace(q, 1000, 0, 7) is b
    big = fat.KEPT_WORKSPACE + 1
    assert fat.workspace(q, big, 0, 7).numel() == big and fat.workspaces[(0, 7, threading.get_ident())] is b  # per call, not kept
    capturing[0] = True                                 # a CUDA graph owns its own buffer
    c = fat.workspace(q, 1000, 0, 7)
    assert c is not b and c.numel() == 1000 and fat.workspaces[(0, 7, threading.get_ident())] is b
    capturing[0] = False
    for stream in range(100, 100 + 2 * fat.KEPT_STREAMS):  # many short-lived streams: the table stays bounded
        fat.workspace(q, 10, 0, stream)
        assert len(fat.workspaces) <= fat.KEPT_STREAMS


@pytest.mark.parametrize("layout", ("bshd", "bhsd", "sbhd"))
def test_empty_like_is_used_only_where_it_gives_the_plans_strides(layout):
    from fastattn.torch import _plans as fat

    q, k, v = qkv(layout=layout)
    assert fat.like(q, fat.out_shape(q, v, layout))      # contiguous: empty_like gives o
    assert all(fat.like(t, list(t.shape), t.stride()) for t in (q, k, v))
    q, k, v = qkv(layout=layout, dv=32)
    assert not fat.like(q, fat.out_shape(q, v, layout))  # o has v's head dim
    packed = torch.empty(2, 128, 3, 8, 64, device="meta", dtype=torch.bfloat16)
    q = packed[:, :, 0]  # a slice of packed qkv, not dense: empty_like makes it contiguous,
    assert fat.like(q, fat.out_shape(q, q, "bshd")) and not fat.like(q, list(q.shape), q.stride())  # o's, not d_q's
    t = torch.empty(2, 8, 128, 64, device="meta", dtype=torch.bfloat16).transpose(1, 2)  # dense, permuted
    assert fat.like(t, list(t.shape), t.stride()) and not fat.like(t, fat.out_shape(t, t, "bshd"))


def test_only_plain_eager_calls_skip_the_custom_ops():
    from fastattn.torch import _executor as fat
    from torch._subclasses.fake_tensor import FakeTensorMode

    q = torch.empty(2, 4, device="meta")
    assert not fat.plain_eager(q)  # not a CUDA tensor
    with FakeTensorMode():
        assert fat.dispatch_modes() > 0
    assert fat.dispatch_modes() == 0 and not fat.functorch_active()
    seen = []
    torch.func.grad(lambda x: (seen.append(fat.functorch_active()), x.sum())[1])(torch.ones(3))
    assert seen == [True]


def paged_inputs(device="meta", b=3, sq=1, hq=8, hkv=2, d=64, pages=12, page=16, per_seq=4):
    q = torch.empty(b, sq, hq, d, device=device, dtype=torch.bfloat16)
    k, v = (torch.empty(pages, page, hkv, d, device=device, dtype=torch.bfloat16) for _ in range(2))
    table = torch.zeros(b, per_seq, device=device, dtype=torch.int32)
    lens = torch.zeros(b, device=device, dtype=torch.int32)
    return q, k, v, table, lens


def test_paged_checks_its_inputs():
    from fastattn.torch import attention_paged

    q, k, v, table, lens = paged_inputs()
    assert attention_paged(q, k, v, table, lens, causal_bottom_right=True).shape == (3, 1, 8, 64)
    assert attention_paged(q, k, v[..., :32], table, lens).shape == (3, 1, 8, 32)  # v's head dim
    with pytest.raises(fastattn.InvalidArgumentError, match=r"^block_table: expected an int32 tensor"):
        attention_paged(q, k, v, table.long(), lens)
    with pytest.raises(fastattn.InvalidArgumentError, match=r"^block_table: .*got torch.int32 \(2, 4\)"):
        attention_paged(q, k, v, table[:2], lens)
    with pytest.raises(fastattn.InvalidArgumentError, match=r"^cache_seqlens: expected an int32 tensor of shape "
                                                            r"\(3,\)"):
        attention_paged(q, k, v, table, lens[:2])
    with pytest.raises(fastattn.InvalidArgumentError, match=r"^seq_lens_q: expected"):
        attention_paged(q, k, v, table, lens, seq_lens_q=lens.float())
    with pytest.raises(fastattn.InvalidArgumentError, match="differ in pages, page size or heads"):
        attention_paged(q, k, v[:, :8], table, lens)
    with pytest.raises(fastattn.InvalidArgumentError, match="heads_kv must divide heads_q"):
        attention_paged(q[:, :, :3], k, v, table, lens)
    with pytest.raises(fastattn.InvalidArgumentError, match="causal and causal_bottom_right are exclusive"):
        attention_paged(q, k, v, table, lens, causal=True, causal_bottom_right=True)
    with pytest.raises(fastattn.InvalidArgumentError, match=r"^q is on cpu"):
        attention_paged(*paged_inputs(device="cpu"))
    with pytest.raises(fastattn.InvalidArgumentError, match="forward only"):
        attention_paged(q.clone().requires_grad_(), k, v, table, lens)
    with torch.no_grad():  # no gradients wanted: fine
        assert attention_paged(q.clone().requires_grad_(), k, v, table, lens).shape == (3, 1, 8, 64)


def test_paged_traces_as_one_op():
    from torch.fx.experimental.proxy_tensor import make_fx

    from fastattn.torch import attention_paged

    def decode(q, k, v, table, lens):
        return attention_paged(q, k, v, table, lens, causal_bottom_right=True, window=(128, 0))

    gm = make_fx(decode, tracing_mode="fake")(*paged_inputs(sq=4))
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and "fastattn" in str(n.target)]
    assert [str(n.target) for n in calls] == ["fastattn.paged_forward.default"]
    assert calls[0].args[5:] == (None, True, True, 128, 0, 0.0)  # causal, at the bottom right
    assert tuple(calls[0].meta["val"].shape) == (3, 4, 8, 64)


def test_the_gpu_tests_thread_helper_collects_results_and_raises_errors():
    from helpers.torch import in_threads

    seen = set()
    assert in_threads(6, lambda i: seen.add(threading.get_ident()) or i * i) == {i: i * i for i in range(6)}
    assert len(seen) == 6  # each call on a thread of its own
    with pytest.raises(ZeroDivisionError):
        in_threads(3, lambda i: 1 // (i - 1))


@pytest.mark.parametrize("layout", ["bshd", "sbhd", "bhsd"])
def test_config_shape_reads_sizes_and_strides_in_the_layout(layout):
    from fastattn.torch._plans import AXES, config_shape

    b, sq, skv, hq, hkv, dqk, dv = 2, 5, 7, 6, 3, 8, 16
    order = {"bshd": lambda s, h, d: (b, s, h, d), "sbhd": lambda s, h, d: (s, b, h, d),
             "bhsd": lambda s, h, d: (b, h, s, d)}[layout]
    q, k, v = (torch.empty(order(s, h, d), device="meta") for s, h, d in ((sq, hq, dqk), (skv, hkv, dqk), (skv, hkv, dv)))
    got = config_shape(q, k, v, None, layout)
    assert {key: val for key, val in got.items() if key != "layout"} == dict(
        batch=b, heads_q=hq, heads_kv=hkv, seqlen_q=sq, seqlen_kv=skv, head_dim_qk=dqk, head_dim_v=dv)
    axes = AXES[layout]
    for name, t in (("q", q), ("k", k), ("v", v), ("o", torch.empty(order(sq, hq, dv), device="meta"))):
        assert got["layout"][name] == tuple(t.stride()[a] for a in axes), name
    o = torch.empty(order(sq, hq, dv), device="meta").transpose(0, 1)  # o given: its own strides
    assert config_shape(q, k, v, o, layout)["layout"]["o"] == tuple(o.stride()[a] for a in axes)


def test_a_miss_inside_a_capture_raises_before_any_cudnn_work(env, monkeypatch):
    # A plan load or build inside the caller's CUDA-graph capture would invalidate it:
    # remember() takes only a plan the process holds, else raises, and
    # builds nothing. fake_core's plans stand in for cuDNN's.
    from fastattn import runtime
    from fastattn.torch import _plans

    cfg = fastattn.AttentionConfig(batch=1, heads_q=2, seqlen_q=64, head_dim_qk=64)
    q = k = v = torch.empty(1, 64, 2, 64, device="meta", dtype=torch.bfloat16)
    monkeypatch.setattr(_plans, "capturing", lambda: True)
    builds = runtime.stats()["builds"]
    with pytest.raises(fastattn.InvalidArgumentError, match="being captured on the current stream"):
        _plans.remember(("capture test", 1), cfg, q, k, v, "bshd")
    assert runtime.stats()["builds"] == builds and runtime.planned(cfg) is None
    monkeypatch.setattr(_plans, "capturing", lambda: False)
    first = _plans.remember(("capture test", 2), cfg, q, k, v, "bshd")  # outside a capture: built
    monkeypatch.setattr(_plans, "capturing", lambda: True)
    assert _plans.remember(("capture test", 3), cfg, q, k, v, "bshd").plan is first.plan is runtime.planned(cfg)


def test_ulps_apart_counts_units_in_the_last_place_of_the_dtype():
    # The GPU tests' measure for kernels that are not bitwise repeatable (helpers.torch):
    # one bf16 ulp at 1.0 is 2^-7, at 0.0625 it is 2^-11; NaN is never within a bound.
    from helpers.torch import ulps_apart

    a = torch.tensor([1.0, 0.0625, -3.0, 0.0, 1.0, float("nan")], dtype=torch.bfloat16)
    b = torch.tensor([1.0 + 2**-7, 0.0625 + 2**-10, -3.0, 0.0, 1.0 + 2**-5, 1.0], dtype=torch.bfloat16)
    got = ulps_apart(a, b)
    assert got[:5].tolist() == [1.0, 2.0, 0.0, 0.0, 4.0] and got[5].isnan()
    assert not (ulps_apart(a, b) <= 1).all() and (ulps_apart(a[:4], a[:4]) <= 1).all()
