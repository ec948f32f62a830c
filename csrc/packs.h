// A launch that repeats, made cheap: cached variant packs, then CUDA graph replays.
// Includes cudnn-frontend (its backend shims and graph internals): for attention.cpp
// alone. Not for two translation units: the explicit instantiations below may appear
// once in a program.
//
// cudnn-frontend's execute creates, fills, finalizes and destroys a cuDNN variant
// pack descriptor on every call (plans.h detail::execute: six backend calls around
// the one that launches). A finalized pack can be executed again, so each thread
// keeps the packs of its recent calls, keyed by (graph, pointers, workspace). The
// layers of a model and the steps of a loop repeat their pointers (PyTorch's caching
// allocator hands the same blocks back), so in the steady state a call is
// cudnnBackendExecute alone. NVIDIA/cudnn-frontend#1086 asks for this upstream.
//
// cudnnBackendExecute itself costs the host several times what the whole of fastattn's
// execute replaying a graph costs (docs/BENCHMARKS.md, "C++ execute against
// cudnn-frontend's"). So a
// key's third run also captures the launch as a CUDA graph (on a stream of the thread's
// own, cuDNN's handle bound to it for the capture), and its later runs replay that
// graph on the caller's stream: the kernels, their arguments (the key's pointers, the
// plan's scalars) and any memset cuDNN issues, with none of cuDNN's host work.
// Everything a launch reads per call is behind those pointers, in device memory, so new
// data behind the same pointers is read (tests/attention/test_packs_gpu.py). A stream that is
// being captured (the caller's own CUDA graph) gets cuDNN's execute, which its capture
// records. A ragged launch given cumulative lengths captures and replays the index
// kernel (ragged.h) with it, and its key includes the lengths' pointers.
//
// A launch here does what the frontend's execute_plan_at_index does for a plan of
// cuDNN's own engines, and nothing else: the pass-by-value scalars and the workspace
// regions of the frontend's variant-pack template, the engine's workspace after the
// frontend's share, and its per-call workspace edits (copies from device constants
// here, zeroing). A graph whose execute does more (pointer replacements, the frontend's
// own OSS engines, host values read per call, tensor dumps) keeps the frontend's
// execute: capture_direct leaves it unusable.

#pragma once

#include <cudnn_frontend.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "device.h"
#include "fastattn.h"
#include "graph_state.h"
#include "handles.h"
#include "ragged.h"
#include "status.h"

