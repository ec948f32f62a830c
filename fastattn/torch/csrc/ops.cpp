// fastattn's PyTorch op library: the per-call path of fastattn.torch.attention in C++.
//
// Its ops, fastattn::native_attention_forward/_backward, native_varlen_forward/_backward
// and native_paged_forward, have the schemas of the Python custom ops fastattn::attention_*,
// varlen_* and paged_forward, under other names so that both can be loaded at once, with
// kernels for CUDA (the work), Meta (shapes only, for torch.compile's fake tensors), CPU
// (a clear error) and Autograd (a C++ autograd node, so that an eager training step runs
// no Python for attention): kernels.cpp, generated from the ops' specs at the build.
//
// The hot path: a key of the tensors' shapes, strides, dtypes, devices and the
// options -> a plan in a C++ table (a shared lock, no GIL); outputs and workspace
// from ATen's caching allocator; pointers into a slot array; fastattn._core's execute
// through the C ABI it hands out (fastattn_abi.h) on the current stream. A miss calls
// the Python miss handler registered by fastattn/torch/_native.py under the GIL: it
// validates the call and gets the plan from the runtime (memory, disk, Redis, build)
// exactly as the Python path does, so both paths run the very same plans.
//
// This unit: the Python module, and the bridge to Python (the miss handler, exceptions);
// ops.h lists the others. Never includes cudnn-frontend: its statics live once, in
// _core. Compiled on first use against the installed torch (fastattn/torch/_native.py).

#include <torch/csrc/utils/pybind.h>  // first: Python.h, then pybind11 with torch's casters

#include <ATen/Context.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <array>
#include <string>

#include "ops.h"
#include "python.h"
#include "to_python.h"

