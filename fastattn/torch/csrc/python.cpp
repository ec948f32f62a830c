// python.h's functions, over torch's Python headers (python.h says why they live here).
#include <torch/csrc/autograd/python_variable.h>  // Python.h, pybind11, THPVariable_*

#include <torch/csrc/Exceptions.h>

#include <utility>

#include "python.h"

namespace fastattn::ops {

bool is_tensor(PyObject *obj) { return THPVariable_Check(obj); }

bool is_plain_tensor(PyObject *obj) { return Py_TYPE(obj) == reinterpret_cast<PyTypeObject *>(THPVariableClass); }

const at::Tensor &unpack(PyObject *obj) { return THPVariable_Unpack(obj); }

PyObject *wrap(at::Tensor t) { return THPVariable_Wrap(std::move(t)); }

PyObject *translating(c10::function_ref<PyObject *()> body) {
    HANDLE_TH_ERRORS
    return body();
    END_HANDLE_TH_ERRORS
}

}  // namespace fastattn::ops
