// What the op library's translation units share: tensors, the plan table and its keys,
// outputs and workspaces, the launch through _core's C ABI, the bridge to Python, and
// the generated kernels' declarations (fastattn_kernels.h).
//
// The units are compiled in parallel and linked into one library (fastattn/torch/_native.py):
//   kernels.cpp each op's plan lookup, work and kernels by dispatch key, autograd.cpp its
//               Autograd kernel and autograd node (apart: autograd's headers are the
//               slowest to compile), and registration.cpp their registration: generated
//               from the ops' specs (fastattn/torch/_specs.py) at the build, by
//               fastattn/torch/_kernels.py;
//   ops.cpp     the Python module and the bridge to Python (the miss, exceptions), init
//               and clear;
//   python.cpp  python.h's tensors in Python objects, over torch's Python headers;
//   table.cpp   the plan table, outputs and workspaces, run;
//   eager.cpp   the eager entries past torch.ops (call, call_varlen, call_paged), with
//               their argument readers (readers.h, which the tests' extension includes too);
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
// valid after value is gone): fastattn_options.h's FA_<OP>_FROM, an autograd node's options.
inline c10::string_view fa_named(c10::string_view value, std::initializer_list<c10::string_view> names) {
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

// Each op's options (FA_DENSE_PARAMS, DenseOptions, ...): generated from
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

// A packed op's own tensor (tokens, ...): all but its token count, which its plans serve any of.
inline void put_packed(std::vector<int64_t> &key, const Tensor &t) {
    key.push_back(static_cast<int64_t>(t.scalar_type()));
    key.push_back(static_cast<int64_t>(t.device().type()) * 1024 + t.device().index());
    key.push_back(t.dim());
    for (int64_t i = 1; i < t.dim(); ++i) key.push_back(t.size(i));
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
// `miss` asks Python for it (miss below: the GIL taken, a new reference to the plan), and
// the table keeps what it returns. A Python
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

// A new tensor of t's shape, strides and dtype (empty_cuda).
inline Tensor empty_like_cuda(const Tensor &t) { return empty_cuda(t.sizes(), t.strides(), t.scalar_type(), t); }

// paged's seq_lens_q slot when the call passes none (its spec's `absent`, as _paged's
// function of that name): seqlen_q for each of the batch's sequences, made per call, so
// that one made inside a CUDA graph capture is filled by the graph itself.
Tensor query_lengths(const Tensor &q);

// `size` bytes of workspace for a launch on `stream` from q's device: kept per (thread,
// device, stream), or fresh (capturing, or large). Undefined for 0.
Tensor workspace(int64_t size, const Tensor &q, const c10::Stream &stream);

// Releases every thread's kept workspaces (only while no op runs).
void clear_workspaces();
int64_t kept_workspace_bytes();

// ---- the Python side (ops.cpp) ----------------------------------------------------------------

// A miss of an op's kernels (its Options: DenseOptions, VarlenOptions, PagedOptions): under
// the GIL, the op's plan_for (fastattn.torch._native.PLAN_FOR) with the call's inputs in
// its spec's order (nullopt: None), o (the backward's forward output, null for the
// forward) and the options, which validates the call as the Python path does.
template <class Options>
Entry miss(int direction, std::initializer_list<OptTensor> inputs, const Tensor *o, const Options &opt);

// The CPU kernels' error: fastattn runs on CUDA tensors (table.cpp).
[[noreturn]] void cpu_error(const Tensor &q);

// A backward without cuDNN's deterministic algorithm is about to run (run, for every op's
// and the SDPA mode's backward): while torch.use_deterministic_algorithms(True) is set,
// what PyTorch's own non-deterministic kernels do there, a warning (warn_only) or an
// error, from fastattn.torch._executor.alert_not_deterministic under the GIL (the Python
// path's words and exception); else nothing, at the cost of one flag read.
void alert_not_deterministic();

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
// capture, which is not kept; PyTorch's kernels for return_debug_mask) with their reasons,
// and (true, "head_dim_padded", n): n of the served calls had their head dims padded.
// zero_sdpa_calls() starts them again (fastattn.clear()).
std::vector<std::tuple<bool, std::string, uint64_t>> sdpa_calls();
void zero_sdpa_calls();

// The route of a signature seen for the first time: _sdpa_mode._route's answer (ops.cpp,
// under the GIL). bias: attn_bias as the kernel got it; training: the forward's
// compute_log_sumexp (true for the backward); deterministic: cuDNN's deterministic
// backward asked for (strict_determinism() of a training call).
SdpaRoute miss_sdpa(const Tensor &q, const Tensor &k, const Tensor &v, const OptTensor &bias, double dropout_p,
                    bool is_causal, std::optional<double> scale, bool training, bool deterministic);

// _sdpa_mode._composite's output for a call the op library's composite hands to Python
// (a mask that requires grad: sdpa.cpp kPython); ops.cpp, under the GIL.
Tensor python_composite(const Tensor &q, const Tensor &k, const Tensor &v, const OptTensor &mask, double dropout_p,
                        bool is_causal, std::optional<double> scale, bool enable_gqa);

// A call signature's route: from the map, else miss_sdpa's (kept, but for a refusal
// inside a CUDA-graph capture). Shared: valid for as long as the caller holds it, whether
// or not the map drops it meanwhile.
std::shared_ptr<const SdpaRoute> sdpa_route(const Tensor &q, const Tensor &k, const Tensor &v, const OptTensor &bias,
                                            double dropout_p, bool is_causal, const std::optional<double> &scale,
                                            bool training, bool deterministic);

// torch.use_deterministic_algorithms(True) without warn_only (_sdpa_mode._strict): a call
// with a backward then takes cuDNN's deterministic backward, or PyTorch's kernels.
bool strict_determinism();

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

}  // namespace fastattn::ops

// Each op's plan lookup, work, CUDA kernel (kernels.cpp) and autograd (autograd.cpp):
// generated from the ops' specs at the build (fastattn/torch/_kernels.py).
#include "fastattn_kernels.h"
