// What the units that read Python's objects need of torch's Python headers, compiled once, in
// python.cpp: a tensor inside a Python object, a Python object for a tensor, torch's
// translation of C++ exceptions into Python's, and the GIL released for a scope; and the
// eager entries (eager.cpp) that ops.cpp adds to the Python module.
// torch/csrc/autograd/python_variable.h (with pybind11 and autograd's variable.h) takes
// longer to parse than eager.cpp takes to compile without it, and the library builds as
// long as its slowest unit: parsed beside the other units, not inside one.
#pragma once

#include <Python.h>

#include <ATen/core/Tensor.h>
#include <c10/util/FunctionRef.h>

#include "ops.h"

namespace fastattn::ops {

bool is_tensor(PyObject *obj);            // a torch.Tensor, subclasses included (THPVariable_Check)
bool is_plain_tensor(PyObject *obj);      // exactly a torch.Tensor, no subclass
const at::Tensor &unpack(PyObject *obj);  // the tensor of an obj that is_tensor (THPVariable_Unpack)
PyObject *wrap(at::Tensor t);             // t as a torch.Tensor, a new reference (THPVariable_Wrap)

// body(), with a C++ exception it throws turned into the Python exception torch raises for it
// and its TORCH_WARNs into Python warnings (HANDLE_TH_ERRORS): nullptr where it threw.
PyObject *translating(c10::function_ref<PyObject *()> body);

// The GIL released for a scope and taken back at its end (pybind11's gil_scoped_release).
class GilReleased {
  public:
    GilReleased() : state_(PyEval_SaveThread()) {}
    ~GilReleased() { PyEval_RestoreThread(state_); }
    GilReleased(const GilReleased &) = delete;
    GilReleased &operator=(const GilReleased &) = delete;

  private:
    PyThreadState *state_;
};

// ---- eager.cpp ----------------------------------------------------------------------------------

// Adds the entries that take Python's vectorcall convention to `module`: call and call_varlen.
// False, with the Python error set, where one could not be added.
bool add_fastcall_entries(PyObject *module);

// attention_paged()'s eager callable, over fastattn::native_paged_forward's arguments (eager.cpp).
Tensor call_paged(FA_PAGED_TENSORS, FA_PAGED_PARAMS);

}  // namespace fastattn::ops
