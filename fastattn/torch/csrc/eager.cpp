// The eager entries (call, call_varlen, call_paged): from Python straight to the CUDA kernels,
// past torch.ops and the dispatcher, and profile_eager, the dense entry taken apart.
//
// call: attention()'s own 18 arguments, as they are. fastattn.torch.attention() hands
// them here first, outside torch.compile; NotImplemented hands the call back to its
// Python body (read_call says which values it takes), which then runs the dispatcher's
// ops. It runs plain eager calls only: plain CUDA tensors, outside torch.compile,
// dispatch modes, torch.func transforms and torch.jit.trace (outside_modes). A call
// through torch.ops parses its arguments against a 19-argument schema into a boxed
// stack and crosses the dispatcher twice (Autograd, then CUDA); this reads positional
// arguments off a METH_FASTCALL call and runs the same kernels (forward_work), the same
// plan table and the same autograd node (DenseBackward, direct) as the ops do.
// Gradients are decided here: the grad mode and requires_grad.
//
// call_varlen: attention_varlen()'s 17 arguments, likewise. Its Python body
// (_check_varlen, the option checks, bucketing, the op's argument parsing and the
// dispatcher) cost about as much host time a call as the native op itself
// (measured by benchmarks/profile_varlen.py; docs/history/benchmarks-log.md,
// "attention_varlen per call"). It reads the same arguments, makes every check _check_varlen makes, and
// runs the op's kernels (varlen.cpp: the same plan table, the same C++ autograd) when all
// of them pass and every value is one that needs no conversion: plain bools, a None or
// (left, right) window of ints, a None or positive float scale, int max lengths, the
// alignment's name, no dropout, no return_lse, plain CUDA tensors outside dispatch modes
// and torch.func transforms. Anything else returns NotImplemented, and the Python body
// takes the call, checks it and reports (tests/pytorch/test_torch_native.py holds the two
// to the same answers).
#include <torch/csrc/utils/pybind.h>  // first: Python.h, then pybind11 with torch's casters

#include <algorithm>

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/record_function.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <chrono>
#include <cmath>
#include <tuple>
#include <utility>
#include <vector>

#include "ops.h"

