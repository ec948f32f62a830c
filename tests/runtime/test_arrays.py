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

from helpers.paths import ROOT

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


def memory_order(cfg, name):
    """The dimensions of `name` outermost first: how a framework holds the tensor."""
    _, strides = _arrays.layout(cfg, name)
    return sorted(range(len(strides)), key=lambda i: -strides[i])


@pytest.mark.parametrize("layout", ["bshd", "sbhd", "bhsd"])
@pytest.mark.parametrize("name", DENSE)
def test_the_configs_order_and_the_memory_order_pass(layout, name):
    cfg = CFG.replace(layout=layout)
    _arrays.check(cfg, 0, name, desc_for(cfg, name))
    _arrays.check(cfg, 0, name, desc_for(cfg, name, memory_order(cfg, name)))


def test_other_orders_of_the_same_memory_are_refused():
    # (b, s, d, h) of bshd memory: the same elements, listed in neither order.
    with pytest.raises(InvalidArgumentError, match=r"^q: shape \(2, 16, 32, 4\) .* or \(2, 16, 4, 32\) at strides "
                                                   r"\(2048, 128, 32, 1\) in memory order, layout='bshd'"):
        _arrays.check(CFG, 0, "q", desc_for(CFG, "q", (0, 2, 3, 1)))


def test_a_transposed_square_bias_is_refused():
    # Regression (H200, test_feature_tensors_are_checked_on_the_gpu): with seqlen_q ==
    # seqlen_kv a transposed bias has the same (extent, stride) pairs as the bias, and a
    # check that took any dimension order took it: a silently transposed bias.
    cfg = CFG.replace(seqlen_kv=CFG.seqlen_q, bias="1hss")
    b = desc_for(cfg, "bias")
    _arrays.check(cfg, 0, "bias", b)
    t = b._replace(strides=(b.strides[0], b.strides[1], 1, cfg.seqlen_q))
    with pytest.raises(InvalidArgumentError, match=r"^bias: shape \(1, 4, 16, 16\) at element strides "
                                                   r"\(1024, 256, 1, 16\) does not lay out"):
        _arrays.check(cfg, 0, "bias", t)


def test_seq_equal_to_heads_takes_only_the_configs_order():
    # bshd with seqlen == heads: (b, s, h, d) and (b, h, s, d) have the same extents, so a
    # (b, s, h, d) array cannot be told from bhsd memory in (b, h, s, d) order.
    cfg = CFG.replace(seqlen_q=4)
    _arrays.check(cfg, 0, "q", desc_for(cfg, "q"))
    with pytest.raises(InvalidArgumentError, match=r"^q: .*has the same extents, .*pass the \(batch, head, seq, dim\) "
                                                   r"view"):
        _arrays.check(cfg, 0, "q", desc_for(cfg, "q", (0, 2, 1, 3)))
    with pytest.raises(InvalidArgumentError, match="^q: shape"):  # bhsd memory
        _arrays.check(cfg, 0, "q", desc_for(cfg.replace(layout="bhsd"), "q"))


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
    # Only tokens first: (heads, tokens, dim) is refused even where it is the same memory.
    with pytest.raises(InvalidArgumentError, match="^q: shape"):
        _arrays.check(cfg, 0, "q", q._replace(shape=(4, 32, 32), strides=(32, 128, 1)))
    with pytest.raises(InvalidArgumentError, match="^q: shape"):
        _arrays.check(cfg, 0, "q", q._replace(shape=(4, 32, 32), strides=(32 * 32, 32, 1)))
    # heads == dim: a transposed (tokens, dim, heads) view has the same pairs, and is refused.
    sq = CFG.replace(heads_q=32, heads_kv=32, padding=True, ragged=True)
    good = desc_for(sq, "q")
    _arrays.check(sq, 0, "q", good)
    with pytest.raises(InvalidArgumentError, match="^q: shape"):
        _arrays.check(sq, 0, "q", good._replace(strides=(good.strides[0], 1, 32)))
    # Tokens as (batch, seq) that are not one run: refused.
    with pytest.raises(InvalidArgumentError, match="^q: shape"):
        _arrays.check(cfg, 0, "q", q._replace(shape=(2, 16, 4, 32), strides=(17 * 128, 128, 32, 1)))


