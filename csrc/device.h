// The CUDA runtime calls fastattn makes itself, beside those cudnn-frontend's shim
// wraps: entry points looked up in the libcudart the frontend loaded, statuses, the
// current device and the capture mode for a scope. Needs no cudnn-frontend: only
// cuda_symbol reaches it, defined in attention.cpp (the one translation unit that
// includes it), so that the process has one copy of the frontend's CUDA loader.
#pragma once

#include <cuda.h>  // the driver's types (cuDeviceGetName)
#include <cuda_runtime_api.h>

#include "fastattn.h"

namespace fastattn::detail {

enum class CudaLibrary { kRuntime, kDriver };

// The entry point `name` of the libcudart (kRuntime) or libcuda (kDriver) that
// cudnn-frontend loaded. Throws, as the frontend's loader does, when the library or the
// symbol is missing: call it where exceptions become statuses (guarded), or once, from
// a function-local static, on a path that already made a CUDA call.
void *cuda_symbol(CudaLibrary library, const char *name);

// A runtime entry point, looked up once per call site (a function-local static).
template <class F>
F *cudart(const char *name) {
    return reinterpret_cast<F *>(cuda_symbol(CudaLibrary::kRuntime, name));
}
using GetDeviceFn        = cudaError_t(int *);
using SetDeviceFn        = cudaError_t(int);
using GetCountFn         = cudaError_t(int *);
using AttributeFn        = cudaError_t(int *, cudaDeviceAttr, int);
using VersionFn          = cudaError_t(int *);
using IsCapturingFn      = cudaError_t(cudaStream_t, cudaStreamCaptureStatus *);
using ErrorStringFn      = const char *(cudaError_t);
using GetLastErrorFn     = cudaError_t();
using DeviceGetNameFn    = CUresult(char *, int, CUdevice);
using DeviceGetFn        = CUresult(CUdevice *, int);
using StreamCreateFn     = cudaError_t(cudaStream_t *, unsigned int);
using StreamDestroyFn    = cudaError_t(cudaStream_t);
using BeginCaptureFn     = cudaError_t(cudaStream_t, cudaStreamCaptureMode);
using EndCaptureFn       = cudaError_t(cudaStream_t, cudaGraph_t *);
using InstantiateFn      = cudaError_t(cudaGraphExec_t *, cudaGraph_t, unsigned long long);
using GraphLaunchFn      = cudaError_t(cudaGraphExec_t, cudaStream_t);
using GraphExecDestroyFn = cudaError_t(cudaGraphExec_t);
using GraphDestroyFn     = cudaError_t(cudaGraph_t);
using ExchangeModeFn     = cudaError_t(cudaStreamCaptureMode *);
using MallocFn           = cudaError_t(void **, size_t);
using MallocAsyncFn      = cudaError_t(void **, size_t, cudaStream_t);
using FreeAsyncFn        = cudaError_t(void *, cudaStream_t);
using MemGetInfoFn       = cudaError_t(size_t *, size_t *);
using MemcpyAsyncFn      = cudaError_t(void *, const void *, size_t, cudaMemcpyKind, cudaStream_t);
using MemsetAsyncFn      = cudaError_t(void *, int, size_t, cudaStream_t);
using StreamSyncFn       = cudaError_t(cudaStream_t);

// A failed runtime call as a status (kCudaError), the thread's last error cleared.
Status cuda_failure(cudaError_t err, const char *what);

// Inline: every launch makes a few of these calls, and success costs one compare.
inline Status cuda_status(cudaError_t err, const char *what) {
    if (err == cudaSuccess) return {};
    return cuda_failure(err, what);
}

// A stream's capture state, for messages: "capturing", "not capturing", ...
const char *capture_state(cudaStream_t s);

// Makes `device` current for the scope and restores the caller's device after.
// cudaGetDevice is a thread-local read, so the common case (already current)
// costs no driver call. Inline: it is part of every launch.
class DeviceGuard {
   public:
    explicit DeviceGuard(int device) : target_(device) {
        static GetDeviceFn *get = cudart<GetDeviceFn>("cudaGetDevice");
        status_ = cuda_status(get(&previous_), "cudaGetDevice");
        if (status_.ok() && previous_ != target_) status_ = cuda_status(set()(target_), "cudaSetDevice");
    }
    ~DeviceGuard() {
        if (status_.ok() && previous_ != target_) (void)set()(previous_);
    }
    DeviceGuard(const DeviceGuard &)            = delete;
    DeviceGuard &operator=(const DeviceGuard &) = delete;
    const Status &status() const { return status_; }

   private:
    static SetDeviceFn *set() {
        static SetDeviceFn *fn = cudart<SetDeviceFn>("cudaSetDevice");
        return fn;
    }
    int target_, previous_ = -1;
    Status status_;
};

// Relaxed stream-capture mode for this thread, for the scope. A capture in CUDA's
// global mode (PyTorch's default) on any thread is invalidated by a potentially unsafe
// call from any other. fastattn's stream creation, graph instantiation and graph
// destruction touch no stream of anyone else's and must not count as such (PyTorch
// relaxes its allocator's calls the same way). Not around the capture itself: there
// the thread's own mode makes any unsafe call cuDNN would make fail the capture.
class RelaxedCaptureMode {
   public:
    RelaxedCaptureMode() { ok_ = exchange()(&mode_) == cudaSuccess; }
    ~RelaxedCaptureMode() {
        if (ok_) (void)exchange()(&mode_);
    }
    RelaxedCaptureMode(const RelaxedCaptureMode &)            = delete;
    RelaxedCaptureMode &operator=(const RelaxedCaptureMode &) = delete;

   private:
    static ExchangeModeFn *exchange() {
        static ExchangeModeFn *fn = cudart<ExchangeModeFn>("cudaThreadExchangeStreamCaptureMode");
        return fn;
    }
    cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
    bool ok_                    = false;
};

// A device array of at least `count` int32, each `value`, on `device` (made current by
// the caller): a full_lengths plan's lengths (slots.h's Layout::lengths). Shared by every
// plan in the process and never freed, so that freeing a plan makes no CUDA call (a
// plan may be freed inside someone's capture, where cudaFree would break it) and a CUDA
// graph captured from a plan stays valid after the plan goes. Made once per (device,
// value), regrown by powers of two: a few bytes per distinct sequence length. Made in
// relaxed capture mode, on a stream of its own that is synchronized before the return:
// never on a caller's stream, which may be capturing.
Status constant_int32(int device, int32_t value, int64_t count, intptr_t *out);

// A device copy of the `bytes` bytes at `data`, on `device` (made current by the caller),
// made once per (device, contents) and never freed, as constant_int32's arrays are:
// what cudnn-frontend would copy from the host into the workspace at each execute
// (ALiBi's slopes, the backward's workaround lengths), read by a device-to-device copy
// instead, which a caller's capture can record safely (packs.h, DirectLaunch::edits).
Status constant_bytes(int device, const void *data, size_t bytes, intptr_t *out);

}  // namespace fastattn::detail
