// Where an attention config becomes a cuDNN graph, a graph becomes a plan, and a
// plan runs. The only translation unit that includes cudnn-frontend: through this
// file's headers (graph_state.h, handles.h, packs.h, graphs.h, graphs_fp8.h), which
// nothing else includes. What needs no frontend (device.cpp, slots.cpp, ragged.cpp)
// compiles beside it, in translation units of its own.
//
// cudnn-frontend is compiled in its dynamic-loading mode: nothing here links
// against cuDNN or CUDA. The Python loader (fastattn/_loader.py) finds and loads
// libcudnn and what it needs, then load_cudnn() hands the library to the frontend.
#include "fastattn.h"
#include "bench.h"

#include <dlfcn.h>

#include <chrono>
#include <cstring>
#include <mutex>
#include <sstream>
#include <unordered_map>

#include <cudnn_frontend.h>

#include "device.h"
#include "graph_state.h"
#include "graphs.h"
#include "graphs_fp8.h"
#include "handles.h"
#include "packs.h"
#include "ragged.h"
#include "slots.h"
#include "status.h"

namespace cudnn_frontend {
// The frontend resolves every cuDNN symbol through this handle in dynamic-loading mode.
void *cudnn_dlhandle = nullptr;
}  // namespace cudnn_frontend

