// The eager entries (call, call_varlen, call_paged): from Python straight to the CUDA kernels,
// past torch.ops and the dispatcher, and profile_eager, the dense entry taken apart.
//
// call: attention()'s own arguments, as they are, read by read_attention (generated from
// fastattn/torch/_specs.py's CALLS, which a test holds to attention()'s signature).
// fastattn.torch.attention() hands them here first, outside torch.compile;
// NotImplemented hands the call back to its Python body (read_call says which values it
// takes), which then runs the dispatcher's ops. It runs plain eager calls only: plain CUDA tensors, outside torch.compile,
// dispatch modes, torch.func transforms and torch.jit.trace (outside_modes). A call
// through torch.ops parses its arguments against a 19-argument schema into a boxed
// stack and crosses the dispatcher twice (Autograd, then CUDA); this reads positional
// arguments off a METH_FASTCALL call and runs the same work (dense_forward), the same
// plan table and the same autograd node (DenseBackward, direct) as the ops do.
// Gradients are decided here: the grad mode and requires_grad.
//
// call_varlen: attention_varlen()'s arguments, likewise (read_attention_varlen). Its Python
// body (_check_varlen, the option checks, bucketing, the op's argument parsing and the
// dispatcher) cost about as much host time a call as the native op itself (measured by
// benchmarks/profile_varlen.py; docs/history/benchmarks-log.md, "attention_varlen per
// call"). It reads the same arguments, makes every check _check_varlen makes, and runs the
// op's work (varlen_forward; its node, VarlenBackward, for training) when all of them pass
// and every value is one that needs no conversion: plain bools, a None or (left, right)
// window of ints, a None or positive float scale, int max lengths, the alignment's name, no
// dropout, no return_lse, plain CUDA tensors outside dispatch modes and torch.func
// transforms. Anything else returns NotImplemented, and the Python body takes the call,
// checks it and reports (tests/pytorch/test_torch_native.py holds the two to the same
// answers).
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
#include <type_traits>
#include <utility>
#include <vector>

#include "ops.h"

namespace fastattn::ops {

namespace py = pybind11;

namespace {

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
        o = std::get<0>(opt.training ? dense_recorded(true, q, k, v, seq_len_q, seq_len_kv, bias, sink, no_rng, opt)
                                     : dense_forward(q, k, v, seq_len_q, seq_len_kv, bias, sink, no_rng, opt));
    }
    return THPVariable_Wrap(std::move(o));
}

// Outside dispatch modes (FakeTensorMode, make_fx's proxy mode) and torch.func
// transforms, whose tensors the eager kernels do not handle, and outside
// torch.jit.trace, whose tracer records only calls that reach the dispatcher (it
// includes the Tracer key while tracing): _executor.plain_eager's test.
bool outside_modes() {
    if (c10::impl::TorchDispatchModeTLS::stack_len() != 0) return false;
    const auto included = c10::impl::tls_local_dispatch_key_set().included_;
    return !included.has(c10::DispatchKey::FuncTorchDynamicLayerFrontMode) &&
           !included.has(c10::DispatchKey::FuncTorchDynamicLayerBackMode) && !included.has(c10::DispatchKey::Tracer);
}

// ---- attention()'s own arguments, read in C -------------------------------------------------
// fastattn.torch.attention() hands its arguments here first, as they are, outside
// torch.compile: its Python body (option checks, the dispatch-mode and functorch
// checks, the flags) cost host time on every call, a fair fraction of a small call's
// launch (benchmarks/profile_native_step.py: docs/history/benchmarks-log.md, "Numbers
// moved out of code comments"). This takes the values that need no conversion: bools
// that are bools, a None or (left, right) window of ints, a None or positive finite
// float scale, the layout and alignment names, no dropout, no return_lse, plain CUDA
// tensors outside dispatch modes and torch.func transforms. Anything else returns
// NotImplemented, and attention()'s Python body takes the call, checks it and reports
// what is wrong, so every value accepted here is one the Python body accepts with the
// same meaning (tests/pytorch/test_torch_native.py holds both to that).

constexpr const char *kCallDoc =
    "call(<attention()'s arguments in its order>) -> o, or NotImplemented: NotImplemented for anything "
    "attention()'s Python body must convert, check or report.";

