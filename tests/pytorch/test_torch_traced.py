"""Tracing sees what eager sees: under FakeTensorMode with CUDA fake
tensors (what torch.compile's and torch.export's tracing give the entry points), every
entry point of fastattn.torch and fastattn.flash refuses what an eager call refuses,
with the same exception and message, and accepts what it accepts, with the same output
shape. Eager here: meta and CPU tensors, which the Python body checks on every call (an
eager CUDA call checks the same tensors once per plan, in plan_for, on a miss)."""

from __future__ import annotations

import contextlib
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

import fastattn.torch  # noqa: E402
from fastattn import flash  # noqa: E402
from fastattn.errors import InvalidArgumentError, NotSupportedError  # noqa: E402
from fastattn.torch import _dense, _native, _paged, _specs, _varlen  # noqa: E402
from helpers.torch import take_python_path  # noqa: E402

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LAYOUTS = {"bshd": lambda b, s, h, d: (b, s, h, d), "bhsd": lambda b, s, h, d: (b, h, s, d),
           "sbhd": lambda b, s, h, d: (s, b, h, d)}


@pytest.fixture(autouse=True)
def python_path(monkeypatch):
    """The Python path (the native path's tracing is in test_torch_native.py)."""
    take_python_path(monkeypatch)


@st.composite
def tensor_specs(draw, n: int):
    """n tensors' (dtype, device, rank change): one fp16/bf16 dtype on the main device
    (CUDA, or meta for eager), or at times another dtype, the CPU, a dimension less or
    more."""
    common = draw(st.sampled_from(DTYPES[:2]))
    if draw(st.booleans()):
        return [(common, "main", 0)] * n
    odd = st.integers(0, 3).map(lambda i: i == 0)
    return [(draw(st.sampled_from(DTYPES)) if draw(odd) else common, "cpu" if draw(odd) else "main",
             draw(st.sampled_from((-1, 1))) if draw(odd) else 0) for _ in range(n)]


@st.composite
def calls(draw):
    """(what the call is, builder): builder(main device) makes the call's arguments
    and calls it, so that one draw runs on meta tensors and under FakeTensorMode alike."""
    entry = draw(st.sampled_from(("attention", "flash_attn_func", "attention_varlen", "flash_attn_varlen_func",
                                  "attention_paged", "flash_attn_with_kvcache")))
    specs = draw(tensor_specs(3))
    hq = draw(st.integers(1, 8))
    hkv = draw(st.sampled_from([h for h in range(1, hq + 1) if hq % h == 0])) if draw(st.integers(0, 3)) else (
        draw(st.integers(1, 8)))  # mostly dividing hq (GQA), at times not
    hv = hkv if draw(st.integers(0, 5)) else draw(st.integers(1, 8))
    d, dv = 16, draw(st.sampled_from((16, 32)))
    causal = draw(st.booleans())
    layout = draw(st.sampled_from(sorted(LAYOUTS))) if entry == "attention" else "bshd"
    alibi = draw(st.sampled_from((None, None, "paper's", "too many"))) if entry.startswith("flash_attn_") else None

    def tensor(shape, spec, main):
        dtype, where, rank = spec
        shape = shape[1:] if rank < 0 else (1, *shape) if rank > 0 else shape
        return torch.zeros(shape, dtype=dtype, device=main if where == "main" else "cpu")

    def build(main):
        slopes = None if alibi is None else torch.tensor(
            flash.standard_alibi_slopes(hq) if alibi == "paper's" else [0.5] * (hq + 1), device=main)

        def qkv(shapes):
            return [tensor(shape, spec, main) for shape, spec in zip(shapes, specs)]

        if entry in ("attention", "flash_attn_func"):
            shape = LAYOUTS[layout]
            q, k, v = qkv((shape(2, 8, hq, d), shape(2, 12, hkv, d), shape(2, 12, hv, dv)))
            if entry == "attention":
                return fastattn.torch.attention(q, k, v, causal=causal, layout=layout)
            return flash.flash_attn_func(q, k, v, causal=causal, alibi_slopes=slopes)
        if entry in ("attention_varlen", "flash_attn_varlen_func"):
            q, k, v = qkv(((20, hq, d), (24, hkv, d), (24, hv, dv)))
            cu_q = torch.tensor([0, 8, 20], dtype=torch.int32, device=main)
            cu_k = torch.tensor([0, 12, 24], dtype=torch.int32, device=main)
            if entry == "attention_varlen":
                return fastattn.torch.attention_varlen(q, k, v, cu_q, cu_k, 12, 12, causal=causal)
            return flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 12, 12, causal=causal, alibi_slopes=slopes)
        if entry == "attention_paged":
            q, k, v = qkv(((2, 4, hq, d), (6, 16, hkv, d), (6, 16, hv, dv)))
            table = torch.zeros(2, 3, dtype=torch.int32, device=main)
            lengths = torch.full((2,), 20, dtype=torch.int32, device=main)
            return fastattn.torch.attention_paged(q, k, v, table, lengths, causal_bottom_right=causal)
        q, k, v = qkv(((2, 4, hq, d), (2, 32, hkv, d), (2, 32, hv, dv)))
        return flash.flash_attn_with_kvcache(q, k, v, causal=causal, alibi_slopes=slopes)

    return f"{entry} {layout} causal={causal} alibi={alibi} heads {hq}/{hkv}/{hv} dv={dv} (dtype, device, rank): {specs}", build


