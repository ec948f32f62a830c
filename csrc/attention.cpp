// Where an attention config becomes a cuDNN graph, a graph becomes a plan, and a
// plan runs. The only translation unit that includes cudnn-frontend.
//
// cudnn-frontend is compiled in its dynamic-loading mode: nothing here links
// against cuDNN or CUDA. The Python loader (fastattn/_loader.py) finds and loads
// libcudnn and what it needs, then load_cudnn() hands the library to the frontend.
#include "fastattn.h"

#include <dlfcn.h>

#include <chrono>
#include <cstring>
#include <exception>
#include <mutex>
#include <sstream>

#include <cudnn_frontend.h>

namespace cudnn_frontend {
// The frontend resolves every cuDNN symbol through this handle in dynamic-loading mode.
void *cudnn_dlhandle = nullptr;
}  // namespace cudnn_frontend

namespace fe = cudnn_frontend;

namespace fastattn {

class Graph {
   public:
    std::shared_ptr<fe::graph::Graph> g;
    Direction dir     = Direction::kForward;
    GraphKind kind;
    int64_t workspace = 0;
};

void GraphDeleter::operator()(Graph *g) const { delete g; }

namespace {

// Fixed tensor uids. The sorted-pointer execute takes user pointers in uid order,
// so these numbers fix the argument order of execute_forward / execute_backward.
enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV, kSeqLenQ, kSeqLenKV };
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

// CUDA runtime entry points the frontend's shim does not wrap, looked up once in
// the libcudart the frontend loaded.
template <class F>
F *cudart(const char *name) {
    return reinterpret_cast<F *>(fe::detail::get_cuda_symbol(fe::detail::CudaLibrary::CUDART, name));
}
using GetDeviceFn      = cudaError_t(int *);
using SetDeviceFn      = cudaError_t(int);
using GetCountFn       = cudaError_t(int *);
using AttributeFn      = cudaError_t(int *, cudaDeviceAttr, int);
using VersionFn        = cudaError_t(int *);
using ErrorStringFn    = const char *(cudaError_t);
using GetLastErrorFn   = cudaError_t();
using DeviceGetNameFn  = CUresult(char *, int, CUdevice);
using DeviceGetFn      = CUresult(CUdevice *, int);

Status cuda_status(cudaError_t err, const char *what) {
    if (err == cudaSuccess) return {};
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

// Makes `device` current for the scope and restores the caller's device after.
// cudaGetDevice is a thread-local read, so the common case (already current)
// costs no driver call.
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
    const Status &status() const { return status_; }

   private:
    static SetDeviceFn *set() {
        static SetDeviceFn *fn = cudart<SetDeviceFn>("cudaSetDevice");
        return fn;
    }
    int target_, previous_ = -1;
    Status status_;
};

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
        auto st         = fe::detail::create_handle(&h);
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

Status set_stream(int device, cudnnHandle_t h, intptr_t stream) {
    auto s = reinterpret_cast<cudaStream_t>(stream);
    if (t_state.stream[device] == s) return {};
    auto st = fe::detail::set_stream(h, s);
    if (st != CUDNN_STATUS_SUCCESS) {
        return error(Code::kInvalidArgument,
                     std::string("cudnnSetStream failed for stream=") + std::to_string(stream) + ": " +
                         fe::detail::get_error_string(st));
    }
    t_state.stream[device] = s;
    return {};
}

std::vector<int64_t> strides(const int64_t s[4]) { return {s[0], s[1], s[2], s[3]}; }

std::shared_ptr<fe::graph::Tensor_attributes> input(fe::graph::Graph &g, const char *name, int64_t uid,
                                                    std::vector<int64_t> dims, std::vector<int64_t> stride) {
    return g.tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim(dims).set_stride(stride));
}

void set_output(const std::shared_ptr<fe::graph::Tensor_attributes> &t, const char *name, int64_t uid,
                std::vector<int64_t> dims, std::vector<int64_t> stride) {
    t->set_output(true).set_name(name).set_uid(uid).set_dim(dims).set_stride(stride);
}