namespace fastattn::ops {

namespace py = pybind11;

const fastattn_abi *g_abi = nullptr;

namespace {

PyObject *g_miss = nullptr;            // the Python miss handler; a new reference, never released
PyObject *g_error_for_code = nullptr;  // fastattn.errors.error_for_code; likewise
PyObject *g_sdpa_route = nullptr;      // fastattn.torch._sdpa_mode._route, once the mode is on; likewise
PyObject *g_sdpa_composite = nullptr;  // fastattn.torch._sdpa_mode._composite, alike

py::object to_py(const OptTensor &t) { return given(t) ? py::cast(*t) : py::none(); }

// The Python miss handler's answer: (plan, forward graph, backward graph, forward
// workspace bytes, backward workspace bytes, whether the backward is deterministic), as
// the table keeps it (a new reference).
Entry entry_of(const py::object &got) {
    auto t = got.cast<py::tuple>();
    return Entry{py::object(t[0]).inc_ref().ptr(),
                 {reinterpret_cast<const void *>(t[1].cast<intptr_t>()),
                  reinterpret_cast<const void *>(t[2].cast<intptr_t>())},
                 {t[3].cast<int64_t>(), t[4].cast<int64_t>()},
                 t[5].cast<bool>()};
}

// The miss handler, checked; call with the GIL held.
py::object handler() {
    TORCH_CHECK(g_miss != nullptr && g_abi != nullptr, "fastattn: the op library was not initialized");
    return py::reinterpret_borrow<py::object>(g_miss);
}

}  // namespace

// The miss handler's arguments: (kind, direction, the inputs, o, the options).
template <class Options>
Entry miss(int direction, std::initializer_list<OptTensor> inputs, const Tensor *o, const Options &opt) {
    py::gil_scoped_acquire gil;
    py::list args;
    args.append(static_cast<int64_t>(Options::kind));
    args.append(direction);
    for (const OptTensor &t : inputs) args.append(to_py(t));
    args.append(o != nullptr ? py::cast(*o) : py::none());
    args.append(to_python(opt));
    return entry_of(handler()(*args));
}

// For each op's generated kernels.
#define FA_INSTANTIATE(Options) \
    template Entry miss(int, std::initializer_list<OptTensor>, const Tensor *, const Options &);
FA_OPTIONS(FA_INSTANTIATE)
#undef FA_INSTANTIATE

namespace {

template <size_t N>
std::array<int64_t, N> ints(const py::handle &seq) {
    auto t = seq.cast<py::tuple>();
    TORCH_CHECK(t.size() == N, "fastattn: the SDPA mode's route has ", t.size(), " numbers where ", N, " belong");
    std::array<int64_t, N> out{};
    for (size_t i = 0; i < N; ++i) out[i] = t[i].cast<int64_t>();
    return out;
}

}  // namespace

// _sdpa_mode._route's answer: a _Route (layout, options, out_stride, lse_shape,
// grad_strides) or the reason PyTorch's kernels run the call (a str).
SdpaRoute miss_sdpa(const Tensor &q, const Tensor &k, const Tensor &v, const OptTensor &bias, double dropout_p,
                    bool is_causal, std::optional<double> scale, bool training, bool deterministic) {
    py::gil_scoped_acquire gil;
    TORCH_CHECK(g_sdpa_route != nullptr, "fastattn: the SDPA mode's kernels run without enable_sdpa()");
    py::object got = py::reinterpret_borrow<py::object>(g_sdpa_route)(
        q, k, v, to_py(bias), dropout_p, is_causal, scale ? py::cast(*scale) : py::none(), training, deterministic);
    SdpaRoute r;
    if (py::isinstance<py::str>(got)) {
        r.reason = got.cast<std::string>();
        return r;
    }
    auto t = got.cast<py::tuple>();
    auto options = t[1].cast<py::tuple>();
    r.ours = true;
    r.opt = FA_DENSE_FROM(options);
    r.out_stride = ints<4>(t[2]);
    for (auto n : t[3].cast<py::tuple>()) r.lse_shape.push_back(n.cast<int64_t>());
    auto grads = t[4].cast<py::tuple>();
    for (size_t i = 0; i < 3; ++i) r.grad_strides[i] = ints<4>(grads[i]);
    return r;
}

// _sdpa_mode._composite's answer to a call the op library's composite hands to Python
// (sdpa.cpp kPython): its output, or its exception as error_already_set.
Tensor python_composite(const Tensor &q, const Tensor &k, const Tensor &v, const OptTensor &mask, double dropout_p,
                        bool is_causal, std::optional<double> scale, bool enable_gqa) {
    py::gil_scoped_acquire gil;
    TORCH_CHECK(g_sdpa_composite != nullptr, "fastattn: the SDPA mode's kernels run without enable_sdpa()");
    return py::reinterpret_borrow<py::object>(g_sdpa_composite)(
               q, k, v, to_py(mask), dropout_p, is_causal, py::arg("scale") = scale ? py::cast(*scale) : py::none(),
               py::arg("enable_gqa") = enable_gqa)
        .cast<Tensor>();
}

void alert_not_deterministic() {
    if (!at::globalContext().deterministicAlgorithms()) return;
    py::gil_scoped_acquire gil;
    // (a Python exception propagates as error_already_set, as raise_status's below)
    py::module_::import("fastattn.torch._executor").attr("alert_not_deterministic")();
}

// Through the dispatcher, which hands a Python exception back to Python as it is.
[[noreturn]] void raise_status(int code, const char *message) {
    py::gil_scoped_acquire gil;
    TORCH_CHECK(g_error_for_code != nullptr, "fastattn: the op library was not initialized (status ", code, "): ",
                message);
    py::object exc = py::reinterpret_borrow<py::object>(g_error_for_code)(code, message);
    PyErr_SetObject(reinterpret_cast<PyObject *>(Py_TYPE(exc.ptr())), exc.ptr());
    throw py::error_already_set();
}

namespace {

// ---- Python: initialization and introspection -------------------------------------------------

void init(py::capsule abi, py::object miss, py::object error_for_code, int64_t max_entries) {
    auto *table = static_cast<const fastattn_abi *>(PyCapsule_GetPointer(abi.ptr(), FASTATTN_ABI_CAPSULE));
    if (table == nullptr) throw py::error_already_set();
    TORCH_CHECK(table->version == FASTATTN_ABI_VERSION && table->num_slots == FASTATTN_NUM_SLOTS,
                "fastattn: _core's C ABI is version ", table->version, " with ", table->num_slots,
                " slots; this op library was built for version ", FASTATTN_ABI_VERSION, " with ",
                FASTATTN_NUM_SLOTS, ": rebuild it");
    set_max_entries(static_cast<size_t>(std::max<int64_t>(max_entries, 0)));
    g_abi = table;
    if (g_miss != nullptr) Py_DECREF(g_miss);
    g_miss = miss.inc_ref().ptr();
    if (g_error_for_code != nullptr) Py_DECREF(g_error_for_code);
    g_error_for_code = error_for_code.inc_ref().ptr();
}

// Forgets every plan and route and releases the kept workspaces (tests, and memory back
// to the caching allocator): only while no op runs, since a running op holds its workspace.
void clear() {
    clear_table();
    clear_workspaces();
    clear_sdpa_routes();
}

// The SDPA mode's kernels on (with the route function they ask for a new signature's
// route, and the Python composite they hand the calls of kPython to) or off; for CUDA, or
// the CPU (tests: the kernels' fallback, on CPU tensors).
void sdpa_kernels(bool on, py::object route, const std::string &key, const std::vector<std::string> &early,
                  py::object composite) {
    TORCH_CHECK_VALUE(key == "CUDA" || key == "CPU", "fastattn: sdpa_kernels(key='", key, "'): 'CUDA' or 'CPU'");
    if (on) {
        TORCH_CHECK_VALUE(!route.is_none() && !composite.is_none(),
                          "fastattn: sdpa_kernels(True, ...): needs route and composite");
        if (g_sdpa_route != nullptr) Py_DECREF(g_sdpa_route);
        g_sdpa_route = route.inc_ref().ptr();
        if (g_sdpa_composite != nullptr) Py_DECREF(g_sdpa_composite);
        g_sdpa_composite = composite.inc_ref().ptr();
    }
    set_sdpa_kernels(on, key == "CUDA" ? c10::DispatchKey::CUDA : c10::DispatchKey::CPU, early);
}

}  // namespace

}  // namespace fastattn::ops