def outcome(build, main: str, mode) -> tuple:
    """("ok", shape, dtype) or (exception class, message), the device's name in the
    message made neutral: the main device is meta in one run, cuda:0 in the other."""
    try:
        with mode:
            o = build(main)
        return "ok", tuple(o.shape), o.dtype
    except Exception as e:  # noqa: BLE001 - the class is what is compared
        return type(e), re.sub(r"\b(cuda:0|cuda|meta)\b", "DEVICE", str(e))


@SETTINGS
@given(calls())
def test_fake_cuda_tensors_meet_the_eager_checks(call):
    what, build = call
    eager = outcome(build, "meta", contextlib.nullcontext())
    traced = outcome(build, "cuda", FakeTensorMode(allow_non_fake_inputs=False))
    assert traced == eager, what
    assert eager[0] in ("ok", InvalidArgumentError, NotSupportedError), eager  # no raw IndexError, RuntimeError


def test_the_examples_of_the_issue():
    """fp32, 8 query heads against 3 KV heads, q and k on two GPUs, a 3-D q: each refused
    under FakeTensorMode as an eager call refuses it (its plan_for's checks)."""
    with FakeTensorMode(allow_non_fake_inputs=False):
        def qkv(dtype=torch.bfloat16, hkv=8, k_device="cuda:0", rank=4):
            q = torch.zeros((2, 16, 8, 64)[4 - rank:], dtype=dtype, device="cuda:0")
            return q, torch.zeros(2, 16, hkv, 64, dtype=dtype, device=k_device), torch.zeros(
                2, 16, hkv, 64, dtype=dtype, device="cuda:0")

        for entry in (fastattn.torch.attention, flash.flash_attn_func):
            with pytest.raises(InvalidArgumentError, match=r"^q has dtype torch.float32: expected torch.float16"):
                entry(*qkv(dtype=torch.float32))
            with pytest.raises(InvalidArgumentError, match=r"^heads: q has 8, k 3, v 3; k and v must match"):
                entry(*qkv(hkv=3))
            with pytest.raises(InvalidArgumentError, match=r"^q, k, v are on different devices: cuda:0, cuda:1, "
                                                           r"cuda:0$"):
                entry(*qkv(k_device="cuda:1"))
        with pytest.raises(InvalidArgumentError, match=r"^q has shape \(16, 8, 64\): expected 4 dimensions"):
            fastattn.torch.attention(*qkv(rank=3))
        # What eager's plan_for raises on a miss, for the same tensors: the same.
        q, k, v = qkv(k_device="cuda:1")
        options = _dense.DenseOptions("bshd", False, False, -1, -1, 0.0, False, False, False, 0.0, False)
        with pytest.raises(InvalidArgumentError, match=r"^q, k, v are on different devices: cuda:0, cuda:1"):
            _dense.plan_for(q, k, v, None, None, None, None, None, None, options)


