"""GPU: forward and backward against a float64 reference, probe verdicts, bad input,
single-flight builds. Outputs are poisoned (NaN) before every run, inputs are fresh
random data each time."""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest

import fastattn
from fastattn import AttentionConfig

from helpers.gpu import DeviceBuffer, Tensor, random_inputs, reference, rel_error, synchronize

# ||out - ref|| / ||ref|| bounds: float32 accumulation over 16-bit inputs and outputs.
FWD_TOL = {"fp16": 4e-3, "bf16": 2e-2}
BWD_TOL = {"fp16": 1e-2, "bf16": 4e-2}

MASKS = {
    # name: (mask, window, seqlen_q, seqlen_kv); lengths deliberately not multiples of 64
    "none": ("none", (-1, -1), 200, 200),
    "causal": ("causal", (-1, -1), 200, 200),
    "bottom_right": ("causal_bottom_right", (-1, -1), 100, 300),
    "sliding_window": ("causal", (47, 0), 200, 200),
}
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}
HEAD_DIMS = {"same": (128, 128), "qk_ne_v": (128, 64)}
LAYOUTS = ("bshd", "sbhd", "bhsd")


def make_config(dtype, mask_name, heads_name, dims_name, layout, **extra):
    mask, window, sq, skv = MASKS[mask_name]
    hq, hkv = HEADS[heads_name]
    dqk, dv = HEAD_DIMS[dims_name]
    return AttentionConfig(batch=2, heads_q=hq, heads_kv=hkv, seqlen_q=sq, seqlen_kv=skv, head_dim_qk=dqk,
                           head_dim_v=dv, dtype=dtype, layout=layout, mask=mask, window=window, **extra)


class Run:
    """Device tensors for one config, run through a plan."""

    def __init__(self, cfg: AttentionConfig, plan, seed: int):
        self.cfg, self.plan = cfg, plan
        rng = np.random.default_rng(seed)
        self.q, self.k, self.v, self.d_o = random_inputs(cfg, rng, backward=cfg.training)
        self.t = {name: Tensor(cfg, name) for name in ("q", "k", "v", "o")}
        self.t["q"].write(self.q)
        self.t["k"].write(self.k)
        self.t["v"].write(self.v)
        if cfg.training:
            for name in ("stats", "d_o", "d_q", "d_k", "d_v"):
                self.t[name] = Tensor(cfg, name)
            self.t["d_o"].write(self.d_o)
        self.ws = DeviceBuffer(plan.workspace_size)

    def forward(self):
        t = self.t
        stats = t["stats"].ptr if self.cfg.training else 0
        self.plan.forward(t["q"].ptr, t["k"].ptr, t["v"].ptr, t["o"].ptr, stats=stats, workspace=self.ws.ptr)
        synchronize()

    def backward(self):
        t = self.t
        self.plan.backward(t["q"].ptr, t["k"].ptr, t["v"].ptr, t["o"].ptr, t["d_o"].ptr, t["stats"].ptr,
                           t["d_q"].ptr, t["d_k"].ptr, t["d_v"].ptr, workspace=self.ws.ptr)
        synchronize()


MATRIX = list(itertools.product(("fp16", "bf16"), MASKS, HEADS, HEAD_DIMS, LAYOUTS))