// ---- the readers of the generated read_attention and read_attention_varlen -------------------
// One per kind of argument (fastattn/torch/_specs.py's Arg.read), each taking only the
// values the Python body takes with the same meaning that need no conversion, else false.

// A tensor (whether a plain CUDA one is the entry's to check).
bool fa_read_tensor(PyObject *arg, PyObject *&out) {
    out = arg;
    return THPVariable_Check(arg);
}

// None or a tensor.
bool fa_read_optional(PyObject *arg, OptTensor &out) {
    if (arg == Py_None) return true;
    if (!THPVariable_Check(arg)) return false;
    out = THPVariable_Unpack(arg);
    return true;
}

// True or False.
bool fa_read_bool(PyObject *arg, bool &out) {
    out = arg == Py_True;
    return arg == Py_True || arg == Py_False;
}

// A window bound: an int in [-1, 2**31) (_fields.check_int).
bool read_bound(PyObject *arg, int64_t &out) {
    if (!PyLong_CheckExact(arg)) return false;
    int overflow = 0;
    out = PyLong_AsLongLongAndOverflow(arg, &overflow);
    return overflow == 0 && out >= -1 && out < (int64_t{1} << 31);
}

// A window: None (unbounded) or a (left, right) tuple or list of bounds.
bool fa_read_window(PyObject *w, int64_t &left, int64_t &right) {
    left = right = -1;
    if (w == Py_None) return true;
    return (PyTuple_CheckExact(w) || PyList_CheckExact(w)) && PySequence_Fast_GET_SIZE(w) == 2 &&
           read_bound(PySequence_Fast_GET_ITEM(w, 0), left) && read_bound(PySequence_Fast_GET_ITEM(w, 1), right);
}

// A float that is positive and finite, in float64 and in the float32 cuDNN gets
// (_fields' "positive").
bool positive_float32(double value) {
    const float f = static_cast<float>(value);
    return std::isfinite(value) && value > 0.0 && f != 0.0f && !std::isinf(f);
}

// None (0.0 here: the default) or a positive float (a scale).
bool fa_read_positive_or_none(PyObject *s, double &out) {
    out = 0.0;
    if (s == Py_None) return true;
    if (!PyFloat_CheckExact(s)) return false;
    out = PyFloat_AS_DOUBLE(s);
    return positive_float32(out);
}

// 0.0 or 0 (none, 0.0 here), or a positive float, as the float32 cuDNN gets (the values
// _options.positive_or_zero makes of it).
bool fa_read_positive_or_zero(PyObject *s, double &out) {
    out = 0.0;
    if (PyLong_CheckExact(s)) {
        int overflow = 0;
        return PyLong_AsLongLongAndOverflow(s, &overflow) == 0 && overflow == 0;
    }
    if (!PyFloat_CheckExact(s)) return false;
    const double value = PyFloat_AS_DOUBLE(s);
    if (value == 0.0) return true;  // -0.0 too: none
    out = static_cast<float>(value);
    return positive_float32(value);
}

// 0.0 or 0 (no dropout: a dropout draws its seed in Python).
bool fa_read_zero(PyObject *p) {
    int overflow = 0;
    return (PyFloat_CheckExact(p) && PyFloat_AS_DOUBLE(p) == 0.0) ||
           (PyLong_CheckExact(p) && PyLong_AsLongLongAndOverflow(p, &overflow) == 0 && overflow == 0);
}

// False (no return_lse: the Python body returns the stats).
bool fa_read_false(PyObject *arg) { return arg == Py_False; }

// A name among `names` (string literals: the view outlives the argument).
template <size_t N>
bool fa_read_name(PyObject *arg, const c10::string_view (&names)[N], c10::string_view &out) {
    if (!PyUnicode_CheckExact(arg)) return false;
    Py_ssize_t size = 0;
    const char *text = PyUnicode_AsUTF8AndSize(arg, &size);
    if (text == nullptr) {
        PyErr_Clear();  // (a lone surrogate: no name of ours)
        return false;
    }
    for (const c10::string_view name : names) {
        if (name == c10::string_view(text, static_cast<size_t>(size))) {
            out = name;
            return true;
        }
    }
    return false;
}

