// Where an attention config becomes a cuDNN graph, a graph becomes a plan, and a
// plan runs. The only translation unit that includes cudnn-frontend.
//
// cudnn-frontend is compiled in its dynamic-loading mode: nothing here links
// against cuDNN or CUDA. The Python loader (fastattn/_loader.py) finds and loads
// libcudnn and what it needs, then load_cudnn() hands the library to the frontend.
#include "fastattn.h"
#include "bench.h"

#include <dlfcn.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <exception>
#include <mutex>
#include <unordered_map>
#include <sstream>

#include <cudnn_frontend.h>

namespace cudnn_frontend {
// The frontend resolves every cuDNN symbol through this handle in dynamic-loading mode.
void *cudnn_dlhandle = nullptr;
}  // namespace cudnn_frontend

namespace fe = cudnn_frontend;

namespace fastattn {

// What a launch through cuDNN's backend itself needs (packs.inc), read from the
// frontend graph once, when the graph is made or loaded.
struct DirectLaunch {
    bool usable  = false;  // false: every call goes through the frontend's execute
    uint64_t serial = 0;   // this graph's, never reused: the key of its cached variant packs
    cudnnBackendDescriptor_t plan = nullptr;  // the chosen plan, owned by the frontend graph
    int64_t fe_workspace = 0;                 // the frontend's share of the workspace, ahead of cuDNN's
    std::vector<int64_t> uids;                // the variant pack's uids, sorted
    std::vector<void *> fixed;                // its pointers that never change (pass-by-value scalars)
    std::vector<int> user;                    // the caller's i-th pointer (uid order) goes to pack index user[i]
    std::vector<std::pair<int, int64_t>> in_workspace;  // pack index, byte offset into the workspace
};

// A ragged graph's index arrays, which fastattn computes from cumulative lengths
// (ragged.inc): n = batch + 1 entries per row, rows `stride` int32 apart from byte
// `offset` of the workspace; the rows' multipliers; the slots such a launch takes.
struct RaggedIndex {
    int n = 0, stride = 0;  // n == 0: not a ragged graph
    int64_t offset = 0;
    int32_t mult[5] = {};   // token strides of q, k, v, o, stats (0: no packed stats)
    uint64_t cu_slots = 0;
};

class Graph {
   public:
    std::shared_ptr<fe::graph::Graph> g;
    Direction dir     = Direction::kForward;
    uint64_t slots    = 0;  // bit s set: the graph takes the tensor of Slot s at execute
    uint64_t by_value = 0;  // host values (host_seed's seed and offset): not held to device alignment
    int64_t workspace = 0;
    // The variant pack's layout, fixed when the graph is made: order[i] is the slot of
    // its i-th tensor in uid order (cuDNN's sorted order), so execute writes each
    // pointer straight to its place, with no map, vector or search per call.
    int8_t order[kNumSlots] = {};
    int n                   = 0;
    DirectLaunch direct;
    RaggedIndex ragged;
};

namespace {

// A tensor's uid is its slot + 1: the sorted-pointer execute takes user pointers in
// uid order, which is then slot order.
constexpr int64_t uid(Slot s) { return static_cast<int64_t>(s) + 1; }
constexpr uint64_t bit(Slot s) { return uint64_t{1} << s; }
static_assert(kNumSlots <= 64, "slot masks are 64-bit");

// Each slot's name in errors, and why a plan may not take it.
struct SlotSpec {
    const char *name;
    const char *absent;
};
constexpr SlotSpec kSlots[kNumSlots] = {
#define FASTATTN_SLOT_SPEC_(UPPER, Camel, name, absent) {name, absent},
    FASTATTN_SLOT_TABLE(FASTATTN_SLOT_SPEC_)
#undef FASTATTN_SLOT_SPEC_
};
constexpr int kMaxDevices                        = 64;
constexpr uintptr_t kAlignment                   = 16;

std::mutex g_load_mutex;
int64_t g_cudnn_version = 0;

Status error(Code code, std::string message) { return Status{code, std::move(message)}; }

double ms_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// Runs fn and turns any C++ exception into a status with `code`: nothing crosses
// the boundary (cudnn-frontend throws from graph construction, blob parsing and
// its dynamic loader; an uncaught throw aborts the Python process).
template <class Fn>
Status guarded(Code code, const char *what, Fn &&fn) {
    try {
        return fn();
    } catch (const std::exception &e) {
        return error(code, std::string(what) + ": " + e.what());
    } catch (...) {
        return error(code, std::string(what) + ": unknown C++ exception");
    }
}

// CUDA runtime entry points, statuses, DeviceGuard and RelaxedCaptureMode.
#include "cuda.inc"

}  // namespace

// A plan may be freed while some thread captures (Python's garbage collector runs
// anywhere): its graph's destruction may unload runtime-compiled kernels, which a
// capture in global mode would count as unsafe.
void GraphDeleter::operator()(Graph *g) const {
    RelaxedCaptureMode relaxed;
    delete g;
}

namespace {

// cuDNN handles are per thread and per device. They are deliberately never
// destroyed: at thread or process exit the CUDA context may already be gone, and
// destroying a handle then crashes (PyTorch leaks its handles for the same reason).
struct ThreadState {
    cudnnHandle_t handle[kMaxDevices] = {};
    cudaStream_t stream[kMaxDevices]  = {};
};
thread_local ThreadState t_state;

// Call with `device` current (inside a DeviceGuard).
Status thread_handle(int device, cudnnHandle_t *out) {
    if (device < 0 || device >= kMaxDevices) {
        return error(Code::kInvalidArgument, "device=" + std::to_string(device) + " is out of range");
    }
    if (t_state.handle[device] == nullptr) {
        cudnnHandle_t h = nullptr;
        cudnnStatus_t st;
        {
            // A thread's first launch may be inside the caller's capture: cudnnCreate's
            // allocations must not invalidate it (see set_stream).
            RelaxedCaptureMode relaxed;
            st = fe::detail::create_handle(&h);
        }
        if (st != CUDNN_STATUS_SUCCESS) {
            return error(Code::kCudnnError,
                         std::string("cudnnCreate failed: ") + fe::detail::get_error_string(st));
        }
        t_state.handle[device] = h;
        t_state.stream[device] = nullptr;  // a new handle runs on the default stream
    }
    *out = t_state.handle[device];
    return {};
}

// A stream's capture state, for messages.
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

Status set_stream(int device, cudnnHandle_t h, intptr_t stream) {
    auto s = reinterpret_cast<cudaStream_t>(stream);
    if (t_state.stream[device] == s) return {};
    cudnnStatus_t st;
    {
        // Binding a stream records nothing into a capture, but cuDNN may make calls that
        // CUDA counts as unsafe while any capture in global mode (PyTorch's default) is
        // under way, which would invalidate the caller's capture: relaxed for this call
        // only (as PyTorch's allocator relaxes its own), never around a launch.
        RelaxedCaptureMode relaxed;
        st = fe::detail::set_stream(h, s);
    }
    if (st != CUDNN_STATUS_SUCCESS) {
        std::ostringstream msg;
        msg << "cudnnSetStream failed for stream=" << stream << " (" << capture_state(s)
            << "; the handle was bound to stream=" << reinterpret_cast<intptr_t>(t_state.stream[device])
            << "): " << fe::detail::get_error_string(st);
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

#define FA_RETURN_IF_ERROR(expr)          \
    do {                                  \
        Status _st = (expr);              \
        if (!_st.ok()) return _st;        \
    } while (0)

// Ragged launches from cumulative lengths: the index kernel and its arrays' places.
#include "ragged.inc"

// Launches through cached variant packs: capture_direct(graph) and launch_cached(...).
#include "packs.inc"

// The graph builders: make_graph(config, direction) and slot_mask(config, direction).
#include "graphs.inc"
// The FP8 builders (sdpa_fp8, sdpa_fp8_backward), which make_graph dispatches to.
#include "graphs_fp8.inc"

// Fixes the graph's tensors and their places in the variant pack.
void set_layout(Graph &graph, const Config &c, Direction dir) {
    graph.dir      = dir;
    graph.slots    = slot_mask(c, dir);
    graph.by_value = c.host_seed ? bit(kSlotSeed) | bit(kSlotOffset) : uint64_t{0};
    graph.n        = 0;
    for (int s = 0; s < kNumSlots; ++s) {
        if (graph.slots & bit(static_cast<Slot>(s))) graph.order[graph.n++] = static_cast<int8_t>(s);
    }
    set_ragged_index(graph, c);
}

// The uids of a slot mask, sorted: what cuDNN's variant pack holds, in its order.
std::vector<int64_t> mask_uids(uint64_t mask) {
    std::vector<int64_t> uids;
    for (int s = 0; s < kNumSlots; ++s) {
        if (mask & bit(static_cast<Slot>(s))) uids.push_back(uid(static_cast<Slot>(s)));
    }
    return uids;
}

// A failed build step is cuDNN refusing the graph, unless the failure is the
// environment's (CUDA, handle, device), which the caller must hear about as such.
Status build_step(const fe::error_t &e, const char *stage) {
    if (e.is_good()) return {};
    std::string msg = std::string(stage) + ": " + e.err_msg;
    switch (e.code) {
        case fe::error_code_t::CUDA_API_FAILED:
        case fe::error_code_t::INVALID_CUDA_DEVICE:
            return error(Code::kCudaError, msg);
        case fe::error_code_t::HANDLE_ERROR:
            return error(Code::kCudnnError, msg);
        default:
            return error(Code::kNotSupported, msg);
    }
}

// A deserialized graph has no engine configs, and asking it for its plan name reads
// past the end of an empty vector: only built graphs are asked (`built`).
Status finish(Graph &graph, const char *stage_prefix, bool built, GraphInfo *info) {
    auto uids = graph.g->get_variant_pack_uids_sorted();
    if (uids != mask_uids(graph.slots)) {
        return error(Code::kCorruptPlan, std::string(stage_prefix) + ": plan's tensors do not match its config");
    }
    FA_RETURN_IF_ERROR(build_step(graph.g->get_workspace_size(graph.workspace), "get_workspace_size"));
    place_index(graph);
    if (graph.ragged.n > 0) (void)ragged_kernel();  // loaded now, not inside a caller's launch or capture
    info->workspace_size = graph.workspace;
    if (built) FA_RETURN_IF_ERROR(build_step(graph.g->get_plan_name(info->engine_name), "get_plan_name"));
    capture_direct(graph);
    return {};
}

Status check_pointer(intptr_t p, const char *name) {
    if (p == 0) return error(Code::kInvalidArgument, std::string(name) + " is a null pointer");
    if (static_cast<uintptr_t>(p) % kAlignment != 0) {
        std::ostringstream msg;
        msg << name << "=0x" << std::hex << p << " is not " << std::dec << kAlignment << "-byte aligned";
        return error(Code::kInvalidArgument, msg.str());
    }
    return {};
}

Status check_workspace(const Graph &g, intptr_t workspace) {
    if (g.workspace > 0) return check_pointer(workspace, "workspace");
    return {};
}

// How a launch reaches cuDNN: through a cached variant pack (packs.inc), or through
// the frontend's execute, which fastattn takes where a graph's execute does more
// than fill pointers, and which the benchmark times as the floor to beat.
enum class Via { kCachedPack, kFrontend };

// `ptrs` in uid order. The frontend's cheapest entry point for a plan already chosen
// is its sorted-pointer execute (graph_interface.h, 1.28): straight to
// execute_plan_at_index with the candidate plan, where its map overloads first build
// and search an unordered_map. It still makes a variant pack per call.
// `index`: the launch's cumulative lengths, when it was given them (the index kernel
// runs first, on the same stream).
Status run(const Graph &g, int device, void **ptrs, int n, intptr_t workspace, intptr_t stream, Via via,
           const IndexLaunch *index = nullptr) {
    return guarded(Code::kCudnnError, "execute", [&]() -> Status {
        LaunchScope scope(device, stream);
        FA_RETURN_IF_ERROR(scope.status());
        if (via == Via::kCachedPack && g.direct.usable && !fe::isLoggingTensorDumpEnabled()) {
            return launch_cached(g, scope.handle(), device, stream, ptrs, reinterpret_cast<void *>(workspace), index);
        }
        if (index != nullptr) FA_RETURN_IF_ERROR(launch_index(*index, reinterpret_cast<cudaStream_t>(stream)));
        auto e = g.g->execute(scope.handle(), ptrs, n, reinterpret_cast<void *>(workspace));
        if (e.is_bad()) return error(Code::kCudnnError, "execute: " + e.err_msg);
        return {};
    });
}

}  // namespace

Status load_cudnn(const std::string &path, int64_t *version) {
    std::lock_guard<std::mutex> lock(g_load_mutex);
    if (fe::cudnn_dlhandle == nullptr) {
        void *h = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
        if (h == nullptr) {
            const char *why = dlerror();
            return error(Code::kLibraryError, "dlopen(" + path + ") failed: " + (why ? why : "unknown error"));
        }
        if (dlsym(h, "cudnnGetVersion") == nullptr || dlsym(h, "cudnnBackendExecute") == nullptr) {
            return error(Code::kLibraryError, path + " does not export cuDNN's backend API");
        }
        fe::cudnn_dlhandle = h;
    }
    auto st = guarded(Code::kLibraryError, "cudnnGetVersion", [&]() -> Status {
        g_cudnn_version = static_cast<int64_t>(fe::detail::get_backend_version());
        return {};
    });
    *version = g_cudnn_version;
    return st;
}

const char *slot_name(int slot) { return slot >= 0 && slot < kNumSlots ? kSlots[slot].name : nullptr; }

#define FASTATTN_STATUS_NAME_(UPPER, Cpp, value, Python) {value, #Python},
const StatusName kStatusNames[] = {FASTATTN_STATUS_TABLE(FASTATTN_STATUS_NAME_)};
#undef FASTATTN_STATUS_NAME_
const int kNumStatusNames = sizeof kStatusNames / sizeof kStatusNames[0];

int64_t cudnn_version() { return g_cudnn_version; }
int64_t cudnn_header_version() { return CUDNN_VERSION; }
int64_t frontend_version() { return CUDNN_FRONTEND_VERSION; }
const char *plan_policy() { return "heuristics=A,FALLBACK;build=HEURISTICS_CHOICE"; }

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
        auto get_dev  = reinterpret_cast<DeviceGetFn *>(
            fe::detail::get_cuda_symbol(fe::detail::CudaLibrary::CUDA, "cuDeviceGet"));
        auto get_name = reinterpret_cast<DeviceGetNameFn *>(
            fe::detail::get_cuda_symbol(fe::detail::CudaLibrary::CUDA, "cuDeviceGetName"));
        CUdevice dev;
        char name[256] = {};
        if (get_dev(&dev, device) != CUDA_SUCCESS || get_name(name, sizeof(name) - 1, dev) != CUDA_SUCCESS) {
            return error(Code::kCudaError, "cuDeviceGetName failed for device " + std::to_string(device));
        }
        out->name = name;
        return {};
    });
}