namespace fastattn::detail {

// Three things execute needs are not public in the frontend: its share of the
// workspace, its per-call workspace edits (private to fe::graph::Graph) and the plan
// list (protected in ICudnn). They are read once per graph through a template
// argument naming the member, which is exempt from access checking in an explicit
// instantiation ([temp.spec.general]/6). A frontend that renames or retypes them
// fails to compile here, never at run time.
template <class Tag, typename Tag::type Member>
struct Expose {
    friend typename Tag::type member(Tag) { return Member; }
};
using WorkspaceEdits = std::unordered_map<fe::graph::Tensor_attributes::uid_t,
                                          std::tuple<int64_t, int64_t, std::vector<float>>>;
struct FeWorkspaceSize {
    using type = int64_t fe::graph::Graph::*;
    friend type member(FeWorkspaceSize);
};
struct FeWorkspaceEdits {
    using type = WorkspaceEdits fe::graph::Graph::*;
    friend type member(FeWorkspaceEdits);
};
struct FePlans {
    using type = fe::graph::Execution_plan_list fe::ICudnn::*;
    friend type member(FePlans);
};
template struct Expose<FeWorkspaceSize, &fe::graph::Graph::fe_workspace_size>;
template struct Expose<FeWorkspaceEdits, &fe::graph::Graph::cached_workspace_modifications>;
template struct Expose<FePlans, &fe::ICudnn::plans>;

// The frontend's workspace edits (graph_interface.h's run_auxiliary_kernels, per
// execute): copy host values in, zero a region, or only place a tensor there.
inline constexpr int64_t kEditCopy = 0, kEditZero = 1, kEditPlaceOnly = 2;

inline std::atomic<uint64_t> g_next_serial{1};

// Fills graph.direct from its frontend graph, once its plan is chosen and its
// variant-pack template prepared, with `device` current. Leaves it unusable where a
// launch needs more.
//
// The frontend's copies (ALiBi's slopes, the backward's workaround lengths) read a
// temporary: run_auxiliary_kernels iterates its map by value (1.28), so the source of
// each cudaMemcpyAsync is freed when it returns. Eagerly the driver has staged the
// pageable copy by then; a caller's CUDA graph capture records the address instead,
// and its replays read whatever the heap put there since. Here each copy's values
// become a device constant (device.h's constant_bytes, never freed, so a captured graph
// outlives the plan), and the launch copies device to device (apply_edits).
inline void capture_direct(Graph &graph, int device) {
    DirectLaunch d;
    d.serial = g_next_serial.fetch_add(1, std::memory_order_relaxed);
    fe::graph::Graph &g = *graph.g;
    const auto &plans   = g.*member(FePlans{});
    const auto &t       = g.varpack_template;
    if (graph.by_value != 0) {
        d.why_not = "host seeds (values read per call)";
    } else if (plans.candidate < 0 || plans.candidate >= static_cast<int64_t>(plans.execution_plans.size()) ||
               plans.execution_plans[plans.candidate] == nullptr) {
        d.why_not = "no cuDNN plan chosen (the frontend's own engine)";
    } else if (!t.replacement_slots.empty()) {
        d.why_not = "pointer replacements";
    } else if (t.user_slots.size() != static_cast<size_t>(graph.n) || t.template_ptrs.size() != t.all_uids.size()) {
        d.why_not = "a variant-pack template that does not match its tensors";
    }
    for (const auto &[uid, edit] : g.*member(FeWorkspaceEdits{})) {
        const int64_t kind = std::get<0>(edit);
        const auto &values = std::get<2>(edit);
        DirectLaunch::Edit e;
        e.offset = std::get<1>(edit);
        if (kind == kEditPlaceOnly) continue;
        if (kind == kEditCopy) {
            d.copies_from_host = true;
            e.bytes = static_cast<int64_t>(values.size() * sizeof(float));
            if (e.bytes == 0) continue;
            if (d.why_not.empty()) {
                Status st = constant_bytes(device, values.data(), static_cast<size_t>(e.bytes), &e.from);
                if (!st.ok()) d.why_not = "its workspace values could not be copied to the device: " + st.message;
            }
        } else if (kind == kEditZero && values.size() == 1 && values[0] > 0) {
            e.bytes = static_cast<int64_t>(values[0]);  // the frontend's encoding of a memset's size
            e.zero  = true;
        } else if (d.why_not.empty()) {
            d.why_not = "a workspace edit of kind " + std::to_string(kind) + " (unknown here)";
        }
        d.edits.push_back(e);
    }
    if (d.why_not.empty()) {
        d.plan         = plans.execution_plans[plans.candidate]->get_raw_desc();
        d.fe_workspace = g.*member(FeWorkspaceSize{});
        d.uids         = t.all_uids;
        d.fixed        = t.template_ptrs;
        d.user         = t.user_slots;
        d.in_workspace = t.workspace_slots;
        d.usable       = true;
    }
    graph.direct = std::move(d);
}

// The workspace edits of a direct launch, on `stream` ahead of its kernels (and inside
// a replay's capture, so that a replay does them too).
inline Status apply_edits(const DirectLaunch &d, void *workspace, cudaStream_t stream) {
    static MemcpyAsyncFn *copy = cudart<MemcpyAsyncFn>("cudaMemcpyAsync");
    static MemsetAsyncFn *zero = cudart<MemsetAsyncFn>("cudaMemsetAsync");
    for (const auto &e : d.edits) {
        char *at = static_cast<char *>(workspace) + e.offset;
        const auto n = static_cast<size_t>(e.bytes);
        if (e.zero) {
            FA_RETURN_IF_ERROR(cuda_status(zero(at, 0, n, stream), "cudaMemsetAsync"));
        } else {
            FA_RETURN_IF_ERROR(cuda_status(copy(at, reinterpret_cast<const void *>(e.from), n,
                                                cudaMemcpyDeviceToDevice, stream), "cudaMemcpyAsync"));
        }
    }
    return {};
}

// One thread's finalized variant packs: a set-associative table (64 sets of 4), so
// that a lookup hashes once and compares at most four keys. 256 packs hold every
// layer of a large model forward and backward; a full set drops its oldest.
class PackCache {
   public:
    struct Entry {
        uint64_t serial = 0;  // 0: empty (serials start at 1)
        void *workspace = nullptr;
        // The caller's pointers in uid order, then (a ragged graph) its cumulative
        // lengths, 0 when it gave the index arrays itself: a replay runs the index kernel
        // on exactly those.
        void *user[kNumSlots + 2] = {};
        cudnnBackendDescriptor_t pack = nullptr;
        // The frontend graph, kept alive while its pack and replay are: a plan freed
        // meanwhile (fastattn.clear, a dropped Plan) leaves no entry pointing at its
        // scalars or its kernels. Its serial is never reused, so the entry is never hit
        // again; it goes when evicted or when the thread exits.
        std::shared_ptr<fe::graph::Graph> keep;
        uint32_t runs = 0;                  // launches through the pack
        cudaGraphExec_t replay = nullptr;   // the launch captured as a CUDA graph, once it repeats
        bool no_replay = false;             // its capture failed: the pack serves
    };

