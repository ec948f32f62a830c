// cuDNN handles, one per thread and device, and the preamble of every launch
// (LaunchScope: the device current, this thread's handle, bound to the stream). Includes
// cudnn-frontend (its dynamic-loading shims): for attention.cpp and the headers it
// alone includes.
#pragma once

#include <cudnn_frontend.h>

#include <atomic>
#include <cstdint>
#include <sstream>
#include <string>

#include "device.h"
#include "fastattn.h"
#include "status.h"

namespace fastattn::detail {

inline constexpr int kMaxDevices = 64;

// cuDNN handles are per thread and per device. They are deliberately never
// destroyed: at thread or process exit the CUDA context may already be gone, and
// destroying a handle then crashes (PyTorch leaks its handles for the same reason).
struct ThreadState {
    cudnnHandle_t handle[kMaxDevices] = {};
    cudaStream_t stream[kMaxDevices]  = {};
};
inline thread_local ThreadState t_state;

// Handles handed on by threads that are done with them (the warm-up's loaders:
// hand_on_handle), bound to no stream. A thread's first launch takes one instead of
// paying cudnnCreate on the caller's path (1.4 ms on the H200, cuDNN 9.19). A cuDNN
// handle must not be used by two threads at once; which thread made it does not matter.
inline constexpr int kSpareHandles = 2;
inline std::atomic<cudnnHandle_t> g_spare_handles[kMaxDevices][kSpareHandles];

inline Status check_device_index(int device) {
    if (device < 0 || device >= kMaxDevices) {
        return error(Code::kInvalidArgument, "device=" + std::to_string(device) + " is out of range");
    }
    return {};
}

// Call with `device` current (inside a DeviceGuard).
inline Status thread_handle(int device, cudnnHandle_t *out) {
    FA_RETURN_IF_ERROR(check_device_index(device));
    if (t_state.handle[device] == nullptr) {
        for (auto &spare : g_spare_handles[device]) {
            cudnnHandle_t h = spare.exchange(nullptr);
            if (h != nullptr) {
                t_state.handle[device] = h;
                t_state.stream[device] = nullptr;  // spares are bound to the default stream
                break;
            }
        }
    }
    if (t_state.handle[device] == nullptr) {
        cudnnHandle_t h = nullptr;
        cudnnStatus_t st;
        {
            // A thread's first launch may be inside the caller's capture: cudnnCreate's
            // allocations must not invalidate it (see set_stream).
            RelaxedCaptureMode relaxed;
            st = cudnn_frontend::detail::create_handle(&h);
        }
        if (st != CUDNN_STATUS_SUCCESS) {
            return error(Code::kCudnnError,
                         std::string("cudnnCreate failed: ") + cudnn_frontend::detail::get_error_string(st));
        }
        t_state.handle[device] = h;
        t_state.stream[device] = nullptr;  // a new handle runs on the default stream
    }
    *out = t_state.handle[device];
    return {};
}

// Hands this thread's handle for `device` (if it has one) to the next thread that needs
// one, and forgets it here: for a thread that makes no more cuDNN calls on `device`.
// Kept where every spare slot is taken.
inline Status hand_on_handle(int device) {
    FA_RETURN_IF_ERROR(check_device_index(device));
    cudnnHandle_t h = t_state.handle[device];
    if (h == nullptr) return {};
    if (t_state.stream[device] != nullptr) {
        RelaxedCaptureMode relaxed;  // as set_stream's
        cudnnStatus_t st = cudnn_frontend::detail::set_stream(h, nullptr);
        if (st != CUDNN_STATUS_SUCCESS) {
            return error(Code::kCudnnError,
                         std::string("cudnnSetStream failed: ") + cudnn_frontend::detail::get_error_string(st));
        }
        t_state.stream[device] = nullptr;
    }
    for (auto &spare : g_spare_handles[device]) {
        cudnnHandle_t empty = nullptr;
        if (spare.compare_exchange_strong(empty, h)) {
            t_state.handle[device] = nullptr;
            break;
        }
    }
    return {};
}

inline Status set_stream(int device, cudnnHandle_t h, intptr_t stream) {
    auto s = reinterpret_cast<cudaStream_t>(stream);
    if (t_state.stream[device] == s) return {};
    cudnnStatus_t st;
    {
        // Binding a stream records nothing into a capture, but cuDNN may make calls that
        // CUDA counts as unsafe while any capture in global mode (PyTorch's default) is
        // under way, which would invalidate the caller's capture: relaxed for this call
        // only (as PyTorch's allocator relaxes its own), never around a launch.
        RelaxedCaptureMode relaxed;
        st = cudnn_frontend::detail::set_stream(h, s);
    }
    if (st != CUDNN_STATUS_SUCCESS) {
        std::ostringstream msg;
        msg << "cudnnSetStream failed for stream=" << stream << " (" << capture_state(s)
            << "; the handle was bound to stream=" << reinterpret_cast<intptr_t>(t_state.stream[device])
            << "): " << cudnn_frontend::detail::get_error_string(st);
        return error(Code::kInvalidArgument, msg.str());
    }
    t_state.stream[device] = s;
    return {};
}

// The preamble of every launch: `device` current for the scope (restored after),
// this thread's handle for it, bound to `stream`. One place, so that execute and the
// benchmark hook pay exactly the same for it.
class LaunchScope {
   public:
    LaunchScope(int device, intptr_t stream) : guard_(device) {
        status_ = guard_.status();
        if (status_.ok()) status_ = thread_handle(device, &handle_);
        if (status_.ok()) status_ = set_stream(device, handle_, stream);
    }
    const Status &status() const { return status_; }
    cudnnHandle_t handle() const { return handle_; }

   private:
    DeviceGuard guard_;
    cudnnHandle_t handle_ = nullptr;
    Status status_;
};

}  // namespace fastattn::detail
