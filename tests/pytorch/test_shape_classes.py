"""attention() with shape classes, without a GPU: meta tensors posing as CUDA ones and a
recording plan. Which plan a call asks for (a second length in a class asks for none),
what it passes at run time (offsets from the call's batch strides, its lengths), what
a class does not serve. Numerics: test_shape_classes_gpu.py."""

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is an optional extra (pip install torch)")

import fastattn  # noqa: E402
from fastattn import bounded, shape_classes as sc  # noqa: E402
from fastattn.torch import _api, _dense, _native, _plans, _shape_classes  # noqa: E402
from helpers import benchmarks  # noqa: E402
from helpers.torch import take_python_path  # noqa: E402


class RecordingPlan:
    forward_workspace_size = backward_workspace_size = 0

    def __init__(self, cfg):
        self.config, self.calls = cfg, []

    def forward(self, *args, **kw):
        self.calls.append(("forward", args, kw))

    def backward(self, *args, **kw):
        self.calls.append(("backward", args, kw))


@pytest.fixture
def fake(monkeypatch):
    asked = []

    def plan(cfg, device=None):
        asked.append(cfg)
        return RecordingPlan(cfg)

    monkeypatch.setattr(fastattn, "plan", plan)
    monkeypatch.setattr(_plans, "plans", {})
    monkeypatch.setattr(_shape_classes, "plans", _plans.plans)
    monkeypatch.setattr(_shape_classes, "_arrays", bounded.Table("arrays"))
    monkeypatch.setattr(_shape_classes, "raw_stream", lambda device: 7)
    for mod in (_plans, _shape_classes):
        monkeypatch.setattr(mod, "capturing", lambda: False)
    monkeypatch.setattr(fastattn.runtime, "warm_torch_backward", lambda: None)
    take_python_path(monkeypatch)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # the eager branch, on meta tensors
    monkeypatch.setattr(_api, "plain_eager", lambda q: True)
    monkeypatch.setattr(_dense, "_check", lambda *a: None)
    monkeypatch.setattr(_shape_classes, "_check", lambda *a: None)
    monkeypatch.setattr(_shape_classes, "SETTING", sc.OFF)
    monkeypatch.setattr(_shape_classes, "_override_ok", [False])  # a cuDNN before 9.21: ragged class plans
    monkeypatch.setattr(_shape_classes, "_refused", bounded.Table("class_refusals"))
    return asked


@pytest.fixture
def override(fake, monkeypatch):
    """fake, with a cuDNN that has the shape override (9.21 or newer)."""
    monkeypatch.setattr(_shape_classes, "_override_ok", [True])
    return fake


def meta(*shape, grad=False, dtype=torch.bfloat16):
    return torch.empty(*shape, device="meta", dtype=dtype, requires_grad=grad)


def test_a_second_length_in_a_class_asks_for_no_plan(fake):
    classes = (256, 1024)
    for s in (100, 200, 256, 2):
        q, k, v = meta(2, s, 8, 64), meta(2, s, 2, 64), meta(2, s, 2, 64)
        o = _api.attention(q, k, v, causal=True, shape_classes=classes)
        assert o.shape == (2, s, 8, 64)
    assert len(fake) == 1
    cfg = fake[0]
    assert (cfg.ragged, cfg.padding, cfg.seqlen_q, cfg.seqlen_kv, cfg.batch, cfg.mask) == \
        (True, True, 256, 256, 2, "causal")
    q, k, v = meta(2, 300, 8, 64), meta(2, 300, 2, 64), meta(2, 300, 2, 64)
    _api.attention(q, k, v, causal=True, shape_classes=classes)
    assert len(fake) == 2 and fake[1].seqlen_q == 1024