@pytest.mark.parametrize("dtype,mask,heads,dims,layout", MATRIX, ids=["-".join(p) for p in MATRIX])
def test_forward_backward_match_float64_reference(dtype, mask, heads, dims, layout):
    cfg = make_config(dtype, mask, heads, dims, layout, training=True)
    result = fastattn.probe(cfg)
    assert result.supported, result.reason
    run = Run(cfg, fastattn.plan(cfg), seed=hash((dtype, mask, heads, dims, layout)) & 0xFFFF)
    run.forward()
    o_ref, stats_ref, grads_ref = reference(cfg, run.q, run.k, run.v, run.d_o)
    errors = {"o": rel_error(run.t["o"].read(), o_ref), "stats": rel_error(run.t["stats"].read(), stats_ref)}
    run.backward()
    for name, ref in zip(("d_q", "d_k", "d_v"), grads_ref):
        errors[name] = rel_error(run.t[name].read(), ref)
    print(cfg.to_json(), errors)
    assert errors["o"] < FWD_TOL[dtype], errors
    assert errors["stats"] < 1e-3, errors  # float32 log-sum-exp of float32 scores
    for name in ("d_q", "d_k", "d_v"):
        assert errors[name] < BWD_TOL[dtype], errors


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_inference_forward_writes_no_stats_and_matches_reference(dtype):
    cfg = make_config(dtype, "causal", "gqa", "same", "bshd")
    p = fastattn.plan(cfg)
    assert p.backward_engine is None and p.backward_workspace_size == 0
    run = Run(cfg, p, seed=7)
    run.forward()
    o_ref, _, _ = reference(cfg, run.q, run.k, run.v)
    assert rel_error(run.t["o"].read(), o_ref) < FWD_TOL[dtype]


def test_explicit_strides_packed_qkv():
    # q, k, v interleaved in one (b, s, 3, h, d) buffer, as a fused QKV projection writes it.
    b, s, h, d = 2, 130, 4, 64
    row = 3 * h * d
    q_strides = (s * row, d, row, 1)
    base = AttentionConfig(batch=b, heads_q=h, seqlen_q=s, head_dim_qk=d, dtype="bf16", mask="causal")
    o_strides = base.strides("o")
    cfg = base.replace(layout={"q": q_strides, "k": q_strides, "v": q_strides, "o": o_strides})
    assert not isinstance(cfg.layout, str)
    rng = np.random.default_rng(11)
    from helpers.gpu import quantize, to_raw

    qkv = quantize(rng.standard_normal((b, s, 3, h, d)), "bf16")
    buf = DeviceBuffer(qkv.size * 2)
    buf.upload(to_raw(qkv, "bf16"))
    out = Tensor(cfg, "o")
    p = fastattn.plan(cfg)
    ws = DeviceBuffer(p.workspace_size)
    p.forward(buf.ptr, buf.ptr + h * d * 2, buf.ptr + 2 * h * d * 2, out.ptr, workspace=ws.ptr)
    synchronize()
    q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
    o_ref, _, _ = reference(cfg, q, k, v)
    assert rel_error(out.read(), o_ref) < FWD_TOL["bf16"]


def test_deterministic_backward_is_bitwise_stable():
    cfg = AttentionConfig(batch=2, heads_q=8, heads_kv=2, seqlen_q=512, head_dim_qk=128, dtype="bf16",
                          mask="causal", training=True, deterministic=True)
    result = fastattn.probe(cfg)
    assert result.supported, result.reason
    run = Run(cfg, fastattn.plan(cfg), seed=3)
    run.forward()
    outputs = []
    for _ in range(3):
        for name in ("d_q", "d_k", "d_v"):
            run.t[name].buf.poison()
        run.backward()
        outputs.append(tuple(run.t[name].raw() for name in ("d_q", "d_k", "d_v")))
    assert outputs[0] == outputs[1] == outputs[2]
    _, _, grads = reference(cfg, run.q, run.k, run.v, run.d_o)
    for name, ref in zip(("d_q", "d_k", "d_v"), grads):
        assert rel_error(run.t[name].read(), ref) < BWD_TOL["bf16"]


def test_serialized_plan_reloads_and_runs_bitwise_identical():
    from fastattn import _core

    cfg = make_config("bf16", "causal", "gqa", "same", "bshd", training=True)
    built = fastattn.plan(cfg)
    fwd_blob, bwd_blob = built.serialize()
    assert fwd_blob and bwd_blob
    loaded = _core.load_plan(cfg, built.device, fwd_blob, bwd_blob)
    assert loaded.workspace_size == built.workspace_size
    a, b = Run(cfg, built, seed=5), Run(cfg, loaded, seed=5)
    for r in (a, b):
        r.forward()
        r.backward()
    for name in ("o", "stats", "d_q", "d_k", "d_v"):
        assert a.t[name].raw() == b.t[name].raw(), name