// Masks and windows, shared by both directions. The frontend's left bound counts
// the diagonal (it keeps keys j > i - left_bound), FlashAttention's does not.
template <class Attributes>
void apply_mask(const Config &c, Attributes &a) {
    using Align = fe::DiagonalAlignment_t;
    if (c.mask == 1 || c.mask == 2) {
        a.set_diagonal_alignment(c.mask == 2 ? Align::BOTTOM_RIGHT : Align::TOP_LEFT);
        a.set_diagonal_band_right_bound(0);
    } else if (c.window_right >= 0) {
        a.set_diagonal_alignment(Align::TOP_LEFT);
        a.set_diagonal_band_right_bound(static_cast<int>(c.window_right));
    }
    if (c.window_left >= 0) a.set_diagonal_band_left_bound(static_cast<int>(c.window_left + 1));
}

// The one function that turns a config into a cuDNN graph.
std::shared_ptr<fe::graph::Graph> make_graph(const Config &c, Direction dir) {
    auto g = std::make_shared<fe::graph::Graph>();
    g->set_io_data_type(c.dtype == 1 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF)
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);

    const std::vector<int64_t> q_dims  = {c.batch, c.heads_q, c.seqlen_q, c.head_dim_qk};
    const std::vector<int64_t> k_dims  = {c.batch, c.heads_kv, c.seqlen_kv, c.head_dim_qk};
    const std::vector<int64_t> v_dims  = {c.batch, c.heads_kv, c.seqlen_kv, c.head_dim_v};
    const std::vector<int64_t> o_dims  = {c.batch, c.heads_q, c.seqlen_q, c.head_dim_v};
    const std::vector<int64_t> s_dims  = {c.batch, c.heads_q, c.seqlen_q, 1};
    const std::vector<int64_t> s_strides = {c.heads_q * c.seqlen_q, c.seqlen_q, 1, 1};

    auto q = input(*g, "q", kQ, q_dims, strides(c.q_stride));
    auto k = input(*g, "k", kK, k_dims, strides(c.k_stride));
    auto v = input(*g, "v", kV, v_dims, strides(c.v_stride));
    std::shared_ptr<fe::graph::Tensor_attributes> seq_len_q, seq_len_kv;
    if (c.padding) {
        const std::vector<int64_t> dims = {c.batch, 1, 1, 1}, unit = {1, 1, 1, 1};
        seq_len_q  = input(*g, "seq_len_q", kSeqLenQ, dims, unit);
        seq_len_kv = input(*g, "seq_len_kv", kSeqLenKV, dims, unit);
        seq_len_q->set_data_type(fe::DataType_t::INT32);
        seq_len_kv->set_data_type(fe::DataType_t::INT32);
    }
    auto apply_features = [&](auto &a) {  // what both directions share beyond the mask
        if (c.padding) a.set_padding_mask(true).set_seq_len_q(seq_len_q).set_seq_len_kv(seq_len_kv);
        if (c.alibi) a.set_alibi_mask(true);
    };

    if (dir == Direction::kForward) {
        auto a = fe::graph::SDPA_attributes().set_name("sdpa").set_generate_stats(c.training).set_attn_scale(c.scale);
        apply_mask(c, a);
        apply_features(a);
        auto [o, stats] = g->sdpa(q, k, v, a);
        set_output(o, "o", kO, o_dims, strides(c.o_stride));
        if (c.training) {
            set_output(stats, "stats", kStats, s_dims, s_strides);
            stats->set_data_type(fe::DataType_t::FLOAT);
        }
        return g;
    }
    auto o     = input(*g, "o", kO, o_dims, strides(c.o_stride));
    auto d_o   = input(*g, "d_o", kDO, o_dims, strides(c.o_stride));
    auto stats = input(*g, "stats", kStats, s_dims, s_strides);
    stats->set_data_type(fe::DataType_t::FLOAT);
    auto a = fe::graph::SDPA_backward_attributes()
                 .set_name("sdpa_backward")
                 .set_attn_scale(c.scale)
                 .set_deterministic_algorithm(c.deterministic);
    apply_mask(c, a);
    apply_features(a);
    auto [d_q, d_k, d_v] = g->sdpa_backward(q, k, v, o, d_o, stats, a);
    set_output(d_q, "d_q", kDQ, q_dims, strides(c.q_stride));
    set_output(d_k, "d_k", kDK, k_dims, strides(c.k_stride));
    set_output(d_v, "d_v", kDV, v_dims, strides(c.v_stride));
    return g;
}

