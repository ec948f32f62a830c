# cython: language_level=3, embedsignature=True
# distutils: language = c++
"""fastattn's only extension module: plan objects over the C++ core in csrc/.

Thin by design: build, serialize, deserialize and execute call straight into C++
with the GIL released; a C++ status becomes an exception through one table
(fastattn.errors). Files, keys and policy live in Python modules, not here.
"""

from libc.stdint cimport int64_t, intptr_t, uint8_t, uint64_t
from libc.string cimport memset
from libcpp cimport bool as cbool
from libcpp.string cimport string
from libcpp.vector cimport vector

from fastattn import _arrays, defects as _defects
from fastattn.errors import CorruptPlanError, InvalidArgumentError, NotSupportedError, error_for_code

# The core's Config and its enums (csrc/config_gen.h) and the conversion _c_config, generated
# from AttentionConfig's field registry by tools/gen_config.py.
include "_core_config.pxi"


cdef extern from "fastattn.h" namespace "fastattn" nogil:
    cdef enum class Code(int):
        kOk

    cdef cppclass Status:
        Code code
        string message
        cbool ok()

    # Anonymous: Cython indexes arrays only with plain integer constants.
    cdef enum:
        kSlotQ, kSlotK, kSlotV, kSlotO, kSlotStats, kSlotDO, kSlotDQ, kSlotDK, kSlotDV,
        kSlotSeqLenQ, kSlotSeqLenKV, kSlotRaggedQ, kSlotRaggedK, kSlotRaggedV, kSlotRaggedO,
        kSlotBias, kSlotDBias, kSlotSeed, kSlotOffset, kSlotSink, kSlotDSink,
        kSlotPageTableK, kSlotPageTableV, kSlotRaggedStats,
        kSlotDescaleQ, kSlotDescaleK, kSlotDescaleV, kSlotDescaleS, kSlotScaleS, kSlotScaleO, kSlotAmaxS, kSlotAmaxO,
        kSlotDescaleO, kSlotDescaleDO, kSlotDescaleDP, kSlotScaleDQ, kSlotScaleDK, kSlotScaleDV, kSlotScaleDP,
        kSlotAmaxDQ, kSlotAmaxDK, kSlotAmaxDV, kSlotAmaxDP, kSlotCuSeqlensQ, kSlotCuSeqlensKV, kNumSlots

    cdef enum class Direction(int):
        kForward
        kBackward

    cdef cppclass GraphInfo:
        int64_t workspace_size
        string engine_name
        double build_ms

    cdef cppclass DeviceInfo:
        string name
        int major, minor, sm_count, driver_version, runtime_version

    cdef cppclass Graph:
        pass

    cdef cppclass GraphPtr:
        Graph* get()

    const char* slot_name(int slot)
    cdef struct StatusName:
        int code
        const char* python
    const StatusName kStatusNames[]
    const int kNumStatusNames

    Status load_cudnn(const string& path, int64_t* version)
    int64_t cudnn_version()
    int64_t cudnn_header_version()
    int64_t frontend_version()
    const char* plan_policy()
    Status device_count(int* count)
    Status current_device(int* device)
    Status stream_capturing(intptr_t stream, cbool* capturing)
    Status device_info(int device, DeviceInfo* out)
    Status build_graph(const Config& cfg, Direction dir, int device, GraphPtr* out, GraphInfo* info)
    Status serialize_graph(const Graph* g, vector[uint8_t]* blob)
    Status deserialize_graph(const uint8_t* data, size_t size, const Config& cfg, Direction dir, int device,
                             GraphPtr* out, GraphInfo* info)
    Status execute(const Graph* g, Direction dir, int device, const intptr_t* slots, intptr_t workspace,
                   intptr_t stream)


cdef inline object _error(const Status& st, str prefix=None):
    msg = st.message.decode("utf-8", "replace")
    if prefix:
        msg = f"{prefix}: {msg}"
    return error_for_code(<int>st.code, msg)