def test_corrupt_blob_is_an_error_not_a_crash():
    from fastattn import _core

    cfg = make_config("bf16", "none", "mha", "same", "bshd")
    fwd_blob, _ = fastattn.plan(cfg).serialize()
    for blob in (b"", b"\x00" * 64, fwd_blob[: len(fwd_blob) // 2], b"{not json"):
        with pytest.raises(fastattn.CorruptPlanError):
            _core.load_plan(cfg, 0, blob)


def test_refused_config_reports_cudnns_reason():
    # A sliding window with more queries than keys: refused by cuDNN (frontend 1.28,
    # cuDNN 9.19). The verdict and its words are cuDNN's; fastattn has no rule for it.
    cfg = AttentionConfig(batch=1, heads_q=2, seqlen_q=256, seqlen_kv=128, head_dim_qk=128, dtype="bf16",
                          mask="causal", window=(16, 0))
    result = fastattn.probe(cfg)
    assert result.supported is False
    assert result.reason.startswith("forward: ") and len(result.reason) > len("forward: ") + 10
    with pytest.raises(fastattn.NotSupportedError) as e:
        fastattn.plan(cfg)
    assert str(e.value) == result.reason
    assert isinstance(e.value, NotImplementedError)
    again = fastattn.probe(cfg)
    assert again.cached and not again.supported and again.reason == result.reason


def test_probe_and_plan_share_one_build():
    cfg = make_config("fp16", "none", "mha", "same", "bhsd", training=True).replace(seqlen_q=201, seqlen_kv=201)
    before = fastattn.stats()["builds"]
    result = fastattn.probe(cfg)
    assert result.supported and not result.cached and result.build_seconds > 0
    assert result.forward_engine and result.backward_engine
    p = fastattn.plan(cfg)
    assert fastattn.plan(cfg) is p
    assert fastattn.stats()["builds"] == before + 1
    assert p.forward_workspace_size == result.forward_workspace_size
    assert p.backward_workspace_size == result.backward_workspace_size
    assert fastattn.probe(cfg).cached


def test_many_threads_asking_for_one_new_config_build_once():
    cfg = AttentionConfig(batch=3, heads_q=6, heads_kv=3, seqlen_q=333, head_dim_qk=64, dtype="bf16",
                          mask="causal", training=True)
    before = fastattn.stats()["builds"]
    barrier = threading.Barrier(16)
    plans, errors = [], []

    def worker():
        try:
            barrier.wait()
            plans.append(fastattn.plan(cfg))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(plans) == 16 and all(p is plans[0] for p in plans)
    assert fastattn.stats()["builds"] == before + 1


def test_plans_run_from_other_threads_and_streams():
    from cuda.bindings import runtime as rt

    cfg = make_config("bf16", "causal", "mha", "same", "bshd", training=True)
    p = fastattn.plan(cfg)
    run = Run(cfg, p, seed=9)
    err, stream = rt.cudaStreamCreate()
    assert int(err) == 0
    try:
        def work():
            t = run.t
            p.forward(t["q"].ptr, t["k"].ptr, t["v"].ptr, t["o"].ptr, stats=t["stats"].ptr, workspace=run.ws.ptr,
                      stream=int(stream))
            rt.cudaStreamSynchronize(stream)

        th = threading.Thread(target=work)
        th.start()
        th.join()
        o_ref, stats_ref, _ = reference(cfg, run.q, run.k, run.v)
        assert rel_error(run.t["o"].read(), o_ref) < FWD_TOL["bf16"]
    finally:
        rt.cudaStreamDestroy(stream)


@pytest.fixture(scope="module")
def setup():
    cfg = make_config("bf16", "causal", "gqa", "same", "bshd", training=True)
    p = fastattn.plan(cfg)
    return cfg, p, Run(cfg, p, seed=1)


class TestBadInput:

    def test_null_pointer(self, setup):
        _, p, r = setup
        t = r.t
        with pytest.raises(fastattn.InvalidArgumentError, match="^k is a null pointer"):
            p.forward(t["q"].ptr, 0, t["v"].ptr, t["o"].ptr, stats=t["stats"].ptr, workspace=r.ws.ptr)

    def test_misaligned_pointer(self, setup):
        _, p, r = setup
        t = r.t
        with pytest.raises(fastattn.InvalidArgumentError, match="o=0x[0-9a-f]+ is not 16-byte aligned"):
            p.forward(t["q"].ptr, t["k"].ptr, t["v"].ptr, t["o"].ptr + 2, stats=t["stats"].ptr, workspace=r.ws.ptr)

    def test_missing_stats_in_training(self, setup):
        _, p, r = setup
        t = r.t
        with pytest.raises(fastattn.InvalidArgumentError, match="stats is a null pointer"):
            p.forward(t["q"].ptr, t["k"].ptr, t["v"].ptr, t["o"].ptr, workspace=r.ws.ptr)

    def test_missing_workspace(self, setup):
        _, p, r = setup
        t = r.t
        if p.backward_workspace_size == 0:
            pytest.fail("expected a GQA backward plan that needs workspace")
        with pytest.raises(fastattn.InvalidArgumentError, match="workspace is a null pointer"):
            p.backward(t["q"].ptr, t["k"].ptr, t["v"].ptr, t["o"].ptr, t["d_o"].ptr, t["stats"].ptr,
                       t["d_q"].ptr, t["d_k"].ptr, t["d_v"].ptr)

    def test_stats_for_inference_plan(self):
        cfg = make_config("bf16", "causal", "gqa", "same", "bshd")
        p = fastattn.plan(cfg)
        r = Run(cfg, p, seed=2)
        t = r.t
        stats = DeviceBuffer(4 * 2 * 4 * 200)
        with pytest.raises(fastattn.InvalidArgumentError, match="training=False"):
            p.forward(t["q"].ptr, t["k"].ptr, t["v"].ptr, t["o"].ptr, stats=stats.ptr, workspace=r.ws.ptr)
        with pytest.raises(fastattn.InvalidArgumentError, match="training=True"):
            p.backward(t["q"].ptr, t["k"].ptr, t["v"].ptr, t["o"].ptr, t["o"].ptr, stats.ptr, t["q"].ptr,
                       t["k"].ptr, t["v"].ptr)

    def test_bad_device(self):
        with pytest.raises(fastattn.InvalidArgumentError, match="device=-1"):
            fastattn.probe(make_config("bf16", "none", "mha", "same", "bshd"), device=-1)
        with pytest.raises(fastattn.InvalidArgumentError, match="device=63: this process sees"):
            fastattn.probe(make_config("bf16", "none", "mha", "same", "bshd"), device=63)

    def test_a_failed_cuda_call_leaves_no_error_behind(self):
        # PyTorch reads the CUDA runtime's last error after its kernel launches: a
        # failure of ours left there would surface as PyTorch's own ("invalid device
        # ordinal" from torch.randn, seen 2026-11-29).
        import ctypes

        from fastattn import _core
        from fastattn._loader import ensure_loaded

        cudart = ctypes.CDLL(ensure_loaded().cudart)
        assert cudart.cudaGetLastError() == 0
        with pytest.raises(fastattn.CudaError, match="invalid device ordinal"):
            _core.get_device_info(63)
        assert cudart.cudaGetLastError() == 0

    def test_invalid_config_raises_before_any_build(self):
        before = fastattn.stats()["builds"]
        with pytest.raises(fastattn.InvalidArgumentError, match="heads_kv=3"):
            fastattn.probe({"batch": 1, "heads_q": 4, "heads_kv": 3, "seqlen_q": 16, "head_dim_qk": 64})
        assert fastattn.stats()["builds"] == before


def test_device_info_describes_the_gpu():
    info = fastattn.device_info()
    assert info["name"] and info["sm_count"] > 0 and info["compute_capability"][0] >= 7
    v = fastattn.versions()
    assert v["cudnn_loaded"] and v["cudnn_loaded"] >= 90000


def test_cli_probe_on_the_gpu(capsys):
    import json

    from fastattn import cli

    code = cli.main(["probe", "--batch", "1", "--heads-q", "8", "--seqlen-q", "256", "--seqlen-kv", "128",
                     "--head-dim-qk", "128", "--mask", "causal", "--window", "16", "0", "--json"])
    body = json.loads(capsys.readouterr().out)
    assert code == cli.EXIT_UNSUPPORTED and not body["supported"] and body["reason"]
    code = cli.main(["probe", "--batch", "1", "--heads-q", "8", "--seqlen-q", "256", "--head-dim-qk", "128",
                     "--training", "--json"])
    body = json.loads(capsys.readouterr().out)
    assert code == cli.EXIT_OK and body["supported"] and body["backward_engine"]


# -- integer-like addresses and the C++ floor's hooks (csrc/bench.h) -------------------


def test_integer_like_addresses_run_like_ints():
    cfg = make_config("bf16", "causal", "gqa", "same", "bshd", training=True, deterministic=True)
    p = fastattn.plan(cfg)
    a, b = Run(cfg, p, seed=8), Run(cfg, p, seed=8)
    a.forward()
    t = b.t
    p.forward(*(np.uint64(t[n].ptr) for n in ("q", "k", "v", "o")), stats=np.int64(t["stats"].ptr),
              workspace=np.int64(b.ws.ptr))
    synchronize()
    for name in ("o", "stats"):
        assert a.t[name].raw() == b.t[name].raw(), name


@pytest.mark.parametrize("mode", ["fastattn", "fastattn_packs_only", "frontend_sorted", "frontend_sorted_preamble",
                                  "frontend_uid_map"])
def test_bench_execute_writes_what_forward_and_backward_write(mode):
    from fastattn import _core

    cfg = make_config("bf16", "causal", "gqa", "same", "bshd", training=True, deterministic=True)
    p = fastattn.plan(cfg)
    a, b = Run(cfg, p, seed=7), Run(cfg, p, seed=7)
    a.forward()
    a.backward()
    t = b.t
    fwd = {n: t[n].ptr for n in ("q", "k", "v", "o", "stats")}
    assert _core.bench_execute(p, "forward", mode, 1, b.ws.ptr, 0, **fwd) > 0
    synchronize()
    bwd = dict(fwd, **{n: t[n].ptr for n in ("d_o", "d_q", "d_k", "d_v")})
    assert _core.bench_execute(p, "backward", mode, 1, b.ws.ptr, 0, **bwd) > 0
    synchronize()
    for name in ("o", "stats", "d_q", "d_k", "d_v"):
        assert a.t[name].raw() == b.t[name].raw(), name


def test_bench_raw_execute_takes_pointers_in_uid_order(setup):
    from fastattn import _core

    _, p, r = setup
    t = r.t
    ptrs = [t[n].ptr for n in ("q", "k", "v", "o", "stats")]
    assert _core.bench_raw_execute(p, "forward", ptrs, r.ws.ptr, 0, 3) > 0
    with pytest.raises(fastattn.InvalidArgumentError, match=r"forward takes 5 tensors \(q, k, v, o, stats\), got 4"):
        _core.bench_raw_execute(p, "forward", ptrs[:4], r.ws.ptr, 0, 3)
    synchronize()


def test_bench_execute_checks_like_execute_in_fastattn_mode_only(setup):
    from fastattn import _core

    _, p, r = setup
    t = r.t
    fwd = {n: t[n].ptr for n in ("q", "k", "v", "o")}  # no stats: a training forward needs them
    with pytest.raises(fastattn.InvalidArgumentError, match="stats is a null pointer"):
        _core.bench_execute(p, "forward", "fastattn", 2, r.ws.ptr, 0, **fwd)
    with pytest.raises(fastattn.InvalidArgumentError, match="mode='fast'"):
        _core.bench_execute(p, "forward", "fast", 2, r.ws.ptr, 0, **fwd)
    with pytest.raises(fastattn.InvalidArgumentError, match="dq= is not a tensor"):
        _core.bench_execute(p, "forward", "fastattn", 2, r.ws.ptr, 0, dq=t["d_q"].ptr)
    with pytest.raises(fastattn.InvalidArgumentError, match="direction='sideways'"):
        _core.bench_execute(p, "sideways", "fastattn", 2, r.ws.ptr, 0, **fwd)