    PackCache() = default;
    PackCache(const PackCache &)            = delete;
    PackCache &operator=(const PackCache &) = delete;
    ~PackCache() {
        for (auto &e : entries_) drop(e);
        for (auto &e : deferred_) drop(e);
        for (auto s : capture_) {
            if (s != nullptr) (void)stream_destroy()(s);
        }
    }

    // The entry of g for `user` (key_n pointers: g.n in uid order, then a ragged graph's
    // two cumulative lengths) and `workspace`, its pack made on a miss.
    // `stream`: the caller's, asked whether it is being captured only on a miss.
    Status find(const Graph &g, void *const *user, int key_n, void *workspace, intptr_t stream, Entry **found) {
        const DirectLaunch &d = g.direct;
        const size_t bytes    = static_cast<size_t>(key_n) * sizeof(void *);
        constexpr uint64_t kMix = 0x9E3779B97F4A7C15ull;  // 2^64 / golden ratio: spreads aligned addresses
        uint64_t h = (d.serial * kMix) ^ reinterpret_cast<uintptr_t>(workspace);
        for (int i = 0; i < key_n; ++i) h = (h ^ reinterpret_cast<uintptr_t>(user[i])) * kMix;
        const int set = static_cast<int>(h >> (64 - kSetBits));
        Entry *ways   = &entries_[set * kWays];
        for (int w = 0; w < kWays; ++w) {
            const Entry &e = ways[w];
            if (e.serial == d.serial && e.workspace == workspace && std::memcmp(e.user, user, bytes) == 0) {
                ++hits;
                *found = &ways[w];
                return {};
            }
        }
        bool capturing = false;
        FA_RETURN_IF_ERROR(stream_capturing(stream, &capturing));
        cudnnBackendDescriptor_t fresh = nullptr;
        FA_RETURN_IF_ERROR(make_pack(d, user, workspace, &fresh));
        ++misses;
        Entry &e = ways[next_[set]];
        next_[set] = static_cast<uint8_t>((next_[set] + 1) % kWays);
        retire(e, capturing);
        e.serial    = d.serial;
        e.workspace = workspace;
        std::memcpy(e.user, user, bytes);
        e.pack = fresh;
        e.keep = g.g;
        *found = &e;
        return {};
    }

    // A stream of this thread's on `device` to capture launches on, made on first use.
    Status capture_stream(int device, cudaStream_t *out) {
        if (capture_[device] == nullptr) {
            static StreamCreateFn *create = cudart<StreamCreateFn>("cudaStreamCreateWithFlags");
            FA_RETURN_IF_ERROR(cuda_status(create(&capture_[device], cudaStreamNonBlocking), "cudaStreamCreateWithFlags"));
        }
        *out = capture_[device];
        return {};
    }

    uint64_t hits = 0, misses = 0, replays = 0;

   private:
    static constexpr int kSetBits = 6, kWays = 4;