Status build_graph(const Config &cfg, Direction dir, int device, GraphPtr *out, GraphInfo *info) {
    if (fe::cudnn_dlhandle == nullptr) return error(Code::kLibraryError, "cuDNN is not loaded");
    if (dir == Direction::kBackward && !cfg.training) {
        return error(Code::kInvalidArgument, "a backward graph needs training=True");
    }
    // Measured on the H200 with cuDNN 9.19 (tests/config/test_alignment_bias_gpu.py, session 5's run
    // s5-2): with a bias of one row broadcast over the queries (shapes "..1s"), cuDNN builds and
    // runs the backward graph and its d_q and d_k are wrong (relative error 0.75-1.0 against
    // float64) while the forward is right. Refused, so that the probe says so instead of a
    // silent wrong gradient. (Broadcasting that row with a stride of 0 is the next thing to try.)
    if (dir == Direction::kBackward && cfg.bias_batch > 0 && cfg.bias_seq_q == 1 && cfg.seqlen_q > 1) {
        return error(Code::kNotSupported,
                     "a bias of one row (shape ..1s, broadcast over the queries) has no correct backward here: "
                     "cuDNN 9.19's backward gives wrong d_q and d_k for it (measured by fastattn's float64 tests); "
                     "use it without gradients (training=False) or give the bias seqlen_q rows");
    }
    return guarded(Code::kNotSupported, "graph construction", [&]() -> Status {
        auto t0 = std::chrono::steady_clock::now();
        DeviceGuard guard(device);
        FA_RETURN_IF_ERROR(guard.status());
        cudnnHandle_t h;
        FA_RETURN_IF_ERROR(thread_handle(device, &h));

        GraphPtr graph(new Graph);
        set_layout(*graph, cfg, dir);
        graph->g        = make_graph(cfg, dir);
        auto &g         = *graph->g;
        FA_RETURN_IF_ERROR(build_step(g.validate(), "validate"));
        FA_RETURN_IF_ERROR(build_step(g.build_operation_graph(h), "build_operation_graph"));
        // Keep in step with plan_policy().
        FA_RETURN_IF_ERROR(build_step(g.create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}),
                                      "create_execution_plans"));
        FA_RETURN_IF_ERROR(build_step(g.check_support(h), "check_support"));
        FA_RETURN_IF_ERROR(build_step(g.build_plans(fe::BuildPlanPolicy_t::HEURISTICS_CHOICE), "build_plans"));
        FA_RETURN_IF_ERROR(finish(*graph, "build", /*built=*/true, info));
        info->build_ms = ms_since(t0);
        *out           = std::move(graph);
        return {};
    });
}

