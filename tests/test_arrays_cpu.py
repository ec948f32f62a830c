"""fastattn._arrays without a GPU: array objects checked against the config.

Host arrays (numpy, CPU torch tensors) go through cuda.core's StridedMemoryView as
they would on a GPU machine and are refused; device arrays are stood in for by
descriptions (ArrayDesc) of device memory, which check() takes as it takes a real one.
"""

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastattn import AttentionConfig, _arrays
from fastattn.errors import InvalidArgumentError, LibraryError

CFG = AttentionConfig(batch=2, heads_q=4, heads_kv=2, seqlen_q=16, seqlen_kv=24, head_dim_qk=32, head_dim_v=16,
                      dtype="bf16", layout="bshd", training=True)
PLAN = SimpleNamespace(config=CFG, device=0, forward_workspace_size=64, backward_workspace_size=256)
DENSE = ("q", "k", "v", "o", "d_q", "d_k", "d_v", "d_o", "stats")


def desc_for(cfg, name, order=None, device=0, dtype=None, ptr=1 << 20):
    """The description of a correct device array for `name`, its dimensions listed in `order`."""
    shape, strides = _arrays.layout(cfg, name)
    order = order or range(len(shape))
    return _arrays.ArrayDesc(ptr, tuple(shape[i] for i in order), tuple(strides[i] for i in order),
                             dtype or _arrays.expected_dtype(cfg, name), device, True, "test.Array")


# -- host arrays are refused --------------------------------------------------------------


def test_numpy_array_is_refused_as_host_memory():
    a = np.zeros(CFG.shape("q"), dtype=np.float16)
    with pytest.raises(InvalidArgumentError, match=r"^q: device memory needed, got host memory \(numpy.ndarray\)"):
        _arrays.address(PLAN, "q", a)


def test_cpu_torch_tensor_is_refused_as_host_memory():
    torch = pytest.importorskip("torch")
    t = torch.zeros(CFG.shape("k"), dtype=torch.bfloat16)  # bfloat16 without ml_dtypes, too
    with pytest.raises(InvalidArgumentError, match=r"^k: device memory needed, got host memory \(torch.Tensor\)"):
        _arrays.address(PLAN, "k", t)


def test_host_workspace_is_refused():
    with pytest.raises(InvalidArgumentError, match="^workspace: device memory needed"):
        _arrays.workspace_address(PLAN, True, np.zeros(1024, np.uint8))


def test_object_that_is_no_array_is_a_type_error_naming_the_tensor():
    with pytest.raises(TypeError, match=r"^bias= takes a device address \(int\) or a device array"):
        _arrays.address(PLAN, "bias", "0x10")


def test_integer_like_objects_are_addresses():
    assert _arrays.address(PLAN, "q", np.uint64(4096)) == 4096


def test_cuda_array_interface_without_a_driver_is_a_clear_error():
    class CAI:
        __cuda_array_interface__ = {"shape": (2, 16, 4, 32), "typestr": "<f2", "data": (1 << 20, False),
                                    "version": 3, "strides": None}

    # No driver here: cuda.core cannot ask which device the pointer is on. With a
    # driver, the made-up pointer is no allocation: still an error naming q.
    with pytest.raises((LibraryError, InvalidArgumentError), match="^q: "):
        _arrays.address(PLAN, "q", CAI())


# -- the config's layout ----------------------------------------------------------------


@pytest.mark.parametrize("layout", ["bshd", "sbhd", "bhsd"])
@pytest.mark.parametrize("name", DENSE)
def test_the_configs_layout_in_any_dimension_order_passes(layout, name):
    cfg = CFG.replace(layout=layout)
    for order in itertools.permutations(range(4)):
        _arrays.check(cfg, 0, name, desc_for(cfg, name, order))


def test_wrong_dtype_device_and_strides_are_named():
    with pytest.raises(InvalidArgumentError, match="^q: dtype float16, the config needs bfloat16"):
        _arrays.check(CFG, 0, "q", desc_for(CFG, "q", dtype="float16"))
    with pytest.raises(InvalidArgumentError, match="^stats: dtype bfloat16, the config needs float32"):
        _arrays.check(CFG, 0, "stats", desc_for(CFG, "stats", dtype="bfloat16"))
    with pytest.raises(InvalidArgumentError, match="^v: on device 1, but the plan runs on device 0"):
        _arrays.check(CFG, 0, "v", desc_for(CFG, "v", device=1))
    d = desc_for(CFG.replace(layout="bhsd"), "o")  # bhsd memory for a bshd config
    with pytest.raises(InvalidArgumentError, match=r"^o: shape \(2, 4, 16, 16\) at element strides .* layout='bshd'"):
        _arrays.check(CFG, 0, "o", d)