    // What the frontend's execute_plan_at_index and create_variant_pack do, kept.
    static Status make_pack(const DirectLaunch &d, void *const *user, void *workspace, cudnnBackendDescriptor_t *out) {
        std::vector<void *> ptrs = d.fixed;
        for (size_t i = 0; i < d.user.size(); ++i) ptrs[d.user[i]] = user[i];
        for (const auto &[slot, offset] : d.in_workspace) ptrs[slot] = static_cast<char *>(workspace) + offset;
        void *engine_workspace = static_cast<char *>(workspace) + d.fe_workspace;
        const auto n           = static_cast<int64_t>(ptrs.size());
        cudnnBackendDescriptor_t p = nullptr;
        cudnnStatus_t st = fe::detail::create_descriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &p);
        if (st == CUDNN_STATUS_SUCCESS) {
            st = fe::detail::set_attribute(p, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1,
                                           &engine_workspace);
        }
        if (st == CUDNN_STATUS_SUCCESS) {
            st = fe::detail::set_attribute(p, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, n,
                                           ptrs.data());
        }
        if (st == CUDNN_STATUS_SUCCESS) {
            st = fe::detail::set_attribute(p, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, n, d.uids.data());
        }
        if (st == CUDNN_STATUS_SUCCESS) st = fe::detail::finalize(p);
        if (st != CUDNN_STATUS_SUCCESS) {
            if (p != nullptr) fe::detail::destroy_descriptor(p);
            return error(Code::kCudnnError,
                         std::string("execute: variant pack: ") + fe::detail::get_error_string(st));
        }
        *out = p;
        return {};
    }

    // An evicted entry may hold the last reference to a plan freed meanwhile, whose
    // destruction frees cuDNN's runtime-compiled kernels (a module unload, a potentially
    // unsafe call). Inside the caller's capture nothing is destroyed: the entry waits
    // for this thread's next miss outside one (seen 2026-12-01: an eviction inside
    // torch.cuda.graph invalidated the capture, and the next launch failed with
    // CUDNN_STATUS_EXECUTION_FAILED_CUDART, only once the suite had filled the table).
    void retire(Entry &e, bool capturing) {
        if (capturing) {
            if (e.serial != 0) deferred_.push_back(std::move(e));
            e = Entry{};
            return;
        }
        drop(e);
        for (auto &old : deferred_) drop(old);
        deferred_.clear();
    }
    // Relaxed: a capture in global mode on another thread must not count it as unsafe.
    static void drop(Entry &e) {
        static GraphExecDestroyFn *destroy = cudart<GraphExecDestroyFn>("cudaGraphExecDestroy");
        RelaxedCaptureMode relaxed;
        if (e.pack != nullptr) fe::detail::destroy_descriptor(e.pack);
        if (e.replay != nullptr) (void)destroy(e.replay);
        e = Entry{};  // releases `keep`: perhaps the plan's last reference
    }
    static StreamDestroyFn *stream_destroy() {
        static StreamDestroyFn *fn = cudart<StreamDestroyFn>("cudaStreamDestroy");
        return fn;
    }

    Entry entries_[(1 << kSetBits) * kWays];
    cudaStream_t capture_[kMaxDevices] = {};
    uint8_t next_[1 << kSetBits] = {};  // per set, the way the next miss replaces
    std::vector<Entry> deferred_;       // evicted inside a capture: dropped at the next miss outside one
};

// The calling thread's packs, made on its first launch and destroyed when it exits.
inline PackCache &thread_packs() {
    thread_local std::unique_ptr<PackCache> packs;
    if (!packs) packs = std::make_unique<PackCache>();
    return *packs;
}

// Set by the benchmark hook (attention.cpp's time_execute, kFastattnPacksOnly) to time this thread's
// launches through their packs alone; never set in production.
inline thread_local bool t_replays_off = false;

class ReplaysOff {
   public:
    explicit ReplaysOff(bool off) : previous_(t_replays_off) { t_replays_off = off; }
    ~ReplaysOff() { t_replays_off = previous_; }

   private:
    bool previous_;
};

// A launch run this many times through its pack is captured as a CUDA graph, and
// replayed from then on: a graph launch costs the host less than cuDNN's execute,
// and pointers that repeat this often will repeat again. A one-off call is never
// captured (a capture and an instantiation cost far more than a launch).
inline constexpr uint32_t kReplayAfter = 3;

