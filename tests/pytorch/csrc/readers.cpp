// The op library's argument readers (fastattn/torch/csrc/readers.h, with the readers generated
// from fastattn/torch/_specs.py's CALLS) in an extension of the tests' own, which
// tests/conftest.py's `readers` fixture builds with the op library's compiler line:
// test_torch_native.py and test_torch_varlen.py hold their answers to the Python bodies',
// and the library a user runs carries no entry for tests.
#include <torch/csrc/utils/pybind.h>  // first: Python.h, then pybind11 with torch's casters

#include <torch/csrc/Exceptions.h>


#include "readers.h"
#include "to_python.h"

namespace py = pybind11;

namespace {

using fastattn::ops::AttentionCall;
using fastattn::ops::AttentionVarlenCall;

// read_call(<call's arguments>): (the options call would run with, as DenseOptions' fields,
// whether seq_lens_kv is given), or None where attention()'s Python body takes the call.
PyObject *read_call(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    HANDLE_TH_ERRORS
    if (!fastattn::ops::attention_args("read_call", nargs)) return nullptr;
    AttentionCall c;
    if (!fastattn::ops::read_call(args, c)) Py_RETURN_NONE;
    return py::make_tuple(fastattn::ops::to_python(c.options), fastattn::ops::given(c.seq_lens_kv)).release().ptr();
    END_HANDLE_TH_ERRORS
}

// read_varlen_call(<call_varlen's arguments>): the options call_varlen would run with
// (inference: max_q the bucket itself), as VarlenOptions' fields, or None where
// attention_varlen()'s Python body takes the call; the tensors are not looked at
// (check_varlen_tensors does).
PyObject *read_varlen_call(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    HANDLE_TH_ERRORS
    if (!fastattn::ops::attention_varlen_args("read_varlen_call", nargs)) return nullptr;
    AttentionVarlenCall c;
    if (!fastattn::ops::read_attention_varlen(args, c)) Py_RETURN_NONE;
    return fastattn::ops::to_python(c.options).release().ptr();
    END_HANDLE_TH_ERRORS
}

// The gradients the C entries' calls compute (decide_<op>_grads, generated from the ops' specs):
// (training, bias_grad) for dense, training for varlen.
py::tuple dense_grads(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
                      const fastattn::ops::OptTensor &bias, const fastattn::ops::OptTensor &sink) {
    fastattn::ops::DenseOptions opt;
    fastattn::ops::decide_dense_grads(q, k, v, bias, sink, opt);
    return py::make_tuple(opt.training, opt.bias_grad);
}

bool varlen_grads(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
                  const fastattn::ops::OptTensor &sink) {
    fastattn::ops::VarlenOptions opt;
    fastattn::ops::decide_varlen_grads(q, k, v, sink, opt);
    return opt.training;
}

using FastCall = PyObject *(*)(PyObject *, PyObject *const *, Py_ssize_t);
PyCFunction as_pycfunction(FastCall f) { return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(f)); }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("check_varlen_tensors", &fastattn::ops::varlen_tensors_ok,
          "check_varlen_tensors(q, k, v, cu_seqlens_q, cu_seqlens_kv): call_varlen's tensor checks");
    m.def("dense_grads", &dense_grads, "dense_grads(q, k, v, bias, sink): call's (training, bias_grad)");
    m.def("varlen_grads", &varlen_grads, "varlen_grads(q, k, v, sink): call_varlen's training");
    // As the C entries: METH_FASTCALL, the arguments by position.
    static PyMethodDef fastcall_defs[] = {
        {"read_call", as_pycfunction(&read_call), METH_FASTCALL, "what call would run with, or None"},
        {"read_varlen_call", as_pycfunction(&read_varlen_call), METH_FASTCALL,
         "what call_varlen would run with, or None"},
    };
    for (PyMethodDef &def : fastcall_defs) {
        m.add_object(def.ml_name, py::reinterpret_steal<py::object>(PyCFunction_NewEx(&def, nullptr, m.ptr())));
    }
}