def test_the_custom_ops_fake_implementations_check():
    """The ops themselves (what a traced graph holds) refuse what the entry points refuse."""
    with FakeTensorMode(allow_non_fake_inputs=False):
        q = torch.zeros(2, 16, 8, 64, dtype=torch.float32, device="cuda")
        options = _dense.DenseOptions("bshd", False, False, -1, -1, 0.0, False, False, False, 0.0, False)
        with pytest.raises(InvalidArgumentError, match=r"^q has dtype torch.float32"):
            _dense.forward_op(q, q, q, None, None, None, None, None, *options)
        q = torch.zeros(20, 8, 64, dtype=torch.bfloat16, device="cuda")
        k = torch.zeros(20, 3, 64, dtype=torch.bfloat16, device="cuda")
        cu = torch.tensor([0, 20], dtype=torch.int32, device="cuda")
        options = _varlen.VarlenOptions(32, 32, False, False, -1, -1, 0.0, False, False, False, 0.0)
        with pytest.raises(InvalidArgumentError, match=r"^shapes do not fit"):
            _varlen.forward_op(q, k, k, cu, cu, None, None, *options)
        q = torch.zeros(2, 1, 8, 64, dtype=torch.bfloat16, device="cuda")
        cache = torch.zeros(4, 16, 3, 64, dtype=torch.bfloat16, device="cuda")
        table = torch.zeros(2, 2, dtype=torch.int32, device="cuda")
        lengths = torch.zeros(2, dtype=torch.int32, device="cuda")
        with pytest.raises(InvalidArgumentError, match=r"heads_kv must divide heads_q"):
            _paged.forward_op(q, cache, cache, table, lengths, None, *_paged.PagedOptions(False, False, -1, -1, 0.0))


def _heads_8_against_3():
    """q (8 heads) and k, v (3) as CUDA fake tensors, for each entry point: its arguments."""
    with FakeTensorMode(allow_non_fake_inputs=False):
        q = torch.zeros(2, 4, 8, 64, dtype=torch.bfloat16, device="cuda")
        k = torch.zeros(2, 16, 3, 64, dtype=torch.bfloat16, device="cuda")
        table = torch.zeros(2, 1, dtype=torch.int32, device="cuda")
        lengths = torch.zeros(2, dtype=torch.int32, device="cuda")
    return {"attention": (lambda q, k: fastattn.torch.attention(q, k, k), (q, k)),
            "flash_attn_func": (lambda q, k: flash.flash_attn_func(q, k, k, causal=True), (q, k)),
            "attention_paged": (lambda q, k, t, n: fastattn.torch.attention_paged(q, k, k, t, n), (q, k, table, lengths))}


class _Call(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args) * 2


@pytest.mark.parametrize("entry", ["attention", "flash_attn_func", "attention_paged"])
def test_torch_export_reports_what_eager_reports(entry):
    """torch.export with CUDA fake inputs (what it traces from; no GPU needed): non-strict
    runs the Python with fake tensors and raises eager's error; strict traces it with
    dynamo, whose error carries it (and torch.compile without fullgraph runs the call
    eagerly there, which raises it)."""
    fn, args = _heads_8_against_3()[entry]
    message = r"(heads: q has 8, k 3, v 3|q \(2, 4, 8, 64\) does not fit k_cache)"
    with pytest.raises(InvalidArgumentError, match=message):
        torch.export.export(_Call(fn), args, strict=False)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"raised exception InvalidArgumentError\([\"']" + message):
        torch.export.export(_Call(fn), args, strict=True)


def _unchecked(name: str, schema: str, fake):
    """A stand-in for a native op: the op library's Meta kernels check nothing."""
    op = torch.library.custom_op(f"fastattn_tests::{name}", lambda *a: fake(*a), mutates_args=(), schema=schema)
    op.register_fake(fake)
    return op._opoverload, op._opoverload


_NATIVE = {}