def init_cudnn(str path):
    """Hands the already-loaded libcudnn at `path` to the core; returns its version."""
    cdef string p = path.encode()
    cdef int64_t version = 0
    cdef Status st
    with nogil:
        st = load_cudnn(p, &version)
    if not st.ok():
        raise _error(st)
    return version


def versions():
    """(cuDNN loaded at run time or 0, cuDNN headers built against, cudnn-frontend built against)."""
    return cudnn_version(), cudnn_header_version(), frontend_version()


def policy():
    """How the core chooses a plan among cuDNN's candidates (part of the cache key)."""
    return plan_policy().decode()


def get_device_count():
    cdef int n = 0
    cdef Status st = device_count(&n)
    if not st.ok():
        raise _error(st)
    return n


def get_current_device():
    cdef int d = 0
    cdef Status st = current_device(&d)
    if not st.ok():
        raise _error(st)
    return d


def get_device_info(int device):
    """A dict: name, compute capability, SM count, driver and runtime versions."""
    cdef DeviceInfo info
    cdef Status st
    with nogil:
        st = device_info(device, &info)
    if not st.ok():
        raise _error(st)
    return {
        "name": info.name.decode("utf-8", "replace"),
        "compute_capability": (info.major, info.minor),
        "sm_count": info.sm_count,
        "driver_version": info.driver_version,
        "runtime_version": info.runtime_version,
    }


# The tensors' names in slot order, from the one slot table (fastattn_abi.h): the
# keyword names of forward and backward.
SLOT_NAMES = tuple(slot_name(i).decode() for i in range(kNumSlots))


def status_codes():
    """{exception class name in fastattn.errors: status code}: fastattn_abi.h's table of
    the codes every call into the core returns (kOk left out)."""
    return {kStatusNames[i].python.decode(): kStatusNames[i].code for i in range(kNumStatusNames)
            if kStatusNames[i].code != 0}


cdef intptr_t _address(Plan p, str name, object x) except? 0:
    """A device address from anything that is not exactly an int (the fast path's
    type): integer-like objects (numpy integers) through __index__, device arrays
    (PyTorch, DLPack, __cuda_array_interface__, plan.allocate's) checked against the
    config by fastattn._arrays, once per call.

    A PyTorch tensor that is what fastattn._arrays last accepted for this tensor of
    this plan (device, dtype, shape and strides all equal) is taken here, compiled,
    which costs less than the trip through _arrays, most of what is left being torch's
    own attributes. Anything else, accepted or not, goes to _arrays, the one place that
    decides and raises."""
    if type(x) in _arrays._torch_types:
        e = p._layouts.get(name)
        # e.torch_dtype is the config's dtype and e.last a (shape, strides) that
        # passed, both set by _arrays only: equal to them is what _arrays accepts.
        if e is not None and x.is_cuda and x.get_device() == p.device and x.dtype is e.torch_dtype:
            last = e.last
            if x.shape == last[0] and x.stride() == last[1]:
                return x.data_ptr()
    return _arrays.address(p, name, x)