Status serialize_graph(const Graph *graph, std::vector<uint8_t> *blob) {
    if (graph == nullptr) return error(Code::kInvalidArgument, "serialize: no graph");
    return guarded(Code::kInternal, "serialize", [&]() -> Status {
        auto e = graph->g->serialize(*blob, /*serialize_structure=*/false);
        if (e.is_bad()) return error(Code::kInternal, "serialize: " + e.err_msg);
        return {};
    });
}

Status deserialize_graph(const uint8_t *data, size_t size, const Config &cfg, Direction dir, int device,
                         GraphPtr *out, GraphInfo *info) {
    if (fe::cudnn_dlhandle == nullptr) return error(Code::kLibraryError, "cuDNN is not loaded");
    if (data == nullptr || size == 0) return error(Code::kCorruptPlan, "deserialize: empty plan blob");
    return guarded(Code::kCorruptPlan, "deserialize", [&]() -> Status {
        auto t0 = std::chrono::steady_clock::now();
        DeviceGuard guard(device);
        FA_RETURN_IF_ERROR(guard.status());
        cudnnHandle_t h;
        FA_RETURN_IF_ERROR(thread_handle(device, &h));
        // Must be a std::vector<uint8_t>: other containers silently select the
        // overload that expects a serialized graph structure.
        const std::vector<uint8_t> blob(data, data + size);
        GraphPtr graph(new Graph);
        set_layout(*graph, cfg, dir);
        graph->g        = std::make_shared<fe::graph::Graph>();
        auto e = graph->g->deserialize(h, blob, /*enforce_precompiled=*/false, /*run_warmup=*/false);
        if (e.is_bad()) return error(Code::kCorruptPlan, "deserialize: " + e.err_msg);
        FA_RETURN_IF_ERROR(finish(*graph, "deserialize", /*built=*/false, info));
        info->build_ms = ms_since(t0);
        *out           = std::move(graph);
        return {};
    });
}

