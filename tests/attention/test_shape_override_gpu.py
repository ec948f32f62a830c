"""GPU: shape-override plans (config.shape_override, cuDNN >= 9.21, forward only): one plan
declared for the longest lengths runs each call at its own (Plan.forward's at=), against a
float64 reference on fresh random data at that length, outputs poisoned first. Below
cuDNN 9.21 the plan is refused with cudnn-frontend's reason, which is asserted there."""

from __future__ import annotations

import numpy as np
import pytest

import fastattn
from fastattn import AttentionConfig, runtime
from fastattn.errors import InvalidArgumentError, NotSupportedError

from helpers.gpu import DeviceBuffer, Tensor, random_inputs, reference, rel_error, synchronize

pytestmark = pytest.mark.gpu

FWD_TOL = {"fp16": 4e-3, "bf16": 2e-2}
DECLARED = 512


def _cudnn() -> int:
    runtime.libraries()
    return int(runtime.versions()["cudnn_loaded"] or 0)


def _declared(**fields) -> AttentionConfig:
    base = dict(batch=2, heads_q=4, heads_kv=2, seqlen_q=DECLARED, seqlen_kv=DECLARED, head_dim_qk=128,
                dtype="bf16", layout="bshd", shape_override=True)
    return AttentionConfig(**{**base, **fields})


def _plan_or_refusal(cfg: AttentionConfig):
    """The plan where cuDNN >= 9.21 runs it; below 9.21 cudnn-frontend's refusal, and on SM90
    the known defect's (fastattn.defects: sm90-sdpa-shape-override), are asserted and the test
    ends there."""
    import torch

    if _cudnn() < 92100:
        with pytest.raises(NotSupportedError, match="9.21"):
            fastattn.plan(cfg)
        return None
    if torch.cuda.get_device_capability() == (9, 0):
        with pytest.raises(NotSupportedError, match="sm90-sdpa-shape-override"):
            fastattn.plan(cfg)
        return None
    return fastattn.plan(cfg)


class Call:
    """One call at (s_q, s_kv) of a plan declared longer: its tensors laid out as the
    config's layout at those lengths (an exact config of the call describes them)."""

    def __init__(self, plan, s_q: int, s_kv: int, seed: int):
        self.plan = plan
        self.at = plan.config.replace(seqlen_q=s_q, seqlen_kv=s_kv, shape_override=False)
        rng = np.random.default_rng(seed)
        self.q, self.k, self.v, _ = random_inputs(self.at, rng, backward=False)
        self.t = {n: Tensor(self.at, n) for n in ("q", "k", "v", "o")}
        for n, x in (("q", self.q), ("k", self.k), ("v", self.v)):
            self.t[n].write(x)
        self.ws = DeviceBuffer(plan.workspace_size)

    def forward(self, at=None):
        t = self.t
        self.plan.forward(t["q"].ptr, t["k"].ptr, t["v"].ptr, t["o"].ptr, workspace=self.ws.ptr,
                          at=at or (self.at.seqlen_q, self.at.seqlen_kv))
        synchronize()