cdef class Plan:
    """A built (or loaded) cuDNN attention plan for one AttentionConfig on one device.

    Made by fastattn.plan(config); not constructed directly. Holds the forward graph
    and, when config.training, the backward graph.

    Attributes:
      config: the AttentionConfig.
      device: the CUDA device the plan runs on.
      forward_workspace_size, backward_workspace_size: bytes of workspace each
        direction needs (0: none, and workspace may be 0).
      workspace_size: the larger of the two: one buffer of this size serves both.
      forward_engine, backward_engine: cuDNN's names of the chosen plans.
      forward_ms, backward_ms: wall time to build (or deserialize) each graph.
      defects: the fastattn.defects.Decision its graphs were made under: the known cuDNN
        defects they avoid and how (empty for most configs).
    """

    cdef GraphPtr _fwd
    cdef GraphPtr _bwd
    cdef readonly object config
    cdef readonly int device
    cdef readonly int64_t forward_workspace_size
    cdef readonly int64_t backward_workspace_size
    cdef readonly str forward_engine
    cdef readonly str backward_engine
    cdef readonly double forward_ms
    cdef readonly double backward_ms
    cdef Config _c
    cdef Config _c_bwd  # _c with the defects' backward remedy (full_lengths), when one applies
    cdef cbool _training
    cdef readonly object defects
    # What fastattn._arrays expects of each tensor, by name, filled on first use.
    cdef readonly dict _layouts

    def __init__(self):
        raise TypeError("Plan objects are made by fastattn.plan(config)")

    @property
    def workspace_size(self):
        return max(self.forward_workspace_size, self.backward_workspace_size)

    @property
    def training(self):
        return self._training

    def __repr__(self):
        return (f"<fastattn.Plan device={self.device} forward={self.forward_engine!r} "
                f"backward={self.backward_engine!r} workspace={self.workspace_size} config={self.config.to_json()}>")

    def forward(self, q, k, v, o, stats=0, workspace=0, stream=0, seq_len_q=0, seq_len_kv=0, *,
                ragged_q=0, ragged_k=0, ragged_v=0, ragged_o=0, ragged_stats=0, bias=0, seed=0, offset=0, sink=0,
                page_table_k=0, page_table_v=0, descale_q=0, descale_k=0, descale_v=0, descale_s=0, scale_s=0,
                scale_o=0, amax_s=0, amax_o=0, cu_seqlens_q=0, cu_seqlens_kv=0):
        """Runs attention forward: o = softmax(scale * q @ k^T, masked) @ v.

        Every tensor (and the workspace) is a CUDA device address as an int (16-byte
        aligned; unchecked, the zero-overhead path) or a device array: a PyTorch
        tensor, DLPack, __cuda_array_interface__ or plan.allocate(name), checked against
        the config (device, dtype, shape and strides; see fastattn._arrays). An array's
        shape is read in the (batch, head, seq, dim) order below or in the layout's
        memory order (bshd: (batch, seq, head, dim)) where the extents tell the two
        apart. Host arrays are refused: nothing is copied, so lengths, offsets and page
        tables built on the host go to the device first (with config.host_seed, seed
        and offset are host values: an int or a numpy integer). stream is a
        cudaStream_t as an int (0: the legacy default stream) or a stream object
        (__cuda_stream__: cuda.core Stream, PyTorch streams). Shapes, strides and dtype
        are the config's (see fastattn.config): q (b, hq, sq, dqk), k (b, hkv, skv, dqk),
        v (b, hkv, skv, dv), o (b, hq, sq, dv) in config.dtype; stats (b, hq, sq, 1)
        float32, contiguous, required when config.training and 0 otherwise; workspace
        of plan.forward_workspace_size bytes (0 allowed when that is 0).
        The config's features take more tensors, each required when the feature is on
        and 0 otherwise (config.shape(name) gives each one's shape):
          seq_len_q, seq_len_kv (padding): int32 (b,) lengths;
          ragged_q, ragged_k, ragged_v, ragged_o (ragged): int32 (b + 1,) element
            offsets of each sequence's first token in q, k, v, o; ragged_stats
            (ragged and training) the same in the packed float32 stats (tokens, hq);
          or, in their place, cu_seqlens_q, cu_seqlens_kv (ragged): int32 (b + 1,)
            cumulative token counts, FlashAttention's (4-byte aligned; the same array
            twice for self-attention), from which the plan computes the lengths and
            offsets into its workspace, on `stream`, as part of the launch;
          bias (bias): config.dtype, the bias's shape, contiguous;
          seed, offset (dropout): int64 scalars, Philox's seed and offset (with
            config.host_seed, the values themselves, not addresses);
          sink (sinks): float32 (1, hq, 1, 1);
          page_table_k, page_table_v (page_size): int32 (b, 1, pages per sequence, 1).
        With an FP8 dtype, q, k, v are config.dtype and o config.out_dtype, and the
        forward takes float32 (1, 1, 1, 1) scalars: descale_q, descale_k, descale_v
        (each tensor's real values are its FP8 values times its descale), descale_s and
        scale_s (the softmax probabilities' FP8 round trip inside the kernel), scale_o
        (o is stored as its real values times scale_o); it writes amax_s and amax_o,
        the largest |value| of the probabilities and of o before scaling.

        Asynchronous on `stream`: nothing is allocated, copied or synchronized.
        Raises InvalidArgumentError for a null, misaligned or unexpected pointer or an
        array that does not match the config or is in host memory (naming the tensor),
        TypeError for an argument that is neither, CudnnError or CudaError when the
        launch fails.
        """
        cdef intptr_t t[kNumSlots]
        cdef int64_t host[2]
        cdef intptr_t ws
        cdef Status st
        memset(t, 0, sizeof(t))
        _put(self, t, kSlotQ, q)
        _put(self, t, kSlotK, k)
        _put(self, t, kSlotV, v)
        _put(self, t, kSlotO, o)
        _put(self, t, kSlotStats, stats)
        _put(self, t, kSlotSeqLenQ, seq_len_q)
        _put(self, t, kSlotSeqLenKV, seq_len_kv)
        _put(self, t, kSlotRaggedQ, ragged_q)
        _put(self, t, kSlotRaggedK, ragged_k)
        _put(self, t, kSlotRaggedV, ragged_v)
        _put(self, t, kSlotRaggedO, ragged_o)
        _put(self, t, kSlotRaggedStats, ragged_stats)
        _put(self, t, kSlotBias, bias)
        _put(self, t, kSlotSeed, seed)
        _put(self, t, kSlotOffset, offset)
        _put(self, t, kSlotSink, sink)
        _put(self, t, kSlotPageTableK, page_table_k)
        _put(self, t, kSlotPageTableV, page_table_v)
        _put(self, t, kSlotDescaleQ, descale_q)
        _put(self, t, kSlotDescaleK, descale_k)
        _put(self, t, kSlotDescaleV, descale_v)
        _put(self, t, kSlotDescaleS, descale_s)
        _put(self, t, kSlotScaleS, scale_s)
        _put(self, t, kSlotScaleO, scale_o)
        _put(self, t, kSlotAmaxS, amax_s)
        _put(self, t, kSlotAmaxO, amax_o)
        _put(self, t, kSlotCuSeqlensQ, cu_seqlens_q)
        _put(self, t, kSlotCuSeqlensKV, cu_seqlens_kv)
        ws = <intptr_t>workspace if type(workspace) is int else _workspace(self, False, workspace)
        st = _launch(self, Direction.kForward, t, host, ws, _stream(stream))
        if not st.ok():
            raise _error(st)

    def backward(self, q, k, v, o, d_o, stats, d_q, d_k, d_v, workspace=0, stream=0, seq_len_q=0, seq_len_kv=0, *,
                 ragged_q=0, ragged_k=0, ragged_v=0, ragged_o=0, ragged_stats=0, bias=0, d_bias=0, seed=0, offset=0,
                 sink=0, d_sink=0, descale_q=0, descale_k=0, descale_v=0, descale_o=0, descale_d_o=0, descale_s=0,
                 descale_d_p=0, scale_s=0, scale_d_q=0, scale_d_k=0, scale_d_v=0, scale_d_p=0, amax_d_q=0,
                 amax_d_k=0, amax_d_v=0, amax_d_p=0, cu_seqlens_q=0, cu_seqlens_kv=0):
        """Runs attention backward: writes d_q, d_k, d_v from q, k, v, the forward's o and
        stats, and the output gradient d_o.

        Device addresses as ints or device arrays, and stream, as forward takes them.
        d_q, d_k, d_v, d_o have the shapes
        and strides of q, k, v, o, in config.dtype; stats is the float32 tensor the
        training forward wrote; workspace of plan.backward_workspace_size bytes. The
        feature tensors are forward's (give backward the same seed and offset: the same
        dropout mask; cumulative lengths or lengths and offsets, as forward), plus d_bias (bias_grad: the bias's shape and dtype) and d_sink
        (sinks: float32 (1, hq, 1, 1)), which backward writes.
        With an FP8 dtype: o is config.out_dtype, d_o, d_q, d_k, d_v config.grad_dtype,
        and backward takes the float32 (1, 1, 1, 1) descales of q, k, v, o, d_o, s (the
        forward's) and d_p (the probabilities' gradient inside the kernel), the scales
        of s, d_q, d_k, d_v and d_p, and writes amax_d_q, amax_d_k, amax_d_v, amax_d_p.
        Needs a plan built with training=True. Asynchronous on `stream`; with GQA the
        kernels accumulate d_k and d_v internally, so nothing needs zeroing first.

        Raises InvalidArgumentError (bad pointer, an array that does not match the
        config, plan without backward), TypeError, CudnnError or CudaError when the
        launch fails.
        """
        cdef intptr_t t[kNumSlots]
        cdef int64_t host[2]
        cdef intptr_t ws
        cdef Status st
        if not self._training:
            raise InvalidArgumentError("this plan has no backward graph: build it with training=True")
        memset(t, 0, sizeof(t))
        _put(self, t, kSlotQ, q)
        _put(self, t, kSlotK, k)
        _put(self, t, kSlotV, v)
        _put(self, t, kSlotO, o)
        _put(self, t, kSlotDO, d_o)
        _put(self, t, kSlotStats, stats)
        _put(self, t, kSlotDQ, d_q)
        _put(self, t, kSlotDK, d_k)
        _put(self, t, kSlotDV, d_v)
        _put(self, t, kSlotSeqLenQ, seq_len_q)
        _put(self, t, kSlotSeqLenKV, seq_len_kv)
        _put(self, t, kSlotRaggedQ, ragged_q)
        _put(self, t, kSlotRaggedK, ragged_k)
        _put(self, t, kSlotRaggedV, ragged_v)
        _put(self, t, kSlotRaggedO, ragged_o)
        _put(self, t, kSlotRaggedStats, ragged_stats)
        _put(self, t, kSlotBias, bias)
        _put(self, t, kSlotDBias, d_bias)
        _put(self, t, kSlotSeed, seed)
        _put(self, t, kSlotOffset, offset)
        _put(self, t, kSlotSink, sink)
        _put(self, t, kSlotDSink, d_sink)
        _put(self, t, kSlotDescaleQ, descale_q)
        _put(self, t, kSlotDescaleK, descale_k)
        _put(self, t, kSlotDescaleV, descale_v)
        _put(self, t, kSlotDescaleO, descale_o)
        _put(self, t, kSlotDescaleDO, descale_d_o)
        _put(self, t, kSlotDescaleS, descale_s)
        _put(self, t, kSlotDescaleDP, descale_d_p)
        _put(self, t, kSlotScaleS, scale_s)
        _put(self, t, kSlotScaleDQ, scale_d_q)
        _put(self, t, kSlotScaleDK, scale_d_k)
        _put(self, t, kSlotScaleDV, scale_d_v)
        _put(self, t, kSlotScaleDP, scale_d_p)
        _put(self, t, kSlotAmaxDQ, amax_d_q)
        _put(self, t, kSlotAmaxDK, amax_d_k)
        _put(self, t, kSlotAmaxDV, amax_d_v)
        _put(self, t, kSlotAmaxDP, amax_d_p)
        _put(self, t, kSlotCuSeqlensQ, cu_seqlens_q)
        _put(self, t, kSlotCuSeqlensKV, cu_seqlens_kv)
        ws = <intptr_t>workspace if type(workspace) is int else _workspace(self, True, workspace)
        st = _launch(self, Direction.kBackward, t, host, ws, _stream(stream))
        if not st.ok():
            raise _error(st)

    def allocate(self, str name, stream=None):
        """A new device buffer (fastattn.DeviceTensor) for tensor `name` of the config
        ("q", "d_k", "stats", "seq_len_q", ..., or "workspace": plan.workspace_size
        bytes), shaped and strided as the config lays it out, contents undefined;
        allocated stream-ordered on `stream` (None: the device's default stream) through
        cuda.core. Pass it to forward/backward like any device array."""
        return _arrays.allocate(self, name, stream)

    def serialize(self):
        """(forward blob, backward blob or None): the plans without graph structure, for
        the persistent cache. Load them with fastattn._core.load_plan."""
        cdef vector[uint8_t] blob
        cdef Status st
        with nogil:
            st = serialize_graph(self._fwd.get(), &blob)
        if not st.ok():
            raise _error(st)
        fwd = bytes(blob) if blob.size() else b""
        if not self._training:
            return fwd, None
        blob.clear()
        with nogil:
            st = serialize_graph(self._bwd.get(), &blob)
        if not st.ok():
            raise _error(st)
        return fwd, (bytes(blob) if blob.size() else b"")


