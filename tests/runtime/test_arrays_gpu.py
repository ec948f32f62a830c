"""GPU: plan.forward / plan.backward on array objects: ints, plan.allocate's
DeviceTensors, cuda.core streams, PyTorch tensors, CuPy and JAX arrays (each where it is
installed) give bitwise-identical results; every mismatch is an error that names the
tensor. Outputs are poisoned (NaN) before each run, so an unwritten element differs."""

from __future__ import annotations

import numpy as np
import pytest

import fastattn
from fastattn import AttentionConfig

from helpers.gpu import Tensor, _check, random_inputs, synchronize, to_raw

NAMES_FWD = ("q", "k", "v", "o", "stats")
NAMES_BWD = ("d_o", "d_q", "d_k", "d_v")


def _copy(dst: int, src: int, nbytes: int):
    from cuda.bindings import runtime as rt

    _check(rt.cudaMemcpy(dst, src, nbytes, rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice))


def _cfg(**extra):
    return AttentionConfig(batch=2, heads_q=4, heads_kv=2, seqlen_q=136, seqlen_kv=136, head_dim_qk=64,
                           dtype="bf16", layout="bshd", mask="causal", training=True, deterministic=True, **extra)


@pytest.fixture(scope="module")
def reference():
    """Inputs, and the outputs of forward and backward run on ints."""
    cfg = _cfg()
    p = fastattn.plan(cfg)
    q, k, v, d_o = random_inputs(cfg, np.random.default_rng(3), backward=True)
    t = {n: Tensor(cfg, n) for n in NAMES_FWD + NAMES_BWD}
    for n, x in (("q", q), ("k", k), ("v", v), ("d_o", d_o)):
        t[n].write(x)
    ws = p.allocate("workspace")
    p.forward(*(t[n].ptr for n in ("q", "k", "v", "o")), stats=t["stats"].ptr, workspace=ws.ptr)
    p.backward(*(t[n].ptr for n in ("q", "k", "v", "o", "d_o", "stats", "d_q", "d_k", "d_v")), workspace=ws.ptr)
    synchronize()
    return cfg, p, t


def _nbytes(cfg, name):
    return cfg.storage_elements(name) * (4 if name == "stats" else 2)


def test_device_tensors_and_stream_objects_match_ints(reference):
    from cuda.core import Device

    cfg, p, t = reference
    stream = Device(p.device).create_stream()
    a = {n: p.allocate(n, stream=stream) for n in NAMES_FWD + NAMES_BWD}
    for n in ("q", "k", "v", "d_o"):
        assert a[n].shape == cfg.shape(n) and a[n].strides == cfg.strides(n)
        _copy(a[n].ptr, t[n].ptr, _nbytes(cfg, n))
    ws = p.allocate("workspace", stream=stream)
    assert ws.nbytes >= p.workspace_size
    # The whole device, not only the stream: the stream-ordered allocations must have run,
    # and a device-to-device cudaMemcpy returns before its copy lands, on the legacy
    # stream, which a cuda.core stream (non-blocking) does not wait for (seen on the H200 in a
    # shuffled test order: the forward read q, k, v half copied).
    synchronize()
    p.forward(a["q"], a["k"], a["v"], a["o"], stats=a["stats"], workspace=ws, stream=stream)
    p.backward(a["q"], a["k"], a["v"], a["o"], a["d_o"], a["stats"], a["d_q"], a["d_k"], a["d_v"], workspace=ws,
               stream=stream)
    stream.sync()
    for n in ("o", "stats", "d_q", "d_k", "d_v"):
        out = Tensor(cfg, n)
        _copy(out.ptr, a[n].ptr, _nbytes(cfg, n))
        assert out.raw() == t[n].raw(), n


def _torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    return torch


def _torch_copy(torch, cfg, t, name, dtype=None):
    """A torch tensor in bshd memory order holding tensor `name`'s bytes."""
    b, h, s, d = cfg.shape(name)
    if name == "stats":
        x = torch.empty((b, h, s, 1), dtype=torch.float32, device="cuda")
    else:
        x = torch.empty((b, s, h, d), dtype=dtype or torch.bfloat16, device="cuda")
    _copy(x.data_ptr(), t[name].ptr, _nbytes(cfg, name))
    return x


