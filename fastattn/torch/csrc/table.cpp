// The plan table, outputs and workspaces, and the launch through _core's C ABI: what
// every op's kernel shares (ops.h). Needs no autograd and no Python beyond Python.h (a
// plan's reference dropped under the GIL): a unit that compiles in seconds.
#include <Python.h>

#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/full.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ops.h"

namespace fastattn::ops {

namespace {

// ---- the plan table -----------------------------------------------------------------------------
// At most g_max_entries entries (FASTATTN_MEMORY_MAX_ENTRIES, fastattn/bounded.py): past
// it an insert drops the least recently used eighth. Each entry is shared: the table
// holds one owner and each thread's last hit another, so an entry dropped (or cleared)
// while a thread still runs it stays valid until that thread's next lookup of its kind
// and direction; its Python plan reference goes with its last owner.

// Whether Py_DECREF may run: not once Python is finalizing or gone (a thread's
// thread_locals die at its exit, the main thread's inside exit(), after finalization):
// the process is ending, and the plan goes with it.
bool python_alive() {
#if PY_VERSION_HEX >= 0x030D0000
    return Py_IsInitialized() && !Py_IsFinalizing();
#else
    return Py_IsInitialized() && !_Py_IsFinalizing();
#endif
}

struct Kept {
    Entry entry;  // its plan: a reference this Kept owns
    // g_clock at its last use, stored by every hit without a lock (relaxed: an
    // approximate order is all a trim needs).
    mutable std::atomic<uint64_t> used;
    Kept(const Entry &e, uint64_t now) : entry(e), used(now) {}
    Kept(const Kept &) = delete;
    Kept &operator=(const Kept &) = delete;
    ~Kept() {
        if (entry.plan == nullptr || !python_alive()) return;
        PyGILState_STATE gil = PyGILState_Ensure();
        Py_DECREF(static_cast<PyObject *>(entry.plan));
        PyGILState_Release(gil);
    }
};
using Owned = std::shared_ptr<const Kept>;

// Read under a shared lock on a thread's first call of a key; written under the unique
// lock after a miss (which took and released the GIL: a hit never takes the GIL, so a
// hit waiting for the lock never holds it). Owners are released after the lock is: the
// last one takes the GIL.
std::shared_mutex g_table_lock;
// Never destroyed: at exit Python is finalized and the plans go with the process.
auto &g_table = *new std::unordered_map<std::vector<int64_t>, Owned, KeyHash>();
// Advanced by each insert; a hit stamps its entry with it, so a trim drops the entries
// unused since the oldest inserts, never one used between every two (a hot shape). An
// insert, not a hit, advances it: a hit stores what it loads, it adds nothing. By two, the
// insert's stamp between (fastattn.bounded.tick): an entry hit after an insert is later
// than the entry inserted.
std::atomic<uint64_t> g_clock{0};
std::atomic<size_t> g_max_entries{1};  // set by init() (ops.cpp) before any op can run
std::atomic<uint64_t> g_evictions{0};

// A thread's last hits, one per kind and direction: a model's attention layers share
// a shape, so a call's key is usually the one before it, and comparing it costs less
// than hashing it, locking and searching. clear_table() bumps g_generation, which makes
// every thread's stale.
std::atomic<uint64_t> g_generation{0};
struct LastHit {
    uint64_t generation = ~uint64_t{0};
    std::vector<int64_t> key;
    Owned kept;  // an owner: the entry outlives its eviction while this thread may run it
};
thread_local LastHit t_last_hit[kNumKinds][2];  // [Kind][direction]: every key starts with (kind, direction)

void mark_used(const Kept &k, uint64_t now) {
    if (k.used.load(std::memory_order_relaxed) != now) k.used.store(now, std::memory_order_relaxed);
}

// Under the unique lock: past the cap, the least recently used entries moved into
// `dropped` (released by the caller after the lock).
void trim(std::vector<Owned> &dropped) {
    const size_t n = trim_least_recent(g_table, g_max_entries.load(std::memory_order_relaxed), dropped);
    g_evictions.fetch_add(n, std::memory_order_relaxed);
}

// Releases owners, perhaps the last of their plans, with the GIL taken once for all of
// them (each ~Kept would take it alone; see python_alive for when none is).
void release(std::vector<Owned> &owners) {
    if (owners.empty() || !python_alive()) {
        owners.clear();
        return;
    }
    PyGILState_STATE gil = PyGILState_Ensure();
    owners.clear();
    PyGILState_Release(gil);
}

// A miss: the Python runtime validates and finds or builds the plan; kept under `key`.
// Two threads missing on one key both ask (the runtime builds a (config, device) once);
// the first insert stays.
Owned insert(std::vector<int64_t> key, c10::function_ref<Entry()> miss) {
    const Entry e = miss();
    std::vector<Owned> dropped;
    Owned kept;
    {
        std::unique_lock<std::shared_mutex> lock(g_table_lock);
        const uint64_t now = g_clock.fetch_add(2, std::memory_order_relaxed) + 1;
        auto fresh = std::make_shared<const Kept>(e, now);
        auto [it, inserted] = g_table.try_emplace(std::move(key), fresh);
        kept = it->second;
        if (inserted) {
            trim(dropped);
        } else {
            mark_used(*kept, now);
            dropped.push_back(std::move(fresh));  // the other thread's entry stays
        }
    }
    release(dropped);
    return kept;
}

}  // namespace

const Entry &lookup(const std::vector<int64_t> &key, c10::function_ref<Entry()> miss) {
    LastHit &last = t_last_hit[key[0]][key[1]];
    const uint64_t generation = g_generation.load(std::memory_order_acquire);
    const uint64_t now = g_clock.load(std::memory_order_relaxed);
    if (last.generation == generation && last.key == key) {
        mark_used(*last.kept, now);
        return last.kept->entry;
    }
    Owned found;
    {
        std::shared_lock<std::shared_mutex> lock(g_table_lock);
        auto it = g_table.find(key);
        if (it != g_table.end()) found = it->second;
    }
    if (found != nullptr) {
        mark_used(*found, now);
        last.key.assign(key.begin(), key.end());  // into the capacity it has: no allocation once grown
    } else {
        // The miss runs Python, which may run another call on this thread (a finalizer)
        // and so overwrite the caller's key and this thread's last hit: the key is copied first.
        std::vector<int64_t> mine(key);
        found = insert(mine, miss);
        last.key = std::move(mine);
    }
    last.generation = generation;
    // Released at the return, outside every lock: perhaps a dropped entry's last owner (~Kept takes the GIL).
    const Owned previous = std::exchange(last.kept, std::move(found));
    return last.kept->entry;
}

size_t table_size() {
    std::shared_lock<std::shared_mutex> lock(g_table_lock);
    return g_table.size();
}

void set_max_entries(size_t n) {
    TORCH_CHECK_VALUE(n >= 1, "fastattn: the op library's tables hold at least 1 entry, got ", n);
    g_max_entries.store(n, std::memory_order_relaxed);
}

size_t max_entries() { return g_max_entries.load(std::memory_order_relaxed); }

uint64_t table_evictions() { return g_evictions.load(std::memory_order_relaxed); }

void zero_table_evictions() { g_evictions.store(0, std::memory_order_relaxed); }

void clear_table() {
    std::vector<Owned> dropped;
    {
        std::unique_lock<std::shared_mutex> lock(g_table_lock);
        dropped.reserve(g_table.size());
        for (auto &kv : g_table) dropped.push_back(std::move(kv.second));
        g_table.clear();
        g_generation.fetch_add(1, std::memory_order_release);  // every thread's last hits are stale
    }
    release(dropped);  // (those a thread's last hit holds go at that thread's next lookup)
}

namespace {

// ---- outputs ------------------------------------------------------------------------------------
// From the caching allocator directly, as at::empty's CUDA kernel allocates them, but
// not through the dispatcher: its empty (the dispatch, TensorOptions unpacking, a
// device guard) costs host time that shows beside a small call's launch
// (benchmarks/csrc/profile_eager.cpp: the rows "output allocation, direct / through at::empty" in docs/history/
// benchmarks-log.md; "Numbers moved out of code comments" there). The allocator is the
// one at::empty gave the process's first output (a configured backend, cudaMallocAsync or a pluggable
// one, stays in use), and allocates on the current device: used only while the tensor's
// device is current, which it is in any program on one GPU; else at::empty, which makes
// it current for the call.
std::atomic<c10::Allocator *> g_cuda_allocator{nullptr};

bool device_current(const Tensor &like) {
    static const c10::impl::DeviceGuardImplInterface *const cuda =
        c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
    return cuda->getDevice() == like.device();
}

}  // namespace

Tensor empty_cuda(c10::IntArrayRef sizes, c10::IntArrayRef strides, at::ScalarType dtype, const Tensor &like) {
    c10::Allocator *allocator = g_cuda_allocator.load(std::memory_order_relaxed);
    if (allocator != nullptr && device_current(like)) {
        constexpr c10::DispatchKeySet cuda_keys(c10::DispatchKey::CUDA);
        return strides.empty() ? at::detail::empty_generic(sizes, allocator, cuda_keys, dtype, std::nullopt)
                               : at::detail::empty_strided_generic(sizes, strides, allocator, cuda_keys, dtype);
    }
    const auto options = like.options().dtype(dtype);
    Tensor t = strides.empty() ? at::empty(sizes, options) : at::empty_strided(sizes, strides, options);
    if (allocator == nullptr && t.is_cuda()) g_cuda_allocator.store(t.storage().allocator(), std::memory_order_relaxed);
    return t;
}

Tensor query_lengths(const Tensor &q) { return at::full({q.size(0)}, q.size(1), q.options().dtype(at::kInt)); }

[[noreturn]] void cpu_error(const Tensor &q) {
    TORCH_CHECK_VALUE(false, "fastattn: q is on ", q.device(), ": fastattn runs on CUDA tensors");
}

namespace {

// ---- the workspace ------------------------------------------------------------------------------
// Kept per (thread, device, stream) and grown as needed, as PyTorch keeps cuBLAS's
// workspaces per handle and stream: an allocation from the caching allocator and its
// free on every call cost host time next to a small call's launch. Reuse within a
// thread is safe: that thread's launches on one stream run in order, and a launch holds
// a reference (a grown-over buffer stays alive until the call using it has queued its
// work; the allocator then frees it stream-ordered). Not shared between threads: a
// call's launches into its workspace are several (cudnn-frontend copies the plan's
// constants into it, then cuDNN's kernels run), and two threads' launches on one stream
// interleave (seen on the H200: 16 threads, wrong outputs). Two cases take a fresh buffer
// from the caching allocator instead, freed when the call returns:
// - a stream capturing a CUDA graph: the buffer comes from the graph's private pool, as
//   every tensor of the captured region does; a kept one would be shared between the
//   graph's replays and later eager calls, which the replays (on any stream) are not
//   ordered with;
// - a workspace over kKeptWorkspaceMax: the launch it serves dwarfs an allocation.

constexpr int64_t kKeptWorkspaceMax = int64_t{16} << 20;  // as the Python path's (_plans.KEPT_WORKSPACE)
constexpr int64_t kWorkspaceGrain = int64_t{1} << 20;      // grown in MiB steps, not call by call

struct KeptWorkspace {
    c10::Stream stream;
    Tensor buffer;
};

// One thread's kept workspaces, listed in g_threads so that clear() and the accounting
// reach every thread's; a thread's are released when it exits.
struct ThreadWorkspaces;
std::mutex g_workspace_lock;  // guards g_threads and every ThreadWorkspaces::kept
// Never destroyed: a thread may exit after static destruction began.
auto *g_threads = new std::vector<ThreadWorkspaces *>();

struct ThreadWorkspaces {
    std::vector<KeptWorkspace> kept;
    ThreadWorkspaces() {
        std::lock_guard<std::mutex> lock(g_workspace_lock);
        g_threads->push_back(this);
    }
    ~ThreadWorkspaces() {
        std::vector<KeptWorkspace> released;  // freed after the lock is released
        std::lock_guard<std::mutex> lock(g_workspace_lock);
        g_threads->erase(std::find(g_threads->begin(), g_threads->end(), this));
        released.swap(kept);
        // The main thread's thread_locals die inside exit(), after Python has finalized:
        // PyTorch's caching allocator then throws from a free, inside a noexcept
        // destructor, and the process aborts at exit (seen on the H200: 2 of 3 pytest
        // processes of one GPU run, exit 134, "invalid device pointer"; pytorch/pytorch#185148 is the same failure
        // from a global's destructor at exit). The process is ending: its buffers go
        // with it, unfreed.
        if (!Py_IsInitialized()) {
            for (auto &k : released) (void)k.buffer.unsafeReleaseTensorImpl();
        }
    }
};
thread_local ThreadWorkspaces t_workspaces;

int64_t grain(int64_t size) { return (size + kWorkspaceGrain - 1) / kWorkspaceGrain * kWorkspaceGrain; }

}  // namespace

Tensor workspace(int64_t size, const Tensor &q, const c10::Stream &stream) {
    if (size == 0) return Tensor();
    const auto bytes = q.options().dtype(at::kByte);
    if (size > kKeptWorkspaceMax || g_abi->stream_capturing(reinterpret_cast<intptr_t>(stream.native_handle())) != 0) {
        return at::empty({size}, bytes);  // capturing, or the query failed: the safe choice
    }
    // Named before the lock: a thread's first use constructs it, and its constructor takes the lock.
    ThreadWorkspaces &mine = t_workspaces;
    {
        std::lock_guard<std::mutex> lock(g_workspace_lock);  // uncontended but for clear() and the accounting
        for (const auto &kept : mine.kept) {
            if (kept.stream == stream && kept.buffer.numel() >= size) return kept.buffer;
        }
    }
    // None yet on this stream, or too small: allocated and the old one freed outside the
    // lock (the allocator may record Python stack traces, which take the GIL).
    Tensor fresh = at::empty({grain(size)}, bytes), old;
    std::lock_guard<std::mutex> lock(g_workspace_lock);
    for (auto &kept : mine.kept) {
        if (kept.stream != stream) continue;
        old = std::exchange(kept.buffer, fresh);  // destroyed after the lock is released (declared before it)
        return fresh;
    }
    mine.kept.push_back({stream, fresh});
    return fresh;
}

void clear_workspaces() {
    std::vector<KeptWorkspace> released;  // freed after the lock is released
    std::lock_guard<std::mutex> lock(g_workspace_lock);
    for (ThreadWorkspaces *t : *g_threads) {
        for (auto &kept : t->kept) released.push_back(std::move(kept));
        t->kept.clear();
    }
}

int64_t kept_workspace_bytes() {
    std::lock_guard<std::mutex> lock(g_workspace_lock);
    int64_t total = 0;
    for (const ThreadWorkspaces *t : *g_threads) {
        for (const auto &kept : t->kept) total += kept.buffer.numel();
    }
    return total;
}

void run(const Entry &e, int direction, const Tensor &q, intptr_t *slots) {
    // Before the workspace and the launch: a raise leaves nothing queued.
    if (direction == FASTATTN_BACKWARD && !e.deterministic) alert_not_deterministic();
    const int64_t size = e.workspace[direction];
    const c10::Stream stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(q.device());
    const Tensor ws = workspace(size, q, stream);  // held until the launch is queued
    char message[512];
    const int code = g_abi->execute(e.graph[direction], direction, q.get_device(), slots, size ? ptr(ws) : 0,
                                    reinterpret_cast<intptr_t>(stream.native_handle()), message, sizeof message);
    if (code != FASTATTN_STATUS_OK) raise_status(code, message);
}

}  // namespace fastattn::ops