cdef object _ZERO = 0


cdef inline int _put(Plan p, intptr_t* t, int slot, object x) except -1:
    """Writes tensor `x` into slot `slot`: the one place forward and backward fill slots.
    Small enough to inline, so that an int costs a type check and a conversion, as a
    typed argument did; everything else goes to _put_object."""
    if x is _ZERO:  # not given (the default): the slot stays 0. CPython caches small ints: every 0 is this one
        return 0
    if type(x) is int:  # the zero-overhead path: C++ checks null and alignment, nothing else
        t[slot] = <intptr_t>x
        return 0
    return _put_object(p, t, slot, x)


cdef int _put_object(Plan p, intptr_t* t, int slot, object x) except -1:
    if p._c.host_seed and (slot == kSlotSeed or slot == kSlotOffset):
        t[slot] = <intptr_t>_arrays.host_value(SLOT_NAMES[slot], x)
    else:
        t[slot] = _address(p, SLOT_NAMES[slot], x)
    return 0


cdef inline intptr_t _stream(object stream) except? 0:
    if type(stream) is int:
        return <intptr_t>stream
    return <intptr_t>_arrays.stream_handle(stream)


cdef intptr_t _workspace(Plan p, bint backward, object workspace) except? 0:
    return <intptr_t>_arrays.workspace_address(p, backward, workspace)