def test_the_native_path_under_tracing_checks_before_its_op(monkeypatch):
    """With the native path decided, a trace records the op library's ops, whose Meta
    kernels check nothing: the entry points check before them."""
    if not _NATIVE:
        _NATIVE["dense"] = _unchecked("dense", _specs.forward_schema(_dense.SPEC), lambda q, k, v, *rest: (
            q.new_empty(q.shape), q.new_empty(0, dtype=torch.float32)))
        _NATIVE["paged"] = _unchecked("paged", _specs.forward_schema(_paged.SPEC), lambda q, *rest: q.new_empty(q.shape))
    monkeypatch.setattr(_native, "DENSE", _NATIVE["dense"])
    monkeypatch.setattr(_native, "PAGED", _NATIVE["paged"])
    calls = _heads_8_against_3()
    for entry in ("attention", "attention_paged"):
        fn, args = calls[entry]
        with pytest.raises(InvalidArgumentError, match=r"heads: q has 8, k 3, v 3|heads_kv must divide heads_q"):
            with FakeTensorMode(allow_non_fake_inputs=False):
                fn(*args)
        with pytest.raises(InvalidArgumentError):
            torch.export.export(_Call(fn), args, strict=False)
        torch._dynamo.reset()
        with pytest.raises(torch._dynamo.exc.Unsupported, match=r"InvalidArgumentError"):
            torch.export.export(_Call(fn), args, strict=True)
    # Inputs that pass are traced as the native op.
    with FakeTensorMode(allow_non_fake_inputs=False):
        q = torch.zeros(2, 4, 8, 64, dtype=torch.bfloat16, device="cuda")
        k = torch.zeros(2, 16, 2, 64, dtype=torch.bfloat16, device="cuda")
    torch._dynamo.reset()
    ep = torch.export.export(_Call(lambda q, k: fastattn.torch.attention(q, k, k)), (q, k), strict=True)
    assert "fastattn_tests.dense.default" in [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("change,match", [
    (dict(hkv=3), r"^heads: q has 8, k 3, v 3"),
    (dict(dtype=torch.bfloat16), r"^q has dtype torch.bfloat16: FP8 attention takes"),
    (dict(scale_device="cpu"), r"^descale_q: expected a torch.float32 tensor of one element on DEVICE"),
])
def test_fp8_entry_points_under_fake_tensors_meet_the_eager_checks(change, match):
    def call(main, hkv=8, dtype=torch.float8_e4m3fn, scale_device=None):
        q = torch.zeros(2, 16, 8, 64, dtype=dtype, device=main)
        k = torch.zeros(2, 16, hkv, 64, dtype=dtype, device=main)
        s = torch.ones(1, device=scale_device or main)
        o = fastattn.torch.attention_fp8(q, k, k, s, s, s, s, s, s, training=True)
        g = torch.zeros(2, 16, 8, 64, dtype=torch.float8_e5m2, device=main)
        fastattn.torch.attention_fp8_backward(g, o.o, o.stats, q, k, k, *[s] * 12)
        return o.o

    eager = outcome(lambda main: call(main, **change), "meta", contextlib.nullcontext())
    assert eager[0] is InvalidArgumentError and re.search(match, eager[1]), eager
    assert outcome(lambda main: call(main, **change), "cuda", FakeTensorMode(allow_non_fake_inputs=False)) == eager
    assert outcome(call, "cuda", FakeTensorMode(allow_non_fake_inputs=False))[0] == "ok"


# -- alibi_slopes: fastattn.flash reads them (cuDNN computes its own) -------------------------

def _alibi_call(device="meta", slopes_device=None, slopes=None):
    q = torch.zeros(2, 16, 8, 64, dtype=torch.bfloat16, device=device)
    slopes = torch.tensor(slopes or flash.standard_alibi_slopes(8), device=slopes_device or device)
    return flash.flash_attn_func(q, q, q, causal=True, alibi_slopes=slopes)


def _forward_bias(gm):
    """The bias argument of the traced graph's fastattn forward."""
    (forward,) = [n for n in gm.graph.nodes if n.op == "call_function" and "attention_forward" in str(n.target)]
    return forward.args[5]


def test_alibi_slopes_that_hold_no_values_take_the_bias():
    """Fake (FakeTensorMode, make_fx, export) and meta slopes cannot be read: fastattn.flash
    reads nothing there (no DataDependentOutputException, no 'item() on meta tensors') and
    runs FlashAttention's ALiBi as a bias computed from the slopes in the graph, which
    serves any slopes; real slopes are read (the paper's: cuDNN's ALiBi, others: the bias)."""
    assert _alibi_call().shape == (2, 16, 8, 64)
    with FakeTensorMode(allow_non_fake_inputs=False):
        assert _alibi_call("cuda").shape == (2, 16, 8, 64)
    assert _alibi_call(slopes_device="cpu").shape == (2, 16, 8, 64)  # real slopes: read
    assert _alibi_call(slopes_device="cpu", slopes=[0.5] * 8).shape == (2, 16, 8, 64)
    from torch.fx.experimental.proxy_tensor import make_fx

    q = torch.zeros(2, 16, 8, 64, dtype=torch.bfloat16, device="meta")
    slopes = torch.tensor(flash.standard_alibi_slopes(8))
    gm = make_fx(lambda q, s: flash.flash_attn_func(q, q, q, causal=True, alibi_slopes=s), tracing_mode="fake")(q,
                                                                                                              slopes)
    assert _forward_bias(gm) is not None
    with FakeTensorMode(allow_non_fake_inputs=False):
        q, s = torch.zeros(2, 16, 8, 64, dtype=torch.bfloat16, device="cuda"), torch.zeros(8, device="cuda")
    exported = torch.export.export(_Call(lambda q, s: flash.flash_attn_func(q, q, q, causal=True, alibi_slopes=s)),
                                   (q, s), strict=False)
    assert _forward_bias(exported.graph_module) is not None


def test_torch_compile_reads_alibi_slopes_between_two_graphs():
    """dynamo does not trace the check: it runs on the real slopes between two graphs (so
    that the compiled call takes eager's path), and fullgraph=True refuses it naming the
    check."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    def block(q, slopes):
        return flash.flash_attn_func(q * 2, q, q, causal=True, alibi_slopes=slopes) + 1

    q = torch.zeros(2, 16, 8, 64, dtype=torch.bfloat16, device="meta")
    good, bad = torch.tensor(flash.standard_alibi_slopes(8)), torch.full((8,), 0.5)
    torch._dynamo.reset()
    compiled = torch.compile(block, backend=backend)
    assert compiled(q, good).shape == q.shape and len(graphs) >= 2  # the graph broken at the check
    assert compiled(q, bad).shape == q.shape  # other slopes: the bias
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"_read_alibi_slopes"):
        torch.compile(block, backend=backend, fullgraph=True)(q, good)


def _meta(*shape, dtype=torch.bfloat16):
    return torch.zeros(*shape, dtype=dtype, device="meta")


_CONFIG_REFUSALS = {
    # What only the AttentionConfig of the call refuses (not the tensor checks): meta and
    # traced calls build it too (each module's config_for, from its op's fake kernel).
    "dense window and causal": (lambda: fastattn.torch.attention(*[_meta(1, 4, 2, 8)] * 3, causal=True,
                                                                   window=(1, 3)),
                                "mask='causal' fixes the right bound at 0"),
    "dense length 2**31": (lambda: fastattn.torch.attention(*[_meta(1, 2**31, 2, 8)] * 3), "seqlen_q=2147483648"),
    "dense shape classes": (lambda: fastattn.torch.attention(*[_meta(1, 4, 2, 8)] * 3, shape_classes="x"),
                            "shape_classes='x'"),
    "dense one class bound": (lambda: fastattn.torch.attention(*[_meta(1, 4, 2, 8)] * 3, shape_classes=(1,)),
                              "shape_classes=(1,)"),
    "varlen window and causal": (lambda: fastattn.torch.attention_varlen(
        *[_meta(8, 2, 8)] * 3, *[torch.zeros(2, dtype=torch.int32, device="meta")] * 2, 8, 8, causal=True,
        window=(1, 3)), "mask='causal' fixes the right bound at 0"),
    "varlen shape classes": (lambda: fastattn.torch.attention_varlen(
        *[_meta(8, 2, 8)] * 3, *[torch.zeros(2, dtype=torch.int32, device="meta")] * 2, 8, 8, shape_classes="1,x"),
        "shape_classes='1,x'"),
    "paged window and causal": (lambda: fastattn.torch.attention_paged(
        _meta(1, 1, 2, 8), _meta(4, 16, 2, 8), _meta(4, 16, 2, 8), torch.zeros(1, 4, dtype=torch.int32, device="meta"),
        torch.zeros(1, dtype=torch.int32, device="meta"), causal_bottom_right=True, window=(1, 3)),
        "mask='causal_bottom_right' fixes the right bound at 0"),
}


@pytest.mark.parametrize("case", sorted(_CONFIG_REFUSALS))
def test_a_meta_call_refuses_what_its_config_refuses(case):
    call, message = _CONFIG_REFUSALS[case]
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        call()


@pytest.mark.parametrize("case", sorted(k for k in _CONFIG_REFUSALS if "2**31" not in k))
def test_a_traced_call_refuses_what_its_config_refuses(case):
    call, message = _CONFIG_REFUSALS[case]
    with FakeTensorMode(), pytest.raises(InvalidArgumentError, match=re.escape(message)):
        call()
