"""Arrays from any CUDA framework for Plan.forward / Plan.backward, checked against the config.

The plan's int arguments are device addresses, taken unchecked (the zero-overhead
path stays in _core.pyx). Anything else reaches this module once per tensor per call:
an object that exposes DLPack (``__dlpack__``) or the CUDA Array Interface
(``__cuda_array_interface__``) (CuPy, JAX, Numba, PyTorch, cuda.core) is read through
cuda.core's ``StridedMemoryView`` and checked against the config: device memory on the
plan's device, dtype, and shape and strides that lay out the config's tensor (any
dimension order that maps the same elements). Errors name the tensor and what
differs. ``DeviceTensor`` (``plan.allocate(name)``) carries its own description.

Needs no GPU to check DLPack objects (host arrays are refused before any CUDA call);
reading a CUDA Array Interface needs the driver (cuda.core asks it which device the
pointer is on).
"""

from __future__ import annotations

import operator
from typing import Any, NamedTuple

from .config import AttentionConfig
from .errors import InvalidArgumentError, LibraryError

# AttentionConfig.tensor_dtype's names -> the names numpy (and cuda.core) use.
_NUMPY_NAMES = {"fp16": "float16", "bf16": "bfloat16", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2",
                "float32": "float32", "int32": "int32", "int64": "int64"}
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "float32": 4, "int32": 4, "int64": 8,
             "uint8": 1}
# The types numpy has only through ml_dtypes, which fastattn does not need: cuda.core
# refuses to name them, naming them in its error.
_ML_DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e5m2")
# The CUDA Array Interface's type strings (bfloat16 has none).
_TYPESTR = {"float16": "<f2", "float32": "<f4", "int32": "<i4", "int64": "<i8", "uint8": "|u1"}
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


def describe(name: str, obj: Any) -> ArrayDesc:
    """Reads an array object through cuda.core. Raises TypeError for an object that is
    no array, LibraryError where reading it needs a CUDA driver that is missing."""
    if isinstance(obj, DeviceTensor):
        return obj.desc
    if not (hasattr(obj, "__dlpack__") or hasattr(obj, "__cuda_array_interface__")):
        raise TypeError(f"{name}= takes a device address (int) or a device array (DLPack or "
                        f"__cuda_array_interface__), got {_type_name(obj)}")
    try:
        from cuda.core.utils import StridedMemoryView
    except ImportError as e:  # cuda-python is a dependency: this is a broken install
        raise LibraryError(f"{name}: reading a {_type_name(obj)} needs cuda.core (cuda-python): {e}") from e
    try:
        # stream_ptr=-1: no stream ordering; the caller orders its work on `stream`.
        view = StridedMemoryView.from_any_interface(obj, stream_ptr=-1)
    except Exception as e:
        if type(e).__name__ == "DynamicLibNotFoundError":
            raise LibraryError(f"{name}: reading a {_type_name(obj)} needs the NVIDIA driver: {e}") from e
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


def _pairs(shape, strides) -> list[tuple[int, int]]:
    """The (extent, stride) of each dimension that has more than one element: what
    places elements, whatever order the dimensions are listed in."""
    out = [(n, s) for n, s in zip(shape, strides) if n != 1]
    out.sort()
    return out


