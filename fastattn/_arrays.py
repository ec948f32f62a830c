"""Arrays from any CUDA framework for Plan.forward / Plan.backward, checked against the config.

The plan's int arguments are device addresses, taken unchecked (the zero-overhead
path stays in _core.pyx). Anything else reaches this module once per tensor per call
and is checked against the config: device memory on the plan's device, dtype, and
shape and strides that lay out the config's tensor, read in the config's
(batch, head, seq, dim) order or, where the extents tell them apart, in the layout's
memory order (see _Expect). Errors name the tensor and what differs.

How an array is read, cheapest first: a PyTorch tensor through its own attributes
(torch's DLPack export alone costs more than all the checks); plan.allocate's
``DeviceTensor`` through the description it carries (made for this tensor of this
config: not checked again); any other object that exposes DLPack (``__dlpack__``) or
the CUDA Array Interface (CuPy, JAX, Numba, cuda.core) through cuda.core's
``StridedMemoryView``.

Host arrays are refused: forward and backward never copy. Host lengths, offsets and
page tables must be copied to the device by the caller, once; only the seed and offset
of a host_seed config are host values (host_value). Needs no GPU to check DLPack
objects (host arrays are refused before any CUDA call); reading a CUDA Array Interface
needs the driver (cuda.core asks it which device the pointer is on).
"""

from __future__ import annotations

import operator
import sys
from typing import Any, NamedTuple

from . import dtypes
from .config import AttentionConfig
from .errors import InvalidArgumentError, LibraryError

# AttentionConfig.tensor_dtype's names -> the names numpy (and cuda.core) use; item
# sizes by numpy's name (fastattn.dtypes's table, a workspace's uint8 too).
_NUMPY_NAMES = {d.name: d.numpy for d in dtypes.ROWS}
_ITEMSIZE = {d.numpy: d.itemsize for d in dtypes.ROWS}
# The types numpy has only through ml_dtypes, which fastattn does not need: cuda.core
# refuses to name them, naming them in its error.
_ML_DTYPES = tuple(d.numpy for d in dtypes.ROWS if d.ml_dtypes)
# The CUDA Array Interface's type strings (bfloat16 and FP8 have none).
_TYPESTR = {d.numpy: d.typestr for d in dtypes.ROWS if d.typestr is not None}
_SEEN_MAX = 8
_RAGGED_PACKED = ("q", "k", "v", "o", "d_q", "d_k", "d_v", "d_o", "stats")


class ArrayDesc(NamedTuple):
    """What an array says of itself, strides in elements."""

    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str
    device_id: int  # -1: host memory
    device_accessible: bool
    kind: str  # the object's type, for errors


def expected_dtype(cfg: AttentionConfig, name: str) -> str:
    return _NUMPY_NAMES[cfg.dtype_of(name)]


