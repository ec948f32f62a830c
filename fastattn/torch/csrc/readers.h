// The C entries' argument readers (eager.cpp's call and call_varlen): one reader per kind of
// argument (fastattn/torch/_specs.py's Arg.read), each taking only the values the Python body
// takes with the same meaning that need no conversion, else false; the readers of each entry
// point's arguments made of them (fastattn_calls.h, generated from _specs.CALLS); and the
// checks of attention_varlen()'s tensors. Beside eager.cpp, the tests' own extension includes
// this header (tests/pytorch/csrc/readers.cpp), so the readers they hold to the Python body
// are these, compiled by the same command, and the op library carries no entry for tests.
#pragma once

#include "python.h"  // first: Python.h

#include <cmath>
#include <cstddef>

#include "ops.h"

namespace fastattn::ops {

// A tensor (whether a plain CUDA one is the entry's to check).
inline bool fa_read_tensor(PyObject *arg, PyObject *&out) {
    out = arg;
    return is_tensor(arg);
}

// None or a tensor.
inline bool fa_read_optional(PyObject *arg, OptTensor &out) {
    if (arg == Py_None) return true;
    if (!is_tensor(arg)) return false;
    out = unpack(arg);
    return true;
}

// True or False.
inline bool fa_read_bool(PyObject *arg, bool &out) {
    out = arg == Py_True;
    return arg == Py_True || arg == Py_False;
}

// A window bound: an int in [-1, 2**31) (_fields.check_int).
inline bool read_bound(PyObject *arg, int64_t &out) {
    if (!PyLong_CheckExact(arg)) return false;
    int overflow = 0;
    out = PyLong_AsLongLongAndOverflow(arg, &overflow);
    return overflow == 0 && out >= -1 && out < (int64_t{1} << 31);
}

// A window: None (unbounded) or a (left, right) tuple or list of bounds.
inline bool fa_read_window(PyObject *w, int64_t &left, int64_t &right) {
    left = right = -1;
    if (w == Py_None) return true;
    return (PyTuple_CheckExact(w) || PyList_CheckExact(w)) && PySequence_Fast_GET_SIZE(w) == 2 &&
           read_bound(PySequence_Fast_GET_ITEM(w, 0), left) && read_bound(PySequence_Fast_GET_ITEM(w, 1), right);
}

// A float that is positive and finite, in float64 and in the float32 cuDNN gets
// (_fields' "positive").
inline bool positive_float32(double value) {
    const float f = static_cast<float>(value);
    return std::isfinite(value) && value > 0.0 && f != 0.0f && !std::isinf(f);
}

// None (0.0 here: the default) or a positive float (a scale).
inline bool fa_read_positive_or_none(PyObject *s, double &out) {
    out = 0.0;
    if (s == Py_None) return true;
    if (!PyFloat_CheckExact(s)) return false;
    out = PyFloat_AS_DOUBLE(s);
    return positive_float32(out);
}

// 0.0 or 0 (none, 0.0 here), or a positive float, as the float32 cuDNN gets (the values
// _options.positive_or_zero makes of it).
inline bool fa_read_positive_or_zero(PyObject *s, double &out) {
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
inline bool fa_read_zero(PyObject *p) {
    int overflow = 0;
    return (PyFloat_CheckExact(p) && PyFloat_AS_DOUBLE(p) == 0.0) ||
           (PyLong_CheckExact(p) && PyLong_AsLongLongAndOverflow(p, &overflow) == 0 && overflow == 0);
}

// False (no return_lse: the Python body returns the stats).
inline bool fa_read_false(PyObject *arg) { return arg == Py_False; }

// A name among `names` (string literals: the view outlives the argument).
template <size_t N>
inline bool fa_read_name(PyObject *arg, const c10::string_view (&names)[N], c10::string_view &out) {
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
inline bool fa_read_max_length(PyObject *arg, int64_t &bucket) {
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
inline bool fa_diagonal(bool causal, bool causal_bottom_right, c10::string_view alignment, bool &out_causal,
                 bool &out_bottom_right) {
    out_causal       = causal || causal_bottom_right;
    out_bottom_right = causal_bottom_right || alignment == "bottom_right";
    return !(causal && causal_bottom_right);
}

}  // namespace fastattn::ops

// Each entry's argument count, reader (read_attention, read_attention_varlen) and call of its
// op's work (run_<entry>), and each op's gradient decision: generated from
// fastattn/torch/_specs.py's CALLS and the ops' specs.
#include "fastattn_calls.h"

namespace fastattn::ops {

// attention()'s arguments as call takes them, but for the tensors' device and the modes:
// read_attention's values, and seq_lens_kv only with seq_lens_q.
inline bool read_call(PyObject *const *args, AttentionCall &c) {
    return read_attention(args, c) && (c.seq_lens_q || !c.seq_lens_kv);
}

// _varlen._check_varlen's checks, for tensors on one device type (the eager call
// requires CUDA besides; the tests give meta tensors).
inline bool varlen_tensors_ok(const Tensor &q, const Tensor &k, const Tensor &v, const Tensor &cu_q, const Tensor &cu_kv) {
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

}  // namespace fastattn::ops