def test_torch_tensors_match_ints(reference):
    torch = _torch()
    cfg, p, t = reference
    x = {n: _torch_copy(torch, cfg, t, n) for n in NAMES_FWD + NAMES_BWD}
    ws = torch.empty(p.workspace_size, dtype=torch.uint8, device="cuda")
    x["o"].fill_(float("nan"))
    x["stats"].fill_(float("nan"))
    # The whole device before the calls on s: PyTorch's streams are non-blocking, so s waits
    # neither for the input copies (cudaMemcpy on the legacy stream, which returns before a
    # device-to-device copy lands) nor for the fills on the current stream (seen on the H200
    # in a reversed test order: a fill landed after the forward, and o read back all zeros).
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    p.forward(x["q"], x["k"], x["v"], x["o"], stats=x["stats"], workspace=ws, stream=s)
    p.backward(x["q"], x["k"], x["v"], x["o"], x["d_o"], x["stats"], x["d_q"], x["d_k"], x["d_v"], workspace=ws,
               stream=s)
    s.synchronize()
    for n in ("o", "stats", "d_q", "d_k", "d_v"):
        out = Tensor(cfg, n)
        _copy(out.ptr, x[n].data_ptr(), _nbytes(cfg, n))
        assert out.raw() == t[n].raw(), n
    # The (batch, head, seq, dim) view of the same memory is the same tensor.
    p.forward(x["q"].transpose(1, 2), x["k"], x["v"], x["o"], stats=x["stats"], workspace=ws)
    synchronize()


def test_torch_mismatches_name_the_tensor(reference):
    torch = _torch()
    cfg, p, t = reference
    x = {n: _torch_copy(torch, cfg, t, n) for n in NAMES_FWD}
    ws = torch.empty(p.workspace_size, dtype=torch.uint8, device="cuda")
    args = lambda **kw: dict(dict(q=x["q"], k=x["k"], v=x["v"], o=x["o"], stats=x["stats"], workspace=ws), **kw)
    with pytest.raises(fastattn.InvalidArgumentError, match="^q: dtype float16, the config needs bfloat16"):
        p.forward(**args(q=x["q"].half()))
    with pytest.raises(fastattn.InvalidArgumentError, match=r"^k: shape \(2, 136, 2, 32\)"):
        p.forward(**args(k=x["k"][..., :32]))
    with pytest.raises(fastattn.InvalidArgumentError, match="^v: shape .* layout='bshd'"):
        p.forward(**args(v=x["v"].transpose(1, 2).contiguous()))  # bhsd memory
    with pytest.raises(fastattn.InvalidArgumentError, match="^stats: device memory needed"):
        p.forward(**args(stats=x["stats"].cpu()))
    if p.forward_workspace_size > 1:
        with pytest.raises(fastattn.InvalidArgumentError, match="^workspace: 1 bytes"):
            p.forward(**args(workspace=ws[:1]))
    if torch.cuda.device_count() > 1:
        with pytest.raises(fastattn.InvalidArgumentError, match="^o: on device 1"):
            p.forward(**args(o=x["o"].to("cuda:1")))


def test_repeated_torch_calls_still_catch_every_change(reference):
    """After a call has passed, _core takes an equal torch tensor without _arrays (the
    compiled path): a tensor that differs in strides, dtype or device still gets its
    error, and the good tensors again give the int path's bits."""
    torch = _torch()
    cfg, p, t = reference
    x = {n: _torch_copy(torch, cfg, t, n) for n in NAMES_FWD}
    ws = torch.empty(p.workspace_size, dtype=torch.uint8, device="cuda")
    good = dict(q=x["q"], k=x["k"], v=x["v"], o=x["o"], stats=x["stats"], workspace=ws)
    for _ in range(3):
        p.forward(**good)
    q_bhsd = x["q"].transpose(1, 2).contiguous().transpose(1, 2)  # same shape, bhsd strides
    assert q_bhsd.shape == x["q"].shape and q_bhsd.stride() != x["q"].stride()
    with pytest.raises(fastattn.InvalidArgumentError, match="^q: shape"):
        p.forward(**dict(good, q=q_bhsd))
    with pytest.raises(fastattn.InvalidArgumentError, match="^k: dtype float16"):
        p.forward(**dict(good, k=x["k"].half()))
    with pytest.raises(fastattn.InvalidArgumentError, match="^v: device memory needed"):
        p.forward(**dict(good, v=x["v"].cpu()))
    x["o"].fill_(float("nan"))
    x["stats"].fill_(float("nan"))
    p.forward(**good)
    torch.cuda.synchronize()
    for n in ("o", "stats"):
        out = Tensor(cfg, n)
        _copy(out.ptr, x[n].data_ptr(), _nbytes(cfg, n))
        assert out.raw() == t[n].raw(), n


