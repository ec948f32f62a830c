// The eager entry's inference call taken apart, for benchmarks/profile_native_step.py: one
// more translation unit of the op library, which that script builds into a library of its
// own (fastattn.torch._native.EXTRA: the same units, this one beside them), so the pieces
// timed are the library's own code and the library a user runs has no profiling entry.
// torch.ops.fastattn_bench.profile_eager(q, k, v, iters): each piece looped `iters` times in
// C++ on q, k, v (bshd, causal, top left, no extras: call attention() on them first, so the
// table has the plan), in microseconds per piece. The pieces that launch (execute,
// forward_work) measure host time only while the GPU keeps up with the loop: use a small shape.
#include <torch/csrc/utils/pybind.h>  // first: Python.h, then pybind11 with torch's casters

#include <ATen/core/Dict.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/record_function.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/library.h>

#include <array>
#include <chrono>
#include <string>

#include "ops.h"

namespace fastattn::ops {

namespace {

namespace py = pybind11;

c10::Dict<std::string, double> profile_eager(const Tensor &q, const Tensor &k, const Tensor &v, int64_t iters) {
    TORCH_CHECK_VALUE(q.is_cuda() && iters > 0, "profile_eager: q on ", q.device(), ", iters=", iters,
                      ": needs CUDA tensors and iters > 0");
    const DenseOptions opt{.layout = "bshd", .causal = true};  // the rest off
    const OptTensor none;
    const std::array<int64_t, 4> o_shape{q.size(0), q.size(1), q.size(2), v.size(3)};  // bshd
    c10::Dict<std::string, double> out;
    auto timed = [&](const char *name, auto &&fn) {
        const auto t0 = std::chrono::steady_clock::now();
        for (int64_t i = 0; i < iters; ++i) fn();
        const std::chrono::duration<double, std::micro> spent = std::chrono::steady_clock::now() - t0;
        out.insert(name, spent.count() / static_cast<double>(iters));
    };
    // torch.ops runs an operator without the GIL, as the eager entry runs these pieces.
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
    timed("current_stream",
          [&] { (void)c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(q.device()); });
    timed("capture_check", [&] { (void)g_abi->stream_capturing(handle); });
    timed("workspace", [&] { Tensor t = workspace(e.workspace[FASTATTN_FORWARD], q, stream); });
    timed("record_function", [&] { RECORD_FUNCTION("fastattn::attention", c10::ArrayRef<const c10::IValue>{}); });
    timed("execute", [&] {
        (void)g_abi->execute(e.graph[FASTATTN_FORWARD], FASTATTN_FORWARD, q.get_device(), slots, ws_ptr, handle,
                             message, sizeof message);
    });
    timed("forward_work", [&] { dense_forward(q, k, v, none, none, none, none, none, opt); });
    {
        py::gil_scoped_acquire gil;  // the pieces that run under the GIL in the eager entry
        timed("gil_release", [&] { py::gil_scoped_release released; });
        timed("allocate_and_wrap_o",
              [&] { Py_DECREF(THPVariable_Wrap(empty_cuda(o_shape, {}, q.scalar_type(), q))); });
    }
    return out;
}

}  // namespace

}  // namespace fastattn::ops

TORCH_LIBRARY(fastattn_bench, m) {
    m.def("profile_eager(Tensor q, Tensor k, Tensor v, int iters) -> Dict(str, float)",
          &fastattn::ops::profile_eager);
}