cdef inline Status _launch(Plan p, Direction d, intptr_t* t, int64_t* host, intptr_t ws, intptr_t s):
    """Launches the filled slots. Returns the status, so that an error is raised (and
    its traceback entry made) once, in forward or backward."""
    cdef Status st
    cdef const Graph* g = p._fwd.get() if d == Direction.kForward else p._bwd.get()
    if p._c.host_seed:  # passed by value: cuDNN reads them from `host` during the call
        host[0] = t[kSlotSeed]
        host[1] = t[kSlotOffset]
        t[kSlotSeed] = <intptr_t>&host[0]
        t[kSlotOffset] = <intptr_t>&host[1]
    with nogil:
        st = execute(g, d, p.device, t, ws, s)
    return st


cdef dict _capabilities = {}  # device -> (major, minor): asked once per device, not per plan


cdef tuple _capability(int device):
    cap = _capabilities.get(device)
    if cap is None:
        cap = _capabilities[device] = tuple(get_device_info(device)["compute_capability"])
    return cap


cdef Plan _new_plan(cfg, int device, registry):
    cdef Plan p = Plan.__new__(Plan)
    p.config = cfg
    p.device = device
    p._training = cfg.training
    p._c = _c_config(cfg)
    # The graph builder's side of fastattn.defects: the same decision PlanCache.describe
    # puts in the cache key, from the same inputs (the cuDNN loaded, the GPU's capability).
    registry = _defects.DEFECTS if registry is None else tuple(registry)
    p.defects = _defects.decide(cfg, cudnn_version(), _capability(device), registry)
    if p.defects.refusal:
        raise NotSupportedError(p.defects.refusal)
    p._c.full_lengths = "forward" in p.defects.full_lengths
    p._c_bwd = p._c
    p._c_bwd.full_lengths = "backward" in p.defects.full_lengths
    p._layouts = {}
    p.forward_engine = None
    p.backward_engine = None
    return p


