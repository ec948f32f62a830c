"""GPU: attention() served by shape classes (fastattn/torch/_shape_classes.py) against float64,
forward and backward, for several lengths in one class; rows past the lengths; a decode
loop whose KV length grows every step building and loading nothing after its first step.
A modest number of cases: each class plan is one build."""

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")

import fastattn  # noqa: E402
import fastattn.torch  # noqa: E402,F401
from fastattn.torch import _api, _dense, _plans  # noqa: E402

FWD_TOL = {torch.float16: 4e-3, torch.bfloat16: 2e-2}
BWD_TOL = {torch.float16: 1e-2, torch.bfloat16: 4e-2}
CLASSES = (128, 512)


def reference(q, k, v, causal=False, bottom_right=False, lens_q=None, lens_kv=None):
    """float64 attention on bshd tensors, per sequence (its own lengths), GQA by
    repetition; rows past a sequence's length are zero."""
    b, s_q, hq, d = q.shape
    out = torch.zeros(b, s_q, hq, v.shape[3], dtype=torch.float64, device=q.device)
    for i in range(b):
        lq = s_q if lens_q is None else int(lens_q[i])
        lk = k.shape[1] if lens_kv is None else int(lens_kv[i])
        qi, ki, vi = (t[i, :n].double().transpose(0, 1) for t, n in ((q, lq), (k, lk), (v, lk)))
        g = hq // ki.shape[0]
        ki, vi = ki.repeat_interleave(g, 0), vi.repeat_interleave(g, 0)
        s = qi @ ki.transpose(-1, -2) / d ** 0.5
        if causal:
            shift = lk - lq if bottom_right else 0
            keep = torch.arange(lk, device=q.device)[None, :] <= torch.arange(lq, device=q.device)[:, None] + shift
            s = s.masked_fill(~keep, float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row that sees no key: zero, as cuDNN's
        out[i, :lq] = (p @ vi).transpose(0, 1)
    return out


def rand(*shape, dtype=torch.bfloat16, grad=False):
    return torch.randn(*shape, device="cuda", dtype=dtype).requires_grad_(grad)


def _counts():
    s = fastattn.runtime.stats()
    return s["builds"], s["deserializations"], s["misses"], len(_plans.plans)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal,bottom_right", [(False, False), (True, False), (True, True)])
def test_one_class_plan_serves_several_lengths_forward_and_backward(dtype, causal, bottom_right):
    b, hq, hkv, d = 2, 4, 2, 64
    before = None
    # All in the (128, 512] class; s_q <= s_kv, so that every row sees a key at either alignment.
    for s_q, s_kv in ((129, 129), (200, 300), (512, 512), (140, 300)):
        q, k, v = rand(b, s_q, hq, d, dtype=dtype, grad=True), *(rand(b, s_kv, hkv, d, dtype=dtype, grad=True)
                                                                   for _ in range(2))
        o = _api.attention(q, k, v, causal=causal, alignment="bottom_right" if bottom_right else "top_left",
                             shape_classes=CLASSES)
        ref = reference(q, k, v, causal, bottom_right)
        torch.testing.assert_close(o.double(), ref, atol=FWD_TOL[dtype], rtol=FWD_TOL[dtype])
        d_o = torch.randn_like(o)
        o.backward(d_o)
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        reference(q64, k64, v64, causal, bottom_right).backward(d_o.double())
        for got, want in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
            torch.testing.assert_close(got.double(), want, atol=BWD_TOL[dtype], rtol=BWD_TOL[dtype])
        if before is None:
            before = _counts()  # the class's plan exists from the first length on
        else:
            assert _counts() == before, "a second length in the class built or loaded a plan"


def test_rows_past_the_lengths_are_zero_in_outputs_and_gradients():
    b, s, h, d = 3, 300, 4, 64
    q, k, v = (rand(b, s, h, d, grad=True) for _ in range(3))
    lens_q = torch.tensor([300, 17, 129], dtype=torch.int32, device="cuda")
    lens_kv = torch.tensor([250, 300, 40], dtype=torch.int32, device="cuda")
    # Top-left causal: every row sees key 0 (rows that see no key are another question).
    o = _api.attention(q, k, v, causal=True, seq_lens_q=lens_q, seq_lens_kv=lens_kv, shape_classes=CLASSES)
    ref = reference(q, k, v, True, False, lens_q, lens_kv)
    torch.testing.assert_close(o.double(), ref, atol=2e-2, rtol=2e-2)
    assert (o[1, 17:] == 0).all() and (o[2, 129:] == 0).all()
    o.backward(torch.randn_like(o))
    assert (q.grad[1, 17:] == 0).all() and (k.grad[2, 40:] == 0).all() and (v.grad[0, 250:] == 0).all()


def test_return_lse_matches_the_exact_plan():
    q, k, v = (rand(2, 200, 4, 64) for _ in range(3))
    o, lse = _api.attention(q, k, v, causal=True, return_lse=True, shape_classes=CLASSES)
    o_exact, lse_exact = _api.attention(q, k, v, causal=True, return_lse=True, shape_classes="off")
    assert lse.shape == lse_exact.shape == (2, 4, 200)
    torch.testing.assert_close(lse, lse_exact, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(o, o_exact, atol=2e-2, rtol=2e-2)


# A cache as long as the class; longer (its batch stride: the last sequence's offset is past
# the (128, 512] plan's tokens, so the step takes the 4096 class, which covers them); longer
# with no class covering it (exact plans: correct, one per step).
@pytest.mark.parametrize("cache_len,classes,builds_nothing", [(512, CLASSES, True), (4096, (*CLASSES, 4096), True),
                                                              (4096, CLASSES, False)])
def test_decode_with_a_growing_kv_length_builds_nothing_after_its_first_step(cache_len, classes, builds_nothing):
    b, hq, hkv, d = 3, 8, 2, 128
    cache_k, cache_v = rand(b, cache_len, hkv, d), rand(b, cache_len, hkv, d)
    before = None
    with torch.no_grad():
        for n in range(130, 170):  # each step one key more, all in the (128, 512] class
            q = rand(b, 1, hq, d)
            o = _api.attention(q, cache_k[:, :n], cache_v[:, :n], causal=True, alignment="bottom_right",
                                 shape_classes=classes)
            if n % 13 == 0 or n == 130:
                ref = reference(q, cache_k[:, :n], cache_v[:, :n], True, True)
                torch.testing.assert_close(o.double(), ref, atol=2e-2, rtol=2e-2)
            if before is None:
                before = _counts()
            elif builds_nothing:
                assert _counts() == before, f"step {n} built or loaded a plan"


def test_the_environment_variable_turns_classes_on_in_a_fresh_process(tmp_path):
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import torch, fastattn, fastattn.torch
        from fastattn.torch import _plans
        q = torch.randn(1, 1, 8, 64, device="cuda", dtype=torch.bfloat16)
        for n in (200, 201, 300, 511):
            k = torch.randn(1, n, 8, 64, device="cuda", dtype=torch.bfloat16)
            fastattn.torch.attention(q, k, k, causal_bottom_right=True)
        s = fastattn.runtime.stats()
        print(s["builds"] + s["deserializations"], len(_plans.plans))
    """)
    import os

    env = {**os.environ, "FASTATTN_SHAPE_CLASSES": "128,512", "FASTATTN_CACHE_DIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1", "1"], r.stdout


def test_varlen_one_class_plan_serves_several_max_lengths():
    from fastattn.torch import _varlen

    h, d = 4, 64
    before = None
    for lens in ((129, 200), (300, 140), (512, 400)):  # max lengths 200, 300, 512: the (128, 512] class
        total = sum(lens)
        q, k, v = (rand(total, h, d, grad=True) for _ in range(3))
        cu = torch.tensor([0, lens[0], total], dtype=torch.int32, device="cuda")
        o = _api.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=True, shape_classes=CLASSES)
        o.backward(torch.ones_like(o))
        for start, n in ((0, lens[0]), (lens[0], lens[1])):
            qi, ki, vi = (t[start:start + n].unsqueeze(0) for t in (q, k, v))
            torch.testing.assert_close(o[start:start + n].double(), reference(qi, ki, vi, True)[0], atol=2e-2,
                                       rtol=2e-2)
        if before is None:
            before = _counts()
        else:
            assert _counts() == before, f"lengths {lens} built or loaded a plan"


SMALL = (64, 128)  # classes (0, 64] and (64, 128]: short lengths in a class declared longer


@pytest.mark.parametrize("n", [2, 33, 64, 100])
def test_repeated_calls_with_new_data_behind_the_same_pointers_stay_right(n):
    # A launch's third run is replayed from fastattn's own CUDA graph (csrc/packs.h): the
    # class plan's offsets and lengths must be read per call, never captured as values.
    # The shape of benchmarks/bench_shape_classes.py, where a captured call faulted.
    q, k, v = rand(1, n, 32, 128), rand(1, n, 8, 128), rand(1, n, 8, 128)
    with torch.no_grad():
        for step in range(6):
            for t in (q, k, v):
                t.copy_(torch.randn_like(t))
            o = _api.attention(q, k, v, causal=True, alignment="bottom_right", shape_classes=SMALL)
            ref = reference(q, k, v, True, True)
            torch.testing.assert_close(o.double(), ref, atol=2e-2, rtol=2e-2, msg=lambda m, step=step: f"step {step}: {m}")


@pytest.mark.parametrize("n", [2, 33, 64])
@pytest.mark.parametrize("held", ["class", "exact"])
def test_a_call_captured_in_a_cuda_graph_replays_right(n, held):
    # Inside a caller's capture a call takes a plan this process holds: its class plan, or
    # (the class plan never loaded) its exact plan; the replay reads new data behind the
    # captured pointers, and nothing is planned inside the capture.
    q, k, v = rand(1, n, 32, 128), rand(1, n, 8, 128), rand(1, n, 8, 128)
    with torch.no_grad():
        _api.attention(q, k, v, causal=True, alignment="bottom_right", shape_classes=SMALL if held == "class" else "off")
        torch.cuda.synchronize()
        before = _counts()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o = _api.attention(q, k, v, causal=True, alignment="bottom_right", shape_classes=SMALL)
        assert _counts() == before
        for _ in range(3):
            for t in (q, k, v):
                t.copy_(torch.randn_like(t))
            o.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(o.double(), reference(q, k, v, True, True), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("batch", [1, 3])
def test_class_plans_captured_in_a_cuda_graph_replay_right(batch):
    # Captured class-plan calls replay wrong outputs or fault ("misaligned address") where
    # the offset arrays made in a capture are temporaries: the allocator gives one launch's
    # four arrays one block (_shape_classes._held_by_captures holds them).
    # GQA and a head dim of v unlike q's, so that q's, k's and o's batch strides (and their
    # offsets) all differ; two calls of different lengths in one capture; new data each
    # replay, against float64.
    shapes = [(batch, n, 8, 64, 2, 128) for n in (130, 300)]  # (b, s, hq, dqk, hkv, dv): both in (128, 512]
    tensors = [(rand(b, s, hq, dqk), rand(b, s, hkv, dqk), rand(b, s, hkv, dv)) for b, s, hq, dqk, hkv, dv in shapes]
    with torch.no_grad():
        for q, k, v in tensors:  # the class plan exists before the capture
            _api.attention(q, k, v, causal=True, shape_classes=CLASSES)
        torch.cuda.synchronize()
        builds = _counts()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [_api.attention(q, k, v, causal=True, shape_classes=CLASSES) for q, k, v in tensors]
        assert _counts() == builds  # served by the class plan: nothing new was planned
        for step in range(3):
            for t in (t for group in tensors for t in group):
                t.copy_(torch.randn_like(t))
            for o in outs:
                o.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            for i, ((q, k, v), o) in enumerate(zip(tensors, outs)):
                torch.testing.assert_close(o.double(), reference(q, k, v, True, False), atol=2e-2, rtol=2e-2,
                                           msg=lambda m, i=i, step=step: f"call {i}, replay {step}: {m}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_override_class_plans_serve_calls_in_their_declared_storage(dtype, monkeypatch):
    # A causal prefill in the first rows of buffers of the class's bound (batch 1) takes the override plan where the loaded cuDNN has it (>= 9.21)
    # and the registry does not refuse it (fastattn.defects); else the ragged one. Either way
    # the outputs are right, and a second length in the class builds nothing.
    from fastattn import defects
    from fastattn import shape_classes as sc
    from fastattn.torch import _shape_classes

    hq, hkv, d, upper = 4, 2, 64, 512
    assert upper <= sc.OVERRIDE_MAX  # a class the override serves
    bufs = [torch.randn(1, upper, h, d, device="cuda", dtype=dtype) for h in (hq, hkv, hkv)]
    before = None
    for n in (129, 200, 300, 512):
        q, k, v = (t[:, :n] for t in bufs)
        o = _api.attention(q, k, v, causal=True, shape_classes=CLASSES)
        assert o.shape == (1, n, hq, d) and o.is_contiguous()
        torch.testing.assert_close(o.double(), reference(q, k, v, True), atol=FWD_TOL[dtype], rtol=FWD_TOL[dtype])
        if before is None:
            before = _counts()
        else:
            assert _counts() == before, "a second length in the class built or loaded a plan"
    # (this test's class plans: batch 1, its heads and dtype, declared for 512 rows)
    kinds = {key[-1].kind for key in _plans.plans if key[0] == "class" and key[1] == 1
             and tuple(key[2]) == (hq, d) and key[5] == dtype and key[-1].upper_q == upper}
    loaded = fastattn.versions()["cudnn_loaded"] or 0
    cfg = fastattn.AttentionConfig(batch=1, heads_q=hq, heads_kv=hkv, seqlen_q=upper, head_dim_qk=d,
                                   dtype="bf16" if dtype == torch.bfloat16 else "fp16", mask="causal",
                                   shape_override=True)
    served = loaded >= 92100 and not defects.decide(cfg, loaded, torch.cuda.get_device_capability()).refusal
    assert kinds == ({_shape_classes.OVERRIDE} if served else {_shape_classes.RAGGED}), (kinds, loaded)