def test_feature_tensors_are_checked():
    cfg = CFG.replace(padding=True, bias="1hss", sinks=True)
    for name in ("seq_len_q", "seq_len_kv", "bias", "sink"):
        _arrays.check(cfg, 0, name, desc_for(cfg, name))
    # A bias with its (seq_q, seq_kv) transposed: not contiguous.
    b = desc_for(cfg, "bias")
    t = b._replace(strides=(b.strides[0], b.strides[1], 1, cfg.seqlen_q))
    with pytest.raises(InvalidArgumentError, match="^bias: shape"):
        _arrays.check(cfg, 0, "bias", t)
    # Lengths as (batch, 1) are the same memory; (batch + 1,) is not.
    _arrays.check(cfg, 0, "seq_len_q", desc_for(cfg, "seq_len_q")._replace(shape=(2, 1), strides=(1, 1)))
    with pytest.raises(InvalidArgumentError, match="^seq_len_q: shape"):
        _arrays.check(cfg, 0, "seq_len_q", desc_for(cfg, "seq_len_q")._replace(shape=(3,)))
    with pytest.raises(InvalidArgumentError, match="^seq_len_kv: dtype int64, the config needs int32"):
        _arrays.check(cfg, 0, "seq_len_kv", desc_for(cfg, "seq_len_kv", dtype="int64"))


def test_ragged_tensors_are_packed_tokens():
    cfg = CFG.replace(padding=True, ragged=True)
    for name in ("q", "k", "v", "o", "d_q", "stats"):
        _arrays.check(cfg, 0, name, desc_for(cfg, name))
    # (batch, seq, heads, dim) packed is the same memory as (tokens, heads, dim).
    q = desc_for(cfg, "q")
    _arrays.check(cfg, 0, "q", q._replace(shape=(2, 16, 4, 32), strides=(16 * 128, 128, 32, 1)))
    with pytest.raises(InvalidArgumentError, match=r"^q: shape \(31, 4, 32\).*at least max_tokens=32"):
        _arrays.check(cfg, 0, "q", q._replace(shape=(31, 4, 32)))
    # The same memory listed in another order passes; heads outermost is other memory.
    _arrays.check(cfg, 0, "q", q._replace(shape=(4, 32, 32), strides=(32, 128, 1)))
    with pytest.raises(InvalidArgumentError, match="^q: shape"):
        _arrays.check(cfg, 0, "q", q._replace(shape=(4, 32, 32), strides=(32 * 32, 32, 1)))


@st.composite
def configs(draw):
    layout = draw(st.sampled_from(["bshd", "sbhd", "bhsd"]))
    hkv = draw(st.sampled_from([1, 2, 4]))
    return AttentionConfig(batch=draw(st.integers(1, 4)), heads_q=hkv * draw(st.integers(1, 3)), heads_kv=hkv,
                           seqlen_q=draw(st.integers(1, 300)), seqlen_kv=draw(st.integers(1, 300)),
                           head_dim_qk=draw(st.sampled_from([64, 128])), head_dim_v=draw(st.sampled_from([64, 128])),
                           dtype=draw(st.sampled_from(["fp16", "bf16"])), layout=layout, training=True)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(cfg=configs(), name=st.sampled_from(DENSE), order=st.permutations(range(4)), data=st.data())
def test_any_change_to_a_correct_layout_is_caught_or_the_same_memory(cfg, name, order, data):
    good = desc_for(cfg, name, order)
    _arrays.check(cfg, 0, name, good)
    i = data.draw(st.integers(0, 3))
    kind = data.draw(st.sampled_from(["extent", "stride"]))
    shape, strides = list(good.shape), list(good.strides)
    if kind == "extent":
        shape[i] += data.draw(st.integers(1, 3))
    else:
        strides[i] += data.draw(st.integers(1, 64))
    bad = good._replace(shape=tuple(shape), strides=tuple(strides))
    if kind == "stride" and good.shape[i] == 1:
        _arrays.check(cfg, 0, name, bad)  # a dimension of one element: its stride places nothing
        return
    with pytest.raises(InvalidArgumentError, match=f"^{name}: shape"):
        _arrays.check(cfg, 0, name, bad)


# -- host values, streams, workspace ------------------------------------------------------


def test_host_values():
    assert _arrays.host_value("seed", 7) == 7
    assert _arrays.host_value("seed", np.int64(-3)) == -3
    assert _arrays.host_value("offset", np.array([11], dtype=np.int64)) == 11
    with pytest.raises(TypeError, match="^offset= takes an int64 host value"):
        _arrays.host_value("offset", np.array([1.5]))
    with pytest.raises(TypeError, match="^seed= takes an int64 host value"):
        _arrays.host_value("seed", np.array([1, 2]))