cdef void _record(Plan p, Direction d, const GraphInfo& info, str engine):
    if d == Direction.kForward:
        p.forward_workspace_size, p.forward_engine, p.forward_ms = info.workspace_size, engine, info.build_ms
    else:
        p.backward_workspace_size, p.backward_engine, p.backward_ms = info.workspace_size, engine, info.build_ms


cdef _build_one(Plan p, const Config& c, Direction d):
    cdef GraphInfo info
    cdef Status st
    cdef GraphPtr* out = &p._fwd if d == Direction.kForward else &p._bwd
    with nogil:
        st = build_graph(c, d, p.device, out, &info)
    if not st.ok():
        where = "forward" if d == Direction.kForward else "backward"
        if c.full_lengths:  # a refusal of the remedy, not of anything the caller asked for: say so
            where += (f" (built with a padding mask over the full lengths, the remedy for known cuDNN defect "
                      f"{', '.join(x.name for x in p.defects.avoided)}; the plain graph is wrong for this config)")
        raise _error(st, where)
    _record(p, d, info, info.engine_name.decode("utf-8", "replace"))


cdef _load_one(Plan p, Direction d, bytes blob, str engine):
    cdef GraphInfo info
    cdef Status st
    cdef const uint8_t[::1] view = blob
    cdef size_t n = view.shape[0]
    cdef const uint8_t* data = &view[0] if n else NULL
    cdef GraphPtr* out = &p._fwd if d == Direction.kForward else &p._bwd
    with nogil:
        st = deserialize_graph(data, n, p._c if d == Direction.kForward else p._c_bwd, d, p.device, out, &info)
    if not st.ok():
        raise _error(st, "forward" if d == Direction.kForward else "backward")
    _record(p, d, info, engine)


