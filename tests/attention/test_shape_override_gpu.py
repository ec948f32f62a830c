"""GPU: shape-override plans (config.shape_override, cuDNN >= 9.21, forward only): one plan
declared for the longest lengths runs each call at its own (Plan.forward's at=), its tensors
in buffers laid out for the declared lengths (cuDNN's contract, cudnn-frontend#1148), against
a float64 reference on fresh random data at the call's lengths, outputs poisoned first. Below
cuDNN 9.21 the plan is refused with cudnn-frontend's reason, and where fastattn.defects
refuses it (SM90) with the defect's; both are asserted there."""

from __future__ import annotations

import numpy as np
import pytest

import fastattn
from fastattn import AttentionConfig, defects, runtime
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
    """The plan where cuDNN >= 9.21 runs it; below 9.21 cudnn-frontend's refusal, and where
    the registry refuses it (fastattn.defects: sm90-sdpa-shape-override*) the defect's, are
    asserted and the test ends there."""
    import torch

    if _cudnn() < 92100:
        with pytest.raises(NotSupportedError, match="9.21"):
            fastattn.plan(cfg)
        return None
    decision = defects.decide(cfg, _cudnn(), torch.cuda.get_device_capability())
    if decision.refusal:
        with pytest.raises(NotSupportedError, match="|".join(d.name for d in decision.avoided)):
            fastattn.plan(cfg)
        return None
    return fastattn.plan(cfg)


class Call:
    """One call at (s_q, s_kv) of a plan declared longer: its tensors in buffers of the
    declared lengths (the rows past the call's hold other finite values, which must not
    reach o), its reference on the call's rows alone."""

    def __init__(self, plan, s_q: int, s_kv: int, seed: int):
        self.plan, self.s_q = plan, s_q
        declared = plan.config.replace(shape_override=False)
        self.at = declared.replace(seqlen_q=s_q, seqlen_kv=s_kv)
        rng = np.random.default_rng(seed)
        q, k, v, _ = random_inputs(declared, rng, backward=False)
        self.q, self.k, self.v = q[:, :, :s_q], k[:, :, :s_kv], v[:, :, :s_kv]
        self.t = {n: Tensor(declared, n) for n in ("q", "k", "v", "o")}
        for n, x in (("q", q), ("k", k), ("v", v)):
            self.t[n].write(x)
        self.ws = DeviceBuffer(plan.workspace_size)

    def forward(self, at=None):
        t = self.t
        self.plan.forward(t["q"].ptr, t["k"].ptr, t["v"].ptr, t["o"].ptr, workspace=self.ws.ptr,
                          at=at or (self.at.seqlen_q, self.at.seqlen_kv))
        synchronize()

    def error(self) -> float:
        o_ref, _, _ = reference(self.at, self.q, self.k, self.v)
        return rel_error(self.t["o"].read()[:, :, :self.s_q], o_ref)


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
        errors[n] = call.error()
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
        errors[(s_q, s_kv)] = call.error()
    assert all(e < FWD_TOL["bf16"] for e in errors.values()), errors


def test_a_decode_plan_serves_every_cache_length():
    plan = _plan_or_refusal(_declared(seqlen_q=1, seqlen_kv=4096))
    if plan is None:
        return
    errors = {}
    for n in (1, 63, 1000, 4096):
        call = Call(plan, 1, n, seed=n)
        call.forward()
        errors[n] = call.error()
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


def test_strides_must_be_the_declared_ones_where_the_call_steps():
    plan = _plan_or_refusal(_declared(mask="causal", seqlen_q=64))
    if plan is None:
        return
    call = Call(plan, 16, 300, seed=9)
    t = call.t
    declared = [tuple(t[n].strides) for n in "qkvo"]
    call.forward(at=(16, 300, *declared))  # the declared strides, stated: the same call
    assert call.error() < FWD_TOL["bf16"]
    # k as the first keys of a cache twice as long: another batch stride, with a batch of 2
    cache_k = (2 * declared[1][0],) + declared[1][1:]
    with pytest.raises(InvalidArgumentError, match=r"k's strides \(\d+, 128, 256, 1\) are not the plan's declared"):
        plan.forward(t["q"].ptr, t["k"].ptr, t["v"].ptr, t["o"].ptr, workspace=call.ws.ptr,
                     at=(16, 300, declared[0], cache_k, declared[2], declared[3]))


def test_a_batch_of_one_takes_any_batch_stride():
    # (nothing steps along a batch of one: a tensor of the call's own length, bshd, has the
    # declared strides but its batch stride)
    plan = _plan_or_refusal(_declared(mask="causal", batch=1))
    if plan is None:
        return
    call = Call(plan, 100, 100, seed=3)
    own = [(100 * s[2],) + tuple(s[1:]) for s in (call.t[n].strides for n in "qkvo")]
    call.forward(at=(100, 100, *own))
    assert call.error() < FWD_TOL["bf16"]