def test_decode_with_a_growing_kv_length_asks_for_one_plan(fake):
    cache_k, cache_v = meta(4, 2048, 2, 128), meta(4, 2048, 2, 128)
    for n in range(1025, 1060):
        q = meta(4, 1, 8, 128)
        _api.attention(q, cache_k[:, :n], cache_v[:, :n], causal_bottom_right=True, shape_classes=(1024, 2048))
    assert len(fake) == 1 and (fake[0].seqlen_q, fake[0].seqlen_kv) == (1, 2048)
    plan = _plans.plans[next(iter(_plans.plans))].plan
    _, _, kw = plan.calls[-1]
    # The offsets are the call's batch strides: the cache's for k and v, q's and o's own.
    assert set(kw) >= {"ragged_q", "ragged_k", "ragged_v", "ragged_o", "seq_len_q", "seq_len_kv"}
    assert "ragged_stats" not in kw
    keys = {key for key in _shape_classes._arrays}
    assert ("off", -1, 7, 4, 2048 * 2 * 128) in keys and ("off", -1, 7, 4, 8 * 128) in keys
    assert ("len", -1, 7, 4, 1) in keys and ("len", -1, 7, 4, 1059) in keys


def test_the_call_lengths_are_passed_when_given(fake):
    q, k, v = meta(3, 50, 4, 64), meta(3, 60, 4, 64), meta(3, 60, 4, 64)
    lq, lkv = meta(3, dtype=torch.int32), meta(3, dtype=torch.int32)
    _api.attention(q, k, v, seq_lens_q=lq, seq_lens_kv=lkv, shape_classes="64")
    plan = _plans.plans[next(iter(_plans.plans))].plan
    _, _, kw = plan.calls[-1]
    assert kw["seq_len_q"] == lq.data_ptr() and kw["seq_len_kv"] == lkv.data_ptr()


def test_training_saves_packed_stats_and_backward_runs_the_class_plan(fake):
    q, k, v = (meta(2, 40, 4, 64, grad=True) for _ in range(3))
    o = _api.attention(q, k, v, shape_classes=(64,))
    assert o.grad_fn is not None
    o.backward(torch.ones_like(o))
    assert q.grad.shape == q.shape and k.grad.shape == k.shape
    plan = _plans.plans[next(iter(_plans.plans))].plan
    assert [c[0] for c in plan.calls] == ["forward", "backward"]
    assert "ragged_stats" in plan.calls[0][2] and "ragged_stats" in plan.calls[1][2]
    assert fake[0].training


def test_return_lse_has_attentions_shape(fake):
    q, k, v = (meta(2, 40, 4, 64) for _ in range(3))
    o, lse = _api.attention(q, k, v, return_lse=True, shape_classes=(64,))
    assert o.shape == (2, 40, 4, 64) and lse.shape == (2, 4, 40)


@pytest.mark.parametrize("case", ["bhsd", "bias", "sinks", "strided_heads", "too_long", "off"])
def test_what_a_class_does_not_serve_takes_an_exact_plan(fake, case, monkeypatch):
    served = []
    monkeypatch.setattr(_dense, "forward_impl", lambda *a: served.append(a) or (a[0], None))
    q, k, v = (meta(2, 40, 4, 64) for _ in range(3))
    kw = {"shape_classes": (64,)}
    if case == "bhsd":
        kw["layout"] = "bhsd"
    elif case == "bias":
        kw["bias"] = meta(1, 4, 40, 40)
    elif case == "sinks":
        kw["sinks"] = meta(4, dtype=torch.float32)
    elif case == "strided_heads":
        q = meta(2, 4, 40, 64).transpose(1, 2)  # bshd shape, heads not packed in each token
    elif case == "too_long":
        q, k, v = (meta(2, 65, 4, 64) for _ in range(3))
    else:
        kw["shape_classes"] = "off"
    _api.attention(q, k, v, **kw)
    assert fake == [] and len(served) == 1


@pytest.mark.parametrize("held", ["class", "exact"])
def test_inside_a_capture_a_call_takes_the_plan_held_for_it(fake, held, monkeypatch):
    # Its class plan where that was loaded before the capture, else its exact plan (if
    # that was); nothing is planned inside the capture.
    served = []
    monkeypatch.setattr(_dense, "forward_impl", lambda *a: served.append("exact") or (a[0], None))
    monkeypatch.setattr(_shape_classes, "forward_impl", lambda *a: served.append("class") or (a[0], None))
    q, k, v = (meta(2, 40, 4, 64) for _ in range(3))
    _api.attention(q, k, v, shape_classes=(64,) if held == "class" else "off")
    asked = list(fake)
    for mod in (_plans, _shape_classes):
        monkeypatch.setattr(mod, "capturing", lambda: True)
    monkeypatch.setattr(fastattn.runtime, "planned", lambda cfg, device=None, wait=False: None)  # (the fake's plans: in _plans)
    _api.attention(q, k, v, shape_classes=(64,))
    assert fake == asked and served == [held, held]