// A max length: an int in [1, 2**31) (not a bool); its plan's bucket, the next power of
// two (_varlen.bucket).
bool fa_read_max_length(PyObject *arg, int64_t &bucket) {
    if (!PyLong_CheckExact(arg)) return false;
    int overflow = 0;
    const long long n = PyLong_AsLongLongAndOverflow(arg, &overflow);
    if (overflow != 0 || n < 1 || n >= (1LL << 31)) return false;
    for (bucket = 1; bucket < n; bucket <<= 1) {
    }
    return true;
}

// The diagonal's rule (_plans.options and _plans.bottom_right): causal and
// causal_bottom_right exclude each other; causal_bottom_right is a causal mask at the
// bottom right; alignment="bottom_right" puts the diagonal there.
bool fa_diagonal(bool causal, bool causal_bottom_right, c10::string_view alignment, bool &out_causal,
                 bool &out_bottom_right) {
    out_causal       = causal || causal_bottom_right;
    out_bottom_right = causal_bottom_right || alignment == "bottom_right";
    return !(causal && causal_bottom_right);
}

}  // namespace

}  // namespace fastattn::ops

// read_attention and read_attention_varlen: generated from fastattn/torch/_specs.py's CALLS.
#include "fastattn_calls.h"

namespace fastattn::ops {

namespace {

PyObject *call_attention(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    HANDLE_TH_ERRORS
    if (nargs != kAttentionArgs) {
        PyErr_Format(PyExc_TypeError, "call() takes %zd positional arguments (%zd given)", kAttentionArgs, nargs);
        return nullptr;
    }
    AttentionCall c;
    // q a plain tensor (attention()'s Python body: q.__class__ is Tensor), on CUDA, outside
    // modes; seq_lens_kv only with seq_lens_q, and seq_lens_q's by default.
    if (Py_TYPE(args[0]) != reinterpret_cast<PyTypeObject *>(THPVariableClass) || !read_attention(args, c) ||
        (!c.seq_lens_q && c.seq_lens_kv) || !THPVariable_Unpack(c.q).is_cuda() || !outside_modes()) {
        Py_RETURN_NOTIMPLEMENTED;
    }
    if (!c.seq_lens_kv) c.seq_lens_kv = c.seq_lens_q;
    return run_eager(THPVariable_Unpack(c.q), THPVariable_Unpack(c.k), THPVariable_Unpack(c.v), c.seq_lens_q,
                     c.seq_lens_kv, c.bias, c.sinks, c.options);
    END_HANDLE_TH_ERRORS
}

// read_attention for the tests (tests/pytorch/test_torch_native.py): (the options the
// eager call would run with, as _dense.DenseOptions' fields, whether seq_lens_kv is
// given), or None where attention()'s Python body takes the call.
PyObject *read_call_for_tests(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    HANDLE_TH_ERRORS
    if (nargs != kAttentionArgs) {
        PyErr_Format(PyExc_TypeError, "read_call() takes %zd positional arguments (%zd given)", kAttentionArgs,
                     nargs);
        return nullptr;
    }
    AttentionCall c;
    if (!read_attention(args, c) || (!c.seq_lens_q && c.seq_lens_kv)) Py_RETURN_NONE;
    return py::make_tuple(to_python(c.options), given(c.seq_lens_kv)).release().ptr();
    END_HANDLE_TH_ERRORS
}

// ---- attention_varlen()'s arguments ------------------------------------------------------------

constexpr const char *kVarlenCallDoc =
    "call_varlen(<attention_varlen()'s arguments in its order>) -> o, or NotImplemented: NotImplemented for "
    "anything its Python body must convert, check or report.";

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
    if (nargs != kAttentionVarlenArgs) {
        PyErr_Format(PyExc_TypeError, "call_varlen() takes %zd positional arguments (%zd given)", kAttentionVarlenArgs,
                     nargs);
        return nullptr;
    }
    AttentionVarlenCall c;
    if (!read_attention_varlen(args, c)) Py_RETURN_NOTIMPLEMENTED;
    for (PyObject *t : {c.q, c.k, c.v, c.cu_seqlens_q, c.cu_seqlens_kv}) {
        if (!plain_tensor(t)) Py_RETURN_NOTIMPLEMENTED;
    }
    const Tensor &q = THPVariable_Unpack(c.q), &k = THPVariable_Unpack(c.k), &v = THPVariable_Unpack(c.v);
    const Tensor &cu_q = THPVariable_Unpack(c.cu_seqlens_q), &cu_kv = THPVariable_Unpack(c.cu_seqlens_kv);
    if (!q.is_cuda() || !varlen_tensors_ok(q, k, v, cu_q, cu_kv) || !outside_modes()) Py_RETURN_NOTIMPLEMENTED;
    const OptTensor &sink = c.sinks;
    if (given(sink) && !(sink->scalar_type() == at::kFloat && sink->dim() == 1 && sink->size(0) == q.size(1) &&
                         sink->is_contiguous() && sink->device() == q.device())) {
        Py_RETURN_NOTIMPLEMENTED;  // the Python body names what is wrong (_dense.check_sink)
    }
    VarlenOptions &o = c.options;
    o.training = at::GradMode::is_enabled() &&
                 (q.requires_grad() || k.requires_grad() || v.requires_grad() || wants_grad(sink));
    // Training plans and plans with sinks declare at least kVarlenMinQ queries (_specs.py says why).
    if (o.training || given(sink)) o.max_q = std::max(o.max_q, kVarlenMinQ);
    const OptTensor no_dropout;
    Tensor o_out;
    {
        pybind11::gil_scoped_release no_gil;  // as run_eager: a miss takes the GIL back
        RECORD_FUNCTION("fastattn::attention_varlen", c10::ArrayRef<const c10::IValue>{});
        o_out = std::get<0>(o.training ? varlen_recorded(true, q, k, v, cu_q, cu_kv, sink, no_dropout, o)
                                       : varlen_forward(q, k, v, cu_q, cu_kv, sink, no_dropout, o));
    }
    return THPVariable_Wrap(std::move(o_out));
    END_HANDLE_TH_ERRORS
}

// For the tests (tests/pytorch/test_torch_native.py): the options call_varlen would run
// with (inference: max_q the bucket itself), as _varlen.VarlenOptions' fields, or None
// where attention_varlen()'s Python body takes the call; the tensors are not looked at
// (check_varlen_tensors does).
PyObject *read_varlen_call_for_tests(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    HANDLE_TH_ERRORS
    if (nargs != kAttentionVarlenArgs) {
        PyErr_Format(PyExc_TypeError, "read_varlen_call() takes %zd positional arguments (%zd given)",
                     kAttentionVarlenArgs, nargs);
        return nullptr;
    }
    AttentionVarlenCall c;
    if (!read_attention_varlen(args, c)) Py_RETURN_NONE;
    return to_python(c.options).release().ptr();
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
    const DenseOptions opt{.layout = "bshd", .causal = true};  // the rest off
    const OptTensor none;
    const std::array<int64_t, 4> o_shape{q.size(0), q.size(1), q.size(2), v.size(3)};  // bshd
    std::vector<std::pair<const char *, double>> out;
    auto timed = [&](const char *name, auto &&fn) {
        const auto t0 = std::chrono::steady_clock::now();
        for (int64_t i = 0; i < iters; ++i) fn();
        const std::chrono::duration<double, std::micro> spent = std::chrono::steady_clock::now() - t0;
        out.emplace_back(name, spent.count() / static_cast<double>(iters));
    };
    {
        py::gil_scoped_release no_gil;  // as the eager entry runs them
        const Entry &e = dense_plan(FASTATTN_FORWARD, q, k, v, none, none, none, none, none, nullptr, opt);
        const c10::Stream stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(q.device());
        const auto handle = reinterpret_cast<intptr_t>(stream.native_handle());
        Tensor o = empty_cuda(o_shape, {}, q.scalar_type(), q);
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
        timed("plan_lookup", [&] { dense_plan(FASTATTN_FORWARD, q, k, v, none, none, none, none, none, nullptr, opt); });
        timed("allocate_o", [&] { Tensor t = empty_cuda(o_shape, {}, q.scalar_type(), q); });
        timed("allocate_o_dispatcher", [&] { Tensor t = at::empty(o_shape, q.options()); });
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
        timed("forward_work", [&] { dense_forward(q, k, v, none, none, none, none, none, opt); });
    }
    timed("gil_release", [&] { py::gil_scoped_release released; });
    timed("allocate_and_wrap_o",
          [&] { Py_DECREF(THPVariable_Wrap(empty_cuda(o_shape, {}, q.scalar_type(), q))); });
    py::dict result;
    for (const auto &[name, us] : out) result[name] = us;
    return result;
}

// ---- attention_paged()'s eager callable -------------------------------------------------------
// _native.PAGED[0]: fastattn::native_paged_forward's arguments, once attention_paged's
// Python body has checked and converted them. A plain call runs the op's work
// (paged_forward) past torch.ops, whose argument parsing and dispatch cost more host
// time than the call's launch; inside a dispatch mode or torch.jit.trace, for tensor
// subclasses with a __torch_dispatch__ (all of which must see the op) and for tensors not
// on CUDA, it runs the op. No autograd either way:
// attention_paged is forward only.
// Whether any of the tensors (a Tensor or an OptTensor each) has `key` in its key set.
template <class... Tensors>
bool any_has(c10::DispatchKey key, const Tensors &...tensors) {
    const auto keys = [](const auto &t) {
        if constexpr (std::is_same_v<std::decay_t<decltype(t)>, OptTensor>) {
            return given(t) ? t->key_set() : c10::DispatchKeySet();
        } else {
            return t.key_set();
        }
    };
    return (keys(tensors) | ...).has(key);
}

// Its parameters are the op's, in its spec's order (FA_PAGED_TENSORS, FA_PAGED_PARAMS).
Tensor call_paged(FA_PAGED_TENSORS, FA_PAGED_PARAMS) {
    py::gil_scoped_release no_gil;
    // A tensor subclass with its own __torch_dispatch__ (the Python key) must see the op too.
    if (any_has(c10::DispatchKey::Python, FA_PAGED_TENSOR_ARGS) || !outside_modes() || !q.is_cuda()) {
        static const auto op = c10::Dispatcher::singleton()
                                   .findSchemaOrThrow("fastattn::native_paged_forward", "")
                                   .typed<decltype(paged_forward_cuda)>();
        return op.call(FA_PAGED_TENSOR_ARGS, FA_PAGED_ARGS);
    }
    RECORD_FUNCTION("fastattn::attention_paged", c10::ArrayRef<const c10::IValue>{});
    return paged_forward(FA_PAGED_TENSOR_ARGS, PagedOptions{FA_PAGED_ARGS});
}

// A METH_FASTCALL function as the PyCFunction that PyMethodDef holds (CPython casts it back).
using FastCall = PyObject *(*)(PyObject *, PyObject *const *, Py_ssize_t);
PyCFunction as_pycfunction(FastCall f) { return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(f)); }

}  // namespace

