// fastattn's PyTorch op library: the per-call path of fastattn.torch.attention in C++.
//
// Registers fastattn::native_attention_forward/_backward, native_varlen_forward/_backward
// (varlen.inc) and native_paged_forward (paged.inc): the schemas of the Python custom
// ops fastattn::attention_*, varlen_* and paged_forward, under other names so that both
// can be loaded at once, with kernels for CUDA (the work),
// Meta (shapes only, for torch.compile's fake tensors), CPU (a clear error) and
// Autograd (a C++ autograd node, so that an eager training step runs no Python
// for attention).
//
// The hot path: a key of the tensors' shapes, strides, dtypes, devices and the
// options -> a plan in a C++ table (a shared lock, no GIL); outputs and workspace
// from ATen's caching allocator; pointers into a slot array; fastattn._core's execute
// through the C ABI it hands out (fastattn_abi.h) on the current stream. A miss calls
// the Python miss handler registered by fastattn/torch/_native.py under the GIL: it
// validates the call and gets the plan from the runtime (memory, disk, Redis, build)
// exactly as the Python path does, so both paths run the very same plans.
//
// Never includes cudnn-frontend: its statics live once, in _core.
// Compiled on first use against the installed torch (fastattn/torch/_native.py).

#include <torch/extension.h>

#include <ATen/EmptyTensor.h>
#include <ATen/record_function.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "fastattn_abi.h"

namespace {

namespace py = pybind11;
using at::Tensor;
using OptTensor = std::optional<Tensor>;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

const fastattn_abi *g_abi = nullptr;  // set once by init(), before any op can run
PyObject *g_miss = nullptr;            // the Python miss handler; a new reference, never released
PyObject *g_error_for_code = nullptr;  // fastattn.errors.error_for_code; likewise


// Positions of (batch, head, seq, dim) in the tensors' shapes, per layout (_plans.AXES).
std::array<int, 4> axes(c10::string_view layout) {
    if (layout == "bshd") return {0, 2, 1, 3};
    if (layout == "sbhd") return {1, 2, 0, 3};
    if (layout == "bhsd") return {0, 1, 2, 3};
    TORCH_CHECK_VALUE(false, "fastattn: layout='", layout, "': must be one of ('bshd', 'sbhd', 'bhsd')");
}

int64_t layout_id(c10::string_view layout) { return layout == "bshd" ? 0 : layout == "sbhd" ? 1 : 2; }

constexpr c10::string_view kLayouts[3] = {"bshd", "sbhd", "bhsd"};  // by layout_id

// ---- the plan table ---------------------------------------------------------------------------

struct Entry {
    PyObject *plan;      // the fastattn.Plan (a reference held by the table): keeps the graphs alive
    const void *graph[2];  // forward, backward (fastattn_abi_execute's graphs)
    int64_t workspace[2];
};

struct KeyHash {
    size_t operator()(const std::vector<int64_t> &k) const noexcept {
        uint64_t h = 1469598103934665603ull;  // FNV-1a over the words
        for (int64_t w : k) h = (h ^ static_cast<uint64_t>(w)) * 1099511628211ull;
        return static_cast<size_t>(h);
    }
};

// Read under a shared lock on every call; written under the unique lock on a miss,
// with the GIL held (the order GIL -> table lock; a hit never takes the GIL, so a hit
// waiting for the lock never holds the GIL). Entries are never removed while ops can
// run (clear() is for tests), so a hit's Entry stays valid after the lock is dropped.
std::shared_mutex g_table_lock;
std::unordered_map<std::vector<int64_t>, Entry, KeyHash> g_table;

void put_tensor(std::vector<int64_t> &key, const Tensor &t) {
    key.push_back(static_cast<int64_t>(t.scalar_type()));
    key.push_back(static_cast<int64_t>(t.device().type()) * 1024 + t.device().index());
    key.push_back(t.dim());
    for (int64_t s : t.sizes()) key.push_back(s);
    for (int64_t s : t.strides()) key.push_back(s);
}

void put_optional(std::vector<int64_t> &key, const OptTensor &t) {
    if (t.has_value() && t->defined()) {
        put_tensor(key, *t);
    } else {
        key.push_back(-1);
    }
}

// An option's key word (fastattn_options.h's FA_<OP>_WORDS): a float's bits, a
// choice's index among its names.
int64_t fa_bits(double x) {
    int64_t b;
    std::memcpy(&b, &x, sizeof b);
    return b;
}

int64_t fa_choice(c10::string_view value, std::initializer_list<c10::string_view> names) {
    int64_t i = 0;
    for (c10::string_view name : names) {
        if (value == name) return i;
        ++i;
    }
    TORCH_CHECK_VALUE(false, "fastattn: '", value, "' is none of the option's names");
}

}  // namespace