def test_the_setting_applies_when_no_keyword_is_given(fake, monkeypatch):
    monkeypatch.setattr(_shape_classes, "SETTING", sc.parse("128"))
    q, k, v = (meta(1, 100, 4, 64) for _ in range(3))
    _api.attention(q, k, v)
    _api.attention(q[:, :90], k[:, :90], v[:, :90])
    assert len(fake) == 1 and fake[0].seqlen_q == 128


def test_auto_without_a_measurement_is_off(fake, monkeypatch, tmp_path):
    monkeypatch.setattr(sc, "PATH", str(tmp_path / "absent.json"))
    monkeypatch.setattr(_shape_classes, "_auto", {})
    monkeypatch.setattr(fastattn.runtime, "libraries", dict)
    monkeypatch.setattr(fastattn.runtime, "versions", lambda: {"cudnn_loaded": 91900})
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(_shape_classes, "SETTING", "auto")
    served = []
    monkeypatch.setattr(_dense, "forward_impl", lambda *a: served.append(a) or (a[0], None))
    q, k, v = (meta(1, 100, 4, 64) for _ in range(3))
    _api.attention(q, k, v)
    assert fake == [] and len(served) == 1
    assert _shape_classes.SETTING == sc.OFF  # and the process's later calls take the native path again


def test_a_bad_keyword_is_named(fake):
    q, k, v = (meta(1, 100, 4, 64) for _ in range(3))
    with pytest.raises(fastattn.InvalidArgumentError, match=r"^shape_classes=\(64, 32\): .*ascending"):
        _api.attention(q, k, v, shape_classes=(64, 32))


def test_the_benchmark_writes_the_file_the_policy_reads(tmp_path):
    import json

    from helpers import benchmarks

    bench = benchmarks.load("bench_shape_classes")
    path = str(tmp_path / "shape_classes.json")
    m = {"n": 65, "forward_class_us": 10.2, "forward_exact_us": 10.0}
    res = {"gpu": "NVIDIA H200", "versions": {"cudnn_loaded": 91900, "fastattn": "0"}, "date": "2026-12-01",
           "shape": {"training": False}, "classes": [{"lo": 64, "hi": 128, "lengths": [m]}]}
    bench.write(path, bench.row(res))
    bench.write(path, bench.row({**res, "gpu": "NVIDIA B200"}))
    bench.write(path, bench.row(res))  # the same GPU and cuDNN again: replaced, not added
    data = json.loads(open(path).read())
    assert sorted(r["gpu"] for r in data["rows"]) == ["NVIDIA B200", "NVIDIA H200"]
    assert sc.measured("NVIDIA H200", 91900, path).ranges == ((64, 128),)


def test_a_class_plan_cudnn_refuses_leaves_the_call_its_exact_plan(fake, monkeypatch):
    served, asked = [], []

    def refuse(cfg, device=None):
        asked.append(cfg)
        raise fastattn.NotSupportedError("ragged: not with this")

    monkeypatch.setattr(fastattn, "plan", refuse)
    monkeypatch.setattr(_shape_classes, "_refused", bounded.Table("class_refusals"))
    monkeypatch.setattr(_dense, "forward_impl", lambda *a: served.append(a) or (a[0], None))
    for s in (100, 120):
        q, k, v = (meta(1, s, 4, 64) for _ in range(3))
        _api.attention(q, k, v, shape_classes=(128,))
    assert len(served) == 2 and len(asked) == 1  # the refusal is asked once