@pytest.mark.parametrize("mask", ["none", "causal"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_one_forward_plan_serves_every_length_up_to_its_own(mask, dtype):
    plan = _plan_or_refusal(_declared(mask=mask, dtype=dtype))
    if plan is None:
        return
    errors = {}
    for n in (2, 17, 64, 100, 255, 256, 257, 511, DECLARED):
        call = Call(plan, n, n, seed=n)
        call.forward()
        o_ref, _, _ = reference(call.at, call.q, call.k, call.v)
        errors[n] = rel_error(call.t["o"].read(), o_ref)
    assert all(e < FWD_TOL[dtype] for e in errors.values()), errors


def test_queries_and_keys_of_different_lengths():
    # (top-left: a bottom-right diagonal is refused beside shape_override, tests/config)
    plan = _plan_or_refusal(_declared(mask="causal"))
    if plan is None:
        return
    errors = {}
    for s_q, s_kv in ((100, 300), (37, 37), (200, 512), (512, 512)):
        call = Call(plan, s_q, s_kv, seed=s_q * 1000 + s_kv)
        call.forward()
        o_ref, _, _ = reference(call.at, call.q, call.k, call.v)
        errors[(s_q, s_kv)] = rel_error(call.t["o"].read(), o_ref)
    assert all(e < FWD_TOL["bf16"] for e in errors.values()), errors


def test_a_decode_plan_serves_every_cache_length():
    plan = _plan_or_refusal(_declared(seqlen_q=1, seqlen_kv=4096))
    if plan is None:
        return
    errors = {}
    for n in (1, 63, 1000, 4096):
        call = Call(plan, 1, n, seed=n)
        call.forward()
        o_ref, _, _ = reference(call.at, call.q, call.k, call.v)
        errors[n] = rel_error(call.t["o"].read(), o_ref)
    assert all(e < FWD_TOL["bf16"] for e in errors.values()), errors


def test_a_call_outside_the_plan_is_refused_naming_its_lengths():
    plan = _plan_or_refusal(_declared())
    if plan is None:
        return
    call = Call(plan, 8, 8, seed=1)
    t = call.t
    args = (t["q"].ptr, t["k"].ptr, t["v"].ptr, t["o"].ptr)
    with pytest.raises(InvalidArgumentError, match=r"execute_at\(seqlen_q=513, seqlen_kv=8\).*declared for "
                                                   r"seqlen_q=512"):
        plan.forward(*args, workspace=call.ws.ptr, at=(DECLARED + 1, 8))
    with pytest.raises(NotSupportedError, match="does not cross seqlen_q == 1"):
        plan.forward(*args, workspace=call.ws.ptr, at=(1, 8))
    with pytest.raises(InvalidArgumentError, match=r"at\[1\] \(seqlen_kv\)=0"):
        plan.forward(*args, workspace=call.ws.ptr, at=(8, 0))
    exact = fastattn.plan(plan.config.replace(shape_override=False))
    with pytest.raises(InvalidArgumentError, match="built without shape_override"):
        exact.forward(*args, workspace=call.ws.ptr, at=(8, 8))


def test_without_at_the_plan_runs_at_its_declared_lengths():
    plan = _plan_or_refusal(_declared(mask="causal"))
    if plan is None:
        return
    cfg = plan.config
    rng = np.random.default_rng(5)
    q, k, v, _ = random_inputs(cfg, rng, backward=False)
    t = {n: Tensor(cfg, n) for n in ("q", "k", "v", "o")}
    for n, x in (("q", q), ("k", k), ("v", v)):
        t[n].write(x)
    ws = DeviceBuffer(plan.workspace_size)
    plan.forward(t["q"].ptr, t["k"].ptr, t["v"].ptr, t["o"].ptr, workspace=ws.ptr)
    synchronize()
    o_ref, _, _ = reference(cfg, q, k, v)
    assert rel_error(t["o"].read(), o_ref) < FWD_TOL["bf16"]


def test_explicit_strides_serve_a_cache_slice():
    # k and v: the first n keys of a cache twice as long (their batch stride is the cache's).
    plan = _plan_or_refusal(_declared(mask="causal", seqlen_q=64))
    if plan is None:
        return
    cfg, n = plan.config, 300
    cache = cfg.replace(seqlen_kv=2 * DECLARED, shape_override=False)
    rng = np.random.default_rng(9)
    q = random_inputs(cfg.replace(seqlen_q=16, shape_override=False), rng, backward=False)[0]
    _, k_all, v_all, _ = random_inputs(cache, rng, backward=False)
    t = {"q": Tensor(cfg.replace(seqlen_q=16, seqlen_kv=n, shape_override=False), "q"),
         "o": Tensor(cfg.replace(seqlen_q=16, seqlen_kv=n, shape_override=False), "o"),
         "k": Tensor(cache, "k"), "v": Tensor(cache, "v")}
    t["q"].write(q)
    t["k"].write(k_all)
    t["v"].write(v_all)
    ws = DeviceBuffer(plan.workspace_size)
    at = (16, n, t["q"].strides, t["k"].strides, t["v"].strides, t["o"].strides)
    plan.forward(t["q"].ptr, t["k"].ptr, t["v"].ptr, t["o"].ptr, workspace=ws.ptr, at=at)
    synchronize()
    call = cfg.replace(seqlen_q=16, seqlen_kv=n, shape_override=False)
    o_ref, _, _ = reference(call, q, k_all[:, :, :n], v_all[:, :, :n])
    assert rel_error(t["o"].read(), o_ref) < FWD_TOL["bf16"]