namespace {

// Why execute refused its pointers, slot by slot (execute's error path).
Status slot_error(const Graph &g, const intptr_t *slots, intptr_t workspace) {
    // A ragged plan given cumulative lengths takes them in place of its index arrays.
    uint64_t takes = g.slots;
    if (g.ragged.n > 0 && (slots[kSlotCuSeqlensQ] != 0 || slots[kSlotCuSeqlensKV] != 0)) {
        takes = g.ragged.cu_slots;
        for (Slot s : kIndexSlots) {
            if (slots[s] != 0) {
                return error(Code::kInvalidArgument, std::string(kSlots[s].name) +
                                                         " given with cu_seqlens_q and cu_seqlens_kv, which fastattn "
                                                         "computes it from: give one or the other");
            }
        }
        for (Slot s : {kSlotCuSeqlensQ, kSlotCuSeqlensKV}) {
            if (slots[s] == 0) {
                return error(Code::kInvalidArgument, std::string(kSlots[s].name) +
                                                         " is null: give both cumulative lengths (the same array "
                                                         "twice for self-attention)");
            }
            if (slots[s] % 4 != 0) {
                std::ostringstream msg;
                msg << kSlots[s].name << "=0x" << std::hex << slots[s] << " is not 4-byte aligned (int32)";
                return error(Code::kInvalidArgument, msg.str());
            }
        }
    }
    for (int s = 0; s < kNumSlots; ++s) {
        if (slots[s] != 0 && !(takes & bit(static_cast<Slot>(s)))) {
            return error(Code::kInvalidArgument, std::string(kSlots[s].name) + " given, but " + kSlots[s].absent);
        }
    }
    for (int s = 0; s < kNumSlots; ++s) {
        if (!(takes & bit(static_cast<Slot>(s))) || (kCuSlots & bit(static_cast<Slot>(s)))) continue;
        if (g.by_value & bit(static_cast<Slot>(s))) {  // a host int64, read by cuDNN during the call
            if (slots[s] == 0) return error(Code::kInvalidArgument, std::string(kSlots[s].name) + " is null");
        } else {
            FA_RETURN_IF_ERROR(check_pointer(slots[s], kSlots[s].name));
        }
    }
    return check_workspace(g, workspace);
}

}  // namespace