namespace fastattn::ops {

namespace py = pybind11;

namespace {

// An optional tensor argument: false when it is neither None nor a tensor.
bool read_optional(PyObject *arg, OptTensor &out) {
    if (arg == Py_None) return true;
    if (!THPVariable_Check(arg)) return false;
    out = THPVariable_Unpack(arg);
    return true;
}

bool wants_grad(const OptTensor &t) { return given(t) && t->requires_grad(); }

// The eager call itself, shared by both entries: gradients are decided here, from the
// grad mode and requires_grad, as autograd would.
PyObject *run_eager(const Tensor &q, const Tensor &k, const Tensor &v, const OptTensor &seq_len_q,
                    const OptTensor &seq_len_kv, const OptTensor &bias, const OptTensor &sink, DenseOptions opt) {
    opt.training = at::GradMode::is_enabled() &&
                   (q.requires_grad() || k.requires_grad() || v.requires_grad() || wants_grad(bias) ||
                    wants_grad(sink));
    opt.bias_grad = opt.training && wants_grad(bias);
    Tensor o;
    {
        // As torch's own ops do: other Python threads run while this one is in cuDNN.
        // A miss takes the GIL back for the Python runtime (lookup).
        pybind11::gil_scoped_release no_gil;
        RECORD_FUNCTION("fastattn::attention", c10::ArrayRef<const c10::IValue>{});
        const OptTensor no_rng;  // dropout draws its seed in Python: the Python body takes it
        o = std::get<0>(opt.training ? forward_recorded(true, q, k, v, seq_len_q, seq_len_kv, bias, sink, no_rng, opt)
                                     : forward_work(q, k, v, seq_len_q, seq_len_kv, bias, sink, no_rng, FA_DENSE_OF(opt)));
    }
    return THPVariable_Wrap(std::move(o));
}

// Outside dispatch modes (FakeTensorMode, make_fx's proxy mode) and torch.func
// transforms, whose tensors the eager kernels do not handle, and outside
// torch.jit.trace, whose tracer records only calls that reach the dispatcher (it
// includes the Tracer key while tracing): _autograd.plain_eager's test.
bool outside_modes() {
    if (c10::impl::TorchDispatchModeTLS::stack_len() != 0) return false;
    const auto included = c10::impl::tls_local_dispatch_key_set().included_;
    return !included.has(c10::DispatchKey::FuncTorchDynamicLayerFrontMode) &&
           !included.has(c10::DispatchKey::FuncTorchDynamicLayerBackMode) && !included.has(c10::DispatchKey::Tracer);
}

// ---- attention()'s own arguments, read in C -------------------------------------------------
// fastattn.torch.attention() hands its 18 arguments here first, as they are, outside
// torch.compile: its Python body (option checks, the dispatch-mode and functorch
// checks, the flags) cost host time on every call, a fair fraction of a small call's
// launch (benchmarks/profile_native_step.py: docs/history/benchmarks-log.md, sessions 6
// and 7, "attention()'s Python"). This takes the values that need no conversion: bools
// that are bools, a None or (left, right) window of ints, a None or positive finite
// float scale, the layout and alignment names, no dropout, no return_lse, plain CUDA
// tensors outside dispatch modes and torch.func transforms. Anything else returns
// NotImplemented, and attention()'s Python body takes the call, checks it and reports
// what is wrong, so every value accepted here is one the Python body accepts with the
// same meaning (tests/pytorch/test_torch_native.py holds both to that).

constexpr const char *kCallDoc =
    "call(q, k, v, causal, causal_bottom_right, window, scale, layout, deterministic, seq_lens_q, seq_lens_kv, "
    "alibi, bias, dropout_p, sinks, alignment, return_lse, softcap) -> o, or NotImplemented: attention()'s arguments in "
    "its order; NotImplemented for anything attention()'s Python body must convert, check or report.";

// A bool argument: 0 or 1, or -1 when it is not a bool.
int read_bool(PyObject *arg) { return arg == Py_True ? 1 : arg == Py_False ? 0 : -1; }

// A window bound: an int in [-1, 2**31) (_fields.check_int), else false.
bool read_bound(PyObject *arg, long long &out) {
    if (!PyLong_CheckExact(arg)) return false;
    int overflow = 0;
    out = PyLong_AsLongLongAndOverflow(arg, &overflow);
    return overflow == 0 && out >= -1 && out < (1LL << 31);
}

// A name among `names`: its index, or -1.
template <size_t N>
int read_name(PyObject *arg, const char *const (&names)[N]) {
    if (!PyUnicode_CheckExact(arg)) return -1;
    for (size_t i = 0; i < N; ++i) {
        if (PyUnicode_CompareWithASCIIString(arg, names[i]) == 0) return static_cast<int>(i);
    }
    return -1;
}

// A window: None (unbounded) or a (left, right) tuple or list of bounds.
bool read_window(PyObject *w, long long &left, long long &right) {
    left = right = -1;
    if (w == Py_None) return true;
    return (PyTuple_CheckExact(w) || PyList_CheckExact(w)) && PySequence_Fast_GET_SIZE(w) == 2 &&
           read_bound(PySequence_Fast_GET_ITEM(w, 0), left) && read_bound(PySequence_Fast_GET_ITEM(w, 1), right);
}

// A scale: None (0.0 here: the default, 1 / sqrt(head_dim_qk)) or a positive finite
// float that stays so in float32, what cuDNN gets (_fields' "positive" checks it too).
bool read_scale(PyObject *s, double &scale) {
    scale = 0.0;
    if (s == Py_None) return true;
    if (!PyFloat_CheckExact(s)) return false;
    scale = PyFloat_AS_DOUBLE(s);
    const float s32 = static_cast<float>(scale);
    return std::isfinite(scale) && scale > 0.0 && s32 != 0.0f && !std::isinf(s32);
}

// A softcap: 0.0 or 0 (none), or a positive finite float that stays so in float32
// (_options.softcap's values), else false.
bool read_softcap(PyObject *s, double &softcap) {
    softcap = 0.0;
    if (PyLong_CheckExact(s)) {
        int overflow = 0;
        return PyLong_AsLongLongAndOverflow(s, &overflow) == 0 && overflow == 0;
    }
    if (!PyFloat_CheckExact(s)) return false;
    const double value = PyFloat_AS_DOUBLE(s);
    const float s32 = static_cast<float>(value);
    softcap = value == 0.0 ? 0.0 : s32;  // the float32 cuDNN gets (-0.0: none), as _options.softcap gives it
    return value == 0.0 || (std::isfinite(value) && value > 0.0 && s32 != 0.0f && !std::isinf(s32));
}

// No dropout: 0.0 or 0 (a dropout draws its seed in Python).
bool read_no_dropout(PyObject *p) {
    int overflow = 0;
    return (PyFloat_CheckExact(p) && PyFloat_AS_DOUBLE(p) == 0.0) ||
           (PyLong_CheckExact(p) && PyLong_AsLongLongAndOverflow(p, &overflow) == 0 && overflow == 0);
}

constexpr const char *kLayoutNames[] = {"bshd", "sbhd", "bhsd"};  // kLayouts' order
constexpr const char *kAlignmentNames[] = {"top_left", "bottom_right"};


// attention()'s scalar arguments, read.
struct CallArgs {
    int layout;
    bool causal, bottom_right, deterministic, alibi;
    long long window_left, window_right;
    double scale, softcap;
};

// attention()'s arguments (args[0..17], its order) as the eager call takes them: false
// for anything its Python body must convert, check or report. The tensors are only
// checked to be tensors or None; whether they are plain CUDA tensors is call's.
bool read_call(PyObject *const *args, CallArgs &out, OptTensor &seq_len_q, OptTensor &seq_len_kv, OptTensor &bias,
               OptTensor &sink) {
    if (!THPVariable_Check(args[0]) || !THPVariable_Check(args[1]) || !THPVariable_Check(args[2]) ||
        args[16] != Py_False) {
        return false;
    }
    const int causal = read_bool(args[3]), causal_br = read_bool(args[4]), deterministic = read_bool(args[8]),
              alibi = read_bool(args[11]);
    if (causal < 0 || causal_br < 0 || deterministic < 0 || alibi < 0 || (causal && causal_br)) return false;
    long long left = -1, right = -1;
    double scale = 0.0, softcap = 0.0;
    if (!read_window(args[5], left, right) || !read_scale(args[6], scale) || !read_no_dropout(args[13]) ||
        !read_softcap(args[17], softcap)) {
        return false;
    }
    const int layout = read_name(args[7], kLayoutNames), alignment = read_name(args[15], kAlignmentNames);
    if (layout < 0 || alignment < 0) return false;
    if (!read_optional(args[9], seq_len_q) || !read_optional(args[10], seq_len_kv) ||
        !read_optional(args[12], bias) || !read_optional(args[14], sink) || (!seq_len_q && seq_len_kv)) {
        return false;
    }
    if (!seq_len_kv) seq_len_kv = seq_len_q;  // seq_lens_kv defaults to seq_lens_q
    // causal_bottom_right: a causal mask, at the bottom right.
    out = {layout, causal == 1 || causal_br == 1, causal_br == 1 || alignment == 1, deterministic == 1,
           alibi == 1, left, right, scale, softcap};
    return true;
}

PyObject *call_attention(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    HANDLE_TH_ERRORS
    if (nargs != 18) {
        PyErr_Format(PyExc_TypeError, "call() takes 18 positional arguments (%zd given)", nargs);
        return nullptr;
    }
    CallArgs a;
    OptTensor seq_len_q, seq_len_kv, bias, sink;
    // q a plain tensor (attention()'s Python body: q.__class__ is Tensor), on CUDA, outside modes.
    if (Py_TYPE(args[0]) != reinterpret_cast<PyTypeObject *>(THPVariableClass) ||
        !read_call(args, a, seq_len_q, seq_len_kv, bias, sink) || !THPVariable_Unpack(args[0]).is_cuda() ||
        !outside_modes()) {
        Py_RETURN_NOTIMPLEMENTED;
    }
    return run_eager(THPVariable_Unpack(args[0]), THPVariable_Unpack(args[1]), THPVariable_Unpack(args[2]), seq_len_q,
                     seq_len_kv, bias, sink,
                     DenseOptions{.layout = kLayouts[a.layout], .causal = a.causal, .bottom_right = a.bottom_right,
                                  .window_left = a.window_left, .window_right = a.window_right, .scale = a.scale,
                                  .deterministic = a.deterministic, .alibi = a.alibi, .training = false,
                                  .dropout = 0.0, .bias_grad = false, .softcap = a.softcap});
    END_HANDLE_TH_ERRORS
}

// read_call for the tests (tests/pytorch/test_torch_native.py): what the eager call would
// run with, (layout, causal, bottom_right, deterministic, alibi, left, right, scale,
// seq_lens_kv given, softcap), or None where attention()'s Python body takes the call.
PyObject *read_call_for_tests(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    HANDLE_TH_ERRORS
    if (nargs != 18) {
        PyErr_Format(PyExc_TypeError, "read_call() takes 18 positional arguments (%zd given)", nargs);
        return nullptr;
    }
    CallArgs a;
    OptTensor seq_len_q, seq_len_kv, bias, sink;
    if (!read_call(args, a, seq_len_q, seq_len_kv, bias, sink)) Py_RETURN_NONE;
    return py::make_tuple(a.layout, a.causal, a.bottom_right, a.deterministic, a.alibi, a.window_left, a.window_right,
                          a.scale, given(seq_len_kv), a.softcap)
        .release()
        .ptr();
    END_HANDLE_TH_ERRORS
}

// ---- attention_varlen()'s arguments ------------------------------------------------------------

constexpr const char *kVarlenCallDoc =
    "call_varlen(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, causal, causal_bottom_right, "
    "window, scale, deterministic, alignment, alibi, dropout_p, return_lse, softcap) -> o, or NotImplemented: "
    "attention_varlen()'s arguments in its order; NotImplemented for anything its Python body must convert, check "
    "or report.";

// attention_varlen()'s scalar arguments, read, max lengths bucketed (_varlen.bucket).
struct VarlenArgs {
    int64_t max_q, max_kv;
    bool causal, bottom_right, deterministic, alibi;
    long long window_left, window_right;
    double scale, softcap;
};

// A max length: an int in [1, 2**31) (not a bool); its plan's bucket, the next power of two.
bool read_max_length(PyObject *arg, int64_t &bucket) {
    if (!PyLong_CheckExact(arg)) return false;
    int overflow = 0;
    const long long n = PyLong_AsLongLongAndOverflow(arg, &overflow);
    if (overflow != 0 || n < 1 || n >= (1LL << 31)) return false;
    for (bucket = 1; bucket < n; bucket <<= 1) {
    }
    return true;
}

// args[5..16] as the eager call takes them, or false.
bool read_varlen_call(PyObject *const *args, VarlenArgs &out) {
    const int causal = read_bool(args[7]), causal_br = read_bool(args[8]), deterministic = read_bool(args[11]),
              alibi = read_bool(args[13]);
    if (causal < 0 || causal_br < 0 || deterministic < 0 || alibi < 0 || (causal && causal_br)) return false;
    if (args[15] != Py_False || !read_no_dropout(args[14])) return false;
    VarlenArgs a{};
    const int alignment = read_name(args[12], kAlignmentNames);
    if (alignment < 0 || !read_max_length(args[5], a.max_q) || !read_max_length(args[6], a.max_kv) ||
        !read_window(args[9], a.window_left, a.window_right) || !read_scale(args[10], a.scale) ||
        !read_softcap(args[16], a.softcap)) {
        return false;
    }
    a.causal        = causal == 1 || causal_br == 1;  // causal_bottom_right: a causal mask, at the bottom right
    a.bottom_right  = causal_br == 1 || alignment == 1;
    a.deterministic = deterministic == 1;
    a.alibi         = alibi == 1;
    out             = a;
    return true;
}

// _varlen._check_varlen's checks, for tensors on one device type (the eager call
// requires CUDA besides; the tests give meta tensors).
bool varlen_tensors_ok(const Tensor &q, const Tensor &k, const Tensor &v, const Tensor &cu_q, const Tensor &cu_kv) {
    const auto dtype = q.scalar_type();
    if (dtype != at::kHalf && dtype != at::kBFloat16) return false;
    for (const Tensor *t : {&q, &k, &v}) {
        if (t->dim() != 3 || !t->is_contiguous() || t->scalar_type() != dtype || t->device() != q.device()) return false;
        if (t->size(1) < 1 || t->size(2) < 1 || t->numel() >= (int64_t{1} << 31)) return false;  // int32 offsets
    }
    if (k.size(0) != v.size(0) || k.size(1) != v.size(1) || q.size(1) % k.size(1) != 0 || k.size(2) != q.size(2)) {
        return false;
    }
    for (const Tensor *cu : {&cu_q, &cu_kv}) {
        if (cu->scalar_type() != at::kInt || cu->dim() != 1 || cu->size(0) < 2 || !cu->is_contiguous() ||
            cu->device() != q.device()) {
            return false;
        }
    }
    return cu_q.size(0) == cu_kv.size(0);
}

// Exactly torch.Tensor (no subclass, whose __torch_function__ the Python body honours).
bool plain_tensor(PyObject *arg) { return Py_TYPE(arg) == reinterpret_cast<PyTypeObject *>(THPVariableClass); }

PyObject *call_varlen(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    HANDLE_TH_ERRORS
    if (nargs != 17) {
        PyErr_Format(PyExc_TypeError, "call_varlen() takes 17 positional arguments (%zd given)", nargs);
        return nullptr;
    }
    VarlenArgs a;
    for (int i = 0; i < 5; ++i) {
        if (!plain_tensor(args[i])) Py_RETURN_NOTIMPLEMENTED;
    }
    const Tensor &q = THPVariable_Unpack(args[0]), &k = THPVariable_Unpack(args[1]), &v = THPVariable_Unpack(args[2]);
    const Tensor &cu_q = THPVariable_Unpack(args[3]), &cu_kv = THPVariable_Unpack(args[4]);
    if (!read_varlen_call(args, a) || !q.is_cuda() || !varlen_tensors_ok(q, k, v, cu_q, cu_kv) || !outside_modes()) {
        Py_RETURN_NOTIMPLEMENTED;
    }
    const bool training = at::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad());
    const OptTensor no_dropout;
    Tensor o;
    {
        pybind11::gil_scoped_release no_gil;  // as run_eager: a miss takes the GIL back
        RECORD_FUNCTION("fastattn::attention_varlen", c10::ArrayRef<const c10::IValue>{});
        if (training) {
            // At least two queries declared (_varlen.MIN_TRAINING_Q says why).
            o = std::get<0>(varlen_forward_autograd(q, k, v, cu_q, cu_kv, no_dropout, std::max<int64_t>(a.max_q, 2),
                                                    a.max_kv, a.causal,
                                                    a.bottom_right, a.window_left, a.window_right, a.scale,
                                                    a.deterministic, true, a.alibi, 0.0, a.softcap));
        } else {
            o = std::get<0>(varlen_forward_cuda(q, k, v, cu_q, cu_kv, no_dropout, a.max_q, a.max_kv, a.causal,
                                                a.bottom_right, a.window_left, a.window_right, a.scale,
                                                a.deterministic, false, a.alibi, 0.0, a.softcap));
        }
    }
    return THPVariable_Wrap(std::move(o));
    END_HANDLE_TH_ERRORS
}

// For the tests (tests/pytorch/test_torch_native.py): what call_varlen would run with,
// (max_q bucket, max_kv bucket, causal, bottom_right, deterministic, alibi, left, right,
// scale, softcap), or None where attention_varlen()'s Python body takes the call; the tensors
// are not looked at (check_varlen_tensors does).
PyObject *read_varlen_call_for_tests(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    HANDLE_TH_ERRORS
    if (nargs != 17) {
        PyErr_Format(PyExc_TypeError, "read_varlen_call() takes 17 positional arguments (%zd given)", nargs);
        return nullptr;
    }
    VarlenArgs a;
    if (!read_varlen_call(args, a)) Py_RETURN_NONE;
    return py::make_tuple(a.max_q, a.max_kv, a.causal, a.bottom_right, a.deterministic, a.alibi, a.window_left,
                          a.window_right, a.scale, a.softcap)
        .release()
        .ptr();
    END_HANDLE_TH_ERRORS
}

// For the tests: whether call_varlen's tensor checks pass (any device type, one for all).
bool check_varlen_tensors_for_tests(const Tensor &q, const Tensor &k, const Tensor &v, const Tensor &cu_q,
                                    const Tensor &cu_kv) {
    return varlen_tensors_ok(q, k, v, cu_q, cu_kv);
}

// ---- profile_eager -----------------------------------------------------------------------------
// The eager entry's inference call taken apart, for benchmarks/profile_native_step.py
// (fastattn itself never calls it): each piece looped `iters` times in C++ on q, k, v
// (bshd, causal, top left, no extras: call attention() on them first, so the table has
// the plan), in microseconds per piece. The pieces that launch (execute, forward_work)
// measure host time only while the GPU keeps up with the loop: use a small shape.

py::dict profile_eager(const Tensor &q, const Tensor &k, const Tensor &v, int64_t iters) {
    TORCH_CHECK_VALUE(q.is_cuda() && iters > 0, "profile_eager: q on ", q.device(), ", iters=", iters,
                      ": needs CUDA tensors and iters > 0");
    const DenseOptions opt{.layout = kLayouts[0], .causal = true, .bottom_right = false, .window_left = -1,
                           .window_right = -1, .scale = 0.0, .deterministic = false, .alibi = false,
                           .training = false, .dropout = 0.0, .bias_grad = false};
    const OptTensor none;
    const auto ax = axes(opt.layout);
    std::vector<std::pair<const char *, double>> out;
    auto timed = [&](const char *name, auto &&fn) {
        const auto t0 = std::chrono::steady_clock::now();
        for (int64_t i = 0; i < iters; ++i) fn();
        const std::chrono::duration<double, std::micro> spent = std::chrono::steady_clock::now() - t0;
        out.emplace_back(name, spent.count() / static_cast<double>(iters));
    };
    {
        py::gil_scoped_release no_gil;  // as the eager entry runs them
        const Entry &e = find_plan(FASTATTN_FORWARD, q, k, v, nullptr, none, none, none, none, none, opt);
        const c10::Stream stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(q.device());
        const auto handle = reinterpret_cast<intptr_t>(stream.native_handle());
        Tensor o = empty_cuda(out_shape(q, v, ax), {}, q.scalar_type(), q);
        const Tensor ws = workspace(e.workspace[FASTATTN_FORWARD], q, stream);
        intptr_t slots[FASTATTN_NUM_SLOTS] = {};
        slots[FASTATTN_SLOT_Q] = ptr(q);
        slots[FASTATTN_SLOT_K] = ptr(k);
        slots[FASTATTN_SLOT_V] = ptr(v);
        slots[FASTATTN_SLOT_O] = ptr(o);
        const intptr_t ws_ptr = ws.defined() ? ptr(ws) : 0;
        char message[512];
        const int code = g_abi->execute(e.graph[FASTATTN_FORWARD], FASTATTN_FORWARD, q.get_device(), slots, ws_ptr,
                                        handle, message, sizeof message);
        if (code != FASTATTN_STATUS_OK) raise_status(code, message);
        timed("plan_lookup", [&] { find_plan(FASTATTN_FORWARD, q, k, v, nullptr, none, none, none, none, none, opt); });
        timed("allocate_o", [&] { Tensor t = empty_cuda(out_shape(q, v, ax), {}, q.scalar_type(), q); });
        timed("allocate_o_dispatcher", [&] { Tensor t = at::empty(out_shape(q, v, ax), q.options()); });
        timed("current_stream", [&] {
            (void)c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(q.device());
        });
        timed("capture_check", [&] { (void)g_abi->stream_capturing(handle); });
        timed("workspace", [&] { Tensor t = workspace(e.workspace[FASTATTN_FORWARD], q, stream); });
        timed("record_function", [&] { RECORD_FUNCTION("fastattn::attention", c10::ArrayRef<const c10::IValue>{}); });
        timed("execute", [&] {
            (void)g_abi->execute(e.graph[FASTATTN_FORWARD], FASTATTN_FORWARD, q.get_device(), slots, ws_ptr, handle,
                                 message, sizeof message);
        });
        timed("forward_work", [&] { forward_work(q, k, v, none, none, none, none, none, FA_DENSE_OF(opt)); });
    }
    timed("gil_release", [&] { py::gil_scoped_release released; });
    timed("allocate_and_wrap_o",
          [&] { Py_DECREF(THPVariable_Wrap(empty_cuda(out_shape(q, v, ax), {}, q.scalar_type(), q))); });
    py::dict result;
    for (const auto &[name, us] : out) result[name] = us;
    return result;
}

// A METH_FASTCALL function as the PyCFunction that PyMethodDef holds (CPython casts it back).
// ---- attention_paged()'s eager callable -------------------------------------------------------
// _native.PAGED[0]: fastattn::native_paged_forward's arguments, once attention_paged's
// Python body has checked and converted them. A plain call runs the op's CUDA kernel
// (paged_forward_cuda) past torch.ops, whose argument parsing and dispatch cost more host
// time than the call's launch; inside a dispatch mode or torch.jit.trace, for tensor
// subclasses with a __torch_dispatch__ (all of which must see the op) and for tensors not
// on CUDA, it runs the op. No autograd either way:
// attention_paged is forward only.
Tensor call_paged(const Tensor &q, const Tensor &k_cache, const Tensor &v_cache, const Tensor &table,
                  const Tensor &cache_seqlens, const OptTensor &seq_lens_q, FA_PAGED_PARAMS) {
    py::gil_scoped_release no_gil;
    // A tensor subclass with its own __torch_dispatch__ (the Python key) must see the op too.
    const bool plain = !(q.key_set() | k_cache.key_set() | v_cache.key_set() | table.key_set() |
                         cache_seqlens.key_set() | (given(seq_lens_q) ? seq_lens_q->key_set() : c10::DispatchKeySet()))
                            .has(c10::DispatchKey::Python);
    if (!plain || !outside_modes() || !q.is_cuda()) {
        static const auto op =
            c10::Dispatcher::singleton()
                .findSchemaOrThrow("fastattn::native_paged_forward", "")
                .typed<Tensor(const Tensor &, const Tensor &, const Tensor &, const Tensor &, const Tensor &,
                              const OptTensor &, FA_PAGED_PARAMS)>();
        return op.call(q, k_cache, v_cache, table, cache_seqlens, seq_lens_q, FA_PAGED_ARGS);
    }
    RECORD_FUNCTION("fastattn::attention_paged", c10::ArrayRef<const c10::IValue>{});
    return paged_forward_cuda(q, k_cache, v_cache, table, cache_seqlens, seq_lens_q, FA_PAGED_ARGS);
}

using FastCall = PyObject *(*)(PyObject *, PyObject *const *, Py_ssize_t);
PyCFunction as_pycfunction(FastCall f) { return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(f)); }

}  // namespace