// The uids a graph of this kind takes at execute, sorted: the order of the
// pointers that execute_forward / execute_backward pass on.
std::vector<int64_t> expected_uids(Direction dir, GraphKind kind) {
    std::vector<int64_t> uids = {kQ, kK, kV, kO};
    if (dir == Direction::kBackward) {
        uids.insert(uids.end(), {kStats, kDO, kDQ, kDK, kDV});
    } else if (kind.training) {
        uids.push_back(kStats);
    }
    if (kind.padding) uids.insert(uids.end(), {kSeqLenQ, kSeqLenKV});
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

#define FA_RETURN_IF_ERROR(expr)          \
    do {                                  \
        Status _st = (expr);              \
        if (!_st.ok()) return _st;        \
    } while (0)

// A deserialized graph has no engine configs, and asking it for its plan name reads
// past the end of an empty vector: only built graphs are asked (`built`).
Status finish(Graph &graph, const char *stage_prefix, bool built, GraphInfo *info) {
    auto uids = graph.g->get_variant_pack_uids_sorted();
    if (uids != expected_uids(graph.dir, graph.kind)) {
        return error(Code::kCorruptPlan, std::string(stage_prefix) + ": plan's tensors do not match its config");
    }
    FA_RETURN_IF_ERROR(build_step(graph.g->get_workspace_size(graph.workspace), "get_workspace_size"));
    info->workspace_size = graph.workspace;
    if (built) FA_RETURN_IF_ERROR(build_step(graph.g->get_plan_name(info->engine_name), "get_plan_name"));
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

Status run(const Graph &g, int device, void **ptrs, int n, intptr_t workspace, intptr_t stream) {
    return guarded(Code::kCudnnError, "execute", [&]() -> Status {
        DeviceGuard guard(device);
        FA_RETURN_IF_ERROR(guard.status());
        cudnnHandle_t h;
        FA_RETURN_IF_ERROR(thread_handle(device, &h));
        FA_RETURN_IF_ERROR(set_stream(device, h, stream));
        auto e = g.g->execute(h, ptrs, n, reinterpret_cast<void *>(workspace));
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
    return guarded(Code::kNotSupported, "graph construction", [&]() -> Status {
        auto t0 = std::chrono::steady_clock::now();
        DeviceGuard guard(device);
        FA_RETURN_IF_ERROR(guard.status());
        cudnnHandle_t h;
        FA_RETURN_IF_ERROR(thread_handle(device, &h));

        GraphPtr graph(new Graph);
        graph->dir      = dir;
        graph->kind     = GraphKind{cfg.training, cfg.padding};
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

Status deserialize_graph(const uint8_t *data, size_t size, Direction dir, GraphKind kind, int device, GraphPtr *out,
                         GraphInfo *info) {
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
        graph->dir      = dir;
        graph->kind     = kind;
        graph->g        = std::make_shared<fe::graph::Graph>();
        auto e = graph->g->deserialize(h, blob, /*enforce_precompiled=*/false, /*run_warmup=*/false);
        if (e.is_bad()) return error(Code::kCorruptPlan, "deserialize: " + e.err_msg);
        FA_RETURN_IF_ERROR(finish(*graph, "deserialize", /*built=*/false, info));
        info->build_ms = ms_since(t0);
        *out           = std::move(graph);
        return {};
    });
}

// The optional per-sequence lengths: required by a padding graph, refused by others.
Status check_seq_lens(const Graph &g, intptr_t seq_len_q, intptr_t seq_len_kv) {
    if (g.kind.padding) {
        FA_RETURN_IF_ERROR(check_pointer(seq_len_q, "seq_len_q"));
        return check_pointer(seq_len_kv, "seq_len_kv");
    }
    if (seq_len_q != 0 || seq_len_kv != 0) {
        return error(Code::kInvalidArgument,
                     "seq_len_q / seq_len_kv given, but the plan was built with padding=False");
    }
    return {};
}

Status execute_forward(const Graph *g, int device, intptr_t q, intptr_t k, intptr_t v, intptr_t o, intptr_t stats,
                       intptr_t seq_len_q, intptr_t seq_len_kv, intptr_t workspace, intptr_t stream) {
    if (g == nullptr || g->dir != Direction::kForward) return error(Code::kInvalidArgument, "not a forward graph");
    FA_RETURN_IF_ERROR(check_pointer(q, "q"));
    FA_RETURN_IF_ERROR(check_pointer(k, "k"));
    FA_RETURN_IF_ERROR(check_pointer(v, "v"));
    FA_RETURN_IF_ERROR(check_pointer(o, "o"));
    if (g->kind.training) {
        FA_RETURN_IF_ERROR(check_pointer(stats, "stats"));
    } else if (stats != 0) {
        return error(Code::kInvalidArgument,
                     "stats given, but the plan was built with training=False and writes no softmax stats");
    }
    FA_RETURN_IF_ERROR(check_seq_lens(*g, seq_len_q, seq_len_kv));
    FA_RETURN_IF_ERROR(check_workspace(*g, workspace));
    // Sorted by uid: q, k, v, o, [stats], [seq_len_q, seq_len_kv].
    void *ptrs[7] = {reinterpret_cast<void *>(q), reinterpret_cast<void *>(k), reinterpret_cast<void *>(v),
                     reinterpret_cast<void *>(o)};
    int n = 4;
    if (g->kind.training) ptrs[n++] = reinterpret_cast<void *>(stats);
    if (g->kind.padding) {
        ptrs[n++] = reinterpret_cast<void *>(seq_len_q);
        ptrs[n++] = reinterpret_cast<void *>(seq_len_kv);
    }
    return run(*g, device, ptrs, n, workspace, stream);
}

Status execute_backward(const Graph *g, int device, intptr_t q, intptr_t k, intptr_t v, intptr_t o, intptr_t d_o,
                        intptr_t stats, intptr_t d_q, intptr_t d_k, intptr_t d_v, intptr_t seq_len_q,
                        intptr_t seq_len_kv, intptr_t workspace, intptr_t stream) {
    if (g == nullptr || g->dir != Direction::kBackward) return error(Code::kInvalidArgument, "not a backward graph");
    FA_RETURN_IF_ERROR(check_pointer(q, "q"));
    FA_RETURN_IF_ERROR(check_pointer(k, "k"));
    FA_RETURN_IF_ERROR(check_pointer(v, "v"));
    FA_RETURN_IF_ERROR(check_pointer(o, "o"));
    FA_RETURN_IF_ERROR(check_pointer(d_o, "d_o"));
    FA_RETURN_IF_ERROR(check_pointer(stats, "stats"));
    FA_RETURN_IF_ERROR(check_pointer(d_q, "d_q"));
    FA_RETURN_IF_ERROR(check_pointer(d_k, "d_k"));
    FA_RETURN_IF_ERROR(check_pointer(d_v, "d_v"));
    FA_RETURN_IF_ERROR(check_seq_lens(*g, seq_len_q, seq_len_kv));
    FA_RETURN_IF_ERROR(check_workspace(*g, workspace));
    // Sorted by uid: q, k, v, o, stats, d_o, d_q, d_k, d_v, [seq_len_q, seq_len_kv].
    void *ptrs[11] = {reinterpret_cast<void *>(q),     reinterpret_cast<void *>(k),   reinterpret_cast<void *>(v),
                      reinterpret_cast<void *>(o),     reinterpret_cast<void *>(stats), reinterpret_cast<void *>(d_o),
                      reinterpret_cast<void *>(d_q),   reinterpret_cast<void *>(d_k), reinterpret_cast<void *>(d_v),
                      reinterpret_cast<void *>(seq_len_q), reinterpret_cast<void *>(seq_len_kv)};
    return run(*g, device, ptrs, g->kind.padding ? 11 : 9, workspace, stream);
}

Status time_raw_execute(const Graph *g, int device, const intptr_t *ptrs, int n, intptr_t workspace,
                        intptr_t stream, int iters, double *seconds) {
    if (g == nullptr || n > 16) return error(Code::kInvalidArgument, "time_raw_execute: bad arguments");
    return guarded(Code::kCudnnError, "time_raw_execute", [&]() -> Status {
        DeviceGuard guard(device);
        FA_RETURN_IF_ERROR(guard.status());
        cudnnHandle_t h;
        FA_RETURN_IF_ERROR(thread_handle(device, &h));
        FA_RETURN_IF_ERROR(set_stream(device, h, stream));
        void *p[16];
        for (int i = 0; i < n; ++i) p[i] = reinterpret_cast<void *>(ptrs[i]);
        auto ws = reinterpret_cast<void *>(workspace);
        auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < iters; ++i) {
            auto e = g->g->execute(h, p, n, ws);
            if (e.is_bad()) return error(Code::kCudnnError, "execute: " + e.err_msg);
        }
        *seconds = ms_since(t0) / 1000.0;
        return {};
    });
}

}  // namespace fastattn