def test_feature_tensors_are_checked_on_the_gpu():
    torch = _torch()
    cfg = _cfg(padding=True, bias="1hss")
    p = fastattn.plan(cfg)
    t = {n: p.allocate(n) for n in ("q", "k", "v", "o", "stats")}
    lens = torch.full((2,), 100, dtype=torch.int32, device="cuda")
    bias = torch.zeros((1, 4, 136, 136), dtype=torch.bfloat16, device="cuda")
    ws = p.allocate("workspace")
    base = dict(stats=t["stats"], workspace=ws, seq_len_q=lens, seq_len_kv=lens, bias=bias)
    p.forward(t["q"], t["k"], t["v"], t["o"], **base)
    synchronize()
    with pytest.raises(fastattn.InvalidArgumentError, match="^bias: shape"):
        p.forward(t["q"], t["k"], t["v"], t["o"], **dict(base, bias=bias.transpose(2, 3)))
    with pytest.raises(fastattn.InvalidArgumentError, match="^seq_len_kv: dtype int64"):
        p.forward(t["q"], t["k"], t["v"], t["o"], **dict(base, seq_len_kv=lens.long()))
    with pytest.raises(fastattn.InvalidArgumentError, match="^seq_len_q is a null pointer"):
        p.forward(t["q"], t["k"], t["v"], t["o"], **dict(base, seq_len_q=0))
    with pytest.raises(fastattn.InvalidArgumentError, match="^seq_len_q: device memory needed.*never copy"):
        p.forward(t["q"], t["k"], t["v"], t["o"], **dict(base, seq_len_q=np.full(2, 100, np.int32)))
    # A transposed bias of the same (square) shape differs only in its strides: refused, not read as it lies.
    with pytest.raises(fastattn.InvalidArgumentError, match="^bias: shape"):
        p.forward(t["q"], t["k"], t["v"], t["o"], **dict(base, bias=bias.transpose(2, 3)))


def _ints_forward(cfg, p, inputs):
    """The Tensors (q, k, v, o, stats) of a forward on ints over `inputs` (name -> logical values)."""
    t = {n: Tensor(cfg, n) for n in NAMES_FWD}
    for n, x in inputs.items():
        t[n].write(x)
    ws = p.allocate("workspace")
    p.forward(t["q"].ptr, t["k"].ptr, t["v"].ptr, t["o"].ptr, stats=t["stats"].ptr, workspace=ws.ptr)
    synchronize()
    return t


def test_torch_with_seqlen_equal_to_heads_takes_the_configs_order():
    """(batch, seq, heads, dim) cannot be told from bhsd memory when seq == heads: refused,
    naming the view to pass; that view gives the int path's bits."""
    torch = _torch()
    cfg = AttentionConfig(batch=2, heads_q=8, seqlen_q=8, head_dim_qk=64, dtype="bf16", layout="bshd",
                          training=True)
    p = fastattn.plan(cfg)
    q, k, v, _ = random_inputs(cfg, np.random.default_rng(5), backward=False)
    ref = _ints_forward(cfg, p, {"q": q, "k": k, "v": v})
    x = {n: _torch_copy(torch, cfg, ref, n) for n in NAMES_FWD}
    ws = torch.empty(p.workspace_size, dtype=torch.uint8, device="cuda")
    with pytest.raises(fastattn.InvalidArgumentError, match=r"^q: .*pass the \(batch, head, seq, dim\) view"):
        p.forward(x["q"], x["k"], x["v"], x["o"], stats=x["stats"], workspace=ws)
    view = lambda n: x[n].transpose(1, 2)
    x["o"].fill_(float("nan"))
    x["stats"].fill_(float("nan"))
    p.forward(view("q"), view("k"), view("v"), view("o"), stats=x["stats"], workspace=ws)
    torch.cuda.synchronize()
    for n in ("o", "stats"):
        out = Tensor(cfg, n)
        _copy(out.ptr, x[n].data_ptr(), _nbytes(cfg, n))
        assert out.raw() == ref[n].raw(), n


