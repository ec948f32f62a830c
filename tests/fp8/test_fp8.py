"""FP8 without a GPU: the config's dtype fields (validation, canonical form, keys), the
FP8 tensors' shapes and dtypes, the core's FP8 slots, and fastattn.torch's FP8 entry
points on meta tensors (fake shapes, traces) and against a recording plan (each scale
reaches its own slot). Numerics are in test_fp8_gpu.py."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastattn import _arrays, config_files, warm
from fastattn.config import FP8_BACKWARD_SCALARS, FP8_FORWARD_SCALARS, AttentionConfig
from fastattn.errors import InvalidArgumentError

BASE = dict(batch=2, heads_q=8, heads_kv=2, seqlen_q=256, head_dim_qk=128)
DTYPE_NAMES = ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2"]


def cfg(**kw):
    return AttentionConfig(**{**BASE, **kw})


# -- config ------------------------------------------------------------------------------

@pytest.mark.parametrize("alias,name", [("fp8_e4m3", "fp8_e4m3"), ("float8_e4m3fn", "fp8_e4m3"),
                                        ("torch.float8_e4m3fn", "fp8_e4m3"), ("e4m3", "fp8_e4m3"),
                                        ("fp8_e5m2", "fp8_e5m2"), ("float8_e5m2", "fp8_e5m2")])
def test_fp8_dtype_names(alias, name):
    c = cfg(dtype=alias)
    assert c.dtype == c.out_dtype == c.grad_dtype == name and c.fp8 and c.itemsize == 1


def test_sixteen_bit_configs_keep_their_canonical_form():
    # The dtype fields follow dtype and stay out of the canonical form (and the key) when they do.
    for dtype in ("fp16", "bf16"):
        d = cfg(dtype=dtype, training=True).to_dict()
        assert "out_dtype" not in d and "grad_dtype" not in d
    assert cfg(out_dtype="bf16") == cfg() and cfg().to_json() == cfg(out_dtype=None, grad_dtype=None).to_json()


def test_fp8_canonical_form_names_only_what_differs():
    plain = cfg(dtype="fp8_e4m3", training=True)
    assert "out_dtype" not in plain.to_dict() and plain.to_dict()["dtype"] == "fp8_e4m3"
    mixed = cfg(dtype="fp8_e4m3", out_dtype="bf16", grad_dtype="fp8_e5m2", training=True)
    d = json.loads(mixed.to_json())
    assert (d["out_dtype"], d["grad_dtype"]) == ("bf16", "fp8_e5m2")
    assert AttentionConfig.from_json(mixed.to_json()) == mixed and mixed != plain
    # replace(): a dtype that followed follows again.
    assert cfg().replace(dtype="fp8_e5m2").out_dtype == "fp8_e5m2"


@pytest.mark.parametrize("kw,field,why", [
    (dict(out_dtype="fp8_e4m3"), "out_dtype", "only an FP8 dtype"),
    (dict(dtype="fp16", grad_dtype="bf16", training=True), "grad_dtype", "only an FP8 dtype"),
    (dict(dtype="fp8_e4m3", grad_dtype="fp8_e5m2"), "grad_dtype", "training=True"),
    (dict(dtype="fp8"), "dtype", "must be one of"),
    (dict(dtype="fp8_e4m3", out_dtype="float32"), "out_dtype", "must be one of"),
    (dict(dtype="fp8_e4m3", out_dtype=["bf16"]), "out_dtype", "must be one of"),
])
def test_bad_dtype_fields_name_the_field(kw, field, why):
    with pytest.raises(InvalidArgumentError, match=rf"^{field}=.*{why}"):
        cfg(**kw)


@settings(max_examples=150, derandomize=True, deadline=None)
@given(dtype=st.sampled_from(DTYPE_NAMES), out=st.one_of(st.none(), st.sampled_from(DTYPE_NAMES + ["int8", 3])),
       grad=st.one_of(st.none(), st.sampled_from(DTYPE_NAMES + ["fp32"])), training=st.booleans())
def test_dtype_fields_property(dtype, out, grad, training):
    try:
        c = cfg(dtype=dtype, out_dtype=out, grad_dtype=grad, training=training)
    except InvalidArgumentError as e:
        assert str(e).split("=")[0] in ("out_dtype", "grad_dtype")
        return
    assert c.out_dtype == (out or dtype) and c.grad_dtype == (grad or dtype)
    assert c.fp8 or (c.out_dtype == c.grad_dtype == dtype)
    assert training or c.grad_dtype == dtype
    assert AttentionConfig.from_json(c.to_json()) == c
    d = c.to_dict()
    assert ("out_dtype" in d) == (c.out_dtype != dtype) and ("grad_dtype" in d) == (c.grad_dtype != dtype)


def test_fp8_tensors_shapes_dtypes_and_sizes():
    c = cfg(dtype="fp8_e4m3", out_dtype="bf16", grad_dtype="fp8_e5m2", training=True)
    for name in FP8_FORWARD_SCALARS + FP8_BACKWARD_SCALARS:
        assert c.shape(name) == (1, 1, 1, 1) and c.strides(name) == (1, 1, 1, 1)
        assert c.dtype_of(name) == "float32" and c.tensor_itemsize(name) == 4 and c.storage_elements(name) == 1
    assert [c.dtype_of(t) for t in ("q", "k", "v", "o", "d_o", "d_q", "d_k", "d_v", "stats")] == [
        "fp8_e4m3"] * 3 + ["bf16"] + ["fp8_e5m2"] * 4 + ["float32"]
    assert c.tensor_itemsize("q") == 1 and c.tensor_itemsize("o") == 2
    assert _arrays.expected_dtype(c, "q") == "float8_e4m3fn" and _arrays.expected_dtype(c, "d_q") == "float8_e5m2"
    assert _arrays.expected_dtype(c, "o") == "bfloat16" and _arrays.expected_dtype(c, "amax_d_p") == "float32"


def test_an_fp8_array_of_the_wrong_dtype_is_named():
    c = cfg(dtype="fp8_e4m3")
    desc = _arrays.ArrayDesc(256, c.shape("q"), c.strides("q"), "bfloat16", 0, True, "torch.Tensor")
    with pytest.raises(InvalidArgumentError, match=r"^q: dtype bfloat16, the config needs float8_e4m3fn"):
        _arrays.check(c, 0, "q", desc)
    scalar = _arrays.ArrayDesc(256, (1,), (1,), "float16", 0, True, "torch.Tensor")
    with pytest.raises(InvalidArgumentError, match=r"^descale_q: dtype float16, the config needs float32"):
        _arrays.check(c, 0, "descale_q", scalar)


def test_kernel_family_and_description():
    bf16, fp8 = cfg(mask="causal"), cfg(mask="causal", dtype="fp8_e4m3", out_dtype="bf16")
    assert "bf16" in warm.kernel_family(bf16) and ("fp8_e4m3", "bf16", "fp8_e4m3") in warm.kernel_family(fp8)
    assert "fp8_e4m3>bf16" in config_files.describe_config(fp8) and "fp8" not in config_files.describe_config(bf16)


def test_builtin_warm_set_has_fp8_rows():
    configs = config_files.builtin_configs()
    fp8 = [c for c in configs if c.fp8]
    assert len(fp8) == 20 and len(configs) == 100 and len(set(configs)) == 100
    assert {c.training for c in fp8} == {False, True} and {c.head_dim_qk for c in fp8} == {128}


def test_probe_and_matrix_flags_take_fp8():
    from fastattn.cli import _main, probe

    parser = _main.build_parser()
    args = parser.parse_args(["probe", "--batch", "1", "--heads-q", "8", "--seqlen-q", "512", "--head-dim-qk", "128",
                              "--dtype", "fp8_e4m3", "--out-dtype", "bf16", "--training", "--grad-dtype",
                              "fp8_e5m2"])
    c = probe.config_from_args(args)
    assert (c.dtype, c.out_dtype, c.grad_dtype) == ("fp8_e4m3", "bf16", "fp8_e5m2")
    args = parser.parse_args(["matrix", "--dtypes", "bf16,fp8_e4m3"])
    assert args.dtypes == ["bf16", "fp8_e4m3"]
    assert parser.parse_args(["matrix"]).dtypes == ["fp16", "bf16"]


# -- the core's slots ----------------------------------------------------------------------

def test_fp8_scalar_lists_follow_the_slot_table():
    # Derived from fastattn/_slots.py (each direction's descale_/scale_/amax_ slots, in the
    # table's order). Pinned here: a change to the slot table that changes a list (or its
    # order, which fastattn.torch's FP8 ops zip with their parameters) shows.
    from fastattn.config import FP8_SCALARS

    assert FP8_FORWARD_SCALARS == ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o",
                                   "amax_s", "amax_o")
    assert FP8_BACKWARD_SCALARS == ("descale_q", "descale_k", "descale_v", "descale_o", "descale_d_o", "descale_s",
                                    "descale_d_p", "scale_s", "scale_d_q", "scale_d_k", "scale_d_v", "scale_d_p",
                                    "amax_d_q", "amax_d_k", "amax_d_v", "amax_d_p")
    assert FP8_SCALARS == tuple(dict.fromkeys(FP8_FORWARD_SCALARS + FP8_BACKWARD_SCALARS))


def test_fp8_slots_are_keywords_of_forward_and_backward():
    _core = pytest.importorskip("fastattn._core", reason="the extension is not built")
    import inspect

    fwd = inspect.signature(_core.Plan.forward).parameters
    bwd = inspect.signature(_core.Plan.backward).parameters
    assert all(n in fwd for n in FP8_FORWARD_SCALARS) and all(n in bwd for n in FP8_BACKWARD_SCALARS)
    assert set(FP8_FORWARD_SCALARS + FP8_BACKWARD_SCALARS) <= set(_core.SLOT_NAMES)
    bare = _core.Plan.__new__(_core.Plan)
    with pytest.raises(TypeError, match=r"^amax_o= takes a device address"):
        bare.forward(16, 16, 16, 16, amax_o="0x10")
    with pytest.raises(Exception, match="not a forward graph"):  # accepted, then refused for the missing graph
        bare.forward(16, 16, 16, 16, **{n: 16 for n in FP8_FORWARD_SCALARS})


# -- measured notes ----------------------------------------------------------------------------

def test_probe_notes_come_from_the_recorded_benchmark(tmp_path):
    from fastattn import perf_notes

    slow = cfg(batch=4, heads_q=32, heads_kv=32, seqlen_q=4096, head_dim_qk=128, mask="causal", dtype="fp8_e4m3",
               training=True)
    fast = slow.replace(mask="none")
    path = tmp_path / "notes.json"
    assert perf_notes.notes(slow, str(path)) == []  # no recorded benchmark, no note
    rows = [{"config": slow.to_dict(), "forward_ratio": 1.26, "backward_ratio": 0.69},
            {"config": fast.to_dict(), "forward_ratio": 1.46, "backward_ratio": 1.29}]
    path.write_text(json.dumps({"format": 1, "gpu": "NVIDIA H200", "date": "2026-11-30", "cudnn": 91900,
                                "rows": rows}))
    (note,) = perf_notes.notes(slow, str(path))
    assert "backward ran at 0.69x bf16's speed" in note and "NVIDIA H200" in note and "bf16 is faster" in note
    assert perf_notes.notes(fast, str(path)) == []
    assert perf_notes.notes(slow.replace(training=False), str(path)) == []  # forward is faster there
    assert perf_notes.notes(slow.replace(dtype="bf16", out_dtype=None, grad_dtype=None), str(path)) == []
    other = tmp_path / "bad.json"
    other.write_text('{"format": 1, "rows": [{"config": {"batch": "x"}}]}')
    assert perf_notes.notes(slow, str(other)) == []