using namespace fastattn::ops;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "fastattn's PyTorch op library (fastattn/torch/csrc/ops.cpp); loaded by fastattn.torch._native";
    m.attr("abi_version") = FASTATTN_ABI_VERSION;
    m.def("init", &init,
          "init(abi_capsule, miss_handler, error_for_code, max_entries): the _core C ABI, the Python miss handler, "
          "fastattn.errors.error_for_code and the most entries the plan table and the SDPA routes each hold "
          "(FASTATTN_MEMORY_MAX_ENTRIES)");
    m.def("raise_status", [](int code, const std::string &message) { raise_status(code, message.c_str()); },
          "raise_status(code, message): raises what a failed execute with this status raises (tests)");
    m.def("alert_not_deterministic", &alert_not_deterministic,
          "alert_not_deterministic(): what a backward without cuDNN's deterministic algorithm does before it runs "
          "(nothing unless torch.use_deterministic_algorithms(True) is set; tests)");
    m.def("table_size", &table_size, "plans in the C++ table");
    m.def("max_entries", &max_entries, "the most entries the plan table and the SDPA routes each hold");
    m.def(
        "set_max_entries", [](int64_t n) { set_max_entries(static_cast<size_t>(std::max<int64_t>(n, 0))); },
        "set_max_entries(n): the most entries the plan table and the SDPA routes each hold, from their next insert "
        "(init sets it from FASTATTN_MEMORY_MAX_ENTRIES)");
    m.def(
        "evictions",
        [] {
            py::dict out;
            out["native_calls"] = table_evictions();
            out["sdpa_routes"] = sdpa_route_evictions();
            return out;
        },
        "entries dropped past the cap: {'native_calls': the plan table's, 'sdpa_routes': the SDPA routes'}");
    m.def(
        "zero_evictions",
        [] {
            zero_table_evictions();
            zero_sdpa_route_evictions();
        },
        "start the eviction counts again");
    m.def("clear", &clear, "forget every plan and release the kept workspaces (only while no op runs)");
    m.def("kept_workspace_bytes", &kept_workspace_bytes, "bytes of workspace kept per thread and stream for reuse");
    m.def("sdpa_kernels", &sdpa_kernels, py::arg("on"), py::arg("route") = py::none(), py::arg("key") = "CUDA",
          py::arg("early") = std::vector<std::string>{}, py::arg("composite") = py::none(),
          "sdpa_kernels(on, route, key='CUDA', early=(), composite=None): the SDPA mode's C++ kernels over "
          "aten::scaled_dot_product_attention, aten::_scaled_dot_product_cudnn_attention and its backward "
          "registered (route: fastattn.torch._sdpa_mode._route; early: _sdpa_mode.EARLY; composite: "
          "_sdpa_mode._composite, for a mask that requires grad) or removed; key 'CPU' for tests");
    m.def("sdpa_route_count", &sdpa_route_count, "call signatures the SDPA mode's C++ kernels have a route for");
    m.def("sdpa_calls", &sdpa_calls,
          "the SDPA mode's C++ forward calls so far: [(served, reason where not, calls)], by route, and "
          "(True, 'head_dim_padded', calls): of the served ones, those padded");
    m.def("zero_sdpa_calls", &zero_sdpa_calls, "start the SDPA mode's call counts again");
    m.def(
        "sdpa_route",
        [](const Tensor &q, const Tensor &k, const Tensor &v, const OptTensor &bias, double dropout_p, bool is_causal,
           std::optional<double> scale, bool training, bool deterministic) -> py::tuple {
            const auto route = sdpa_route(q, k, v, bias, dropout_p, is_causal, scale, training, deterministic);
            const SdpaRoute &r = *route;
            if (!r.ours) return py::make_tuple(false);
            return py::make_tuple(true, to_python(r.opt), r.out_stride, r.lse_shape, r.grad_strides);
        },
        "sdpa_route(q, k, v, attn_bias, dropout_p, is_causal, scale, training, deterministic): the route the SDPA "
        "mode's C++ "
        "kernels take for this call, as they keep it (tests): (False,) for PyTorch's kernels, else (True, options, "
        "out_stride, lse_shape, grad_strides)");
    m.def("call_paged", &call_paged,
          "call_paged(<fastattn::native_paged_forward's arguments>) -> o: attention_paged()'s eager callable, "
          "past torch.ops outside dispatch modes and torch.jit.trace");
    if (!add_fastcall_entries(m.ptr())) throw py::error_already_set();
}
