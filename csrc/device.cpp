// The CUDA runtime calls of device.h that are not inline, and fastattn.h's device
// queries (device_count, current_device, stream_capturing, device_info). A translation
// unit of its own: it needs no cudnn-frontend, so it compiles in seconds, beside it.
#include "device.h"

#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "status.h"

namespace fastattn {
namespace detail {

Status cuda_failure(cudaError_t err, const char *what) {
    // A failed runtime call also stays behind as the thread's "last error", which
    // the next library to check it (PyTorch, after its next kernel launch) would
    // report as its own failure. The error is ours: clear it.
    static GetLastErrorFn *clear = cudart<GetLastErrorFn>("cudaGetLastError");
    (void)clear();
    static ErrorStringFn *str = cudart<ErrorStringFn>("cudaGetErrorString");
    std::ostringstream msg;
    msg << what << " failed: " << str(err) << " (cudaError " << int(err) << ")";
    if (err == cudaErrorInsufficientDriver || err == cudaErrorNoDevice) {
        msg << ". fastattn needs an NVIDIA GPU and its driver (libcuda.so.1)";
    }
    return error(Code::kCudaError, msg.str());
}

const char *capture_state(cudaStream_t s) {
    static IsCapturingFn *is_capturing = cudart<IsCapturingFn>("cudaStreamIsCapturing");
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (is_capturing(s, &status) != cudaSuccess) {
        (void)cudart<GetLastErrorFn>("cudaGetLastError")();
        return "unknown";
    }
    return status == cudaStreamCaptureStatusActive        ? "capturing"
           : status == cudaStreamCaptureStatusInvalidated ? "capture invalidated"
                                                          : "not capturing";
}

namespace {

// `bytes` bytes from `host` into fresh device memory on `device`, in relaxed capture mode
// on a stream of its own that is synchronized before the return (never a caller's
// stream, which may be capturing). Never freed: see device.h. On failure the memory is
// left allocated (and unused): a few bytes, and no free that could meet a capture.
Status upload(const void *host, size_t bytes, intptr_t *out) {
    static MallocFn *malloc_        = cudart<MallocFn>("cudaMalloc");
    static MemcpyAsyncFn *copy      = cudart<MemcpyAsyncFn>("cudaMemcpyAsync");
    static StreamCreateFn *create   = cudart<StreamCreateFn>("cudaStreamCreateWithFlags");
    static StreamSyncFn *sync       = cudart<StreamSyncFn>("cudaStreamSynchronize");
    static StreamDestroyFn *destroy = cudart<StreamDestroyFn>("cudaStreamDestroy");
    RelaxedCaptureMode relaxed;
    void *p = nullptr;
    FA_RETURN_IF_ERROR(cuda_status(malloc_(&p, bytes), "cudaMalloc"));
    cudaStream_t s = nullptr;
    FA_RETURN_IF_ERROR(cuda_status(create(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags"));
    Status st = cuda_status(copy(p, host, bytes, cudaMemcpyHostToDevice, s), "cudaMemcpyAsync");
    if (st.ok()) st = cuda_status(sync(s), "cudaStreamSynchronize");  // `host` may be freed at return
    (void)destroy(s);
    FA_RETURN_IF_ERROR(st);
    *out = reinterpret_cast<intptr_t>(p);
    return {};
}

}  // namespace

Status constant_int32(int device, int32_t value, int64_t count, intptr_t *out) {
    if (count < 1) return error(Code::kInvalidArgument, "constant_int32: count must be at least 1");
    struct Array {
        intptr_t ptr   = 0;
        int64_t count  = 0;
    };
    static std::mutex mutex;
    static std::map<std::pair<int, int32_t>, Array> arrays;  // never freed: see device.h
    std::lock_guard<std::mutex> lock(mutex);
    Array &a = arrays[{device, value}];
    if (a.count >= count) {
        *out = a.ptr;
        return {};
    }
    return guarded(Code::kCudaError, "constant_int32", [&]() -> Status {
        int64_t n = 64;
        while (n < count) n *= 2;
        const std::vector<int32_t> host(static_cast<size_t>(n), value);
        FA_RETURN_IF_ERROR(upload(host.data(), host.size() * sizeof(int32_t), &a.ptr));
        a.count = n;  // an older, smaller array stays: plans still hold it
        *out    = a.ptr;
        return {};
    });
}

Status constant_bytes(int device, const void *data, size_t bytes, intptr_t *out) {
    if (bytes == 0) return error(Code::kInvalidArgument, "constant_bytes: bytes must be at least 1");
    static std::mutex mutex;
    static std::map<std::pair<int, std::string>, intptr_t> arrays;  // never freed: see device.h
    std::lock_guard<std::mutex> lock(mutex);
    intptr_t &a = arrays[{device, std::string(static_cast<const char *>(data), bytes)}];
    if (a != 0) {
        *out = a;
        return {};
    }
    return guarded(Code::kCudaError, "constant_bytes", [&]() -> Status {
        FA_RETURN_IF_ERROR(upload(data, bytes, &a));
        *out = a;
        return {};
    });
}

}  // namespace detail

using namespace detail;

Status device_count(int *count) {
    return guarded(Code::kLibraryError, "CUDA runtime", [&]() -> Status {
        static GetCountFn *fn = cudart<GetCountFn>("cudaGetDeviceCount");
        *count                = 0;
        return cuda_status(fn(count), "cudaGetDeviceCount");
    });
}

Status current_device(int *device) {
    return guarded(Code::kLibraryError, "CUDA runtime", [&]() -> Status {
        static GetDeviceFn *fn = cudart<GetDeviceFn>("cudaGetDevice");
        return cuda_status(fn(device), "cudaGetDevice");
    });
}

Status stream_capturing(intptr_t stream, bool *capturing) {
    return guarded(Code::kLibraryError, "CUDA runtime", [&]() -> Status {
        static IsCapturingFn *fn      = cudart<IsCapturingFn>("cudaStreamIsCapturing");
        cudaStreamCaptureStatus state = cudaStreamCaptureStatusNone;
        FA_RETURN_IF_ERROR(cuda_status(fn(reinterpret_cast<cudaStream_t>(stream), &state), "cudaStreamIsCapturing"));
        *capturing = state != cudaStreamCaptureStatusNone;
        return {};
    });
}

Status device_info(int device, DeviceInfo *out) {
    return guarded(Code::kLibraryError, "CUDA runtime", [&]() -> Status {
        static AttributeFn *attr = cudart<AttributeFn>("cudaDeviceGetAttribute");
        static VersionFn *drv    = cudart<VersionFn>("cudaDriverGetVersion");
        static VersionFn *rt     = cudart<VersionFn>("cudaRuntimeGetVersion");
        FA_RETURN_IF_ERROR(cuda_status(attr(&out->major, cudaDevAttrComputeCapabilityMajor, device),
                                       "cudaDeviceGetAttribute"));
        FA_RETURN_IF_ERROR(cuda_status(attr(&out->minor, cudaDevAttrComputeCapabilityMinor, device),
                                       "cudaDeviceGetAttribute"));
        FA_RETURN_IF_ERROR(cuda_status(attr(&out->sm_count, cudaDevAttrMultiProcessorCount, device),
                                       "cudaDeviceGetAttribute"));
        FA_RETURN_IF_ERROR(cuda_status(drv(&out->driver_version), "cudaDriverGetVersion"));
        FA_RETURN_IF_ERROR(cuda_status(rt(&out->runtime_version), "cudaRuntimeGetVersion"));
        // The device name is the driver's: cudaDeviceProp's layout changes between
        // CUDA releases, cuDeviceGetName's signature does not.
        auto get_dev  = reinterpret_cast<DeviceGetFn *>(cuda_symbol(CudaLibrary::kDriver, "cuDeviceGet"));
        auto get_name = reinterpret_cast<DeviceGetNameFn *>(cuda_symbol(CudaLibrary::kDriver, "cuDeviceGetName"));
        CUdevice dev;
        char name[256] = {};
        if (get_dev(&dev, device) != CUDA_SUCCESS || get_name(name, sizeof(name) - 1, dev) != CUDA_SUCCESS) {
            return error(Code::kCudaError, "cuDeviceGetName failed for device " + std::to_string(device));
        }
        out->name = name;
        return {};
    });
}

}  // namespace fastattn
