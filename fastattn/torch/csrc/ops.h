// What the op library's translation units share: tensors, the plan table and its keys,
// outputs and workspaces, the launch through _core's C ABI, and every kernel's
// declaration (ops.cpp registers them; eager.cpp calls them directly).
//
// The units are compiled in parallel and linked into one library (fastattn/torch/_native.py):
//   ops.cpp     registration (schemas, kernels by dispatch key), the Python module, the
//               bridge to Python (the miss handler, exceptions), init and clear;
//   table.cpp   the plan table, outputs and workspaces, run;
//   dense.cpp   attention()'s kernels and its autograd node, DenseBackward;
//   varlen.cpp  attention_varlen()'s and attention_paged()'s kernels, varlen's autograd Function;
//   eager.cpp   the eager entries past torch.ops (call, call_varlen) and profile_eager;
//   sdpa.cpp    the SDPA mode's kernels over PyTorch's cuDNN SDPA operators.
// Each includes only the torch headers it needs: torch/extension.h alone takes longer to
// parse than most units take to compile (docs/history/benchmarks-log.md, "build times").
//
// Never includes cudnn-frontend: its statics live once, in _core.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Stream.h>
#include <c10/util/Exception.h>
#include <c10/util/FunctionRef.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "fastattn_abi.h"

namespace pybind11 {
class module_;
}  // namespace pybind11

namespace fastattn::ops {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// An option's key word (fastattn_options.h's FA_<OP>_WORDS): a float's bits, a
// choice's index among its names.
inline int64_t fa_bits(double x) {
    int64_t b;
    std::memcpy(&b, &x, sizeof b);
    return b;
}

// A str option's value as the name it is among `names` (string literals: the view stays
// valid after value is gone), for fastattn_options.h's FA_<OP>_FROM.
inline c10::string_view fa_named(const std::string &value, std::initializer_list<c10::string_view> names) {
    for (c10::string_view name : names) {
        if (value == name) return name;
    }
    TORCH_CHECK_VALUE(false, "fastattn: '", value, "' is none of the option's names");
}

inline int64_t fa_choice(c10::string_view value, std::initializer_list<c10::string_view> names) {
    int64_t i = 0;
    for (c10::string_view name : names) {
        if (value == name) return i;
        ++i;
    }
    TORCH_CHECK_VALUE(false, "fastattn: '", value, "' is none of the option's names");
}

}  // namespace fastattn::ops

// Each op's options (FA_DENSE_PARAMS, FA_DENSE_SCHEMA, DenseOptions, ...): generated from
// the ops' specs (fastattn/torch/_specs.py, by _options.py) when this library is built
// (fastattn.torch._native).
#include "fastattn_options.h"