// Each op's options (FA_DENSE_PARAMS, FA_DENSE_SCHEMA, DenseOptions, ...): generated from
// fastattn/torch/_options.py when this library is built (fastattn.torch._native).
#include "fastattn_options.h"

namespace {

bool given(const OptTensor &t) { return t.has_value() && t->defined(); }

py::object to_py(const OptTensor &t) { return given(t) ? py::cast(*t) : py::none(); }

enum Kind : int64_t { kDense = 0, kVarlen = 1, kPaged = 2 };  // the miss handler's first argument; a key's first word

// A thread's last hits, one per kind and direction: a model's attention layers share
// a shape, so a call's key is usually the one before it, and comparing it costs less
// than hashing it, locking and searching. clear() bumps g_generation, which empties
// every thread's.
std::atomic<uint64_t> g_generation{0};
struct LastHit {
    uint64_t generation = ~uint64_t{0};
    std::vector<int64_t> key;
    const Entry *entry = nullptr;
};
thread_local LastHit t_last_hit[3][2];  // [Kind][direction]: every kind's key starts with (kind, direction)
static_assert(kPaged < 3, "t_last_hit has a row per Kind");

// The table's entry for `key`; on a miss, miss() (called under the GIL) asks Python
// for (plan, forward graph, backward graph, forward workspace, backward workspace).
template <class Miss>
const Entry &lookup(const std::vector<int64_t> &key, Miss &&miss) {
    LastHit &last = t_last_hit[key[0]][key[1]];
    const uint64_t generation = g_generation.load(std::memory_order_acquire);
    if (last.generation == generation && last.key == key) return *last.entry;
    {
        std::shared_lock<std::shared_mutex> lock(g_table_lock);
        auto it = g_table.find(key);
        if (it != g_table.end()) {
            last.key.assign(key.begin(), key.end());  // into the capacity it has: no allocation once grown
            last.entry = &it->second;
            last.generation = generation;
            return it->second;
        }
    }
    // A miss: the Python runtime validates and finds or builds the plan. Two threads
    // missing on one key both ask; the runtime builds a (config, device) once.
    TORCH_CHECK(g_miss != nullptr && g_abi != nullptr, "fastattn: the op library was not initialized");
    py::gil_scoped_acquire gil;
    // A Python exception (InvalidArgumentError, NotSupportedError, ...) propagates as
    // py::error_already_set, which PyTorch turns back into the same exception.
    py::object got = miss(py::reinterpret_borrow<py::object>(g_miss));
    auto t = got.cast<py::tuple>();
    Entry e{nullptr,
            {reinterpret_cast<const void *>(t[1].cast<intptr_t>()), reinterpret_cast<const void *>(t[2].cast<intptr_t>())},
            {t[3].cast<int64_t>(), t[4].cast<int64_t>()}};
    std::unique_lock<std::shared_mutex> lock(g_table_lock);
    auto [it, inserted] = g_table.emplace(key, e);
    if (inserted) it->second.plan = py::object(t[0]).inc_ref().ptr();
    return it->second;
}

// The plan for a dense call: everything fastattn.torch._dense.plan_for's key holds (so
// that a hit was validated by the miss that made it), plus the direction. o: the
// backward's forward output (its strides are the plan's); null for the forward.
const Entry &find_plan(int direction, const Tensor &q, const Tensor &k, const Tensor &v, const Tensor *o,
                       const OptTensor &seq_len_q, const OptTensor &seq_len_kv, const OptTensor &bias,
                       const OptTensor &sink, const OptTensor &rng, const DenseOptions &opt) {
    thread_local std::vector<int64_t> key;  // reused: no allocation per call once grown
    key.clear();
    key.push_back(kDense);
    key.push_back(direction);
    put_tensor(key, q);
    put_tensor(key, k);
    put_tensor(key, v);
    if (o != nullptr) put_tensor(key, *o);
    put_optional(key, seq_len_q);
    put_optional(key, seq_len_kv);
    put_optional(key, bias);
    put_optional(key, sink);
    key.push_back(given(rng));
    FA_DENSE_WORDS(key, opt);
    return lookup(key, [&](const py::object &handler) {
        return handler(static_cast<int64_t>(kDense), direction, q, k, v, o != nullptr ? py::cast(*o) : py::none(),
                       to_py(seq_len_q), to_py(seq_len_kv), to_py(bias), to_py(sink), FA_DENSE_TUPLE(opt));
    });
}

// ---- execute ----------------------------------------------------------------------------------

intptr_t ptr(const Tensor &t) { return reinterpret_cast<intptr_t>(t.data_ptr()); }
intptr_t ptr(const OptTensor &t) { return given(t) ? ptr(*t) : 0; }

// Outputs (empty_cuda) and workspaces (workspace): memory.inc.
#include "memory.inc"

// A failed execute as the exception the Python path raises for it (fastattn.errors'
// one code table: InvalidArgumentError, CudnnError, ...), through the dispatcher, which
// hands a Python exception back to Python as it is.
[[noreturn]] void raise_status(int code, const char *message) {
    py::gil_scoped_acquire gil;
    TORCH_CHECK(g_error_for_code != nullptr, "fastattn: the op library was not initialized (status ", code, "): ",
                message);
    py::object exc = py::reinterpret_borrow<py::object>(g_error_for_code)(code, message);
    PyErr_SetObject(reinterpret_cast<PyObject *>(Py_TYPE(exc.ptr())), exc.ptr());
    throw py::error_already_set();
}

void run(const Entry &e, int direction, const Tensor &q, intptr_t *slots) {
    const int64_t size = e.workspace[direction];
    const c10::Stream stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(q.device());
    const Tensor ws = workspace(size, q, stream);  // held until the launch is queued
    char message[512];
    const int code = g_abi->execute(e.graph[direction], direction, q.get_device(), slots, size ? ptr(ws) : 0,
                                    reinterpret_cast<intptr_t>(stream.native_handle()), message, sizeof message);
    if (code != FASTATTN_STATUS_OK) raise_status(code, message);
}

// o's shape: q's, with v's head dim (q is 4-d: its plan was found).
std::array<int64_t, 4> out_shape(const Tensor &q, const Tensor &v, const std::array<int, 4> &ax) {
    const auto qs = q.sizes();
    std::array<int64_t, 4> shape{qs[0], qs[1], qs[2], qs[3]};
    shape[ax[3]] = v.size(ax[3]);
    return shape;
}

std::vector<int64_t> stats_shape(const Tensor &q, const std::array<int, 4> &ax, bool training) {
    if (!training) return {0};  // inference writes no stats: an empty tensor keeps the schema fixed
    return {q.size(ax[0]), q.size(ax[1]), q.size(ax[2]), 1};
}

void put_extras(intptr_t *slots, const OptTensor &seq_len_q, const OptTensor &seq_len_kv, const OptTensor &bias,
                const OptTensor &sink, const OptTensor &rng) {
    slots[FASTATTN_SLOT_SEQ_LEN_Q] = ptr(seq_len_q);
    slots[FASTATTN_SLOT_SEQ_LEN_KV] = ptr(seq_len_kv);
    slots[FASTATTN_SLOT_BIAS] = ptr(bias);
    slots[FASTATTN_SLOT_SINK] = ptr(sink);
    if (given(rng)) {  // Philox's seed at element 0, its offset at element 2 (16-byte aligned)
        slots[FASTATTN_SLOT_SEED] = ptr(rng);
        slots[FASTATTN_SLOT_OFFSET] = ptr(rng) + 16;
    }
}

// The forward's work: (o, stats), stats undefined when not training (the op's kernel,
// forward_cuda, returns an empty tensor in its place: a schema's Tensor is defined).
std::tuple<Tensor, Tensor> forward_work(const Tensor &q, const Tensor &k, const Tensor &v, const OptTensor &seq_len_q,
                                        const OptTensor &seq_len_kv, const OptTensor &bias, const OptTensor &sink,
                                        const OptTensor &rng, FA_DENSE_PARAMS) {
    const DenseOptions opt{FA_DENSE_ARGS};
    const auto ax = axes(layout);
    const Entry &e = find_plan(FASTATTN_FORWARD, q, k, v, nullptr, seq_len_q, seq_len_kv, bias, sink, rng, opt);
    // Rows past a sequence's length are zero, as on the Python path (_dense.forward_impl).
    const auto shape = out_shape(q, v, ax);
    Tensor o = given(seq_len_q) ? at::zeros(shape, q.options()) : empty_cuda(shape, {}, q.scalar_type(), q);
    Tensor stats = training ? empty_cuda(stats_shape(q, ax, true), {}, at::kFloat, q) : Tensor();
    intptr_t slots[FASTATTN_NUM_SLOTS] = {};
    slots[FASTATTN_SLOT_Q] = ptr(q);
    slots[FASTATTN_SLOT_K] = ptr(k);
    slots[FASTATTN_SLOT_V] = ptr(v);
    slots[FASTATTN_SLOT_O] = ptr(o);
    slots[FASTATTN_SLOT_STATS] = training ? ptr(stats) : 0;
    put_extras(slots, seq_len_q, seq_len_kv, bias, sink, rng);
    run(e, FASTATTN_FORWARD, q, slots);
    return {o, stats};
}

std::tuple<Tensor, Tensor> forward_cuda(const Tensor &q, const Tensor &k, const Tensor &v, const OptTensor &seq_len_q,
                                        const OptTensor &seq_len_kv, const OptTensor &bias, const OptTensor &sink,
                                        const OptTensor &rng, FA_DENSE_PARAMS) {
    auto [o, stats] = forward_work(q, k, v, seq_len_q, seq_len_kv, bias, sink, rng, FA_DENSE_ARGS);
    if (!stats.defined()) stats = at::empty({0}, q.options().dtype(at::kFloat));  // inference writes no stats
    return {o, stats};
}

using Grads = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>;

Tensor like(const Tensor &t) { return empty_cuda(t.sizes(), t.strides(), t.scalar_type(), t); }

// The backward's work: d_bias and d_sink undefined where not computed (backward_cuda, the
// op's kernel, returns empty tensors in their place).
Grads backward_work(const Tensor &d_o_in, const Tensor &o, const Tensor &stats, const Tensor &q, const Tensor &k,
                    const Tensor &v, const OptTensor &seq_len_q, const OptTensor &seq_len_kv, const OptTensor &bias,
                    const OptTensor &sink, const OptTensor &rng, FA_DENSE_PARAMS) {
    const DenseOptions opt{FA_DENSE_ARGS};
    // The backward graph reads d_o at o's strides (the plan is built for them).
    const Tensor d_o = d_o_in.strides() == o.strides() ? d_o_in : like(o).copy_(d_o_in);
    const Entry &e = find_plan(FASTATTN_BACKWARD, q, k, v, &o, seq_len_q, seq_len_kv, bias, sink, rng, opt);
    Tensor d_q = like(q), d_k = like(k), d_v = like(v);
    if (given(seq_len_q)) {  // padded rows get zero gradients (see forward_cuda)
        d_q.zero_();
        d_k.zero_();
        d_v.zero_();
    }
    Tensor d_bias = bias_grad ? at::empty_like(*bias, at::MemoryFormat::Contiguous) : Tensor();
    Tensor d_sink = given(sink) ? at::empty_like(*sink) : Tensor();
    intptr_t slots[FASTATTN_NUM_SLOTS] = {};
    slots[FASTATTN_SLOT_Q] = ptr(q);
    slots[FASTATTN_SLOT_K] = ptr(k);
    slots[FASTATTN_SLOT_V] = ptr(v);
    slots[FASTATTN_SLOT_O] = ptr(o);
    slots[FASTATTN_SLOT_DO] = ptr(d_o);
    slots[FASTATTN_SLOT_STATS] = ptr(stats);
    slots[FASTATTN_SLOT_DQ] = ptr(d_q);
    slots[FASTATTN_SLOT_DK] = ptr(d_k);
    slots[FASTATTN_SLOT_DV] = ptr(d_v);
    put_extras(slots, seq_len_q, seq_len_kv, bias, sink, rng);
    if (bias_grad) slots[FASTATTN_SLOT_DBIAS] = ptr(d_bias);
    if (given(sink)) slots[FASTATTN_SLOT_DSINK] = ptr(d_sink);
    run(e, FASTATTN_BACKWARD, q, slots);
    return {d_q, d_k, d_v, d_bias, d_sink};
}

Grads backward_cuda(const Tensor &d_o, const Tensor &o, const Tensor &stats, const Tensor &q, const Tensor &k,
                    const Tensor &v, const OptTensor &seq_len_q, const OptTensor &seq_len_kv, const OptTensor &bias,
                    const OptTensor &sink, const OptTensor &rng, FA_DENSE_PARAMS) {
    auto [d_q, d_k, d_v, d_bias, d_sink] =
        backward_work(d_o, o, stats, q, k, v, seq_len_q, seq_len_kv, bias, sink, rng, FA_DENSE_ARGS);
    return {d_q, d_k, d_v, d_bias.defined() ? d_bias : at::empty({0}, q.options()),
            d_sink.defined() ? d_sink : at::empty({0}, q.options().dtype(at::kFloat))};
}

// ---- Meta (fake tensors: torch.compile) and CPU ------------------------------------------------
// In SymInt arithmetic: under torch.compile's dynamic shapes the sizes are symbols, and
// sizes() would throw.

std::tuple<Tensor, Tensor> forward_meta(const Tensor &q, const Tensor &k, const Tensor &v, const OptTensor &,
                                        const OptTensor &, const OptTensor &, const OptTensor &, const OptTensor &,
                                        FA_DENSE_PARAMS) {
    const auto ax = axes(layout);
    std::vector<c10::SymInt> o(q.sym_sizes().begin(), q.sym_sizes().end());
    o[ax[3]] = v.sym_size(ax[3]);
    std::vector<c10::SymInt> stats{0};
    if (training) stats = {q.sym_size(ax[0]), q.sym_size(ax[1]), q.sym_size(ax[2]), 1};
    return {at::empty_symint(o, q.options()), at::empty_symint(stats, q.options().dtype(at::kFloat))};
}

Tensor like_meta(const Tensor &t) { return at::empty_strided_symint(t.sym_sizes(), t.sym_strides(), t.options()); }

Grads backward_meta(const Tensor &, const Tensor &, const Tensor &, const Tensor &q, const Tensor &k, const Tensor &v,
                    const OptTensor &, const OptTensor &, const OptTensor &bias, const OptTensor &sink,
                    const OptTensor &, FA_DENSE_PARAMS) {
    return {like_meta(q), like_meta(k), like_meta(v),
            bias_grad ? at::empty_like(*bias, at::MemoryFormat::Contiguous) : at::empty({0}, q.options()),
            given(sink) ? at::empty_like(*sink) : at::empty({0}, q.options().dtype(at::kFloat))};
}

[[noreturn]] void cpu_error(const Tensor &q) {
    TORCH_CHECK_VALUE(false, "fastattn: q is on ", q.device(), ": fastattn runs on CUDA tensors");
}

std::tuple<Tensor, Tensor> forward_cpu(const Tensor &q, const Tensor &, const Tensor &, const OptTensor &,
                                       const OptTensor &, const OptTensor &, const OptTensor &, const OptTensor &,
                                       FA_DENSE_PARAMS) {
    cpu_error(q);
}

Grads backward_cpu(const Tensor &, const Tensor &, const Tensor &, const Tensor &q, const Tensor &, const Tensor &,
                   const OptTensor &, const OptTensor &, const OptTensor &, const OptTensor &, const OptTensor &,
                   FA_DENSE_PARAMS) {
    cpu_error(q);
}

#include "dense_autograd.inc"  // attention()'s autograd node, for the eager entry and the ops alike
#include "varlen.inc"  // attention_varlen's ops: the same table, run and conventions
#include "paged.inc"   // attention_paged's (forward only)
#include "eager.inc"   // attention()'s eager entries, past torch.ops and the dispatcher
#include "eager_varlen.inc"  // attention_varlen()'s
#include "profile.inc"  // the eager entry taken apart, for benchmarks/profile_native_step.py

// ---- Python: initialization and introspection -------------------------------------------------

void init(py::capsule abi, py::object miss, py::object error_for_code) {
    auto *table = static_cast<const fastattn_abi *>(PyCapsule_GetPointer(abi.ptr(), FASTATTN_ABI_CAPSULE));
    if (table == nullptr) throw py::error_already_set();
    TORCH_CHECK(table->version == FASTATTN_ABI_VERSION && table->num_slots == FASTATTN_NUM_SLOTS,
                "fastattn: _core's C ABI is version ", table->version, " with ", table->num_slots,
                " slots; this op library was built for version ", FASTATTN_ABI_VERSION, " with ",
                FASTATTN_NUM_SLOTS, ": rebuild it");
    g_abi = table;
    if (g_miss != nullptr) Py_DECREF(g_miss);
    g_miss = miss.inc_ref().ptr();
    if (g_error_for_code != nullptr) Py_DECREF(g_error_for_code);
    g_error_for_code = error_for_code.inc_ref().ptr();
}

size_t table_size() {
    std::shared_lock<std::shared_mutex> lock(g_table_lock);
    return g_table.size();
}

// Forgets every plan and releases the kept workspaces (tests, and memory back to the
// caching allocator): only while no op runs, since a hit holds its Entry unlocked.
void clear() {
    {
        std::unique_lock<std::shared_mutex> lock(g_table_lock);
        for (auto &kv : g_table) Py_XDECREF(kv.second.plan);
        g_table.clear();
        g_generation.fetch_add(1, std::memory_order_release);  // every thread's last hits are stale
    }
    std::vector<KeptWorkspace> released;  // freed after the lock is released
    std::lock_guard<std::mutex> lock(g_workspace_lock);
    for (ThreadWorkspaces *t : *g_threads) {
        for (auto &kept : t->kept) released.push_back(std::move(kept));
        t->kept.clear();
    }
}

// Bytes of workspace kept for reuse (fastattn.torch's memory accounting, tests).
int64_t kept_workspace_bytes() {
    std::lock_guard<std::mutex> lock(g_workspace_lock);
    int64_t total = 0;
    for (const ThreadWorkspaces *t : *g_threads) {
        for (const auto &kept : t->kept) total += kept.buffer.numel();
    }
    return total;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastattn, m) {
    m.def("native_attention_forward(Tensor q, Tensor k, Tensor v, Tensor? seq_len_q, Tensor? seq_len_kv, "
          "Tensor? bias, Tensor? sink, Tensor? rng, " FA_DENSE_SCHEMA ") -> (Tensor, Tensor)");
    m.def("native_attention_backward(Tensor d_o, Tensor o, Tensor stats, Tensor q, Tensor k, Tensor v, "
          "Tensor? seq_len_q, Tensor? seq_len_kv, Tensor? bias, Tensor? sink, Tensor? rng, " FA_DENSE_SCHEMA
          ") -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
    m.def("native_varlen_forward(Tensor q, Tensor k, Tensor v, Tensor cu_q, Tensor cu_kv, Tensor? rng, "
          FA_VARLEN_SCHEMA ") -> (Tensor, Tensor)");
    m.def("native_varlen_backward(Tensor d_o, Tensor o, Tensor stats, Tensor q, Tensor k, Tensor v, Tensor cu_q, "
          "Tensor cu_kv, Tensor? rng, " FA_VARLEN_SCHEMA ") -> (Tensor, Tensor, Tensor)");
    m.def("native_paged_forward(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor cache_seqlens, "
          "Tensor? seq_lens_q, " FA_PAGED_SCHEMA ") -> Tensor");
}

TORCH_LIBRARY_IMPL(fastattn, CUDA, m) {
    m.impl("native_paged_forward", &paged_forward_cuda);
    m.impl("native_attention_forward", &forward_cuda);
    m.impl("native_attention_backward", &backward_cuda);
    m.impl("native_varlen_forward", &varlen_forward_cuda);
    m.impl("native_varlen_backward", &varlen_backward_cuda);
}

TORCH_LIBRARY_IMPL(fastattn, Meta, m) {
    m.impl("native_paged_forward", &paged_forward_meta);
    m.impl("native_attention_forward", &forward_meta);
    m.impl("native_attention_backward", &backward_meta);
    m.impl("native_varlen_forward", &varlen_forward_meta);
    m.impl("native_varlen_backward", &varlen_backward_meta);
}

TORCH_LIBRARY_IMPL(fastattn, CPU, m) {
    m.impl("native_paged_forward", &paged_forward_cpu);
    m.impl("native_attention_forward", &forward_cpu);
    m.impl("native_attention_backward", &backward_cpu);
    m.impl("native_varlen_forward", &varlen_forward_cpu);
    m.impl("native_varlen_backward", &varlen_backward_cpu);
}

TORCH_LIBRARY_IMPL(fastattn, Autograd, m) {
    m.impl("native_attention_forward", &forward_autograd);
    m.impl("native_varlen_forward", &varlen_forward_autograd);
    // Not differentiable (no double backward): their outputs are plain tensors, with no
    // "autograd kernel not registered" warning.
    m.impl("native_attention_backward", torch::CppFunction::makeFallthrough());
    m.impl("native_varlen_backward", torch::CppFunction::makeFallthrough());
    m.impl("native_paged_forward", torch::CppFunction::makeFallthrough());  // forward only
}

namespace {
// A METH_FASTCALL function as the PyCFunction that PyMethodDef holds (CPython casts it back).
using FastCall = PyObject *(*)(PyObject *, PyObject *const *, Py_ssize_t);
PyCFunction as_pycfunction(FastCall f) { return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(f)); }
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "fastattn's PyTorch op library (fastattn/torch/csrc/ops.cpp); loaded by fastattn.torch._native";
    m.attr("abi_version") = FASTATTN_ABI_VERSION;
    m.def("init", &init,
          "init(abi_capsule, miss_handler, error_for_code): the _core C ABI, the Python miss handler and "
          "fastattn.errors.error_for_code");
    m.def("raise_status", [](int code, const std::string &message) { raise_status(code, message.c_str()); },
          "raise_status(code, message): raises what a failed execute with this status raises (tests)");
    m.def("table_size", &table_size, "plans in the C++ table");
    m.def("clear", &clear, "forget every plan and release the kept workspaces (only while no op runs)");
    m.def("profile_eager", &profile_eager, "the eager entry's pieces timed in C++ (benchmarks/profile_native_step.py)");
    m.def("kept_workspace_bytes", &kept_workspace_bytes, "bytes of workspace kept per thread and stream for reuse");
    m.def("check_varlen_tensors", &check_varlen_tensors_for_tests,
          "check_varlen_tensors(q, k, v, cu_seqlens_q, cu_seqlens_kv): call_varlen's tensor checks (tests)");
    // The eager entries take Python's vectorcall convention (METH_FASTCALL), which
    // pybind11 does not offer: each is a plain CPython function added to the module.
    static PyMethodDef fastcall_defs[] = {
        {"call", as_pycfunction(&call_attention), METH_FASTCALL, kCallDoc},
        {"read_call", as_pycfunction(&read_call_for_tests), METH_FASTCALL,
         "read_call(<call's 18 arguments>) -> what call would run with, or None (tests)"},
        {"call_varlen", as_pycfunction(&call_varlen), METH_FASTCALL, kVarlenCallDoc},
        {"read_varlen_call", as_pycfunction(&read_varlen_call_for_tests), METH_FASTCALL,
         "read_varlen_call(<call_varlen's 17 arguments>) -> what call_varlen would run with, or None (tests)"},
    };
    for (PyMethodDef &def : fastcall_defs) {
        m.add_object(def.ml_name, py::reinterpret_steal<py::object>(PyCFunction_NewEx(&def, nullptr, m.ptr())));
    }
}