@settings(max_examples=200, deadline=None, derandomize=True)
@given(name=st.sampled_from(["cu_seqlens_q", "cu_seqlens_kv"]), batch=st.integers(1, 6),
       extent=st.integers(0, 9), trailing=st.sampled_from([(), (1,), (2,)]), stride=st.sampled_from([1, 2, -1]),
       dtype=st.sampled_from(["int32", "int64", "float32"]))
def test_cumulative_lengths_are_batch_plus_one_int32s(name, batch, extent, trailing, stride, dtype):
    # A ragged plan's cu_seqlens_q / _kv as arrays: (batch + 1,) contiguous int32 (or
    # the same memory with extents of 1 added), anything else refused naming the tensor.
    cfg = CFG.replace(batch=batch, padding=True, ragged=True)
    shape = (extent, *trailing)
    strides = (stride * (trailing[0] if trailing else 1), *((1,) if trailing else ()))
    desc = desc_for(cfg, name, dtype=dtype)._replace(shape=shape, strides=strides)
    # The same memory: the extents past 1 with their strides are (batch + 1) int32s in a row.
    same_memory = [(n, st_) for n, st_ in zip(shape, strides) if n != 1] == [(batch + 1, 1)]
    if same_memory and dtype == "int32":
        _arrays.check(cfg, 0, name, desc)
    else:
        with pytest.raises(InvalidArgumentError, match=f"^{name}: "):
            _arrays.check(cfg, 0, name, desc)


def test_host_cumulative_lengths_are_refused_saying_that_nothing_is_copied():
    plan = SimpleNamespace(config=CFG.replace(padding=True, ragged=True), device=0, _layouts={})
    with pytest.raises(InvalidArgumentError, match="^cu_seqlens_q: device memory needed, got host memory "
                                                   r"\(numpy.ndarray\); forward and backward never copy"):
        _arrays.address(plan, "cu_seqlens_q", np.array([0, 16, 32], dtype=np.int32))


@st.composite
def configs(draw):
    layout = draw(st.sampled_from(["bshd", "sbhd", "bhsd"]))
    hkv = draw(st.sampled_from([1, 2, 4]))
    return AttentionConfig(batch=draw(st.integers(1, 4)), heads_q=hkv * draw(st.integers(1, 3)), heads_kv=hkv,
                           seqlen_q=draw(st.integers(1, 300)), seqlen_kv=draw(st.integers(1, 300)),
                           head_dim_qk=draw(st.sampled_from([64, 128])), head_dim_v=draw(st.sampled_from([64, 128])),
                           dtype=draw(st.sampled_from(["fp16", "bf16"])), layout=layout, training=True)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(cfg=configs(), name=st.sampled_from(DENSE), data=st.data())
def test_any_change_to_a_correct_layout_is_caught_or_the_same_memory(cfg, name, data):
    shape, _ = _arrays.layout(cfg, name)
    mem = memory_order(cfg, name)
    # The memory order where its extents tell it from the config's (else it is refused).
    order = data.draw(st.sampled_from([None, mem])) if [shape[i] for i in mem] != list(shape) else None
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


def _offsets(shape, strides):
    idx = np.indices(shape, dtype=np.int64)
    return sum(idx[i] * strides[i] for i in range(len(shape)))


@st.composite
def small_configs(draw):
    """Configs whose extents often coincide (seq == heads, seq_q == seq_kv, batch == heads)."""
    hkv = draw(st.sampled_from([1, 2]))
    return AttentionConfig(batch=draw(st.sampled_from([1, 2])), heads_q=hkv * draw(st.sampled_from([1, 2])),
                           heads_kv=hkv, seqlen_q=draw(st.sampled_from([1, 2, 4])),
                           seqlen_kv=draw(st.sampled_from([1, 2, 4])), head_dim_qk=8, head_dim_v=8,
                           dtype="bf16", layout=draw(st.sampled_from(["bshd", "sbhd", "bhsd"])), training=True,
                           bias=draw(st.sampled_from(["none", "1hss", "bhss"])))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(cfg=small_configs(), data=st.data())