namespace fastattn::ops {

extern const fastattn_abi *g_abi;  // set once by init() (ops.cpp), before any op can run

// A layout's number: its index in kLayouts (generated from fastattn/config.py's LAYOUTS).
inline int64_t layout_id(c10::string_view layout) {
    for (size_t i = 0; i < std::size(kLayouts); ++i) {
        if (kLayouts[i] == layout) return static_cast<int64_t>(i);
    }
    TORCH_CHECK_VALUE(false, "fastattn: layout='", layout, "': must be one of ", kLayoutChoices);
}

// Positions of (batch, head, seq, dim) in the tensors' shapes in a layout (_plans.AXES).
inline std::array<int, 4> axes(c10::string_view layout) { return kAxes[layout_id(layout)]; }

inline bool given(const OptTensor &t) { return t.has_value() && t->defined(); }

inline intptr_t ptr(const Tensor &t) { return reinterpret_cast<intptr_t>(t.data_ptr()); }
inline intptr_t ptr(const OptTensor &t) { return given(t) ? ptr(*t) : 0; }

inline OptTensor saved(const Tensor &t) { return t.defined() ? OptTensor(t) : std::nullopt; }

// A backward's d_sink: like the sinks, or empty without them (an op returns tensors).
// (dense.cpp: this header keeps to ATen's core, which has no factory functions)
Tensor d_sink_like(const OptTensor &sink, const Tensor &q);

// ---- the plan table (table.cpp) ----------------------------------------------------------------


struct KeyHash {  // a table key's hash: FNV-1a over its words
    size_t operator()(const std::vector<int64_t> &k) const noexcept {
        uint64_t h = 1469598103934665603ull;
        for (int64_t w : k) h = (h ^ static_cast<uint64_t>(w)) * 1099511628211ull;
        return static_cast<size_t>(h);
    }
};

struct Entry {
    void *plan;            // the fastattn.Plan, a PyObject (a reference the table's entry owns): keeps the graphs alive
    const void *graph[2];  // forward, backward (fastattn_abi_execute's graphs)
    int64_t workspace[2];
    bool deterministic;  // the backward runs cuDNN's deterministic algorithm (the plan's config.deterministic)
};

inline void put_tensor(std::vector<int64_t> &key, const Tensor &t) {
    key.push_back(static_cast<int64_t>(t.scalar_type()));
    key.push_back(static_cast<int64_t>(t.device().type()) * 1024 + t.device().index());
    key.push_back(t.dim());
    for (int64_t s : t.sizes()) key.push_back(s);
    for (int64_t s : t.strides()) key.push_back(s);
}

inline void put_optional(std::vector<int64_t> &key, const OptTensor &t) {
    if (given(t)) {
        put_tensor(key, *t);
    } else {
        key.push_back(-1);
    }
}

// The table's entry for `key` (its first words: a Kind, then the direction). On a miss,
// `miss` asks Python for it (ops.cpp's miss_dense, miss_varlen, miss_paged: the GIL
// taken, a new reference to the plan), and the table keeps what it returns. A Python
// exception of the miss handler (InvalidArgumentError, NotSupportedError, ...) propagates
// as pybind11::error_already_set, which PyTorch turns back into the same exception.
// The entry stays valid until this thread's next lookup of the same kind and direction
// (this thread's last hit owns it), whether or not the table drops it meanwhile: past
// its cap (set_max_entries) the table drops its least recently used eighth.
const Entry &lookup(const std::vector<int64_t> &key, c10::function_ref<Entry()> miss);

size_t table_size();
// The most entries the plan table and the SDPA mode's route map each hold
// (FASTATTN_MEMORY_MAX_ENTRIES: init() sets it; at least 1).
void set_max_entries(size_t n);
size_t max_entries();
// Under the caller's unique lock on `table` (the plan table, the route map: values are
// shared_ptrs to something with an atomic `used` stamp): past `cap`, the least recently
// used entries are moved into `dropped`, down to the cap less an eighth, for the caller
// to release after the lock (a last owner may take the GIL). Returns how many.
template <class Map, class Owners>
size_t trim_least_recent(Map &table, size_t cap, Owners &dropped) {
    const size_t size = table.size();
    if (size <= cap) return 0;
    const size_t n = size - (cap - cap / 8);  // < size: the cap is at least 1
    std::vector<std::pair<uint64_t, typename Map::iterator>> order;
    order.reserve(size);
    for (auto it = table.begin(); it != table.end(); ++it) {
        order.emplace_back(it->second->used.load(std::memory_order_relaxed), it);
    }
    std::nth_element(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(n - 1), order.end(),
                     [](const auto &a, const auto &b) { return a.first < b.first; });
    for (size_t i = 0; i < n; ++i) {
        dropped.push_back(std::move(order[i].second->second));
        table.erase(order[i].second);
    }
    return n;
}

// Entries the plan table has dropped past the cap (fastattn.stats()["evictions"]["native_calls"]).
uint64_t table_evictions();
void zero_table_evictions();
// Forgets every plan: entries a thread is running stay valid until its next lookup.
void clear_table();

// A failed execute as the exception the Python path raises for it (ops.cpp: fastattn.errors'
// one code table: InvalidArgumentError, CudnnError, ...).
[[noreturn]] void raise_status(int code, const char *message);

// Runs direction `direction` of e's plan on q's device and current stream with `slots`
// (FASTATTN_NUM_SLOTS addresses), its workspace kept per thread and stream. A backward
// of a plan without cuDNN's deterministic algorithm first calls alert_not_deterministic.
void run(const Entry &e, int direction, const Tensor &q, intptr_t *slots);

// ---- outputs and workspaces (table.cpp) --------------------------------------------------------

// A new tensor on like's device from the caching allocator, past the dispatcher; strides
// empty: contiguous.
Tensor empty_cuda(c10::IntArrayRef sizes, c10::IntArrayRef strides, at::ScalarType dtype, const Tensor &like);

// `size` bytes of workspace for a launch on `stream` from q's device: kept per (thread,
// device, stream), or fresh (capturing, or large). Undefined for 0.
Tensor workspace(int64_t size, const Tensor &q, const c10::Stream &stream);

// Releases every thread's kept workspaces (only while no op runs).
void clear_workspaces();
int64_t kept_workspace_bytes();

// ---- the Python side (ops.cpp): each op's miss, under the GIL ----------------------------------

Entry miss_dense(int direction, const Tensor &q, const Tensor &k, const Tensor &v, const Tensor *o,
                 const OptTensor &seq_len_q, const OptTensor &seq_len_kv, const OptTensor &bias, const OptTensor &sink,
                 const DenseOptions &opt);
Entry miss_varlen(int direction, const Tensor &q, const Tensor &k, const Tensor &v, int64_t batch,
                  const OptTensor &sink, const VarlenOptions &opt);
Entry miss_paged(const Tensor &q, const Tensor &k_cache, const Tensor &v_cache, const Tensor &table,
                 const OptTensor &seq_lens_q, const Tensor &cache_seqlens, const PagedOptions &opt);

[[noreturn]] void cpu_error(const Tensor &q);

// A backward without cuDNN's deterministic algorithm is about to run (run, for every op's
// and the SDPA mode's backward): while torch.use_deterministic_algorithms(True) is set,
// what PyTorch's own non-deterministic kernels do there, a warning (warn_only) or an
// error, from fastattn.torch._executor.alert_not_deterministic under the GIL (the Python
// path's words and exception); else nothing, at the cost of one flag read.
void alert_not_deterministic();

// Adds eager.cpp's functions to the Python module: call, call_varlen (the eager entries),
// profile_eager and the tests' read_call, read_varlen_call, check_varlen_tensors.
void add_eager_entries(pybind11::module_ &m);

// ---- attention() (dense.cpp) -----------------------------------------------------------------

using Grads = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>;

// The plan for a dense call: everything fastattn.torch._dense.plan_for's key holds (so
// that a hit was validated by the miss that made it), plus the direction. o: the
// backward's forward output (its strides are the plan's); null for the forward.
const Entry &find_plan(int direction, const Tensor &q, const Tensor &k, const Tensor &v, const Tensor *o,
                       const OptTensor &seq_len_q, const OptTensor &seq_len_kv, const OptTensor &bias,
                       const OptTensor &sink, const OptTensor &rng, const DenseOptions &opt);

// The backward's work: (d_q, d_k, d_v, d_bias, d_sink), the last two undefined where not
// computed (backward_cuda, the op's kernel, returns empty tensors in their place).
Grads backward_work(const Tensor &d_o_in, const Tensor &o, const Tensor &stats, const Tensor &q, const Tensor &k,
                    const Tensor &v, const OptTensor &seq_len_q, const OptTensor &seq_len_kv, const OptTensor &bias,
                    const OptTensor &sink, const OptTensor &rng, FA_DENSE_PARAMS);

// o's shape: q's, with v's head dim (q is 4-d: its plan was found).
std::array<int64_t, 4> out_shape(const Tensor &q, const Tensor &v, const std::array<int, 4> &ax);

// The forward's work: (o, stats), stats undefined when not training.
std::tuple<Tensor, Tensor> forward_work(const Tensor &q, const Tensor &k, const Tensor &v, const OptTensor &seq_len_q,
                                        const OptTensor &seq_len_kv, const OptTensor &bias, const OptTensor &sink,
                                        const OptTensor &rng, FA_DENSE_PARAMS);
// The kernels of fastattn::native_attention_forward / _backward, by dispatch key.
std::tuple<Tensor, Tensor> forward_cuda(const Tensor &q, const Tensor &k, const Tensor &v, const OptTensor &seq_len_q,
                                        const OptTensor &seq_len_kv, const OptTensor &bias, const OptTensor &sink,
                                        const OptTensor &rng, FA_DENSE_PARAMS);
Grads backward_cuda(const Tensor &d_o, const Tensor &o, const Tensor &stats, const Tensor &q, const Tensor &k,
                    const Tensor &v, const OptTensor &seq_len_q, const OptTensor &seq_len_kv, const OptTensor &bias,
                    const OptTensor &sink, const OptTensor &rng, FA_DENSE_PARAMS);
std::tuple<Tensor, Tensor> forward_meta(const Tensor &q, const Tensor &k, const Tensor &v, const OptTensor &,
                                        const OptTensor &, const OptTensor &, const OptTensor &, const OptTensor &,
                                        FA_DENSE_PARAMS);
Grads backward_meta(const Tensor &, const Tensor &, const Tensor &, const Tensor &q, const Tensor &k, const Tensor &v,
                    const OptTensor &, const OptTensor &, const OptTensor &bias, const OptTensor &sink,
                    const OptTensor &, FA_DENSE_PARAMS);
std::tuple<Tensor, Tensor> forward_cpu(const Tensor &q, const Tensor &, const Tensor &, const OptTensor &,
                                       const OptTensor &, const OptTensor &, const OptTensor &, const OptTensor &,
                                       FA_DENSE_PARAMS);
Grads backward_cpu(const Tensor &, const Tensor &, const Tensor &, const Tensor &q, const Tensor &, const Tensor &,
                   const OptTensor &, const OptTensor &, const OptTensor &, const OptTensor &, const OptTensor &,
                   FA_DENSE_PARAMS);
std::tuple<Tensor, Tensor> forward_autograd(const Tensor &q, const Tensor &k, const Tensor &v,
                                            const OptTensor &seq_len_q, const OptTensor &seq_len_kv,
                                            const OptTensor &bias, const OptTensor &sink, const OptTensor &rng,
                                            FA_DENSE_PARAMS);
// A forward that records autograd (DenseBackward). direct: the eager entry's plain CUDA
// tensors, forward_work itself; else the op below Autograd.
std::tuple<Tensor, Tensor> forward_recorded(bool direct, const Tensor &q, const Tensor &k, const Tensor &v,
                                            const OptTensor &seq_len_q, const OptTensor &seq_len_kv,
                                            const OptTensor &bias, const OptTensor &sink, const OptTensor &rng,
                                            const DenseOptions &opt);

// ---- the SDPA mode (sdpa.cpp; fastattn/torch/_sdpa_mode.py) ------------------------------------

// How the mode runs one call signature of aten::_scaled_dot_product_cudnn_attention (and
// its backward): fastattn's dense plan with `opt`, its outputs given the strides and
// shapes the installed torch's Meta kernels give, or PyTorch's own kernels (ours false).
struct SdpaRoute {
    bool ours = false;
    std::string reason;  // why PyTorch's kernels run it (not ours): _route's answer
    DenseOptions opt{};
    std::array<int64_t, 4> out_stride{};
    std::vector<int64_t> lse_shape;
    std::array<std::array<int64_t, 4>, 3> grad_strides{};  // d_query's, d_key's, d_value's
    // Forward calls of this signature (fastattn.stats()["sdpa"]): bumped by every call,
    // without a lock; shared so that a route stays movable into the table.
    std::shared_ptr<std::atomic<uint64_t>> calls = std::make_shared<std::atomic<uint64_t>>(0);
};

// The mode's forward calls so far, by route: (ours, the reason where not, calls) for each
// kept route, those of dropped routes (served, and by reason; the reason "" for those past
// the cap's worth of reasons), and the calls no kept route counts (a refusal inside a
// capture, which is not kept; PyTorch's kernels for return_debug_mask) with their reasons.
// zero_sdpa_calls() starts them again (fastattn.clear()).
std::vector<std::tuple<bool, std::string, uint64_t>> sdpa_calls();
void zero_sdpa_calls();

// The route of a signature seen for the first time: _sdpa_mode._route's answer (ops.cpp,
// under the GIL). bias: attn_bias as the kernel got it; training: the forward's
// compute_log_sumexp (true for the backward).
SdpaRoute miss_sdpa(const Tensor &q, const Tensor &k, const Tensor &v, const OptTensor &bias, double dropout_p,
                    bool is_causal, std::optional<double> scale, bool training);

// A call signature's route: from the map, else miss_sdpa's (kept, but for a refusal
// inside a CUDA-graph capture). Shared: valid for as long as the caller holds it, whether
// or not the map drops it meanwhile.
std::shared_ptr<const SdpaRoute> sdpa_route(const Tensor &q, const Tensor &k, const Tensor &v, const OptTensor &bias,
                                            double dropout_p, bool is_causal, const std::optional<double> &scale,
                                            bool training);

// Registers the mode's kernels over PyTorch's for `key` (CUDA; the CPU for tests of
// their fallback): the cuDNN operator's two, and the composite's for the key and its
// autograd key (on; early_reasons: _sdpa_mode.EARLY), or removes them, PyTorch's serving
// again (off).
void set_sdpa_kernels(bool on, c10::DispatchKey key, const std::vector<std::string> &early_reasons = {});
size_t sdpa_route_count();
void clear_sdpa_routes();  // a route a call holds stays valid until the call is done
// Routes the map has dropped past the cap (fastattn.stats()["evictions"]["sdpa_routes"]).
uint64_t sdpa_route_evictions();
void zero_sdpa_route_evictions();

// ---- attention_varlen() and attention_paged() (varlen.cpp) -------------------------------------

std::tuple<Tensor, Tensor> varlen_forward_cuda(const Tensor &q, const Tensor &k, const Tensor &v, const Tensor &cu_q,
                                               const Tensor &cu_kv, const OptTensor &sink, const OptTensor &rng,
                                               FA_VARLEN_PARAMS);
std::tuple<Tensor, Tensor, Tensor, Tensor> varlen_backward_cuda(const Tensor &d_o_in, const Tensor &o,
                                                                const Tensor &stats, const Tensor &q, const Tensor &k,
                                                                const Tensor &v, const Tensor &cu_q,
                                                                const Tensor &cu_kv, const OptTensor &sink,
                                                                const OptTensor &rng, FA_VARLEN_PARAMS);
std::tuple<Tensor, Tensor> varlen_forward_meta(const Tensor &q, const Tensor &, const Tensor &v, const Tensor &,
                                               const Tensor &, const OptTensor &, const OptTensor &, FA_VARLEN_PARAMS);
std::tuple<Tensor, Tensor, Tensor, Tensor> varlen_backward_meta(const Tensor &, const Tensor &, const Tensor &,
                                                                const Tensor &q, const Tensor &k, const Tensor &v,
                                                                const Tensor &, const Tensor &, const OptTensor &sink,
                                                                const OptTensor &, FA_VARLEN_PARAMS);
std::tuple<Tensor, Tensor> varlen_forward_cpu(const Tensor &q, const Tensor &, const Tensor &, const Tensor &,
                                              const Tensor &, const OptTensor &, const OptTensor &, FA_VARLEN_PARAMS);
std::tuple<Tensor, Tensor, Tensor, Tensor> varlen_backward_cpu(const Tensor &, const Tensor &, const Tensor &,
                                                               const Tensor &q, const Tensor &, const Tensor &,
                                                               const Tensor &, const Tensor &, const OptTensor &,
                                                               const OptTensor &, FA_VARLEN_PARAMS);
std::tuple<Tensor, Tensor> varlen_forward_autograd(const Tensor &q, const Tensor &k, const Tensor &v,
                                                   const Tensor &cu_q, const Tensor &cu_kv, const OptTensor &sink,
                                                   const OptTensor &rng, FA_VARLEN_PARAMS);

Tensor paged_forward_cuda(const Tensor &q, const Tensor &k_cache, const Tensor &v_cache, const Tensor &table,
                          const Tensor &cache_seqlens, const OptTensor &seq_lens_q, FA_PAGED_PARAMS);
Tensor paged_forward_meta(const Tensor &q, const Tensor &, const Tensor &v_cache, const Tensor &, const Tensor &,
                          const OptTensor &, FA_PAGED_PARAMS);
Tensor paged_forward_cpu(const Tensor &q, const Tensor &, const Tensor &, const Tensor &, const Tensor &,
                         const OptTensor &, FA_PAGED_PARAMS);

}  // namespace fastattn::ops