def test_a_closed_device_tensor_is_a_null_pointer(reference):
    cfg, p, t = reference
    q = p.allocate("q")
    q.close()
    with pytest.raises(fastattn.InvalidArgumentError, match="^q is a null pointer"):
        p.forward(q, t["k"].ptr, t["v"].ptr, t["o"].ptr, stats=t["stats"].ptr, workspace=p.allocate("workspace"))


def test_cupy_arrays_match_ints():
    cp = pytest.importorskip("cupy", reason="cupy is not installed")
    cfg = _cfg().replace(dtype="fp16")  # CuPy has no bfloat16
    p = fastattn.plan(cfg)
    q, k, v, _ = random_inputs(cfg, np.random.default_rng(7), backward=False)
    ref = _ints_forward(cfg, p, {"q": q, "k": k, "v": v})
    x = {}
    for n in ("q", "k", "v", "o"):
        bb, hh, ss, dd = cfg.shape(n)
        x[n] = cp.full((bb, ss, hh, dd), cp.nan, dtype=cp.float16)  # bshd memory order
    x["stats"] = cp.full(cfg.shape("stats"), cp.nan, dtype=cp.float32)
    for n in ("q", "k", "v"):
        _copy(x[n].data.ptr, ref[n].ptr, _nbytes(cfg, n))
    ws = cp.empty(p.workspace_size, dtype=cp.uint8)
    stream = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()
    p.forward(x["q"], x["k"], x["v"], x["o"], stats=x["stats"], workspace=ws, stream=stream.ptr)
    stream.synchronize()
    for n in ("o", "stats"):
        out = Tensor(cfg, n)
        _copy(out.ptr, x[n].data.ptr, _nbytes(cfg, n))
        assert out.raw() == ref[n].raw(), n
    with pytest.raises(fastattn.InvalidArgumentError, match="^k: dtype float32, the config needs float16"):
        p.forward(x["q"], x["k"].astype(cp.float32), x["v"], x["o"], stats=x["stats"], workspace=ws)


def _jax():
    import os

    # Before jax starts its backend: by default it takes 75% of the GPU's memory.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    jax = pytest.importorskip("jax", reason="jax is not installed")
    if not any(dev.platform == "gpu" for dev in jax.devices()):
        pytest.skip(f"jax sees no GPU (devices: {jax.devices()})")
    return jax


def test_jax_arrays_match_ints():
    """JAX inputs (immutable: outputs in plan.allocate's buffers), bits as the int path's."""
    jax = _jax()
    import jax.numpy as jnp

    cfg = _cfg()
    p = fastattn.plan(cfg)
    q, k, v, _ = random_inputs(cfg, np.random.default_rng(9), backward=False)
    ref = _ints_forward(cfg, p, {"q": q, "k": k, "v": v})
    x = {}
    for n, values in (("q", q), ("k", k), ("v", v)):
        # The int path's bits (to_raw), in bshd memory order, as bfloat16.
        bits = np.ascontiguousarray(to_raw(values, cfg.dtype).transpose(0, 2, 1, 3))
        x[n] = jax.device_put(jnp.asarray(bits).view(jnp.bfloat16)).block_until_ready()
    o, stats = p.allocate("o"), p.allocate("stats")
    for n, a in (("o", o), ("stats", stats)):
        poisoned = Tensor(cfg, n)  # a fresh Tensor is poisoned (NaN); held: its buffer is freed with it
        _copy(a.ptr, poisoned.ptr, _nbytes(cfg, n))
    synchronize()
    p.forward(x["q"], x["k"], x["v"], o, stats=stats, workspace=p.allocate("workspace"))
    synchronize()
    for n, a in (("o", o), ("stats", stats)):
        out = Tensor(cfg, n)
        _copy(out.ptr, a.ptr, _nbytes(cfg, n))
        assert out.raw() == ref[n].raw(), n
    with pytest.raises(fastattn.InvalidArgumentError, match="^v: dtype float32, the config needs bfloat16"):
        p.forward(x["q"], x["k"], x["v"].astype(jnp.float32), o, stats=stats, workspace=p.allocate("workspace"))