namespace fastattn {

using namespace detail;

// The frontend's CUDA loader, for device.h: one libcudart and one libcuda for the process.
void *detail::cuda_symbol(CudaLibrary library, const char *name) {
    return fe::detail::get_cuda_symbol(
        library == CudaLibrary::kDriver ? fe::detail::CudaLibrary::CUDA : fe::detail::CudaLibrary::CUDART, name);
}

// A plan may be freed while some thread captures (Python's garbage collector runs
// anywhere): its graph's destruction may unload runtime-compiled kernels, which a
// capture in global mode would count as unsafe.
void GraphDeleter::operator()(Graph *g) const {
    RelaxedCaptureMode relaxed;
    delete g;
}

namespace {

std::mutex g_load_mutex;
int64_t g_cudnn_version = 0;

// The one function that turns a config into a cuDNN graph: build, probe and warm all
// come through here, so a probed graph is the graph that runs.
std::shared_ptr<fe::graph::Graph> make_graph(const Config &c, Direction dir) {
    if (is_fp8(c.dtype)) return dir == Direction::kForward ? make_fp8_forward_graph(c) : make_fp8_backward_graph(c);
    return dir == Direction::kForward ? make_forward_graph(c) : make_backward_graph(c);
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
Status finish(Graph &graph, const char *stage_prefix, bool built, int device, GraphInfo *info) {
    auto uids = graph.g->get_variant_pack_uids_sorted();
    if (uids != mask_uids(graph.slots | graph.owned)) {
        return error(Code::kCorruptPlan, std::string(stage_prefix) + ": plan's tensors do not match its config");
    }
    FA_RETURN_IF_ERROR(build_step(graph.g->get_workspace_size(graph.workspace), "get_workspace_size"));
    graph.workspace = place_index(graph.ragged, graph.workspace);
    if (graph.ragged.n > 0) (void)load_index_kernel();  // loaded now, not inside a caller's launch or capture
    info->workspace_size = graph.workspace;
    if (built) FA_RETURN_IF_ERROR(build_step(graph.g->get_plan_name(info->engine_name), "get_plan_name"));
    capture_direct(graph, device);
    return {};
}

// A full_lengths graph's own length arrays (slots.h's Layout::owned), made when the
// graph is built or loaded, with the device current.
Status own_lengths(Graph &graph, const Config &c, int device) {
    if (graph.owned == 0) return {};
    FA_RETURN_IF_ERROR(constant_int32(device, static_cast<int32_t>(c.seqlen_q), c.batch, &graph.lengths[0]));
    return constant_int32(device, static_cast<int32_t>(c.seqlen_kv), c.batch, &graph.lengths[1]);
}

// The remedy replaces lengths a graph does not have; a graph with lengths of its own
// (or FP8's, which no defect names) has no use for it. Python never asks for the pair.
Status check_full_lengths(const Config &c) {
    if (c.full_lengths && (c.padding || c.ragged || c.page_size > 0 || is_fp8(c.dtype) || c.shape_override)) {
        return error(Code::kInvalidArgument, "full_lengths is for 16-bit graphs without lengths of their own (not "
                                             "padding, ragged, paged) and of one shape (not shape_override)");
    }
    return {};
}

// How a launch reaches cuDNN: through a cached variant pack (packs.h), or through
// the frontend's execute, which fastattn takes where a graph's execute does more
// than fill pointers, and which the benchmark times as the floor to beat.
enum class Via { kCachedPack, kFrontend };

// `ptrs` in uid order. The frontend's cheapest entry point for a plan already chosen
// is its sorted-pointer execute (graph_interface.h, 1.28): straight to
// execute_plan_at_index with the candidate plan, where its map overloads first build
// and search an unordered_map. It still makes a variant pack per call.
// `index`: the launch's cumulative lengths, when it was given them (the index kernel
// runs first, on the same stream).
// `shapes`: a shape-override call's tensors (execute_at), which only the frontend's
// execute takes.
struct Overrides {
    std::vector<int64_t> uids;
    std::vector<std::vector<int64_t>> shapes, strides;
};

Status run(const Graph &g, int device, void **ptrs, int n, intptr_t workspace, intptr_t stream, Via via,
           const IndexLaunch *index = nullptr, const Overrides *shapes = nullptr) {
    return guarded(Code::kCudnnError, "execute", [&]() -> Status {
        const bool direct = via == Via::kCachedPack && g.direct.usable && !fe::isLoggingTensorDumpEnabled() &&
                            shapes == nullptr;
        if (!direct && g.direct.copies_from_host) {
            // The frontend's execute would record a copy from freed host memory into the
            // caller's capture (packs.h, capture_direct): refused before touching it.
            bool capturing = false;
            FA_RETURN_IF_ERROR(stream_capturing(stream, &capturing));
            if (capturing) {
                const std::string why = g.direct.usable ? "cudnn-frontend's tensor dumps are on" : g.direct.why_not;
                return error(Code::kNotSupported,
                             "this plan cannot be captured in a CUDA graph: cudnn-frontend's execute copies its "
                             "ALiBi slopes or lengths from a temporary host buffer, which a replay would read after "
                             "it is freed, and fastattn's own launch (which copies them from device memory) cannot "
                             "take it: " + why + "; run it outside the capture");
            }
        }
        LaunchScope scope(device, stream);
        FA_RETURN_IF_ERROR(scope.status());
        if (direct) {
            return launch_cached(g, scope.handle(), device, stream, ptrs, reinterpret_cast<void *>(workspace), index);
        }
        if (index != nullptr) FA_RETURN_IF_ERROR(launch_index(*index, reinterpret_cast<cudaStream_t>(stream)));
        if (shapes != nullptr) {
            std::unordered_map<int64_t, void *> by_uid;
            for (int i = 0; i < n; ++i) by_uid[uid(static_cast<Slot>(g.order[i]))] = ptrs[i];
            auto e = g.g->execute(scope.handle(), by_uid, reinterpret_cast<void *>(workspace), shapes->uids,
                                  shapes->shapes, shapes->strides);
            if (e.is_bad()) return error(Code::kCudnnError, "execute: " + e.err_msg);
            return {};
        }
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

int64_t cudnn_version() { return g_cudnn_version; }
int64_t cudnn_header_version() { return CUDNN_VERSION; }
int64_t frontend_version() { return CUDNN_FRONTEND_VERSION; }
const char *plan_policy() { return "heuristics=A,FALLBACK;build=HEURISTICS_CHOICE"; }

namespace {

// fastattn's own refusals of a graph, before cuDNN is asked anything.
Status check_refusals(const Config &cfg, Direction dir) {
    if (fe::cudnn_dlhandle == nullptr) return error(Code::kLibraryError, "cuDNN is not loaded");
    if (dir == Direction::kBackward && !cfg.training) {
        return error(Code::kInvalidArgument, "a backward graph needs training=True");
    }
    FA_RETURN_IF_ERROR(check_full_lengths(cfg));
    // Measured on the H200 with cuDNN 9.19 (tests/config/test_alignment_bias_gpu.py): with a bias of one row broadcast over the queries (shapes "..1s"), cuDNN builds and
    // runs the backward graph and its d_q and d_k are wrong (relative error 0.75-1.0 against
    // float64) while the forward is right. Refused, so that the probe says so instead of a
    // silent wrong gradient. (Broadcasting that row with a stride of 0 is the next thing to try.)
    if (dir == Direction::kBackward && cfg.bias_batch > 0 && cfg.bias_seq_q == 1 && cfg.seqlen_q > 1) {
        return error(Code::kNotSupported,
                     "a bias of one row (shape ..1s, broadcast over the queries) has no correct backward here: "
                     "cuDNN 9.19's backward gives wrong d_q and d_k for it (measured by fastattn's float64 tests); "
                     "use it without gradients (training=False) or give the bias seqlen_q rows");
    }
    return {};
}

}  // namespace

Status check_graph(const Config &cfg, Direction dir) {
    FA_RETURN_IF_ERROR(check_refusals(cfg, dir));
    return guarded(Code::kNotSupported, "graph construction", [&]() -> Status {
        (void)make_graph(cfg, dir);  // a graph fastattn cannot express throws here (graphs_fp8.h's refuse)
        return {};
    });
}

Status build_graph(const Config &cfg, Direction dir, int device, GraphPtr *out, GraphInfo *info) {
    FA_RETURN_IF_ERROR(check_refusals(cfg, dir));
    return guarded(Code::kNotSupported, "graph construction", [&]() -> Status {
        auto t0 = std::chrono::steady_clock::now();
        // Builds and loads run on threads beside the user's work (the warm-up, preload in
        // the background): a CUDA-graph capture in global mode on another thread is not
        // theirs to invalidate. (fastattn.torch never builds or loads on a capturing thread.)
        RelaxedCaptureMode relaxed;
        DeviceGuard guard(device);
        FA_RETURN_IF_ERROR(guard.status());
        cudnnHandle_t h;
        FA_RETURN_IF_ERROR(thread_handle(device, &h));

        GraphPtr graph(new Graph);
        set_layout(*graph, cfg, dir);
        FA_RETURN_IF_ERROR(own_lengths(*graph, cfg, device));
        graph->g        = make_graph(cfg, dir);
        auto &g         = *graph->g;
        FA_RETURN_IF_ERROR(build_step(g.validate(), "validate"));
        FA_RETURN_IF_ERROR(build_step(g.build_operation_graph(h), "build_operation_graph"));
        // Keep in step with plan_policy().
        FA_RETURN_IF_ERROR(build_step(g.create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}),
                                      "create_execution_plans"));
        FA_RETURN_IF_ERROR(build_step(g.check_support(h), "check_support"));
        FA_RETURN_IF_ERROR(build_step(g.build_plans(fe::BuildPlanPolicy_t::HEURISTICS_CHOICE), "build_plans"));
        FA_RETURN_IF_ERROR(finish(*graph, "build", /*built=*/true, device, info));
        info->build_ms = ms_since(t0);
        *out           = std::move(graph);
        return {};
    });
}

Status export_device_properties(int device, std::string *json) {
    if (fe::cudnn_dlhandle == nullptr) return error(Code::kLibraryError, "cuDNN is not loaded");
    return guarded(Code::kCudnnError, "export_device_properties", [&]() -> Status {
        fe::DeviceProperties props;
        FA_RETURN_IF_ERROR(build_step(props.set_device_id(device).build(), "device properties"));
        std::vector<uint8_t> buf;
        FA_RETURN_IF_ERROR(build_step(props.serialize(buf), "device properties"));
        json->assign(buf.begin(), buf.end());
        return {};
    });
}

Status build_graph_for(const Config &cfg, Direction dir, const std::string &properties, int sm_version,
                       std::vector<uint8_t> *blob, GraphInfo *info) {
    FA_RETURN_IF_ERROR(check_refusals(cfg, dir));
    return guarded(Code::kNotSupported, "graph construction", [&]() -> Status {
        auto t0    = std::chrono::steady_clock::now();
        auto props = std::make_shared<fe::DeviceProperties>();
        std::vector<uint8_t> buf(properties.begin(), properties.end());
        if (auto e = props->deserialize(buf); e.is_bad()) {
            return error(Code::kInvalidArgument, "the GPU's device properties: cuDNN refuses them: " + e.err_msg);
        }
        const Target target{props, sm_version};
        struct Scope {  // t_target for this build alone, whatever it throws
            explicit Scope(const Target *t) { t_target = t; }
            ~Scope() { t_target = nullptr; }
        } scope(&target);
        Graph graph;
        set_layout(graph, cfg, dir);
        graph.g = make_graph(cfg, dir);
        auto &g = *graph.g;
        FA_RETURN_IF_ERROR(build_step(g.validate(), "validate"));
        FA_RETURN_IF_ERROR(build_step(g.build_operation_graph(), "build_operation_graph"));
        // As build_graph's (plan_policy()).
        FA_RETURN_IF_ERROR(build_step(g.create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}),
                                      "create_execution_plans"));
        FA_RETURN_IF_ERROR(build_step(g.check_support(), "check_support"));
        FA_RETURN_IF_ERROR(build_step(g.build_plans(fe::BuildPlanPolicy_t::HEURISTICS_CHOICE), "build_plans"));
        // finish()'s account, without what needs the device (index kernel, direct launch)
        FA_RETURN_IF_ERROR(build_step(g.get_workspace_size(graph.workspace), "get_workspace_size"));
        info->workspace_size = place_index(graph.ragged, graph.workspace);
        FA_RETURN_IF_ERROR(build_step(g.get_plan_name(info->engine_name), "get_plan_name"));
        auto e = g.serialize(*blob, /*serialize_structure=*/false);
        if (e.is_bad()) return error(Code::kInternal, "serialize: " + e.err_msg);
        info->build_ms = ms_since(t0);
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
    FA_RETURN_IF_ERROR(check_full_lengths(cfg));
    return guarded(Code::kCorruptPlan, "deserialize", [&]() -> Status {
        auto t0 = std::chrono::steady_clock::now();
        RelaxedCaptureMode relaxed;  // as in build_graph: another thread's capture is not ours to break
        DeviceGuard guard(device);
        FA_RETURN_IF_ERROR(guard.status());
        cudnnHandle_t h;
        FA_RETURN_IF_ERROR(thread_handle(device, &h));
        // Must be a std::vector<uint8_t>: other containers silently select the
        // overload that expects a serialized graph structure.
        const std::vector<uint8_t> blob(data, data + size);
        GraphPtr graph(new Graph);
        set_layout(*graph, cfg, dir);
        FA_RETURN_IF_ERROR(own_lengths(*graph, cfg, device));
        graph->g        = std::make_shared<fe::graph::Graph>();
        // run_warmup=false: the frontend's warmup captures one launch into a throwaway graph,
        // and while that capture is open, every other thread's cudaDeviceSynchronize fails
        // ("operation not permitted when stream is capturing"; seen on the H200 when the
        // warm-up primed plans so, on a non-blocking stream of its own, beside a
        // torch.cuda.synchronize() on the main thread). Loads run beside the user's work;
        // prime_graph loads the kernels without a capture.
        auto e = graph->g->deserialize(h, blob, /*enforce_precompiled=*/false, /*run_warmup=*/false);
        if (e.is_bad()) return error(Code::kCorruptPlan, "deserialize: " + e.err_msg);
        FA_RETURN_IF_ERROR(finish(*graph, "deserialize", /*built=*/false, device, info));
        info->build_ms = ms_since(t0);
        *out           = std::move(graph);
        return {};
    });
}

Status hand_on_thread_handle(int device) { return hand_on_handle(device); }

Status execute(const Graph *g, Direction dir, int device, const intptr_t *slots, intptr_t workspace,
               intptr_t stream) {
    if (g == nullptr || g->dir != dir) {
        return error(Code::kInvalidArgument,
                     dir == Direction::kForward ? "not a forward graph" : "not a backward graph");
    }
    bool derived = false;
    if (!slots_fit(*g, slots, workspace, &derived)) return slot_error(*g, slots, workspace);
    intptr_t full[kNumSlots];
    IndexLaunch index{&g->ragged, slots[kSlotCuSeqlensQ], slots[kSlotCuSeqlensKV], workspace};
    if (derived) {
        fill_index_slots(g->ragged, g->slots, slots, workspace, full);
        slots = full;
    } else if (g->owned != 0) {  // a defect's remedy: lengths the caller does not give
        fill_owned(*g, slots, full);
        slots = full;
    }
    // The variant pack, filled in place in cuDNN's order. On the stack, not kept with
    // the plan: plans are shared between threads and execute runs without the GIL, so
    // a per-plan array would be written by two launches at once.
    void *pack[kNumSlots];
    for (int i = 0; i < g->n; ++i) pack[i] = reinterpret_cast<void *>(slots[g->order[i]]);
    return run(*g, device, pack, g->n, workspace, stream, Via::kCachedPack, derived ? &index : nullptr);
}

Status prime_graph(const Graph *g, int device, const int64_t *bytes, int32_t seq_len_q, int32_t seq_len_kv) {
    if (g == nullptr) return error(Code::kInvalidArgument, "load_kernels: no graph");
    for (int s = 0; s < kNumSlots; ++s) {
        if ((g->slots & bit(static_cast<Slot>(s))) && !(g->by_value & bit(static_cast<Slot>(s))) && bytes[s] < 1) {
            return error(Code::kInvalidArgument, std::string("load_kernels: no size for tensor ") + kSlots[s].name);
        }
    }
    return guarded(Code::kCudaError, "load_kernels", [&]() -> Status {
        static MallocAsyncFn *alloc     = cudart<MallocAsyncFn>("cudaMallocAsync");
        static FreeAsyncFn *free_       = cudart<FreeAsyncFn>("cudaFreeAsync");
        static MemsetAsyncFn *zero      = cudart<MemsetAsyncFn>("cudaMemsetAsync");
        static StreamCreateFn *create   = cudart<StreamCreateFn>("cudaStreamCreateWithFlags");
        static StreamSyncFn *sync       = cudart<StreamSyncFn>("cudaStreamSynchronize");
        static StreamDestroyFn *destroy = cudart<StreamDestroyFn>("cudaStreamDestroy");
        static MemGetInfoFn *mem_info   = cudart<MemGetInfoFn>("cudaMemGetInfo");
        using PrimaryStateFn = CUresult(CUdevice, unsigned int *, int *);
        static auto *primary = reinterpret_cast<PrimaryStateFn *>(
            cuda_symbol(CudaLibrary::kDriver, "cuDevicePrimaryCtxGetState"));
        static auto *get_device = reinterpret_cast<DeviceGetFn *>(cuda_symbol(CudaLibrary::kDriver, "cuDeviceGet"));
        // Every call here may meet another thread's capture in global mode (PyTorch's
        // default), which a call CUDA counts as unsafe would invalidate: relaxed.
        RelaxedCaptureMode relaxed;
        CUdevice dev       = 0;
        unsigned int flags = 0;
        int active         = 0;
        if (get_device(&dev, device) != CUDA_SUCCESS || primary(dev, &flags, &active) != CUDA_SUCCESS || !active) {
            // A context made here would cost the process memory on a GPU it may not use.
            return error(Code::kInvalidArgument,
                         "load_kernels: device " + std::to_string(device) +
                             " has no CUDA context yet, and fastattn makes none: run any CUDA work on it first");
        }
        DeviceGuard guard(device);
        FA_RETURN_IF_ERROR(guard.status());
        // Scratch is taken beside the caller's own allocations (a model loading, a server
        // filling its KV cache): never more than half of what the device has free, so that
        // it cannot be what makes the caller run out.
        int64_t need = g->workspace;
        for (int i = 0; i < kNumSlots; ++i) {
            const uint64_t b = bit(static_cast<Slot>(i));
            if ((g->slots & b) && !(g->by_value & b) && i != kSlotSeqLenQ && i != kSlotSeqLenKV) need += bytes[i];
        }
        size_t free_bytes = 0, total_bytes = 0;
        FA_RETURN_IF_ERROR(cuda_status(mem_info(&free_bytes, &total_bytes), "cudaMemGetInfo"));
        if (static_cast<uint64_t>(need) > free_bytes / 2) {
            return error(Code::kCudaError, "load_kernels: its scratch (" + std::to_string(need) +
                                               " bytes) would take more than half of device " +
                                               std::to_string(device) + "'s free memory (" +
                                               std::to_string(free_bytes) + " bytes): not launched");
        }
        cudaStream_t s = nullptr;
        FA_RETURN_IF_ERROR(cuda_status(create(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags"));
        // Scratch from the device's stream-ordered pool: its free makes no device-wide
        // synchronization (cudaFree's), which would wait for the caller's work.
        std::vector<void *> scratch;
        auto take = [&](int64_t n, intptr_t *out) -> Status {
            void *p = nullptr;
            FA_RETURN_IF_ERROR(cuda_status(alloc(&p, static_cast<size_t>(n), s), "cudaMallocAsync"));
            scratch.push_back(p);
            *out = reinterpret_cast<intptr_t>(p);
            // Zeros: offsets and pages of 0 (every read in bounds), finite values elsewhere.
            return cuda_status(zero(p, 0, static_cast<size_t>(n), s), "cudaMemsetAsync");
        };
        static const int64_t host_zero[2] = {0, 0};  // a host_seed plan's seed and offset
        intptr_t slots[kNumSlots] = {};
        intptr_t workspace        = 0;
        Status st;
        for (int i = 0; i < kNumSlots && st.ok(); ++i) {
            const uint64_t b = bit(static_cast<Slot>(i));
            if (!(g->slots & b)) continue;
            if (g->by_value & b) {
                slots[i] = reinterpret_cast<intptr_t>(&host_zero[0]);
            } else if (i == kSlotSeqLenQ || i == kSlotSeqLenKV) {
                // Lengths the caller's calls have (the kernels' common path; a length of 0
                // is one no test covers), from the device constants own_lengths uses too.
                st = constant_int32(device, i == kSlotSeqLenQ ? seq_len_q : seq_len_kv, bytes[i] / 4, &slots[i]);
            } else {
                st = take(bytes[i], &slots[i]);
            }
        }
        if (st.ok() && g->workspace > 0) st = take(g->workspace, &workspace);
        if (st.ok()) st = execute(g, g->dir, device, slots, workspace, reinterpret_cast<intptr_t>(s));
        // The launch's status first: a failed sync after it says less about what failed.
        const Status synced = cuda_status(sync(s), "cudaStreamSynchronize");
        if (st.ok()) st = synced;
        for (void *p : scratch) (void)free_(p, s);
        (void)sync(s);
        // This thread's handle was bound to `s` (LaunchScope): bound to no stream again
        // before `s` goes, so that it never names a destroyed stream.
        if (t_state.handle[device] != nullptr) (void)set_stream(device, t_state.handle[device], 0);
        (void)destroy(s);
        return st;
    });
}

namespace {

Status bad_shape(const Config &c, const CallShape &at, const std::string &why, Code code = Code::kInvalidArgument) {
    return error(code, "execute_at(seqlen_q=" + std::to_string(at.seqlen_q) + ", seqlen_kv=" +
                           std::to_string(at.seqlen_kv) + ") of a plan declared for seqlen_q=" +
                           std::to_string(c.seqlen_q) + ", seqlen_kv=" + std::to_string(c.seqlen_kv) + ": " + why);
}

std::vector<int64_t> four(const int64_t s[4]) { return {s[0], s[1], s[2], s[3]}; }

}  // namespace

Status execute_at(const Graph *g, Direction dir, int device, const intptr_t *slots, intptr_t workspace,
                  intptr_t stream, const CallShape &at) {
    if (g == nullptr || g->dir != dir) {
        return error(Code::kInvalidArgument,
                     dir == Direction::kForward ? "not a forward graph" : "not a backward graph");
    }
    const Config &c = g->declared;
    if (dir != Direction::kForward) {
        // (config.py refuses shape_override with training: the backward graph's workspace
        // tensors are declared at the plan's lengths, and no override reaches them)
        return error(Code::kInvalidArgument, "a shape-override plan is forward only");
    }
    if (!g->shape_override) {
        return error(Code::kInvalidArgument,
                     "this plan was built without shape_override: it runs at its config's lengths (execute)");
    }
    if (at.seqlen_q < 1 || at.seqlen_q > c.seqlen_q || at.seqlen_kv < 1 || at.seqlen_kv > c.seqlen_kv) {
        return bad_shape(c, at, "each length must be 1 to the declared one");
    }
    if ((at.seqlen_q == 1) != (c.seqlen_q == 1)) {
        return bad_shape(c, at, "cuDNN's shape override does not cross seqlen_q == 1 (a one-row query runs a plan "
                                "declared for one row)", Code::kNotSupported);
    }
    for (const int64_t *s : {at.q_stride, at.k_stride, at.v_stride, at.o_stride}) {
        for (int i = 0; i < 4; ++i) {
            if (s[i] < 1) return bad_shape(c, at, "every stride must be positive");
        }
    }
    // cuDNN reads a call's tensors in the plan's declared storage: the override gives the
    // call's extents, and its strides must describe that storage (cudnn-frontend#1148). Other
    // strides computed another function or ran out of bounds on SM90 (tools/override_probe);
    // along a dimension of one element nothing is stepped, so its stride is free.
    struct Strides {
        const char *name;
        const int64_t *got, *declared;
        int64_t extent[4];
    };
    const Strides tensors[4] = {{"q", at.q_stride, c.q_stride, {c.batch, c.heads_q, at.seqlen_q, c.head_dim_qk}},
                                {"k", at.k_stride, c.k_stride, {c.batch, c.heads_kv, at.seqlen_kv, c.head_dim_qk}},
                                {"v", at.v_stride, c.v_stride, {c.batch, c.heads_kv, at.seqlen_kv, c.head_dim_v}},
                                {"o", at.o_stride, c.o_stride, {c.batch, c.heads_q, at.seqlen_q, c.head_dim_v}}};
    auto show = [](const int64_t *x) {
        return "(" + std::to_string(x[0]) + ", " + std::to_string(x[1]) + ", " + std::to_string(x[2]) + ", " +
               std::to_string(x[3]) + ")";
    };
    for (const Strides &t : tensors) {
        for (int i = 0; i < 4; ++i) {
            if (t.extent[i] > 1 && t.got[i] != t.declared[i]) {
                return bad_shape(c, at, std::string(t.name) + "'s strides " + show(t.got) +
                                            " are not the plan's declared " + show(t.declared) +
                                            " ((batch, head, seq, dim) order): cuDNN's shape override reads a "
                                            "call's tensors in the declared storage, so only the stride of a "
                                            "dimension of one element may differ");
            }
        }
    }
    bool derived = false;
    if (!slots_fit(*g, slots, workspace, &derived)) return slot_error(*g, slots, workspace);
    Overrides o;
    auto put = [&](Slot s, std::vector<int64_t> dims, std::vector<int64_t> strides) {
        if ((g->slots & bit(s)) == 0) return;
        o.uids.push_back(uid(s));
        o.shapes.push_back(std::move(dims));
        o.strides.push_back(std::move(strides));
    };
    const int64_t b = c.batch, hq = c.heads_q, sq = at.seqlen_q;
    // K in its declared (b, h, s, d) order: cudnn-frontend 1.28's unified SDPA node, the one it
    // picks for an override graph, keeps K so (tools/override_probe: bitwise the exact plan's
    // output with it; K^T computed another function).
    put(kSlotQ, {b, hq, sq, c.head_dim_qk}, four(at.q_stride));
    put(kSlotK, {b, c.heads_kv, at.seqlen_kv, c.head_dim_qk}, four(at.k_stride));
    put(kSlotV, {b, c.heads_kv, at.seqlen_kv, c.head_dim_v}, four(at.v_stride));
    put(kSlotO, {b, hq, sq, c.head_dim_v}, four(at.o_stride));
    void *pack[kNumSlots];
    for (int i = 0; i < g->n; ++i) pack[i] = reinterpret_cast<void *>(slots[g->order[i]]);
    return run(*g, device, pack, g->n, workspace, stream, Via::kFrontend, nullptr, &o);
}

// ---- the benchmark hooks of bench.h, beside the execute they time (execute, run) and
// the frontend calls they time it against.

namespace bench {

uint64_t graph_slots(const Graph *g) { return g == nullptr ? 0u : g->slots; }

bool direct_launch(const Graph *g) { return g != nullptr && g->direct.usable; }

void pack_counts(uint64_t *hits, uint64_t *misses, uint64_t *replays) {
    *hits    = thread_packs().hits;
    *misses  = thread_packs().misses;
    *replays = thread_packs().replays;
}

Status time_execute(const Graph *g, Direction dir, int device, const intptr_t *slots, intptr_t workspace,
                    intptr_t stream, Mode mode, int iters, int layers, int64_t layer_bytes, double *seconds) {
    if (g == nullptr || g->dir != dir || iters < 1 || layers < 1 || layer_bytes < 0) {
        return error(Code::kInvalidArgument,
                     "time_execute: no graph of that direction, or iters < 1, layers < 1 or layer_bytes < 0");
    }
    // Each layer's pointers, made before the clock starts: the graph's device tensors
    // moved by layer_bytes per layer (host values stay), and in uid order for the
    // frontend's execute.
    std::vector<intptr_t> sets(static_cast<size_t>(layers) * kNumSlots);
    std::vector<void *> packs(static_cast<size_t>(layers) * kNumSlots);
    const uint64_t moved = g->slots & ~g->by_value;
    for (int l = 0; l < layers; ++l) {
        intptr_t *set = &sets[static_cast<size_t>(l) * kNumSlots];
        for (int s = 0; s < kNumSlots; ++s) {
            set[s] = slots[s] + ((moved >> s) & 1 ? static_cast<intptr_t>(l * layer_bytes) : 0);
        }
        // The frontend's modes take the whole pack, the plan's own lengths included;
        // execute (the fastattn modes) takes the caller's slots and adds them itself.
        intptr_t pack_slots[kNumSlots];
        if (g->owned != 0) fill_owned(*g, set, pack_slots);
        const intptr_t *from = g->owned != 0 ? pack_slots : set;
        for (int i = 0; i < g->n; ++i) {
            packs[static_cast<size_t>(l) * kNumSlots + i] = reinterpret_cast<void *>(from[g->order[i]]);
        }
    }
    auto layer_slots = [&](int i) { return &sets[static_cast<size_t>(i % layers) * kNumSlots]; };
    auto layer_pack  = [&](int i) { return &packs[static_cast<size_t>(i % layers) * kNumSlots]; };
    if (mode == Mode::kFastattn || mode == Mode::kFastattnPacksOnly) {
        ReplaysOff off(mode == Mode::kFastattnPacksOnly);
        auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < iters; ++i) FA_RETURN_IF_ERROR(execute(g, dir, device, layer_slots(i), workspace, stream));
        *seconds = ms_since(t0) / 1000.0;
        return {};
    }
    if (mode == Mode::kFrontendSortedPreamble) {
        auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < iters; ++i) {
            FA_RETURN_IF_ERROR(run(*g, device, layer_pack(i), g->n, workspace, stream, Via::kFrontend));
        }
        *seconds = ms_since(t0) / 1000.0;
        return {};
    }
    return guarded(Code::kCudnnError, "time_execute", [&]() -> Status {
        LaunchScope scope(device, stream);
        FA_RETURN_IF_ERROR(scope.status());
        const cudnnHandle_t h = scope.handle();
        auto ws = reinterpret_cast<void *>(workspace);
        auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < iters; ++i) {
            void **pack = layer_pack(i);
            fe::error_t e;
            if (mode == Mode::kFrontendSorted) {
                e = g->g->execute(h, pack, g->n, ws);
            } else {
                std::unordered_map<int64_t, void *> by_uid;
                for (int j = 0; j < g->n; ++j) by_uid.emplace(uid(static_cast<Slot>(g->order[j])), pack[j]);
                e = g->g->execute(h, by_uid, ws);
            }
            if (e.is_bad()) return error(Code::kCudnnError, "execute: " + e.err_msg);
        }
        *seconds = ms_since(t0) / 1000.0;
        return {};
    });
}

}  // namespace bench

}  // namespace fastattn