def build_plan(cfg, int device, registry=None):
    """Builds the forward graph and, when cfg.training, the backward graph of `cfg` on
    `device`, with the remedies fastattn.defects decides for it (plan.defects). Raises
    NotSupportedError with cuDNN's reason, prefixed by the direction, or a known defect's.

    registry: the defects to apply (None: fastattn.defects.DEFECTS); () builds the plain
      graphs, for benchmarks and tests that measure a defect. The runtime and the cache
      never pass it: their keys describe the default registry's decision."""
    cdef Plan p = _new_plan(cfg, device, registry)
    _build_one(p, p._c, Direction.kForward)
    if p._training:
        _build_one(p, p._c_bwd, Direction.kBackward)
    return p


def load_plan(cfg, int device, bytes forward_blob not None, bytes backward_blob=None, str forward_engine="",
              str backward_engine="", registry=None):
    """A Plan from blobs that Plan.serialize produced for the same cfg on the same kind
    of GPU and cuDNN. A loaded plan cannot name its engine, so the caller passes the
    names it stored with the blobs. Raises CorruptPlanError when a blob does not load.
    registry: as build_plan's; the blobs must have been built under the same decision."""
    cdef Plan p = _new_plan(cfg, device, registry)
    if p._training and backward_blob is None:
        raise CorruptPlanError("a training plan needs a backward blob")
    _load_one(p, Direction.kForward, forward_blob, forward_engine)
    if p._training:
        _load_one(p, Direction.kBackward, backward_blob, backward_engine)
    return p


# Benchmark hooks for benchmarks/ and the tests (csrc/bench.h), outside the production interface.
include "_core_bench.pxi"

# The C ABI that the PyTorch op library executes plans through (fastattn_abi.h).
include "_core_abi.pxi"