def layout(cfg: AttentionConfig, name: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, element strides) of a buffer made for tensor `name`: the config's
    logical (batch, head, seq, dim) order, or (tokens, heads, dim) for a packed
    (ragged) tensor; (tokens, heads_q) for packed stats."""
    shape, strides = cfg.shape(name), cfg.strides(name)
    if cfg.ragged and name in _RAGGED_PACKED:
        tokens = cfg.max_tokens_kv if name in ("k", "v", "d_k", "d_v") else cfg.max_tokens_q
        _, heads, _, dim = shape
        if name == "stats":
            return (tokens, heads), (heads, 1)
        return (tokens, heads, dim), (heads * dim, dim, 1)
    return shape, strides


def _type_name(obj: Any) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}" if t.__module__ != "builtins" else t.__qualname__


def describe(name: str, obj: Any, cfg: AttentionConfig | None = None) -> ArrayDesc:
    """Reads an array object through cuda.core. Raises TypeError for an object that is
    no array (with why a host sequence is not taken, given `cfg`), LibraryError where
    reading it needs a CUDA driver that is missing."""
    if isinstance(obj, DeviceTensor):
        return obj.desc
    if not (hasattr(obj, "__dlpack__") or hasattr(obj, "__cuda_array_interface__")):
        hint = _host_hint(cfg, name) if cfg is not None and isinstance(obj, (list, tuple)) else ""
        raise TypeError(f"{name}= takes a device address (int) or a device array (DLPack or "
                        f"__cuda_array_interface__), got {_type_name(obj)}{hint}")
    try:
        from cuda.core.utils import StridedMemoryView
    except ImportError as e:  # cuda-python is a dependency: this is a broken install
        raise LibraryError(f"{name}: reading a {_type_name(obj)} needs cuda.core (cuda-python): {e}") from e
    t = type(obj)
    try:
        if t in _legacy_stream_types:
            view = StridedMemoryView.from_dlpack(obj, stream_ptr=_LEGACY_STREAM)
        else:
            # stream_ptr=-1: no stream ordering; the caller orders its work on `stream`.
            view = StridedMemoryView.from_any_interface(obj, stream_ptr=-1)
    except Exception as e:
        if type(e).__name__ == "DynamicLibNotFoundError":
            raise LibraryError(f"{name}: reading a {_type_name(obj)} needs the NVIDIA driver: {e}") from e
        view = _legacy_stream_view(obj) if t not in _legacy_stream_types else None
        if view is None:
            raise InvalidArgumentError(f"{name}: cannot read the {_type_name(obj)} as a strided array: {e}") from e
    try:
        dtype = str(view.dtype)
    except NotImplementedError as e:
        # cuda.core names bfloat16 and the FP8 types only through ml_dtypes, which
        # fastattn does not need; its error names the type.
        named = [t for t in _ML_DTYPES if t in str(e)]
        if not named:
            raise
        dtype = named[0]
    strides = view.strides
    if strides is None:  # C-contiguous, as DLPack and the CAI allow to say
        strides, step = [], 1
        for n in reversed(view.shape):
            strides.append(step)
            step *= n
        strides = tuple(reversed(strides))
    return ArrayDesc(int(view.ptr), tuple(view.shape), tuple(strides), dtype, int(view.device_id),
                     bool(view.is_device_accessible), _type_name(obj))


# DLPack's stream 1: CUDA's legacy default stream. For a producer that refuses -1 (no
# synchronization), which the DLPack standard defines but not every producer takes
# (jaxlib passes it on as a stream handle): it then makes the legacy default stream
# wait for the array, which orders it before fastattn's launch on any blocking stream.
_LEGACY_STREAM = 1
_legacy_stream_types: set = set()  # the array types that needed it (bounded)


def _legacy_stream_view(obj: Any):
    """The view of a device DLPack object read with stream 1 after -1 failed, or None;
    its type then goes straight to stream 1."""
    try:
        device_type = obj.__dlpack_device__()[0]
    except Exception:
        return None
    if device_type != 2:  # kDLCUDA: for host arrays cuda.core never passes -1 on
        return None
    from cuda.core.utils import StridedMemoryView

    try:
        view = StridedMemoryView.from_dlpack(obj, stream_ptr=_LEGACY_STREAM)
    except Exception:
        return None
    if len(_legacy_stream_types) < 64:
        _legacy_stream_types.add(type(obj))
    return view


def _squeeze(shape, strides) -> tuple[tuple[int, int], ...]:
    """The (extent, stride) of each dimension with more than one element, in the order
    listed: a dimension of one element places nothing (its stride is arbitrary, and
    (b, h, s, 1) stats or (b,) lengths are the same memory as the config's 4-d form)."""
    return tuple((n, s) for n, s in zip(shape, strides) if n != 1)


def _extents(pairs) -> tuple[int, ...]:
    return tuple(n for n, _ in pairs)


_INDEX_TENSORS = ("seq_len_q", "seq_len_kv", "ragged_q", "ragged_k", "ragged_v", "ragged_o", "ragged_stats",
                  "cu_seqlens_q", "cu_seqlens_kv",
                  "page_table_k", "page_table_v")


def _host_hint(cfg: AttentionConfig, name: str) -> str:
    """Why a host array is not taken for `name`, where a user might expect it to be."""
    if name in _INDEX_TENSORS:
        return ("; forward and backward never copy (a copy would cost a synchronization per call): "
                "copy the host array to the device once, e.g. torch.as_tensor(a, device='cuda') or cupy.asarray(a)")
    if name in ("seed", "offset") and not cfg.host_seed:
        return "; a config with host_seed=True takes the seed and offset as host values (int or numpy integer)"
    return ""


class _Expect:
    """What tensor `name` of a config must look like, computed once per plan and name
    (Plan._layouts), so that a call's check costs comparisons and a set lookup.

    A dense tensor's shape is read in the config's (batch, head, seq, dim) order or,
    where its extents tell the two apart, in the layout's memory order (bshd:
    (batch, seq, head, dim), as frameworks hold such tensors). Only these two: another
    order of the same (extent, stride) pairs can be a transpose whose extents happen
    to be equal (a square bias, seq == heads), which would run silently wrong. A
    packed (ragged) tensor is (tokens, heads, dim), its tokens any run of dimensions
    (tokens) or (batch, seq) of at least max_tokens."""

    __slots__ = ("dtype", "torch_dtype", "shape", "strides", "forms", "memory", "packed", "seen", "cfg", "last")

    def __init__(self, cfg: AttentionConfig, name: str):
        self.cfg = cfg
        self.dtype = expected_dtype(cfg, name)
        self.torch_dtype = None  # filled on the first torch tensor
        self.shape, self.strides = layout(cfg, name)
        self.packed = cfg.ragged and name in _RAGGED_PACKED
        logical = _squeeze(self.shape, self.strides)
        # Memory order: outermost first (a stable sort: ties keep the logical order).
        order = sorted(range(len(self.shape)), key=lambda i: -self.strides[i])
        self.memory = (tuple(self.shape[i] for i in order), tuple(self.strides[i] for i in order))
        memory = _squeeze(*self.memory)
        self.forms = (logical,) if _extents(memory) == _extents(logical) else (logical, memory)
        # (shape, strides) already seen to pass: a caller passing the same kind of array
        # each call costs a lookup. Bounded: tuples of a torch.Size hash as tuples.
        self.seen: set = set()
        # The (shape, strides) of the last array that passed, compared before hashing (a
        # torch.Size compares as a tuple). One attribute, replaced whole: threads share
        # plans, and a shape and strides kept apart could pair two arrays' halves.
        self.last = (None, None)  # equal to no shape, not even a 0-d array's ()

    def matches(self, shape, strides) -> bool:
        got = _squeeze(shape, strides)
        if not self.packed:
            return got in self.forms
        inner = _squeeze(self.shape[1:], self.strides[1:])
        k = len(inner)
        if len(got) < k or got[len(got) - k:] != inner:
            return False
        lead = got[:len(got) - k]  # the tokens: one run, outer stride = inner extent x inner stride
        for (_, outer), (n, s) in zip(lead, lead[1:]):
            if outer != n * s:
                return False
        if lead and lead[-1][1] != self.strides[0]:
            return False
        tokens = 1
        for n, _ in lead:
            tokens *= n
        return tokens >= self.shape[0]

    def check_layout(self, name: str, shape, strides) -> None:
        last = self.last
        if not (shape == last[0] and strides == last[1]):
            key = (tuple(shape), tuple(strides))
            if key not in self.seen:
                if not self.matches(*key):
                    raise InvalidArgumentError(self._layout_error(name, *key))
                if len(self.seen) < _SEEN_MAX:
                    self.seen.add(key)
            self.last = key

    def _layout_error(self, name: str, shape, strides) -> str:
        if self.packed:
            return (f"{name}: shape {shape} at element strides {strides} does not hold the config's packed {name}: "
                    f"{self.shape} at strides {self.strides} (tokens first, as one dimension or as (batch, seq); "
                    f"at least max_tokens={self.shape[0]} tokens)")
        msg = (f"{name}: shape {shape} at element strides {strides} does not lay out the config's {name}: "
               f"{self.shape} at strides {self.strides} in the config's (batch, head, seq, dim) order")
        if len(self.forms) == 2:
            msg += f", or {self.memory[0]} at strides {self.memory[1]} in memory order"
        elif self.memory != (self.shape, self.strides):
            msg += (f" (its memory order {self.memory[0]} has the same extents, so that order cannot be told apart "
                    f"from a transpose and is not taken: pass the (batch, head, seq, dim) view)")
        return msg + f", layout={_layout_name(self.cfg)}"


def _expect(plan: Any, name: str) -> _Expect:
    cache = getattr(plan, "_layouts", None)
    if cache is None:
        return _Expect(plan.config, name)
    e = cache.get(name)
    if e is None:
        e = cache[name] = _Expect(plan.config, name)
    return e


def _host_error(cfg: AttentionConfig, name: str, kind: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"{name}: device memory needed, got host memory ({kind}){_host_hint(cfg, name)}")


def check(cfg: AttentionConfig, device: int, name: str, d: ArrayDesc, plan: Any = None) -> None:
    """Raises InvalidArgumentError naming `name` and what differs from the config
    (`plan`'s, whose kept expectations are then used)."""
    if not d.device_accessible or d.device_id < 0:
        raise _host_error(cfg, name, d.kind)
    if d.device_id != device:
        raise InvalidArgumentError(f"{name}: on device {d.device_id}, but the plan runs on device {device}")
    e = _Expect(cfg, name) if plan is None else _expect(plan, name)
    if d.dtype != e.dtype:
        raise InvalidArgumentError(f"{name}: dtype {d.dtype}, the config needs {e.dtype}")
    e.check_layout(name, d.shape, d.strides)


def _layout_name(cfg: AttentionConfig) -> str:
    return repr(cfg.layout) if isinstance(cfg.layout, str) else "explicit strides"


# -- PyTorch tensors, read through their own attributes -------------------------------------
# torch's __dlpack__ and __dlpack_device__ are Python functions that cost many times
# what cuda.core's reading of a numpy array costs; torch's own attributes cost a small
# fraction of that. Found from the first tensor's type, never imported.
_torch_types: frozenset = frozenset()
_not_torch: set = set()  # array types seen not to be torch's (bounded)


def _is_torch(t: type) -> bool:
    """Whether `t` is torch.Tensor or nn.Parameter (exact types: a subclass may
    override what its attributes say), remembering torch's types once it is loaded."""
    global _torch_types
    if t in _torch_types:
        return True
    if t in _not_torch:  # every other array type, each call: a lookup, not reading its module
        return False
    module = getattr(t, "__module__", None)
    if type(module) is not str or not module.startswith("torch"):
        if len(_not_torch) < 64:
            _not_torch.add(t)
        return False
    torch = sys.modules.get("torch")
    # getattr: a torch still being imported may lack either yet.
    tensor, parameter = getattr(torch, "Tensor", None), getattr(getattr(torch, "nn", None), "Parameter", None)
    if tensor is None or parameter is None:
        return False
    _torch_types = frozenset({tensor, parameter})
    return t in _torch_types


def _torch_device(plan: Any, name: str, x: Any) -> None:
    """Raises the error for a torch tensor that is not on the plan's CUDA device (the
    fast path tests is_cuda and get_device() inline and calls this only on failure)."""
    if not x.is_cuda:
        device = x.device
        if device.type == "cpu":
            raise _host_error(plan.config, name, "torch.Tensor")
        raise InvalidArgumentError(f"{name}: device memory needed, got a torch.Tensor on {str(device)!r}")
    device = x.get_device()
    if device != plan.device:
        raise InvalidArgumentError(f"{name}: on device {device}, but the plan runs on device {plan.device}")


def _torch_dtype(e: _Expect, name: str, dtype: Any) -> None:
    if e.torch_dtype is None:
        e.torch_dtype = getattr(sys.modules["torch"], e.dtype)
    if dtype is not e.torch_dtype:
        raise InvalidArgumentError(f"{name}: dtype {str(dtype).removeprefix('torch.')}, the config needs {e.dtype}")


def _torch_address(plan: Any, name: str, x: Any) -> int:
    """address() of a torch tensor: the attribute path, whole (see address)."""
    if not (x.is_cuda and x.get_device() == plan.device):
        _torch_device(plan, name, x)
    try:
        e = plan._layouts[name]
    except (KeyError, AttributeError):
        e = _expect(plan, name)
    dtype = x.dtype
    if dtype is not e.torch_dtype:
        _torch_dtype(e, name, dtype)
    shape, strides, last = x.shape, x.stride(), e.last
    if not (shape == last[0] and strides == last[1]):
        e.check_layout(name, shape, strides)
    return x.data_ptr()


def address(plan: Any, name: str, obj: Any) -> int:
    """The device address of array `obj` for tensor `name` of `plan`, checked."""
    t = type(obj)
    if t in _torch_types:
        # _torch_address inline: a Python call would be a good part of this path's cost.
        if not (obj.is_cuda and obj.get_device() == plan.device):
            _torch_device(plan, name, obj)
        try:
            e = plan._layouts[name]
        except (KeyError, AttributeError):
            e = _expect(plan, name)
        dtype = obj.dtype
        if dtype is not e.torch_dtype:
            _torch_dtype(e, name, dtype)
        shape, strides, last = obj.shape, obj.stride(), e.last
        if not (shape == last[0] and strides == last[1]):
            e.check_layout(name, shape, strides)
        return obj.data_ptr()
    if t is DeviceTensor:
        d = obj.desc
        if obj.name == name and obj.config is plan.config and d.device_id == plan.device:
            return d.ptr  # made by Plan.allocate for this tensor of this config: laid out as it
    elif hasattr(obj, "__dlpack__") or hasattr(obj, "__cuda_array_interface__"):
        if _is_torch(t):
            return _torch_address(plan, name, obj)
        d = describe(name, obj)
    elif hasattr(obj, "__index__"):  # an integer-like address (numpy integers)
        return obj.__index__()
    else:
        d = describe(name, obj, plan.config)  # raises the TypeError that names the tensor
    check(plan.config, plan.device, name, d, plan)
    return d.ptr


def _itemsize(dtype: str) -> int:
    if dtype in _ITEMSIZE:
        return _ITEMSIZE[dtype]
    import numpy as np

    return np.dtype(dtype).itemsize


def _torch_workspace(plan: Any, x: Any) -> tuple:
    if not (x.is_cuda and x.get_device() == plan.device):
        _torch_device(plan, "workspace", x)
    return x.shape, x.stride(), x.nbytes, x.data_ptr()


def workspace_address(plan: Any, backward: bool, obj: Any) -> int:
    """The address of a workspace given as an array (any dtype and shape: its bytes
    count), checked for device, size and contiguity; an integer-like object as is.
    Dispatched as address() is, cheapest first."""
    t = type(obj)
    if t in _torch_types:
        shape, strides, have, ptr = _torch_workspace(plan, obj)
    else:
        if t is DeviceTensor:
            d = obj.desc
        elif hasattr(obj, "__dlpack__") or hasattr(obj, "__cuda_array_interface__"):
            if _is_torch(t):
                return workspace_address(plan, backward, obj)  # now in _torch_types
            d = describe("workspace", obj)
        elif hasattr(obj, "__index__"):
            return obj.__index__()
        else:
            d = describe("workspace", obj)  # raises the TypeError that names it
        if not d.device_accessible or d.device_id < 0:
            raise _host_error(plan.config, "workspace", d.kind)
        if d.device_id != plan.device:
            raise InvalidArgumentError(
                f"workspace: on device {d.device_id}, but the plan runs on device {plan.device}")
        shape, strides, ptr = d.shape, d.strides, d.ptr
        have = _itemsize(d.dtype)
        for n in shape:
            have *= n
    # Contiguous: its dimensions, innermost first, one run from stride 1 (a 1-d buffer,
    # the common case, tested without sorting).
    if len(shape) != 1 or (shape[0] > 1 and strides[0] != 1):
        step = 1
        for n, s in sorted(_squeeze(shape, strides), key=lambda p: p[1]):
            if s != step:
                raise InvalidArgumentError(f"workspace: shape {tuple(shape)} at element strides {tuple(strides)} "
                                           f"is not contiguous")
            step *= n
    need = plan.backward_workspace_size if backward else plan.forward_workspace_size
    if have < need:
        raise InvalidArgumentError(f"workspace: {have} bytes, the plan's {'backward' if backward else 'forward'} "
                                   f"needs {need}")
    return ptr


def host_value(name: str, obj: Any) -> int:
    """A host int64 passed by value (config.host_seed's seed and offset): an int, a
    numpy integer or a one-element integer array."""
    try:
        return operator.index(obj)
    except TypeError:  # numpy arrays have __index__ but refuse all but 0-d ones
        pass
    try:
        import numpy as np

        a = np.asarray(obj)
    except Exception:
        a = None
    if a is None or a.size != 1 or a.dtype.kind not in "iu":
        raise TypeError(f"{name}= takes an int64 host value (host_seed=True), got {_type_name(obj)}")
    return int(a.reshape(()))


def stream_handle(obj: Any) -> int:
    """A cudaStream_t as an int from an int, an object with __cuda_stream__ (cuda.core
    Stream, recent PyTorch streams), a PyTorch stream (.cuda_stream) or an integer-like
    object."""
    protocol = getattr(obj, "__cuda_stream__", None)
    if protocol is not None:
        got = protocol()
        if not (isinstance(got, tuple) and len(got) == 2):
            raise TypeError(f"stream=: {_type_name(obj)}.__cuda_stream__() returned {got!r}, not (version, handle)")
        return int(got[1])
    handle = getattr(obj, "cuda_stream", None)  # PyTorch streams from before __cuda_stream__
    if type(handle) is int:
        return handle
    try:
        return operator.index(obj)
    except TypeError:
        pass
    raise TypeError(f"stream= takes a cudaStream_t as an int or an object with __cuda_stream__, got {_type_name(obj)}")


class DeviceTensor:
    """Device memory for one tensor of a config, shaped and strided as the config lays
    it out (made by Plan.allocate). Passed to forward/backward like any array;
    exports DLPack (as bytes, through its cuda.core Buffer) and, but for bfloat16,
    the CUDA Array Interface. Freed when closed or collected."""

    def __init__(self, buffer: Any, desc: ArrayDesc, name: str, config: AttentionConfig | None = None):
        self.buffer, self.desc, self.name, self.config = buffer, desc, name, config

    @property
    def ptr(self) -> int:
        return self.desc.ptr

    @property
    def shape(self) -> tuple[int, ...]:
        return self.desc.shape

    @property
    def strides(self) -> tuple[int, ...]:
        """In elements."""
        return self.desc.strides

    @property
    def dtype(self) -> str:
        return self.desc.dtype

    @property
    def nbytes(self) -> int:
        return int(self.buffer.size)

    @property
    def __cuda_array_interface__(self) -> dict:
        typestr = _TYPESTR.get(self.desc.dtype)
        if typestr is None:
            raise AttributeError(f"{self.desc.dtype} has no CUDA Array Interface type string")
        item = _ITEMSIZE[self.desc.dtype]
        return {"shape": self.shape, "strides": tuple(s * item for s in self.strides), "typestr": typestr,
                "data": (self.ptr, False), "version": 3, "stream": None}

    def __dlpack__(self, *args, **kwargs):
        return self.buffer.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self.buffer.__dlpack_device__()

    def close(self) -> None:
        """Frees the memory; passed again, the tensor is a null pointer (an error),
        not a dangling one."""
        self.buffer.close()
        self.desc = self.desc._replace(ptr=0)

    def __repr__(self) -> str:
        return (f"<fastattn.DeviceTensor {self.name} shape={self.shape} strides={self.strides} "
                f"dtype={self.dtype} device={self.desc.device_id} ptr=0x{self.ptr:x}>")


def scratch_bytes(cfg: AttentionConfig, slot_names: tuple[str, ...], backward: bool) -> tuple[int, ...]:
    """Bytes of each slot's tensor (slot_names: the core's, by slot number) that the
    config's forward (or backward) graph may take, 0 for the others: what
    Plan.load_kernels launches that graph on."""
    from ._slots import NO, SLOTS

    takes = {s.name for s in SLOTS if (s.backward if backward else s.forward) is not NO}
    if not cfg.training:
        takes.discard("stats")  # written by a training plan's forward alone
    sizes = []
    for name in slot_names:
        try:
            sizes.append(max(cfg.storage_elements(name), 1) * cfg.tensor_itemsize(name) if name in takes else 0)
        except InvalidArgumentError:  # a feature's tensor this config does not have
            sizes.append(0)
    return tuple(sizes)


def scratch_lengths(cfg: AttentionConfig) -> tuple[int, int]:
    """The sequence lengths of Plan.load_kernels's launch: the config's own (the kernels'
    common path), each within the packed tokens of a ragged config, whose sequences all
    start at offset 0 there."""
    if cfg.ragged:
        return min(cfg.seqlen_q, cfg.max_tokens_q), min(cfg.seqlen_kv, cfg.max_tokens_kv)
    return cfg.seqlen_q, cfg.seqlen_kv


def allocate(plan: Any, name: str, stream: Any = None) -> DeviceTensor:
    """A new device buffer for tensor `name` of `plan`'s config (its contents
    undefined), allocated stream-ordered on `stream` (default: the device's default
    stream) from the device's memory pool."""
    cfg = plan.config
    if name == "workspace":
        shape, strides, dtype = (max(plan.workspace_size, 1),), (1,), "uint8"
        nbytes = shape[0]
    else:
        shape, strides = layout(cfg, name)  # also rejects an unknown name, naming it
        dtype = expected_dtype(cfg, name)
        nbytes = max(cfg.storage_elements(name), 1) * _ITEMSIZE[dtype]
    from cuda.core import Device, Stream

    dev = Device(plan.device)
    dev.set_current()
    if stream is None:
        s = dev.default_stream
    elif isinstance(stream, Stream):
        s = stream
    elif hasattr(stream, "__cuda_stream__"):  # another framework's stream: cuda.core wraps it
        s = dev.create_stream(stream)
    else:
        s = Stream.from_handle(stream_handle(stream))
    buffer = dev.allocate(nbytes, stream=s)
    desc = ArrayDesc(int(buffer.handle), shape, strides, dtype, plan.device, True, "fastattn.DeviceTensor")
    return DeviceTensor(buffer, desc, name, cfg)
