// ragged.h's index math and kernel: where a ragged graph's index arrays go in its
// workspace, and the kernel that fills them from cumulative lengths (ragged_indices.cu,
// compiled to the PTX of ragged_ptx.h). Needs no cudnn-frontend: a translation unit of
// its own, compiled beside the one that does.
#include "ragged.h"

#include <cstring>
#include <exception>
#include <string>

#include "device.h"
#include "ragged_ptx.h"  // kRaggedIndicesPtx
#include "status.h"

namespace fastattn::detail {

namespace {

using LibraryLoadDataFn  = cudaError_t(cudaLibrary_t *, const void *, cudaJitOption *, void **, unsigned int,
                                      cudaLibraryOption *, void **, unsigned int);
using LibraryGetKernelFn = cudaError_t(cudaKernel_t *, cudaLibrary_t, const char *);
using LaunchKernelFn     = cudaError_t(const void *, dim3, dim3, void **, size_t, cudaStream_t);

struct RaggedKernel {
    Status status;
    LaunchKernelFn *launch = nullptr;
    const void *fn         = nullptr;
};

const RaggedKernel &ragged_kernel() {
    static const RaggedKernel kernel = [] {
        RaggedKernel k;
        try {
            auto *load = cudart<LibraryLoadDataFn>("cudaLibraryLoadData");
            auto *get  = cudart<LibraryGetKernelFn>("cudaLibraryGetKernel");
            k.launch   = cudart<LaunchKernelFn>("cudaLaunchKernel");
            RelaxedCaptureMode relaxed;  // another thread's capture is not ours to break
            cudaLibrary_t lib = nullptr;
            cudaKernel_t fn   = nullptr;
            k.status = cuda_status(load(&lib, kRaggedIndicesPtx, nullptr, nullptr, 0, nullptr, nullptr, 0),
                                   "cudaLibraryLoadData (fastattn's ragged index kernel)");
            if (k.status.ok()) k.status = cuda_status(get(&fn, lib, "fastattn_ragged_indices"), "cudaLibraryGetKernel");
            k.fn = fn;  // the library stays loaded for the process
        } catch (const std::exception &e) {
            k.status = error(Code::kLibraryError,
                             std::string("the CUDA runtime cannot load fastattn's ragged index kernel "
                                         "(cumulative lengths need CUDA 12.0 or newer): ") + e.what());
        }
        return k;
    }();
    return kernel;
}

}  // namespace

RaggedIndex ragged_index(const Config &c, uint64_t slots) {
    RaggedIndex r;
    if (!c.ragged) return r;
    r.n      = static_cast<int>(c.batch + 1);
    r.stride = (r.n + 3) / 4 * 4;  // rows 16-byte aligned, as cuDNN wants every tensor
    const bool stats = (slots >> kSlotRaggedStats) & 1;
    const int64_t mult[5] = {c.q_stride[2], c.k_stride[2], c.v_stride[2], c.o_stride[2], stats ? c.heads_q : 0};
    for (int i = 0; i < 5; ++i) r.mult[i] = static_cast<int32_t>(mult[i]);
    uint64_t derived = 0;
    for (Slot s : kIndexSlots) derived |= uint64_t{1} << s;
    r.cu_slots = (slots & ~derived) | kCuSlots;
    return r;
}

int64_t place_index(RaggedIndex &r, int64_t workspace) {
    if (r.n == 0) return workspace;
    r.offset = (workspace + 15) / 16 * 16;
    return r.offset + int64_t{kIndexRows} * r.stride * 4;
}

Status load_index_kernel() { return ragged_kernel().status; }

void fill_index_slots(const RaggedIndex &r, uint64_t graph_slots, const intptr_t *slots, intptr_t workspace,
                      intptr_t *out) {
    std::memcpy(out, slots, sizeof(intptr_t) * kNumSlots);
    out[kSlotCuSeqlensQ] = out[kSlotCuSeqlensKV] = 0;
    for (int row = 0; row < kIndexRows; ++row) {
        if ((graph_slots >> kIndexSlots[row]) & 1) {
            out[kIndexSlots[row]] = workspace + r.offset + intptr_t{4} * r.stride * row;
        }
    }
}

Status launch_index(const IndexLaunch &x, cudaStream_t stream) {
    const RaggedKernel &k = ragged_kernel();
    FA_RETURN_IF_ERROR(k.status);
    const RaggedIndex &r = *x.index;
    const auto *cu_q  = reinterpret_cast<const int32_t *>(x.cu_q);
    const auto *cu_kv = reinterpret_cast<const int32_t *>(x.cu_kv);
    auto *out         = reinterpret_cast<int32_t *>(x.workspace + r.offset);
    int n = r.n, stride = r.stride;
    int32_t mult[5];
    std::memcpy(mult, r.mult, sizeof mult);
    void *args[] = {&cu_q, &cu_kv, &n, &out, &stride, &mult[0], &mult[1], &mult[2], &mult[3], &mult[4]};
    constexpr unsigned kThreads = 128;
    const dim3 grid((static_cast<unsigned>(n) + kThreads - 1) / kThreads), block(kThreads);
    return cuda_status(k.launch(k.fn, grid, block, args, 0, stream), "cudaLaunchKernel (fastattn's ragged index kernel)");
}

}  // namespace fastattn::detail