def _merge(pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merges dimensions that are one contiguous run (outer stride = inner extent x
    inner stride) into one: (batch, seq) of packed tokens becomes (tokens,)."""
    out: list[tuple[int, int]] = []
    for n, s in sorted(pairs, key=lambda p: p[1]):
        if out and out[-1][0] * out[-1][1] == s:
            out[-1] = (out[-1][0] * n, out[-1][1])
        else:
            out.append((n, s))
    return out


def _expected(cfg: AttentionConfig, name: str):
    """(dtype, shape, strides, (extent, stride) pairs or None when packed) of tensor
    `name`. Plans keep theirs by name (Plan._layouts), so that a call's checks cost
    comparisons, not layout arithmetic or hashing a config."""
    shape, strides = layout(cfg, name)
    packed = cfg.ragged and name in _RAGGED_PACKED
    # The last item: (shape, strides) already seen to pass, a set that check() fills
    # (bounded), so a caller passing the same kind of array each call costs a lookup.
    return expected_dtype(cfg, name), shape, strides, None if packed else _pairs(shape, strides), set()


def _expected_for(plan: Any, name: str):
    cache = getattr(plan, "_layouts", None)
    if cache is None:
        return _expected(plan.config, name)
    e = cache.get(name)
    if e is None:
        e = cache[name] = _expected(plan.config, name)
    return e


def check(cfg: AttentionConfig, device: int, name: str, d: ArrayDesc, plan: Any = None) -> None:
    """Raises InvalidArgumentError naming `name` and what differs from the config
    (`plan`'s, whose kept expectations are then used)."""
    if not d.device_accessible or d.device_id < 0:
        raise InvalidArgumentError(f"{name}: device memory needed, got host memory ({d.kind})")
    if d.device_id != device:
        raise InvalidArgumentError(f"{name}: on device {d.device_id}, but the plan runs on device {device}")
    want, shape, strides, pairs, seen = _expected(cfg, name) if plan is None else _expected_for(plan, name)
    if d.dtype != want:
        raise InvalidArgumentError(f"{name}: dtype {d.dtype}, the config needs {want}")
    if pairs is None:  # packed (ragged)
        # Packed tokens: the inner (heads, dim) as the config's, the rest one run of
        # at least the config's max tokens.
        inner = _pairs(shape[1:], strides[1:])
        got = _pairs(d.shape, d.strides)
        ok = all(p in got for p in inner)
        rest = list(got)
        for p in inner:
            if p in rest:
                rest.remove(p)
        rest = _merge(rest)
        ok = ok and len(rest) <= 1
        tokens = rest[0][0] if rest else 1
        if ok and rest:
            ok = rest[0][1] == strides[0]
        if not ok or tokens < shape[0]:
            raise InvalidArgumentError(
                f"{name}: shape {d.shape} at element strides {d.strides} does not hold the config's packed {name}: "
                f"{shape} at strides {strides} (tokens first; at least max_tokens={shape[0]} tokens)")
        return
    if (d.shape, d.strides) in seen:
        return
    if _pairs(d.shape, d.strides) != pairs:
        raise InvalidArgumentError(
            f"{name}: shape {d.shape} at element strides {d.strides} does not lay out the config's {name}: "
            f"{shape} at strides {strides} in (batch, head, seq, dim) order, layout={_layout_name(cfg)} "
            f"(any order of the same dimensions is accepted)")
    if len(seen) < _SEEN_MAX:
        seen.add((d.shape, d.strides))


def _layout_name(cfg: AttentionConfig) -> str:
    return repr(cfg.layout) if isinstance(cfg.layout, str) else "explicit strides"


def address(plan: Any, name: str, obj: Any) -> int:
    """The device address of array `obj` for tensor `name` of `plan`, checked."""
    if isinstance(obj, DeviceTensor):
        if obj.name == name and obj.config is plan.config:
            return obj.desc.ptr  # made by Plan.allocate for this tensor of this config: laid out as it
        d = obj.desc
    elif hasattr(obj, "__dlpack__") or hasattr(obj, "__cuda_array_interface__"):
        d = describe(name, obj)
    elif hasattr(obj, "__index__"):  # an integer-like address (numpy integers)
        return obj.__index__()
    else:
        d = describe(name, obj)  # raises the TypeError that names the tensor
    check(plan.config, plan.device, name, d, plan)
    return d.ptr


def _itemsize(dtype: str) -> int:
    if dtype in _ITEMSIZE:
        return _ITEMSIZE[dtype]
    import numpy as np

    return np.dtype(dtype).itemsize


def workspace_address(plan: Any, backward: bool, obj: Any) -> int:
    """The address of a workspace given as an array (any dtype and shape: its bytes
    count), checked for device, size and contiguity; an integer-like object as is."""
    if not (isinstance(obj, DeviceTensor) or hasattr(obj, "__dlpack__")
            or hasattr(obj, "__cuda_array_interface__")):
        if hasattr(obj, "__index__"):
            return obj.__index__()
    d = describe("workspace", obj)
    if not d.device_accessible or d.device_id < 0:
        raise InvalidArgumentError(f"workspace: device memory needed, got host memory ({d.kind})")
    if d.device_id != plan.device:
        raise InvalidArgumentError(f"workspace: on device {d.device_id}, but the plan runs on device {plan.device}")
    elements = 1
    for n in d.shape:
        elements *= n
    if _merge(_pairs(d.shape, d.strides)) not in ([], [(elements, 1)]):
        raise InvalidArgumentError(f"workspace: shape {d.shape} at element strides {d.strides} is not contiguous")
    need = plan.backward_workspace_size if backward else plan.forward_workspace_size
    have = elements * _itemsize(d.dtype)
    if have < need:
        raise InvalidArgumentError(f"workspace: {have} bytes, the plan's {'backward' if backward else 'forward'} "
                                   f"needs {need}")
    return d.ptr


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
        self.buffer.close()

    def __repr__(self) -> str:
        return (f"<fastattn.DeviceTensor {self.name} shape={self.shape} strides={self.strides} "
                f"dtype={self.dtype} device={self.desc.device_id} ptr=0x{self.ptr:x}>")


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