def test_an_accepted_array_is_the_configs_memory_however_its_dimensions_are_read(cfg, data):
    """Element by element: read in the order its shape names (the config's, or the
    memory order where that differs in extents), an accepted array puts every element
    where the config does; the config's own tensor is accepted."""
    name = data.draw(st.sampled_from(DENSE + (("bias",) if cfg.bias != "none" else ())))
    shape, strides = _arrays.layout(cfg, name)
    perm = data.draw(st.permutations(range(4)))
    got_shape, got_strides = [shape[p] for p in perm], [strides[p] for p in perm]
    if data.draw(st.booleans()):  # swap two dimensions' strides: a transpose, maybe of equal extents
        i, j = data.draw(st.permutations(range(4)))[:2]
        got_strides[i], got_strides[j] = got_strides[j], got_strides[i]
    d = desc_for(cfg, name)._replace(shape=tuple(got_shape), strides=tuple(got_strides))
    try:
        _arrays.check(cfg, 0, name, d)
        accepted = True
    except InvalidArgumentError as e:
        assert str(e).startswith(f"{name}: shape")
        accepted = False
    # Dimensions of one element are read anywhere (they place nothing): compare without them.
    mine = np.squeeze(_offsets(got_shape, got_strides))
    config = _offsets(shape, strides)
    extents = lambda sh: [n for n in sh if n != 1]
    # The readings the contract offers: the config's order, and the memory order where
    # its extents differ (where they do not, the two cannot be told apart from the
    # array, and only the config's order is the contract).
    mem = memory_order(cfg, name)
    readings = [list(range(4))] + ([mem] if extents(shape[p] for p in mem) != extents(shape) else [])
    same = []
    for r in readings:
        if extents(got_shape) == extents(shape[p] for p in r):  # the array can be read this way
            same.append(np.array_equal(mine, np.squeeze(config.transpose(r))))
    if accepted:
        assert same and all(same), "accepted, but some reading of its shape puts elements elsewhere"
    if got_shape == list(shape) and np.array_equal(mine, np.squeeze(config)):
        assert accepted, "the config's own tensor was refused"


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
    assert (good.shape, good.strides) in plan._layouts["q"].seen
    with pytest.raises(InvalidArgumentError, match="^q: shape"):
        _arrays.check(CFG, 0, "q", desc_for(CFG.replace(layout="bhsd"), "q"), plan)
    with pytest.raises(InvalidArgumentError, match="^q: dtype float16"):
        _arrays.check(CFG, 0, "q", desc_for(CFG, "q", (0, 2, 1, 3), dtype="float16"), plan)
    ragged = SimpleNamespace(config=CFG.replace(padding=True, ragged=True), device=0, _layouts={})
    for tokens in range(48, 64):  # 16 good arrays (more tokens than needed): the kept set stays bounded
        _arrays.check(ragged.config, 0, "k", desc_for(ragged.config, "k")._replace(shape=(tokens, 2, 32)), ragged)
    assert len(ragged._layouts["k"].seen) == _arrays._SEEN_MAX


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


# -- PyTorch tensors: read through their own attributes -------------------------------------