def test_stream_objects():
    class S:
        def __cuda_stream__(self):
            return (0, 0xABC0)

    assert _arrays.stream_handle(S()) == 0xABC0
    assert _arrays.stream_handle(SimpleNamespace(cuda_stream=0xDE00)) == 0xDE00  # PyTorch's attribute
    assert _arrays.stream_handle(np.int64(16)) == 16
    with pytest.raises(TypeError, match="^stream= takes a cudaStream_t"):
        _arrays.stream_handle("default")

    class Bad:
        def __cuda_stream__(self):
            return 5

    with pytest.raises(TypeError, match=r"^stream=: .*Bad.__cuda_stream__\(\) returned 5"):
        _arrays.stream_handle(Bad())


def _device_tensor(nbytes, shape=None, strides=None, device=0):
    shape = shape or (nbytes,)
    strides = strides or (1,)
    desc = _arrays.ArrayDesc(1 << 20, shape, strides, "uint8", device, True, "fastattn.DeviceTensor")
    return _arrays.DeviceTensor(SimpleNamespace(size=nbytes), desc, "workspace")


def test_workspace_objects_are_checked_for_size_device_and_contiguity():
    assert _arrays.workspace_address(PLAN, True, _device_tensor(256)) == 1 << 20
    assert _arrays.workspace_address(PLAN, False, _device_tensor(64)) == 1 << 20
    with pytest.raises(InvalidArgumentError, match="^workspace: 128 bytes, the plan's backward needs 256"):
        _arrays.workspace_address(PLAN, True, _device_tensor(128))
    with pytest.raises(InvalidArgumentError, match="^workspace: on device 1"):
        _arrays.workspace_address(PLAN, False, _device_tensor(64, device=1))
    with pytest.raises(InvalidArgumentError, match="^workspace: shape .* is not contiguous"):
        _arrays.workspace_address(PLAN, False, _device_tensor(512, shape=(16, 32), strides=(64, 1)))


def test_device_tensor_exports_the_cuda_array_interface_but_for_bfloat16():
    t = _device_tensor(256)
    cai = t.__cuda_array_interface__
    assert cai["typestr"] == "|u1" and cai["data"] == (1 << 20, False) and cai["shape"] == (256,)
    desc = desc_for(CFG, "q")  # bf16: no CAI type string
    bf = _arrays.DeviceTensor(SimpleNamespace(size=0), desc, "q")
    assert not hasattr(bf, "__cuda_array_interface__")
    assert _arrays.describe("q", bf) is desc


def test_a_plans_kept_expectations_still_catch_a_wrong_layout():
    plan = SimpleNamespace(config=CFG, device=0, _layouts={})
    good = desc_for(CFG, "q", (0, 2, 1, 3))  # bshd memory listed as (b, s, h, d), as frameworks do
    for _ in range(2):
        _arrays.check(CFG, 0, "q", good, plan)
    assert (good.shape, good.strides) in plan._layouts["q"][-1]
    with pytest.raises(InvalidArgumentError, match="^q: shape"):
        _arrays.check(CFG, 0, "q", desc_for(CFG.replace(layout="bhsd"), "q"), plan)
    with pytest.raises(InvalidArgumentError, match="^q: dtype float16"):
        _arrays.check(CFG, 0, "q", desc_for(CFG, "q", (0, 2, 1, 3), dtype="float16"), plan)
    for order in itertools.permutations(range(4)):  # 24 good orders: the kept set stays bounded
        _arrays.check(CFG, 0, "q", desc_for(CFG, "q", order), plan)
    assert len(plan._layouts["q"][-1]) == _arrays._SEEN_MAX


def test_allocated_tensors_skip_the_check_only_for_their_own_tensor_and_config():
    plan = SimpleNamespace(config=CFG, device=0, _layouts={})
    q = _arrays.DeviceTensor(SimpleNamespace(size=0), desc_for(CFG, "q"), "q", CFG)
    assert _arrays.address(plan, "q", q) == q.ptr
    assert _arrays.address(plan, "d_q", q) == q.ptr  # checked in full: the same layout
    with pytest.raises(InvalidArgumentError, match="^k: shape"):
        _arrays.address(plan, "k", q)
    other = SimpleNamespace(config=CFG.replace(layout="bhsd"), device=0, _layouts={})
    with pytest.raises(InvalidArgumentError, match="^q: shape"):
        _arrays.address(other, "q", q)