def test_offsets_past_int32_are_not_made(fake):
    q, k, v = (meta(3, 40, 4, 64) for _ in range(3))
    _api.attention(q, k, v, shape_classes=(64,))
    t = _shape_classes._array(q, "off", 3, 2**31 // 3 - 1, 7)
    assert t.shape == (4,) and t.dtype == torch.int32


def test_varlen_max_lengths_take_their_class_bound(fake, monkeypatch):
    from fastattn.torch import _varlen

    seen = []
    monkeypatch.setattr(_varlen, "forward_impl", lambda *a: seen.append(a[-1]) or (a[0], None))
    monkeypatch.setattr(_api, "plain_eager", lambda q: True)
    monkeypatch.setattr(_varlen, "_check_varlen", lambda *a: None)
    q, k, v = (meta(300, 4, 64) for _ in range(3))
    cu = meta(3, dtype=torch.int32)
    for max_q, max_kv in ((150, 150), (200, 260), (1, 140)):
        _api.attention_varlen(q, k, v, cu, cu, max_q, max_kv, shape_classes=(128, 1024))
    _api.attention_varlen(q, k, v, cu, cu, 150, 2000, shape_classes=(128, 1024))  # past the classes
    _api.attention_varlen(q, k, v, cu, cu, 150, 150)  # classes off: powers of two
    assert [(o.max_q, o.max_kv) for o in seen] == [(1024, 1024), (1024, 1024), (1, 1024), (1024, 2048),
                                                   (256, 256)]


def _spans_fit(cfg, call_tensors) -> bool:
    """Every tensor's offsets (i * stride(0), batch b) and its s tokens end within the
    plan's declared tokens (max_tokens: batch * class length), in elements."""
    q, k, v = call_tensors
    for t, tokens in ((q, cfg.max_tokens_q), (k, cfg.max_tokens_kv), (v, cfg.max_tokens_kv)):
        b, s, h, d = t.shape
        if (b - 1) * t.stride(0) + s * h * d > tokens * h * d:
            return False
    return True


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("b,cache_len,n", [(3, 4096, 130), (3, 512, 130), (1, 8192, 130), (4, 2048, 1030)])
def test_a_cache_slice_longer_than_its_class_gets_a_plan_whose_tokens_cover_its_offsets(fake, monkeypatch, training,
                                                                                         b, cache_len, n):
    """A KV-cache slice keeps the cache's batch stride: its last sequence starts at
    (b - 1) * cache_len tokens. A plan declared for the slice's class (b * hi tokens) can
    be shorter than that; the call must then take a class whose tokens cover it, or its
    exact plan, never a plan its offsets run past (inference as well as training)."""
    monkeypatch.setattr(_dense, "raw_stream", lambda device: 7)  # an exact plan runs (recorded) too
    classes = (128, 512)
    cache_k, cache_v = meta(b, cache_len, 2, 64, grad=training), meta(b, cache_len, 2, 64, grad=training)
    q = meta(b, 1 if not training else n, 8, 64, grad=training)
    k, v = cache_k[:, :n], cache_v[:, :n]
    _api.attention(q, k, v, causal_bottom_right=True, shape_classes=classes)
    assert len(fake) == 1
    assert not fake[0].ragged or _spans_fit(fake[0], (q, k, v)), (fake[0].max_tokens_q, fake[0].max_tokens_kv)


def test_a_cache_slice_takes_the_smallest_class_that_covers_its_offsets(fake):
    cache_k, cache_v = meta(3, 4096, 2, 64), meta(3, 4096, 2, 64)
    for n in (130, 131, 200):  # decode steps: one plan, declared for the class covering the cache
        q = meta(3, 1, 8, 64)
        _api.attention(q, cache_k[:, :n], cache_v[:, :n], causal_bottom_right=True,
                         shape_classes=(128, 512, 4096, 8192))
    assert len(fake) == 1 and (fake[0].seqlen_q, fake[0].seqlen_kv) == (1, 4096)


@pytest.mark.parametrize("masks", ["bottom-right", "top-left"])
def test_the_server_benchmarks_stream_asks_only_for_plans_warm_builds(override, monkeypatch, masks):
    """benchmarks/bench_server.py's claim, on CPU: every plan its request stream asks for
    (prefills of distinct lengths, decode steps up to 8192 KV tokens) is one that
    `fastattn warm --seqlens 1..8192` with the same classes and mask builds, on a cuDNN
    with the shape override (top-left: override class plans up to OVERRIDE_MAX)."""
    import argparse

    from fastattn.cli import warm as warm_cli

    monkeypatch.setattr(warm_cli, "_cudnn_version", lambda gpu_file: 92801)  # a cuDNN of 9.21 or newer
    bench = benchmarks.load("bench_server")
    bounds = bench.DEFAULT_CLASSES
    reqs = bench.requests(200, 3, 30)
    assert len({s for s, _ in reqs}) == 200 and all(1 <= s <= 4096 for s, _ in reqs)
    assert max(n for _, kv in reqs for n in kv) <= 8192 and all(kv == sorted(kv) for _, kv in reqs)
    q, q1 = meta(1, 4096, 32, 128), meta(1, 1, 32, 128)
    k, v = meta(1, 8192, 8, 128), meta(1, 8192, 8, 128)
    classes = sc.parse(bounds)
    prefill_mask, decode_mask = bench.MASKS[masks]
    for s, kv in reqs[:60]:
        _api.attention(q[:, :s], k[:, :s], v[:, :s], **prefill_mask, shape_classes=classes)
        for n in kv:
            _api.attention(q1, k[:, :n], v[:, :n], **decode_mask, shape_classes=classes)
    args = argparse.Namespace(file=None, heads=32, heads_kv=8, head_dim=128, head_dim_v=None, dtype="bf16",
                              mask=bench.WARM_MASK[masks], batch=1, training=False, shape_classes=classes,
                              seqlens=(1, 8192))
    warmed, uncovered = warm_cli.class_configs(args)
    assert uncovered == [] and len(warmed) <= (16 if masks == "bottom-right" else 16 + 8)
    assert override and all(cfg in warmed for cfg in override), [c for c in override if c not in warmed][:2]
    # top-left: the prefills of the classes up to OVERRIDE_MAX took override plans
    assert any(c.shape_override for c in override) == (masks == "top-left")


def test_the_server_benchmarks_kernel_table():
    bench = benchmarks.load("bench_server")
    rows = [{"prompt": 100, "decode_kv": 300, "steps": 3, "prefill_class": 128, "decode_class": 512,
             "prefill_class_ms": 1.02, "prefill_exact_ms": 1.0, "decode_class_ms": 0.2, "decode_exact_ms": 0.1,
             "prefill_ratio": 1.02, "decode_ratio": 2.0}]
    lines, out = bench._kernel_table(rows)
    assert out["prefill_128"]["within_5pct"] == 1.0 and out["decode_512"]["worst_ratio"] == 2.0
    assert out["kernel_ms_per_request_class"] == pytest.approx(1.02 + 3 * 0.2)
    assert len(lines) == 3


def test_a_capture_without_a_held_plan_says_how_to_load_it(monkeypatch):
    # A call captured in a CUDA graph takes a plan held before the capture (its class's,
    # else its exact one): the refusal says how to load it.
    from fastattn import AttentionConfig
    from fastattn.errors import InvalidArgumentError

    monkeypatch.setattr(_plans, "capturing", lambda: True)
    monkeypatch.setattr(fastattn.runtime, "planned", lambda cfg, device=None, wait=False: None)
    q = meta(1, 40, 4, 64)
    cfg = AttentionConfig(batch=1, heads_q=4, seqlen_q=40, seqlen_kv=40, head_dim_qk=64, dtype="bf16", layout="bshd")
    with pytest.raises(InvalidArgumentError, match="run the call once before capturing.*class plan if that was"):
        _plans.remember(("test",), cfg, q, q, q, "bshd")


def test_arrays_made_inside_a_capture_are_distinct_and_held(monkeypatch):
    # A launch's offset arrays made in a caller's capture must stay allocated for its
    # graph's replays: freed at once, the allocator hands the next one the same block, and
    # one launch's four offset arrays become one (the last). Here on the CPU, where the
    # allocator reuses freed memory the same way often enough; the check is on what is
    # held, not on addresses.
    monkeypatch.setattr(_shape_classes, "_arrays", bounded.Table("arrays"))
    monkeypatch.setattr(_shape_classes, "_held_by_captures", [])
    monkeypatch.setattr(_shape_classes, "capturing", lambda: True)
    q = torch.zeros(3, 5, 2, 8)
    ptrs = _shape_classes._pointers(q, q[:, :, :1], q[:, :, :1], 5 * 2 * 4, None, None, None, True, stream=0)
    assert _shape_classes._arrays == {}  # nothing kept for eager calls: the fills run only at replay
    held = _shape_classes._held_by_captures
    assert len(held) == 7  # ragged q, k, v, o, stats; the two lengths
    assert len({t.data_ptr() for t in held}) == 7 and set(ptrs.values()) == {t.data_ptr() for t in held}
    assert held[0].tolist() == [0, 80, 160, 240] and held[1].tolist() == [0, 80, 160, 240]
    assert held[3].tolist() == [0, 40, 80, 120] and held[4].tolist() == [0, 10, 20, 30]


# -- shape-override class plans (cuDNN >= 9.21) ----------------------------------------------

def declared_rows(b, s, h, d, upper):
    """A tensor of s rows at the start of a buffer of `upper` (bshd): in an override plan's
    declared storage."""
    return meta(b, upper, h, d)[:, :s]


def test_an_override_class_plan_serves_each_length_at_its_own_shape(override):
    for s in (100, 200, 256, 2):
        q, k, v = declared_rows(1, s, 8, 64, 256), declared_rows(1, s, 2, 64, 256), declared_rows(1, s, 2, 64, 256)
        o = _api.attention(q, k, v, causal=True, shape_classes=(256, 1024))
        assert o.shape == (1, s, 8, 64) and o.is_contiguous()
        plan = _plans.plans[next(iter(_plans.plans))].plan
        _, args, kw = plan.calls[-1]
        # The call's lengths, and each tensor's strides in (b, h, s, d) order (the declared
        # buffers'; o's too); no arrays.
        assert kw == {"at": (s, s, (256 * 512, 64, 512, 1), (256 * 128, 64, 128, 1), (256 * 128, 64, 128, 1),
                             (256 * 512, 64, 512, 1))}
    assert len(override) == 1
    cfg = override[0]
    assert (cfg.shape_override, cfg.ragged, cfg.padding, cfg.seqlen_q, cfg.seqlen_kv, cfg.layout, cfg.mask) == \
        (True, False, False, 256, 256, "bshd", "causal")


@pytest.mark.parametrize("tensors", [
    lambda: (meta(1, 100, 8, 64), meta(1, 100, 2, 64), meta(1, 100, 2, 64)),  # shorter than the class: no storage
    lambda: (declared_rows(2, 100, 8, 64, 256),) + (declared_rows(2, 100, 2, 64, 256),) * 2,  # o not contiguous
    lambda: (meta(2, 100, 8, 64), meta(2, 512, 2, 64)[:, :100], meta(2, 512, 2, 64)[:, :100]),  # other strides
    lambda: (declared_rows(1, 100, 8, 64, 256),) + (meta(1, 200, 2, 64)[:, :100],) * 2,  # a cache too short
])
def test_a_call_outside_the_declared_storage_takes_the_ragged_plan(override, tensors):
    # cuDNN reads an override call's tensors in the declared storage (cudnn-frontend#1148):
    # a call whose tensors do not lie so takes the ragged class plan (where its tensors are
    # packed) or its exact plan.
    q, k, v = tensors()
    _api.attention(q, k, v, causal=True, shape_classes=(256, 1024))
    assert not any(c.shape_override for c in override)


def test_an_override_plan_takes_a_cache_slice_at_the_caches_strides(override):
    # A decode step without a mask (every key of the cache slice is the query's), batch 1: a
    # cache at least as long as the class holds its declared rows, and nothing steps along
    # its batch stride.
    cache_k, cache_v = meta(1, 4096, 2, 128), meta(1, 4096, 2, 128)
    for n in (513, 800, 1024):
        _api.attention(meta(1, 1, 8, 128), cache_k[:, :n], cache_v[:, :n], shape_classes=(512, 1024))
    assert len(override) == 1 and (override[0].seqlen_q, override[0].seqlen_kv) == (1, 1024)
    _, _, kw = _plans.plans[next(iter(_plans.plans))].plan.calls[-1]
    assert kw["at"][:2] == (1, 1024) and kw["at"][3] == (4096 * 256, 128, 256, 1)  # the cache's batch stride
    assert len(_shape_classes._arrays) == 0


@pytest.mark.parametrize("kw", [dict(causal_bottom_right=True), dict(causal_bottom_right=True, window=(64, 0))])
def test_a_bottom_right_diagonal_takes_the_ragged_class_plan(override, kw):
    # cudnn-frontend places a bottom-right diagonal from a plan's declared lengths, which an
    # override would not move (AttentionConfig refuses the pair): such calls take ragged plans.
    for n in (100, 120):
        q, k, v = (meta(1, n, 4, 64) for _ in range(3))
        _api.attention(q, k, v, shape_classes=(128,), **kw)
    assert override and all(not c.shape_override and c.ragged for c in override)


def test_calls_with_lengths_take_the_ragged_class_plan(override):
    q, k, v = meta(3, 50, 4, 64), meta(3, 60, 4, 64), meta(3, 60, 4, 64)
    lq, lkv = meta(3, dtype=torch.int32), meta(3, dtype=torch.int32)
    _api.attention(q, k, v, seq_lens_q=lq, seq_lens_kv=lkv, shape_classes="64")
    assert [(c.ragged, c.shape_override) for c in override] == [(True, False)]


def test_an_override_plan_cudnn_refuses_leaves_the_call_the_ragged_one(override, monkeypatch):
    asked = []

    def plan(cfg, device=None):
        asked.append(cfg)
        if cfg.shape_override:
            raise fastattn.NotSupportedError("shape override: not with this")
        return RecordingPlan(cfg)

    monkeypatch.setattr(fastattn, "plan", plan)
    for s in (100, 120):
        q, k, v = (declared_rows(1, s, 4, 64, 128) for _ in range(3))
        _api.attention(q, k, v, shape_classes=(128,))
    assert [c.shape_override for c in asked] == [True, False]  # each asked once
    _, _, kw = _plans.plans[next(iter(_plans.plans))].plan.calls[-1]
    assert "ragged_q" in kw and "at" not in kw


def test_a_training_call_takes_the_ragged_class_plan(override):
    # (the override is forward only: a training plan's backward graph keeps tensors of its
    # own at the declared lengths)
    q, k, v = (meta(2, 40, 4, 64, grad=True) for _ in range(3))
    o = _api.attention(q, k, v, shape_classes=(64,))
    o.backward(torch.ones_like(o))
    assert [(c.ragged, c.shape_override, c.training) for c in override] == [(True, False, True)]
    with torch.no_grad():
        _api.attention(*(declared_rows(1, 40, 4, 64, 64) for _ in range(3)), shape_classes=(64,))
    assert [c.shape_override for c in override] == [False, True]


def _declared_call(s, upper):
    return declared_rows(1, s, 4, 64, upper), declared_rows(1, s, 2, 64, upper), declared_rows(1, s, 2, 64, upper)


def test_a_class_longer_than_override_max_takes_the_ragged_plan(override):
    # Past OVERRIDE_MAX the override plan keeps the declared length's engine, slower there
    # than the ragged plan (docs/BENCHMARKS.md); the class at the bound still takes it.
    upper = sc.OVERRIDE_MAX
    _api.attention(*_declared_call(2 * upper - 5, 2 * upper), causal=True, shape_classes=(upper, 2 * upper))
    _api.attention(*_declared_call(upper - 5, upper), causal=True, shape_classes=(upper, 2 * upper))
    assert [(c.shape_override, c.ragged, c.seqlen_q) for c in override] == \
        [(False, True, 2 * upper), (True, False, upper)]


def test_override_max_0_turns_the_override_off(override, monkeypatch):
    monkeypatch.setattr(sc, "OVERRIDE_MAX", 0)
    _api.attention(*_declared_call(40, 64), causal=True, shape_classes=(64,))
    assert [(c.shape_override, c.ragged) for c in override] == [(False, True)]


def test_an_expanded_tensor_is_not_given_to_an_override_plan(override, monkeypatch):
    served = []
    monkeypatch.setattr(_dense, "forward_impl", lambda *a: served.append(a) or (a[0], None))
    q = meta(2, 40, 4, 64)
    k, v = (meta(2, 40, 1, 64).expand(2, 40, 4, 64) for _ in range(2))  # a stride of 0
    _api.attention(q, k, v, shape_classes=(64,))
    assert override == [] and len(served) == 1