void add_eager_entries(py::module_ &m) {
    m.def("profile_eager", &profile_eager, "the eager entry's pieces timed in C++ (benchmarks/profile_native_step.py)");
    m.def("call_paged", &call_paged,
          "call_paged(<fastattn::native_paged_forward's arguments>) -> o: attention_paged()'s eager callable, "
          "past torch.ops outside dispatch modes and torch.jit.trace");
    m.def("check_varlen_tensors", &check_varlen_tensors_for_tests,
          "check_varlen_tensors(q, k, v, cu_seqlens_q, cu_seqlens_kv): call_varlen's tensor checks (tests)");
    // The eager entries take Python's vectorcall convention (METH_FASTCALL), which
    // pybind11 does not offer: each is a plain CPython function added to the module.
    static PyMethodDef fastcall_defs[] = {
        {"call", as_pycfunction(&call_attention), METH_FASTCALL, kCallDoc},
        {"read_call", as_pycfunction(&read_call_for_tests), METH_FASTCALL,
         "read_call(<call's arguments>) -> what call would run with, or None (tests)"},
        {"call_varlen", as_pycfunction(&call_varlen), METH_FASTCALL, kVarlenCallDoc},
        {"read_varlen_call", as_pycfunction(&read_varlen_call_for_tests), METH_FASTCALL,
         "read_varlen_call(<call_varlen's arguments>) -> what call_varlen would run with, or None (tests)"},
    };
    for (PyMethodDef &def : fastcall_defs) {
        m.add_object(def.ml_name, py::reinterpret_steal<py::object>(PyCFunction_NewEx(&def, nullptr, m.ptr())));
    }
}

}  // namespace fastattn::ops
