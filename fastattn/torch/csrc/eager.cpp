// The eager entries (call, call_varlen, call_paged): from Python straight to the CUDA kernels,
// past torch.ops and the dispatcher.
//
// call: attention()'s own arguments, as they are, read by read_attention (generated from
// fastattn/torch/_specs.py's CALLS, which a test holds to attention()'s signature).
// fastattn.torch.attention() hands them here first, outside torch.compile;
// NotImplemented hands the call back to its Python body (readers.h's read_call says which
// values it takes), which then runs the dispatcher's ops. It runs plain eager calls only: plain CUDA tensors, outside torch.compile,
// dispatch modes, torch.func transforms and torch.jit.trace (outside_modes). A call
// through torch.ops parses its arguments against a 19-argument schema into a boxed
// stack and crosses the dispatcher twice (Autograd, then CUDA); this reads positional
// arguments off a METH_FASTCALL call and runs the same work (dense_forward), the same
// plan table and the same autograd node (DenseBackward, direct) as the ops do.
// Gradients are decided here, from the grad mode and requires_grad, as autograd would;
// what each entry runs, and how, is generated from its op's spec and CALLS
// (fastattn_calls.h: decide_<op>_grads, run_<entry>).
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
#include "python.h"  // first: Python.h

#include <ATen/core/Tensor.h>
#include <ATen/record_function.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>

#include <algorithm>
#include <type_traits>

#include "ops.h"
#include "readers.h"

namespace fastattn::ops {

namespace {

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

PyObject *call_attention(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    return translating([&]() -> PyObject * {
        if (!attention_args("call", nargs)) return nullptr;
        AttentionCall c;
        // q a plain tensor (attention()'s Python body: q.__class__ is Tensor), on CUDA, outside
        // modes; seq_lens_kv seq_lens_q's by default.
        if (!is_plain_tensor(args[0]) || !read_call(args, c) || !unpack(c.q).is_cuda() || !outside_modes()) {
            Py_RETURN_NOTIMPLEMENTED;
        }
        if (!c.seq_lens_kv) c.seq_lens_kv = c.seq_lens_q;
        decide_dense_grads(unpack(c.q), unpack(c.k), unpack(c.v), c.bias, c.sinks, c.options);
        return run_attention(c);
    });
}

// ---- attention_varlen()'s arguments ------------------------------------------------------------

constexpr const char *kVarlenCallDoc =
    "call_varlen(<attention_varlen()'s arguments in its order>) -> o, or NotImplemented: NotImplemented for "
    "anything its Python body must convert, check or report.";

PyObject *call_varlen(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    return translating([&]() -> PyObject * {
        if (!attention_varlen_args("call_varlen", nargs)) return nullptr;
        AttentionVarlenCall c;
        if (!read_attention_varlen(args, c)) Py_RETURN_NOTIMPLEMENTED;
        // Exactly torch.Tensor (no subclass, whose __torch_function__ the Python body honours).
        for (PyObject *t : {c.q, c.k, c.v, c.cu_seqlens_q, c.cu_seqlens_kv}) {
            if (!is_plain_tensor(t)) Py_RETURN_NOTIMPLEMENTED;
        }
        const Tensor &q = unpack(c.q), &k = unpack(c.k), &v = unpack(c.v);
        const Tensor &cu_q = unpack(c.cu_seqlens_q), &cu_kv = unpack(c.cu_seqlens_kv);
        if (!q.is_cuda() || !varlen_tensors_ok(q, k, v, cu_q, cu_kv) || !outside_modes()) Py_RETURN_NOTIMPLEMENTED;
        const OptTensor &sink = c.sinks;
        if (given(sink) && !(sink->scalar_type() == at::kFloat && sink->dim() == 1 && sink->size(0) == q.size(1) &&
                             sink->is_contiguous() && sink->device() == q.device())) {
            Py_RETURN_NOTIMPLEMENTED;  // the Python body names what is wrong (_dense.check_sink)
        }
        VarlenOptions &o = c.options;
        decide_varlen_grads(q, k, v, sink, o);
        // Training plans and plans with sinks declare at least kVarlenMinQ queries (_specs.py says why).
        if (o.training || given(sink)) o.max_q = std::max(o.max_q, kVarlenMinQ);
        return run_attention_varlen(c);
    });
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

// A METH_FASTCALL function as the PyCFunction that PyMethodDef holds (CPython casts it back).
using FastCall = PyObject *(*)(PyObject *, PyObject *const *, Py_ssize_t);
PyCFunction as_pycfunction(FastCall f) { return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(f)); }

}  // namespace

// Its parameters are the op's, in its spec's order (FA_PAGED_TENSORS, FA_PAGED_PARAMS).
Tensor call_paged(FA_PAGED_TENSORS, FA_PAGED_PARAMS) {
    GilReleased no_gil;
    const PagedOptions opt{FA_PAGED_ARGS};
    // A tensor subclass with its own __torch_dispatch__ (the Python key) must see the op too.
    if (any_has(c10::DispatchKey::Python, FA_PAGED_TENSOR_ARGS) || !outside_modes() || !q.is_cuda()) {
        return paged_forward_op(FA_PAGED_TENSOR_ARGS, opt);
    }
    RECORD_FUNCTION("fastattn::attention_paged", c10::ArrayRef<const c10::IValue>{});
    return paged_forward(FA_PAGED_TENSOR_ARGS, opt);
}

bool add_fastcall_entries(PyObject *module) {
    // The eager entries take Python's vectorcall convention (METH_FASTCALL), which
    // pybind11 does not offer: each is a plain CPython function added to the module.
    static PyMethodDef fastcall_defs[] = {
        {"call", as_pycfunction(&call_attention), METH_FASTCALL, kCallDoc},
        {"call_varlen", as_pycfunction(&call_varlen), METH_FASTCALL, kVarlenCallDoc},
    };
    for (PyMethodDef &def : fastcall_defs) {
        PyObject *f = PyCFunction_NewEx(&def, nullptr, module);
        const bool added = f != nullptr && PyModule_AddObjectRef(module, def.ml_name, f) == 0;
        Py_XDECREF(f);
        if (!added) return false;
    }
    return true;
}

}  // namespace fastattn::ops