// Captures the launch of e's pack on a stream of this thread's (the handle rebound
// to it and back), for replay on any stream. A launch cuDNN does not let a capture
// record leaves e without a replay, for good.
inline void capture_replay(const Graph &g, cudnnHandle_t handle, int device, intptr_t stream, const IndexLaunch *index,
                    PackCache::Entry &e) {
    static BeginCaptureFn *begin    = cudart<BeginCaptureFn>("cudaStreamBeginCapture");
    static EndCaptureFn *end        = cudart<EndCaptureFn>("cudaStreamEndCapture");
    static InstantiateFn *inst      = cudart<InstantiateFn>("cudaGraphInstantiateWithFlags");
    static GraphDestroyFn *destroy  = cudart<GraphDestroyFn>("cudaGraphDestroy");
    static GetLastErrorFn *clear    = cudart<GetLastErrorFn>("cudaGetLastError");
    e.no_replay = true;
    cudaStream_t side = nullptr;
    {
        RelaxedCaptureMode relaxed;
        if (!thread_packs().capture_stream(device, &side).ok()) return;
    }
    if (!set_stream(device, handle, reinterpret_cast<intptr_t>(side)).ok()) return;
    cudaGraph_t graph = nullptr;
    bool ok = begin(side, cudaStreamCaptureModeThreadLocal) == cudaSuccess;
    if (ok) {
        ok = index == nullptr || launch_index(*index, side).ok();
        ok = ok && apply_edits(g.direct, e.workspace, side).ok();
        ok = ok && fe::detail::execute(handle, g.direct.plan, e.pack) == CUDNN_STATUS_SUCCESS;
        ok = end(side, &graph) == cudaSuccess && ok && graph != nullptr;
    }
    (void)set_stream(device, handle, stream);
    {
        RelaxedCaptureMode relaxed;
        if (ok) ok = inst(&e.replay, graph, 0) == cudaSuccess;
        if (graph != nullptr) (void)destroy(graph);
    }
    if (!ok) {
        e.replay = nullptr;
        (void)clear();  // the failure is ours, not the next library's to report
        return;
    }
    e.no_replay = false;
}

// Launches g (direct.usable) on `handle`, already bound to `stream`. `user`: the
// caller's g.n pointers in uid order; `index`: its cumulative lengths, if it gave them.
inline Status launch_cached(const Graph &g, cudnnHandle_t handle, int device, intptr_t stream, void *const *user,
                     void *workspace, const IndexLaunch *index) {
    // As the frontend's execute: a thread with no current context (a PyTorch autograd
    // worker that has done no CUDA work) gets the stream's before a driver-API launch.
    if (!fe::detail::has_current_context()) {
        fe::detail::ensure_current_context(reinterpret_cast<cudaStream_t>(stream));
    }
    void *key[kNumSlots + 2];
    int key_n = g.n;
    std::memcpy(key, user, sizeof(void *) * g.n);
    if (g.ragged.n > 0) {
        key[key_n++] = reinterpret_cast<void *>(index != nullptr ? index->cu_q : 0);
        key[key_n++] = reinterpret_cast<void *>(index != nullptr ? index->cu_kv : 0);
    }
    PackCache &packs = thread_packs();
    PackCache::Entry *e = nullptr;
    FA_RETURN_IF_ERROR(packs.find(g, key, key_n, workspace, stream, &e));
    // A stream being captured (the caller's CUDA graph) records cuDNN's own launch,
    // and is not a moment to capture one of ours. Asked only where it decides.
    bool capturing = false;
    if (e->replay != nullptr && !t_replays_off) {
        FA_RETURN_IF_ERROR(stream_capturing(stream, &capturing));
        if (!capturing) {
            static GraphLaunchFn *launch = cudart<GraphLaunchFn>("cudaGraphLaunch");
            ++packs.replays;
            return cuda_status(launch(e->replay, reinterpret_cast<cudaStream_t>(stream)), "cudaGraphLaunch");
        }
    }
    if (index != nullptr) FA_RETURN_IF_ERROR(launch_index(*index, reinterpret_cast<cudaStream_t>(stream)));
    FA_RETURN_IF_ERROR(apply_edits(g.direct, workspace, reinterpret_cast<cudaStream_t>(stream)));
    const cudnnStatus_t st = fe::detail::execute(handle, g.direct.plan, e->pack);
    if (st != CUDNN_STATUS_SUCCESS) {
        return error(Code::kCudnnError, std::string("execute: cudnnBackendExecute: ") + fe::detail::get_error_string(st));
    }
    if (++e->runs >= kReplayAfter && e->replay == nullptr && !e->no_replay && !t_replays_off) {
        FA_RETURN_IF_ERROR(stream_capturing(stream, &capturing));
        if (!capturing) capture_replay(g, handle, device, stream, index, *e);
    }
    return {};
}

}  // namespace fastattn::detail