Status execute(const Graph *g, Direction dir, int device, const intptr_t *slots, intptr_t workspace,
               intptr_t stream) {
    if (g == nullptr || g->dir != dir) {
        return error(Code::kInvalidArgument,
                     dir == Direction::kForward ? "not a forward graph" : "not a backward graph");
    }
    // Every check in one branch-free pass over the slots: a pointer the plan does not
    // take, one it takes missing, a device pointer not 16-byte aligned, the workspace.
    // Only a refusal looks for the culprit (slot_error), so a call pays no per-slot
    // branches or Status objects.
    uint64_t given = 0, misaligned = 0;
    for (int s = 0; s < kNumSlots; ++s) {
        const auto p = static_cast<uintptr_t>(slots[s]);
        given |= static_cast<uint64_t>(p != 0) << s;
        misaligned |= static_cast<uint64_t>(p % kAlignment != 0) << s;
    }
    const auto ws = static_cast<uintptr_t>(workspace);
    const bool bad_workspace = g->workspace > 0 && (ws == 0 || ws % kAlignment != 0);
    // Cumulative lengths are int32 arrays that may start anywhere 4-byte aligned.
    const bool derived   = g->ragged.n > 0 && given == g->ragged.cu_slots;
    const bool bad_cu    = ((slots[kSlotCuSeqlensQ] | slots[kSlotCuSeqlensKV]) & 3) != 0;
    if ((given != g->slots && !derived) || (misaligned & ~g->by_value & ~kCuSlots) != 0 || bad_cu || bad_workspace) {
        return slot_error(*g, slots, workspace);
    }
    intptr_t full[kNumSlots];
    IndexLaunch index{g, slots[kSlotCuSeqlensQ], slots[kSlotCuSeqlensKV], workspace};
    if (derived) {
        fill_index_slots(*g, slots, workspace, full);
        slots = full;
    }
    // The variant pack, filled in place in cuDNN's order. On the stack, not kept with
    // the plan: plans are shared between threads and execute runs without the GIL, so
    // a per-plan array would be written by two launches at once.
    void *pack[kNumSlots];
    for (int i = 0; i < g->n; ++i) pack[i] = reinterpret_cast<void *>(slots[g->order[i]]);
    return run(*g, device, pack, g->n, workspace, stream, Via::kCachedPack, derived ? &index : nullptr);
}

// The benchmark hooks of bench.h.
#include "bench.inc"

}  // namespace fastattn