@pytest.fixture
def torch_on_device(monkeypatch):
    """torch, with CPU tensors taken as if on device 0: the dtype and layout checks of the
    attribute path run on real tensors (the device test, is_cuda and get_device, is
    the only step this stands in for; the GPU tests run it)."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(_arrays, "_torch_device", lambda plan, name, x: None)
    return torch


def test_torch_tensors_are_checked_through_their_attributes(torch_on_device):
    torch = torch_on_device
    plan = SimpleNamespace(config=CFG, device=0, _layouts={})
    b, h, s, d = CFG.shape("q")
    q = torch.empty((b, s, h, d), dtype=torch.bfloat16)  # bshd, as PyTorch holds it
    for x in (q, q.transpose(1, 2), torch.nn.Parameter(q, requires_grad=False)):
        assert _arrays.address(plan, "q", x) == q.data_ptr()
    assert type(q) in _arrays._torch_types  # found from the tensor's type, then kept
    with pytest.raises(InvalidArgumentError, match="^q: dtype float16, the config needs bfloat16"):
        _arrays.address(plan, "q", q.half())
    with pytest.raises(InvalidArgumentError, match=r"^q: shape \(2, 4, 16, 32\) at element strides "
                                                   r"\(2048, 512, 32, 1\) does not lay out .*layout='bshd'"):
        _arrays.address(plan, "q", q.transpose(1, 2).contiguous())  # bhsd memory
    with pytest.raises(InvalidArgumentError, match=r"^q: shape \(\) at element strides \(\)"):
        _arrays.address(SimpleNamespace(config=CFG, device=0, _layouts={}), "q", torch.zeros((), dtype=torch.bfloat16))
    stats = torch.empty(CFG.shape("stats")[:3], dtype=torch.float32)  # (b, h, s): the same memory
    assert _arrays.address(plan, "stats", stats) == stats.data_ptr()
    ws = torch.empty(256, dtype=torch.uint8)
    assert _arrays.workspace_address(PLAN, True, ws) == ws.data_ptr()
    assert _arrays.workspace_address(PLAN, True, ws.view(torch.float32)) == ws.data_ptr()  # bytes count
    with pytest.raises(InvalidArgumentError, match="^workspace: 128 bytes, the plan's backward needs 256"):
        _arrays.workspace_address(PLAN, True, ws[:128])
    with pytest.raises(InvalidArgumentError, match=r"^workspace: shape \(16, 8\) .* is not contiguous"):
        _arrays.workspace_address(PLAN, False, ws.view(16, 16)[:, :8])


def test_torch_fp8_tensors_are_named_by_torchs_dtypes(torch_on_device):
    torch = torch_on_device
    cfg = AttentionConfig(batch=2, heads_q=4, seqlen_q=16, head_dim_qk=128, dtype="fp8_e4m3", layout="bshd")
    plan = SimpleNamespace(config=cfg, device=0, _layouts={})
    b, h, s, d = cfg.shape("q")
    q = torch.empty((b, s, h, d), dtype=torch.float8_e4m3fn)
    assert _arrays.address(plan, "q", q) == q.data_ptr()
    with pytest.raises(InvalidArgumentError, match="^k: dtype float8_e5m2, the config needs float8_e4m3fn"):
        _arrays.address(plan, "k", q.view(torch.float8_e5m2))


def test_torch_host_and_other_device_tensors_are_refused():
    torch = pytest.importorskip("torch")
    with pytest.raises(InvalidArgumentError, match=r"^k: device memory needed, got host memory \(torch.Tensor\)$"):
        _arrays.address(PLAN, "k", torch.zeros(CFG.shape("k"), dtype=torch.bfloat16))
    with pytest.raises(InvalidArgumentError, match="^v: device memory needed, got a torch.Tensor on 'meta'"):
        _arrays.address(PLAN, "v", torch.empty(CFG.shape("v"), dtype=torch.bfloat16, device="meta"))
    with pytest.raises(InvalidArgumentError, match="^workspace: device memory needed, got host memory"):
        _arrays.workspace_address(PLAN, True, torch.zeros(256, dtype=torch.uint8))


def test_a_torch_subclass_goes_through_dlpack():
    torch = pytest.importorskip("torch")

    class Mine(torch.Tensor):  # may override what its attributes say: not the attribute path
        pass

    x = torch.zeros(CFG.shape("q"), dtype=torch.float16).as_subclass(Mine)
    assert not _arrays._is_torch(type(x))
    with pytest.raises(InvalidArgumentError, match=r"^q: device memory needed, got host memory \(.*Mine\)"):
        _arrays.address(PLAN, "q", x)


def test_checking_arrays_never_imports_torch():
    import subprocess
    import sys

    code = ("import sys, numpy as np\nfrom types import SimpleNamespace\nfrom fastattn import AttentionConfig, _arrays\n"
            "cfg = AttentionConfig(batch=1, heads_q=1, seqlen_q=8, head_dim_qk=64)\n"
            "p = SimpleNamespace(config=cfg, device=0, _layouts={})\n"
            "try:\n    _arrays.address(p, 'q', np.zeros(cfg.shape('q'), np.float16))\nexcept ValueError:\n    pass\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


# -- host arrays where a user might expect them ------------------------------------------


def test_host_lengths_are_refused_saying_that_nothing_is_copied():
    cfg = CFG.replace(padding=True)
    plan = SimpleNamespace(config=cfg, device=0, _layouts={})
    lens = np.full(2, 16, dtype=np.int32)
    with pytest.raises(InvalidArgumentError, match="^seq_len_q: device memory needed, got host memory "
                                                   r"\(numpy.ndarray\); forward and backward never copy"):
        _arrays.address(plan, "seq_len_q", lens)
    with pytest.raises(TypeError, match=r"^seq_len_kv= takes a device address .*got list; forward and backward "
                                        "never copy"):
        _arrays.address(plan, "seq_len_kv", [16, 16])
    with pytest.raises(InvalidArgumentError, match="^seed: device memory needed.*host_seed=True takes the seed"):
        _arrays.address(SimpleNamespace(config=cfg.replace(dropout=0.1), device=0), "seed",
                        np.array([7], dtype=np.int64))
    # q has no such hint: nothing about it suggests a host array.
    with pytest.raises(InvalidArgumentError, match=r"^q: device memory needed, got host memory \(numpy.ndarray\)$"):
        _arrays.address(plan, "q", np.zeros(cfg.shape("q"), np.float16))


# -- DeviceTensor ---------------------------------------------------------------------------


def test_a_closed_device_tensor_is_a_null_pointer_not_a_dangling_one():
    closed = []
    q = _arrays.DeviceTensor(SimpleNamespace(size=0, close=lambda: closed.append(1)), desc_for(CFG, "q"), "q", CFG)
    plan = SimpleNamespace(config=CFG, device=0, _layouts={})
    assert _arrays.address(plan, "q", q) == 1 << 20
    q.close()
    assert closed == [1] and _arrays.address(plan, "q", q) == 0  # execute names the null pointer


def test_a_device_tensor_for_another_device_is_checked():
    q = _arrays.DeviceTensor(SimpleNamespace(size=0), desc_for(CFG, "q"), "q", CFG)
    with pytest.raises(InvalidArgumentError, match="^q: on device 0, but the plan runs on device 1"):
        _arrays.address(SimpleNamespace(config=CFG, device=1, _layouts={}), "q", q)


# -- the public surface -----------------------------------------------------------------------


def test_device_tensor_is_public_and_the_package_is_typed():
    import pathlib
    import tomllib

    import fastattn

    assert "DeviceTensor" in fastattn.__all__ and fastattn.DeviceTensor is _arrays.DeviceTensor
    root = pathlib.Path(fastattn.__file__).parent
    assert (root / "py.typed").is_file() and (root / "_core.pyi").is_file()
    # The checkout's pyproject (the package under test may be installed elsewhere).
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "py.typed" in pyproject["tool"]["setuptools"]["package-data"]["fastattn"]


def test_a_producer_that_refuses_dlpacks_no_sync_stream_is_read_with_the_legacy_stream():
    """jaxlib takes DLPack's stream -1 (no synchronization) as a stream handle; such a
    producer is read again with stream 1 (the legacy default stream), then directly."""
    host = np.zeros(CFG.shape("q"), np.float16)
    streams = []

    class Producer:  # a CUDA array as cuda.core sees it: its bytes here are a numpy array's
        def __dlpack_device__(self):
            return (2, 0)  # kDLCUDA, device 0

        def __dlpack__(self, stream=None, **kwargs):
            streams.append(stream)
            if stream == -1:
                raise RuntimeError("invalid stream handle -1")
            return host.__dlpack__()

    cfg = CFG.replace(dtype="fp16", layout="bhsd")
    plan = SimpleNamespace(config=cfg, device=0, _layouts={})
    assert _arrays.address(plan, "q", Producer()) == host.ctypes.data
    assert _arrays.address(plan, "q", Producer()) == host.ctypes.data
    assert streams == [-1, 1, 1]

    class Broken(Producer):
        def __dlpack__(self, stream=None, **kwargs):
            raise RuntimeError("no export today")

    with pytest.raises(InvalidArgumentError, match="^q: cannot read the .*Broken as a strided array: no export today"):
        _arrays.address(plan, "q", Broken())