void add_eager_entries(py::module_ &m) {
    m.def("profile_eager", &profile_eager, "the eager entry's pieces timed in C++ (benchmarks/profile_native_step.py)");
    m.def("call_paged", &call_paged,
          "call_paged(q, k_cache, v_cache, block_table, cache_seqlens, seq_lens_q, <the paged options>) -> o: "
          "attention_paged()'s eager callable (fastattn::native_paged_forward's arguments), past torch.ops "
          "outside dispatch modes and torch.jit.trace");
    m.def("check_varlen_tensors", &check_varlen_tensors_for_tests,
          "check_varlen_tensors(q, k, v, cu_seqlens_q, cu_seqlens_kv): call_varlen's tensor checks (tests)");
    // The eager entries take Python's vectorcall convention (METH_FASTCALL), which
    // pybind11 does not offer: each is a plain CPython function added to the module.
    static PyMethodDef fastcall_defs[] = {
        {"call", as_pycfunction(&call_attention), METH_FASTCALL, kCallDoc},
        {"read_call", as_pycfunction(&read_call_for_tests), METH_FASTCALL,
         "read_call(<call's 18 arguments>) -> what call would run with, or None (tests)"},
        {"call_varlen", as_pycfunction(&call_varlen), METH_FASTCALL, kVarlenCallDoc},
        {"read_varlen_call", as_pycfunction(&read_varlen_call_for_tests), METH_FASTCALL,
         "read_varlen_call(<call_varlen's 17 arguments>) -> what call_varlen would run with, or None (tests)"},
    };
    for (PyMethodDef &def : fastcall_defs) {
        m.add_object(def.ml_name, py::reinterpret_steal<py::object>(PyCFunction_NewEx(&def, nullptr, m.ptr())));
    }
}

}  // namespace fastattn::ops
