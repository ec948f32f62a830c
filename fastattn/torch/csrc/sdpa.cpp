// The SDPA mode's kernels (fastattn/torch/_sdpa_mode.py says what the mode is and why these
// operators): CUDA kernels over aten::_scaled_dot_product_cudnn_attention and its backward,
// and over aten::scaled_dot_product_attention itself (CUDA and AutogradCUDA: the composite,
// which gives the cuDNN operator every call fastattn takes), registered while the mode is on. With the Python kernels they replace, the
// mode's call cost more host time than PyTorch's own cuDNN kernels (docs/BENCHMARKS.md,
// "The SDPA mode"): the dispatcher's call into Python, a signature tuple, the Python
// path's forward. Here a
// call is a route lookup (one hash of its shapes, strides and options), permuted views and
// the dense op's own work (kernels.cpp's dense_forward); a new signature asks Python once (_sdpa_mode._route:
// PyTorch's checks, the plan's verdict, the Meta kernel's strides).
//
// Boxed kernels: they read their arguments off the dispatcher's stack by position, so a
// torch whose operators changed their types still builds this library (enable_sdpa checks
// the arguments' names against the installed torch before registering), and a call
// fastattn does not take is handed, stack and all, to PyTorch's own kernels:
// aten::_cudnn_attention_forward / _backward, which its cuDNN SDPA operators run.
#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <ATen/core/stack.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/full.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/scaled_dot_product_attention_native.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ops.h"

namespace fastattn::ops {

namespace {

using torch::jit::Stack;

// ---- routes -----------------------------------------------------------------------------------

// Written under the unique lock after a miss (which took the GIL and released it), read
// under the shared one. At most max_entries() routes (the plan table's cap,
// FASTATTN_MEMORY_MAX_ENTRIES): past it an insert drops the least recently used eighth,
// as table.cpp's trim. Shared: a route dropped (or cleared) while a call runs on it stays
// valid until the call is done, and its calls are folded into the dropped counts when it
// goes (~KeptRoute), so sdpa_calls() misses none.
struct KeptRoute {
    SdpaRoute route;
    mutable std::atomic<uint64_t> used;  // g_route_clock at its last use (as table.cpp's Kept)
    KeptRoute(SdpaRoute r, uint64_t now) : route(std::move(r)), used(now) {}
    KeptRoute(const KeptRoute &) = delete;
    KeptRoute &operator=(const KeptRoute &) = delete;
    ~KeptRoute();
};
std::shared_mutex g_routes_lock;
// Never destroyed: at exit its routes would fold their counts into what static
// destruction may have taken apart already.
auto &g_routes = *new std::unordered_map<std::vector<int64_t>, std::shared_ptr<const KeptRoute>, KeyHash>();
std::atomic<uint64_t> g_route_clock{0};  // advanced by each insert; a hit stamps its route with it
std::atomic<uint64_t> g_route_evictions{0};

// The calls of routes no longer kept: served ones, and the others by reason (at most
// max_entries() reasons; "" counts those past it, which _sdpa_mode names
// fastattn.bounded.OTHER_REASONS).
std::mutex g_dropped_lock;
uint64_t g_dropped_served = 0;
std::map<std::string, uint64_t> g_dropped_passed;

KeptRoute::~KeptRoute() {
    const uint64_t n = route.calls != nullptr ? route.calls->load(std::memory_order_relaxed) : 0;
    if (n == 0) return;
    std::lock_guard<std::mutex> guard(g_dropped_lock);
    if (route.ours) {
        g_dropped_served += n;
        return;
    }
    const bool room = g_dropped_passed.count(route.reason) != 0 || g_dropped_passed.size() < max_entries();
    g_dropped_passed[room ? route.reason : std::string()] += n;
}

using Routes = std::vector<std::shared_ptr<const KeptRoute>>;

// Under the unique lock: past the cap, the least recently used routes moved into `dropped`
// (released by the caller after the lock).
void trim_routes(Routes &dropped) {
    g_route_evictions.fetch_add(trim_least_recent(g_routes, max_entries(), dropped), std::memory_order_relaxed);
}

std::shared_ptr<const SdpaRoute> route_of(const std::shared_ptr<const KeptRoute> &kept) {
    return std::shared_ptr<const SdpaRoute>(kept, &kept->route);  // (shares kept's ownership)
}

void put_scale(std::vector<int64_t> &key, const std::optional<double> &scale) {
    key.push_back(scale.has_value());
    key.push_back(scale.has_value() ? fa_bits(*scale) : 0);
}

// Forward calls no kept route counts (sdpa_calls).
std::atomic<uint64_t> g_unkept_calls{0};  // a refusal inside a capture: its route is not kept
std::atomic<uint64_t> g_debug_calls{0};   // return_debug_mask: PyTorch's kernels give the mask
std::atomic<uint64_t> g_padded_calls{0};  // served with head dims padded (padded()): counted apart too
constexpr const char *kUnkept = "refused inside a CUDA-graph capture (a plan not loaded before it)";
constexpr const char *kDebug = "return_debug_mask: PyTorch's kernels give the dropout mask";
constexpr const char *kPadded = "head_dim_padded";  // _sdpa_mode.PADDED

// A forward call the composite kernel (below) counted itself, served or handed to
// PyTorch's composite: the cuDNN operator's kernel under it on this thread does not
// count it again.
thread_local bool t_counted = false;

struct Counted {  // t_counted for one call below, then as it was
    const bool before = t_counted;
    Counted() { t_counted = true; }
    ~Counted() { t_counted = before; }
};

void count_call(const SdpaRoute &r) {
    if (r.calls != nullptr) {
        r.calls->fetch_add(1, std::memory_order_relaxed);
    } else {
        g_unkept_calls.fetch_add(1, std::memory_order_relaxed);
    }
}

// The composite's calls handed on before a route is asked, by reason (_sdpa_mode.EARLY,
// given with the kernels; kCudnnOff: PyTorch's cuDNN backend disabled).
constexpr size_t kEarly = 4;
constexpr int kCudnnOff = 3;
std::array<std::string, kEarly> g_early_reasons;
std::array<std::atomic<uint64_t>, kEarly> g_early_calls{};

bool capturing(const Tensor &q) {
    const c10::Stream stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(q.device());
    return g_abi->stream_capturing(reinterpret_cast<intptr_t>(stream.native_handle())) != 0;
}

}  // namespace

bool strict_determinism() {
    at::Context &context = at::globalContext();
    return context.deterministicAlgorithms() && !context.deterministicAlgorithmsWarnOnly();
}

std::shared_ptr<const SdpaRoute> sdpa_route(const Tensor &q, const Tensor &k, const Tensor &v, const OptTensor &bias,
                                            double dropout_p, bool is_causal, const std::optional<double> &scale,
                                            bool training, bool deterministic) {
    deterministic = deterministic && training;  // (as _sdpa_mode._route: a backward's choice)
    thread_local std::vector<int64_t> key;
    key.clear();
    put_tensor(key, q);
    put_tensor(key, k);
    put_tensor(key, v);
    put_optional(key, bias);
    key.push_back(fa_bits(dropout_p));
    key.push_back(is_causal);
    put_scale(key, scale);
    key.push_back(training);
    key.push_back(deterministic);
    {
        const uint64_t now = g_route_clock.load(std::memory_order_relaxed);
        std::shared_lock<std::shared_mutex> lock(g_routes_lock);
        auto it = g_routes.find(key);
        if (it != g_routes.end()) {
            const KeptRoute &kept = *it->second;
            if (kept.used.load(std::memory_order_relaxed) != now) kept.used.store(now, std::memory_order_relaxed);
            return route_of(it->second);
        }
    }
    // The miss runs Python, which may run another call on this thread (a finalizer): this
    // key is copied first.
    std::vector<int64_t> mine = key;
    SdpaRoute r = miss_sdpa(q, k, v, bias, dropout_p, is_causal, scale, training, deterministic);
    if (!r.ours && q.is_cuda() && capturing(q)) {
        // Not kept: a refusal inside a capture may be a plan not loadable there, which the
        // same call outside a capture loads (as _sdpa_mode._route). This call's own.
        r.calls = nullptr;  // counted in g_unkept_calls
        return std::make_shared<const SdpaRoute>(std::move(r));
    }
    Routes dropped;  // released after the lock (declared before it)
    std::unique_lock<std::shared_mutex> lock(g_routes_lock);
    const uint64_t now = g_route_clock.fetch_add(2, std::memory_order_relaxed) + 1;  // (as table.cpp's g_clock)
    auto fresh = std::make_shared<const KeptRoute>(std::move(r), now);
    auto [it, inserted] = g_routes.try_emplace(std::move(mine), fresh);
    if (inserted) {
        trim_routes(dropped);
    } else {
        dropped.push_back(std::move(fresh));  // the other thread's route stays (the same answer)
    }
    return route_of(it->second);
}

namespace {

// ---- tensors ----------------------------------------------------------------------------------

// bhsd tensors as views in the layout's order (what attention()'s plans read), and back
// (_sdpa_mode._views, _to_bhsd).
// (kAxes: where batch, head, seq, dim sit in a layout's shape; SDPA's own order is the identity.)
constexpr std::array<int, 4> kBhsd = {0, 1, 2, 3};

Tensor to_layout(c10::string_view layout, const Tensor &t) {
    const auto ax = axes(layout);
    if (ax == kBhsd) return t;
    std::array<int64_t, 4> order{};  // the inverse of ax: the layout's dims, outermost first
    for (int64_t d = 0; d < 4; ++d) order[ax[d]] = d;
    return t.permute(order);
}

Tensor to_bhsd(c10::string_view layout, const Tensor &t) {
    const auto ax = axes(layout);
    return ax == kBhsd ? t : t.permute({ax[0], ax[1], ax[2], ax[3]});
}

// t with the strides PyTorch's Meta kernel gave: a view where they differ only on dims of
// extent 1 (the same memory), else a copy (_sdpa_mode._matched).
Tensor matched(const Tensor &t, const std::array<int64_t, 4> &stride) {
    const auto st = t.strides();
    bool same = true, compatible = true;
    for (int d = 0; d < 4; ++d) {
        same = same && st[d] == stride[d];
        compatible = compatible && (st[d] == stride[d] || t.size(d) == 1);
    }
    if (same) return t;
    if (compatible) return t.as_strided(t.sizes(), stride);
    return empty_cuda(t.sizes(), stride, t.scalar_type(), t).copy_(t);
}

// attn_bias as fastattn's bias (_sdpa_mode._bias): broadcast over (b, heads_q, seq_q,
// seq_kv), each broadcast dim of extent 1 except the queries' when training (fastattn has
// no correct backward for a one-row bias), contiguous; a float32 bias rounded to q's dtype
// in the same copy (_bias says why).
OptTensor as_bias(const OptTensor &attn_bias, const Tensor &q, const Tensor &k, bool training) {
    if (!given(attn_bias)) return std::nullopt;
    Tensor m = attn_bias->expand({q.size(0), q.size(1), q.size(2), k.size(2)});
    for (int d = 0; d < 3; ++d) {
        if (m.stride(d) == 0 && m.size(d) > 1 && !(d == 2 && training)) m = m.narrow(d, 0, 1);
    }
    if (m.scalar_type() != q.scalar_type()) {
        return m.to(q.scalar_type(), /*non_blocking=*/false, /*copy=*/false, at::MemoryFormat::Contiguous);
    }
    return m.is_contiguous() ? m : m.contiguous();
}

// Philox's seed and offset when there is no dropout: one 0-d int64 tensor on q's device,
// new for each call (a tensor shared by calls would be saved by every autograd node, and
// one first made inside torch.compile's CUDA-graph warm-up would live in its pool), not
// filled: nothing reads it without dropout, as PyTorch's flash kernels leave theirs.
Tensor no_seed(const Tensor &q) { return empty_cuda({}, {}, at::kLong, q); }

c10::OperatorHandle op(const char *name) { return c10::Dispatcher::singleton().findSchemaOrThrow(name, ""); }

// ---- the kernels ------------------------------------------------------------------------------

constexpr size_t kForwardArgs = 9;    // _sdpa_mode.FORWARD_ARGS
constexpr size_t kBackwardArgs = 16;  // _sdpa_mode.BACKWARD_ARGS

// aten::_scaled_dot_product_cudnn_attention: (output in the query's memory order,
// logsumexp, cum_seq_q, cum_seq_k (undefined), max_q, max_k, philox seed and offset,
// debug mask (undefined)), as PyTorch's kernel returns them.
void forward(const c10::OperatorHandle &, Stack *stack) {
    const auto args = torch::jit::last(*stack, kForwardArgs);
    const Tensor q = args[0].toTensor(), k = args[1].toTensor(), v = args[2].toTensor();
    const OptTensor bias = args[3].toOptional<Tensor>();
    const bool lse = args[4].toBool(), is_causal = args[6].toBool(), debug = args[7].toBool();
    const double dropout_p = args[5].toDouble();
    const std::optional<double> scale = args[8].toOptional<double>();
    // q's device current, as PyTorch's generated CUDA wrappers make it (this kernel
    // replaces one): the route's capture check and Python's read the same device.
    const c10::DeviceGuard device(q.device());
    const auto route = sdpa_route(q, k, v, bias, dropout_p, is_causal, scale, lse, lse && strict_determinism());
    const SdpaRoute &r = *route;
    if (t_counted) {
        // (the composite's call, counted there)
    } else if (r.ours && debug) {
        g_debug_calls.fetch_add(1, std::memory_order_relaxed);
    } else {
        count_call(r);
    }
    if (!r.ours || debug) {
        // aten::_cudnn_attention_forward: the same arguments, with no cumulative lengths
        // after attn_bias and the maximal ones, the tensors' own.
        static const c10::OperatorHandle fallback = op("aten::_cudnn_attention_forward");
        const int64_t max_q = q.size(2), max_k = k.size(2);
        stack->insert(stack->end() - 5, {c10::IValue(), c10::IValue(), c10::IValue(max_q), c10::IValue(max_k)});
        // Arguments a newer torch appends (2.14: seqused_k, block_table) at their defaults,
        // which enable_sdpa() checked every one has: a boxed call takes them all.
        const auto &declared = fallback.schema().arguments();
        for (size_t i = kForwardArgs + 4; i < declared.size(); ++i) {
            stack->push_back(*declared[i].default_value());
        }
        fallback.callBoxed(stack);
        return;
    }
    const c10::string_view layout = r.opt.layout;
    const OptTensor rng = dropout_p > 0 ? OptTensor(at::randint(0, int64_t{1} << 62, {4}, q.options().dtype(at::kLong)))
                                        : std::nullopt;
    auto [o, stats] = dense_forward(to_layout(layout, q), to_layout(layout, k), to_layout(layout, v), std::nullopt,
                                    std::nullopt, as_bias(bias, q, k, lse), std::nullopt, rng, r.opt);
    if (!stats.defined()) {  // inference writes no stats; the operator still returns the tensor
        stats = empty_cuda(r.lse_shape, {}, at::kFloat, q);
    } else if (stats.sizes() != c10::IntArrayRef(r.lse_shape)) {
        stats = stats.view(r.lse_shape);
    }
    const Tensor seed = rng ? rng->select(0, 0) : no_seed(q);
    const Tensor offset = rng ? rng->select(0, 2) : seed;
    const int64_t max_q = q.size(2), max_k = k.size(2);
    torch::jit::drop(*stack, kForwardArgs);
    torch::jit::push(*stack, matched(to_bhsd(layout, o), r.out_stride), stats, Tensor(), Tensor(), max_q, max_k, seed,
                     offset, Tensor());
}

// aten::_scaled_dot_product_cudnn_attention_backward: (d_query, d_key, d_value), from the
// side (fastattn's or PyTorch's) that ran the forward: the same route.
void backward(const c10::OperatorHandle &, Stack *stack) {
    const auto args = torch::jit::last(*stack, kBackwardArgs);
    const Tensor q = args[1].toTensor(), k = args[2].toTensor(), v = args[3].toTensor();
    const Tensor b = args[8].isTensor() ? args[8].toTensor() : Tensor();
    const OptTensor bias = b.defined() && b.numel() > 0 ? OptTensor(b) : std::nullopt;
    const double dropout_p = args[13].toDouble();
    const bool is_causal = args[14].toBool();
    const std::optional<double> scale = args[15].toOptional<double>();
    const c10::DeviceGuard device(q.device());  // (as the forward's)
    // (determinism as required now, at the backward: _sdpa_mode._backward)
    const auto route = sdpa_route(q, k, v, bias, dropout_p, is_causal, scale, true, strict_determinism());
    const SdpaRoute &r = *route;
    if (!r.ours) {
        static const c10::OperatorHandle fallback = op("aten::_cudnn_attention_backward");  // the same arguments
        fallback.callBoxed(stack);
        return;
    }
    const c10::string_view layout = r.opt.layout;
    const Tensor d_o = args[0].toTensor(), o = args[4].toTensor(), lse = args[5].toTensor();
    OptTensor rng;
    if (dropout_p > 0) {  // fastattn's rng tensor: the seed at element 0, the offset at element 2
        const Tensor seed = args[6].toTensor(), offset = args[7].toTensor();
        rng = at::stack({seed, seed, offset, offset}).reshape({4});
    }
    const Tensor stats = lse.reshape({q.size(0), q.size(1), q.size(2), 1});
    auto grads = dense_backward(to_layout(layout, d_o), to_layout(layout, o), stats, to_layout(layout, q),
                                to_layout(layout, k), to_layout(layout, v), std::nullopt, std::nullopt,
                                as_bias(bias, q, k, true), std::nullopt, rng, r.opt);
    torch::jit::drop(*stack, kBackwardArgs);
    torch::jit::push(*stack, matched(to_bhsd(layout, std::get<0>(grads)), r.grad_strides[0]),
                     matched(to_bhsd(layout, std::get<1>(grads)), r.grad_strides[1]),
                     matched(to_bhsd(layout, std::get<2>(grads)), r.grad_strides[2]));
}

// ---- the composite: aten::scaled_dot_product_attention -----------------------------------------

constexpr size_t kCompositeArgs = 8;  // _sdpa_mode.COMPOSITE_ARGS

// early()'s answer for a call whose float mask requires grad (_sdpa_mode.TRAINABLE_MASK):
// PyTorch's cuDNN operator gives no gradient for its attn_bias, so the Python composite
// runs it on fastattn's dense op with the bias gradient (_sdpa_mode._trainable_mask),
// written once there: such calls are few (learned position biases), and each costs one
// call into Python.
constexpr int kPython = -2;

// Which of g_early_reasons hands this call on before a route is asked, kPython, or -1
// where the route decides (_sdpa_mode._early).
int early(const Tensor &q, const Tensor &k, const Tensor &v, const OptTensor &mask, bool enable_gqa) {
    // A route is kept for the shapes and strides of plain tensors (and a trace with
    // symbolic shapes has none to read).
    const auto plain = [&q](const Tensor &t) {
        return t.layout() == c10::kStrided && !t.is_nested() && t.device() == q.device() &&
               !t.unsafeGetTensorImpl()->has_symbolic_sizes_strides();
    };
    if (!plain(q) || !plain(k) || !plain(v) || q.dim() != 4 || k.dim() != 4 || v.dim() != 4 ||
        (given(mask) && !plain(*mask))) {
        return 0;
    }
    bool trainable = false;
    if (given(mask)) {
        const Tensor &m = *mask;
        if (m.dim() < 2 || m.dim() > 4 || (m.scalar_type() != at::kBool && !at::isFloatingType(m.scalar_type()))) {
            return 1;
        }
        const std::array<int64_t, 4> out = {q.size(0), q.size(1), q.size(2), k.size(2)};
        for (int64_t d = 1; d <= m.dim(); ++d) {
            if (m.size(-d) != 1 && m.size(-d) != out[4 - d]) return 1;
        }
        trainable = m.requires_grad() && at::GradMode::is_enabled();
    }
    if (!enable_gqa && k.size(1) != q.size(1)) return 2;
    return trainable ? kPython : -1;
}

// 0 and -inf as 0-d tensors of like's dtype on its device, for at::where (a boolean
// mask's bias): given a CPU 0-d tensor and a scalar beside a CUDA condition, where copied
// both from the host on every call (two pageable host-to-device copies a call, profiled),
// and PyTorch's copy from pageable memory synchronizes the stream, which a CUDA-graph
// capture forbids. Kept per device and dtype, made for a plain tensor outside a capture,
// then read by every call on plain tensors, captured ones too (the values never change):
// - copied from the host once, with that wait: a kept pair is read on any stream, so its
//   values must be on the device before any stream reads them (a fill queued on this
//   stream would not be, for another);
// - the fake and functional tensors torch.compile traces with (a real tensor among them is
//   an error), and a capture before any pair is kept, get a pair made for the call, on its
//   stream (a capture's fill runs at the graph's replays);
// - never destroyed: a static's destructor would free CUDA memory after the runtime's teardown.
std::pair<Tensor, Tensor> zero_and_minus_inf(const Tensor &like) {
    constexpr double kInf = std::numeric_limits<double>::infinity();
    static std::mutex lock;
    using Key = std::tuple<c10::DeviceType, c10::DeviceIndex, c10::ScalarType>;
    static auto *kept = new std::map<Key, std::pair<Tensor, Tensor>>();
    const bool plain = !like.key_set().has_any(
        c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::Functionalize}));
    const Key key{like.device().type(), like.device().index(), like.scalar_type()};
    if (plain) {
        std::lock_guard<std::mutex> guard(lock);
        auto it = kept->find(key);
        if (it != kept->end()) return it->second;
    }
    if (!plain || (like.is_cuda() && capturing(like))) {
        return {at::zeros({}, like.options()), at::full({}, -kInf, like.options())};
    }
    const c10::InferenceMode normal(false);  // (kept, so usable outside inference mode too)
    const auto host = like.options().device(c10::kCPU);
    std::pair<Tensor, Tensor> made{at::zeros({}, host).to(like.device()),
                                   at::full({}, -kInf, host).to(like.device())};
    std::lock_guard<std::mutex> guard(lock);
    return kept->emplace(key, std::move(made)).first->second;
}

// attn_mask as the cuDNN operator's attn_bias: a view of 4 dims; a boolean mask as SDPA
// reads one (0 where True, -inf where False). `empty` (True on the rows that keep no key)
// sets their output to zeros after, as PyTorch's math kernel gives it
// (_sdpa_mode._composite_bias; fastattn.torch.scaled_dot_product_attention's rule,
// _sdpa._as_bias); where the backward runs (lse), such a row is 0 throughout in the bias,
// an ordinary row for the kernel, since the backward would read its -inf logsumexp. A
// float mask's rows of -inf alike. Every step is a kernel on the mask's device: no copy
// from the host, which would wait for the stream (and which a capture refuses).
OptTensor composite_bias(const OptTensor &mask, const Tensor &q, bool lse, Tensor &empty) {
    if (!given(mask)) return std::nullopt;
    constexpr double kInf = std::numeric_limits<double>::infinity();
    Tensor m = *mask;
    while (m.dim() < 4) m = m.unsqueeze(0);
    if (m.scalar_type() != at::kBool) {
        // (amax: one pass over the mask; it refuses a dim of no keys, where every row keeps none)
        empty = m.size(-1) > 0 ? m.amax(-1, /*keepdim=*/true).eq(-kInf)
                               : m.ne(-kInf).any(-1, /*keepdim=*/true).logical_not_();
        return lse ? m.masked_fill(empty, 0.0) : m;
    }
    const Tensor kept = m.any(-1, /*keepdim=*/true);
    empty = kept.logical_not();
    const auto [zero, minus_inf] = zero_and_minus_inf(q);
    // (for the backward, the inner where over one column: the rows keeping no key 0 throughout)
    return at::where(m, zero, lse ? at::where(kept, minus_inf, zero) : minus_inf);
}

// Head dims that are not multiples of 8 padded with zeros to them, as PyTorch's flash
// backend pads them (cuDNN takes multiples of 8 only), the scale kept at the real head
// dim's: zeros add nothing to q . k and give output columns that are cut off (v's real
// head dim, returned; 0 where nothing is padded). _sdpa_mode._padded.
int64_t padded(Tensor &q, Tensor &k, Tensor &v, std::optional<double> &scale) {
    const int64_t d_qk = q.size(-1), d_v = v.size(-1);
    if (d_qk % 8 == 0 && d_v % 8 == 0) return 0;
    if (!scale) scale = 1.0 / std::sqrt(static_cast<double>(d_qk));
    const auto pad = [](const Tensor &t) { return at::constant_pad_nd(t, {0, (8 - t.size(-1) % 8) % 8}); };
    if (d_qk % 8 != 0) q = pad(q), k = pad(k);
    if (d_v % 8 != 0) v = pad(v);
    return d_v;
}

// aten::scaled_dot_product_attention, every backend's entry (registered for the device's
// key and its autograd key): a call fastattn takes runs as the cuDNN operator's call
// through the dispatcher (PyTorch's autograd formula for it; the kernels above), any
// other as PyTorch's own composite (its backend choice, its errors).
void composite(const c10::OperatorHandle &, Stack *stack) {
    const auto args = torch::jit::last(*stack, kCompositeArgs);
    const Tensor q = args[0].toTensor(), k = args[1].toTensor(), v = args[2].toTensor();
    const OptTensor mask = args[3].toOptional<Tensor>();
    const double dropout_p = args[4].toDouble();
    const bool is_causal = args[5].toBool(), enable_gqa = args[7].toBool();
    const std::optional<double> scale = args[6].toOptional<double>();
    // PyTorch's cuDNN backend disabled (an sdpa_kernel context without CUDNN_ATTENTION,
    // enable_cudnn_sdp(False)): the backends the user enabled run the call, as PyTorch's
    // composite would choose among them. First: one read of the process-wide flag.
    at::Context &context = at::globalContext();
    int e = context.userEnabledCuDNNSDP() ? early(q, k, v, mask, enable_gqa) : kCudnnOff;
    if (e == kPython) {
        // (it counts the call itself; below it, nothing counts it again)
        const Counted counted;
        Tensor o = python_composite(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa);
        torch::jit::drop(*stack, kCompositeArgs);
        torch::jit::push(*stack, std::move(o));
        return;
    }
    // PyTorch's composite asks its kernels for the logsumexp only where autograd needs it.
    const bool lse =
        e < 0 && at::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad());
    if (e >= 0) {
        g_early_calls[e].fetch_add(1, std::memory_order_relaxed);
    } else {
        const c10::DeviceGuard device(q.device());  // (as the forward's)
        Tensor qp = q, kp = k, vp = v, empty;
        std::optional<double> s = scale;
        const int64_t head_dim_v = padded(qp, kp, vp, s);
        const OptTensor bias = composite_bias(mask, qp, lse, empty);
        const auto route = sdpa_route(qp, kp, vp, bias, dropout_p, is_causal, s, lse, lse && strict_determinism());
        count_call(*route);
        if (route->ours) {
            if (head_dim_v != 0) g_padded_calls.fetch_add(1, std::memory_order_relaxed);
            static const c10::OperatorHandle cudnn = op("aten::_scaled_dot_product_cudnn_attention");
            Stack call{qp, kp, vp, bias, lse, dropout_p, is_causal, false, s};
            {
                const Counted counted;
                cudnn.callBoxed(&call);
            }
            Tensor o = call[0].toTensor();
            if (head_dim_v != 0) o = o.narrow(-1, 0, head_dim_v);
            // In place where autograd saves nothing (a copy kernel fewer); out of place where
            // the cuDNN operator's backward saves o (_sdpa_mode._composite alike).
            if (empty.defined()) o = lse ? o.masked_fill(empty, 0.0) : o.masked_fill_(empty, 0.0);
            torch::jit::drop(*stack, kCompositeArgs);
            torch::jit::push(*stack, std::move(o));
            return;
        }
    }
    const Counted counted;
    Tensor o = at::native::scaled_dot_product_attention(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa);
    torch::jit::drop(*stack, kCompositeArgs);
    torch::jit::push(*stack, std::move(o));
}

// Holds the two kernels while the mode is on. A plain pointer, not destroyed at exit: a
// static's destructor would deregister from a dispatcher that static destruction may
// already have taken apart (the mode on at exit is the usual case).
torch::Library *g_library = nullptr;
torch::Library *g_autograd_library = nullptr;  // the composite's kernel for the autograd key
std::mutex g_library_lock;

}  // namespace

void set_sdpa_kernels(bool on, c10::DispatchKey key, const std::vector<std::string> &early_reasons) {
    std::lock_guard<std::mutex> guard(g_library_lock);
    if (on && g_library == nullptr) {
        TORCH_CHECK(early_reasons.size() == kEarly, "fastattn: sdpa_kernels: ", kEarly, " early reasons, got ",
                    early_reasons.size());
        std::copy(early_reasons.begin(), early_reasons.end(), g_early_reasons.begin());
        // PyTorch warns that a kernel replaces another for the same key: that is the point.
        struct Quiet : c10::WarningHandler {
            void process(const c10::Warning &) override {}
        } quiet;
        c10::WarningUtils::WarningHandlerGuard silence(&quiet);
        auto library = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", key, __FILE__, __LINE__);
        library->impl("_scaled_dot_product_cudnn_attention", torch::CppFunction::makeFromBoxedFunction<&forward>());
        library->impl("_scaled_dot_product_cudnn_attention_backward",
                      torch::CppFunction::makeFromBoxedFunction<&backward>());
        // The composite for both keys: the autograd key's alone would be passed over in
        // inference mode, and the device key's alone would leave the autograd key without
        // a kernel (the composite fills it only where the device has none).
        library->impl("scaled_dot_product_attention", torch::CppFunction::makeFromBoxedFunction<&composite>());
        const c10::DispatchKey autograd =
            key == c10::DispatchKey::CUDA ? c10::DispatchKey::AutogradCUDA : c10::DispatchKey::AutogradCPU;
        auto grad = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", autograd, __FILE__, __LINE__);
        grad->impl("scaled_dot_product_attention", torch::CppFunction::makeFromBoxedFunction<&composite>());
        g_library = library.release();
        g_autograd_library = grad.release();
    } else if (!on) {
        // The dispatcher falls back to the kernels these replaced, PyTorch's. The routes
        // stay (a call may be running on one): what a signature's route is does not
        // depend on the mode.
        delete g_autograd_library;
        g_autograd_library = nullptr;
        delete g_library;
        g_library = nullptr;
    }
}

size_t sdpa_route_count() {
    std::shared_lock<std::shared_mutex> lock(g_routes_lock);
    return g_routes.size();
}

uint64_t sdpa_route_evictions() { return g_route_evictions.load(std::memory_order_relaxed); }

void zero_sdpa_route_evictions() { g_route_evictions.store(0, std::memory_order_relaxed); }

namespace {

void zero_dropped_and_unkept() {
    {
        std::lock_guard<std::mutex> guard(g_dropped_lock);
        g_dropped_served = 0;
        g_dropped_passed.clear();
    }
    g_unkept_calls = 0;
    g_debug_calls = 0;
    g_padded_calls = 0;
    for (auto &n : g_early_calls) n = 0;
}

}  // namespace

void clear_sdpa_routes() {
    Routes dropped;  // released after the lock (declared before it)
    {
        std::unique_lock<std::shared_mutex> lock(g_routes_lock);
        for (auto &kv : g_routes) {
            kv.second->route.calls->store(0);  // (a call still holding one counts from here)
            dropped.push_back(std::move(kv.second));
        }
        g_routes.clear();
    }
    dropped.clear();
    zero_dropped_and_unkept();
}

std::vector<std::tuple<bool, std::string, uint64_t>> sdpa_calls() {
    std::vector<std::tuple<bool, std::string, uint64_t>> out;
    {
        std::shared_lock<std::shared_mutex> lock(g_routes_lock);
        for (const auto &kv : g_routes) {
            const SdpaRoute &r = kv.second->route;
            out.emplace_back(r.ours, r.reason, r.calls->load());
        }
    }
    {
        std::lock_guard<std::mutex> guard(g_dropped_lock);
        out.emplace_back(true, std::string(), g_dropped_served);
        for (const auto &[reason, n] : g_dropped_passed) out.emplace_back(false, reason, n);
    }
    out.emplace_back(false, kUnkept, g_unkept_calls.load());
    out.emplace_back(false, kDebug, g_debug_calls.load());
    out.emplace_back(true, kPadded, g_padded_calls.load());  // (of the served ones above)
    for (size_t i = 0; i < kEarly; ++i) out.emplace_back(false, g_early_reasons[i], g_early_calls[i].load());
    return out;
}

void zero_sdpa_calls() {
    {
        std::shared_lock<std::shared_mutex> lock(g_routes_lock);
        for (const auto &kv : g_routes) kv.second->route.calls->store(0);
    }
    zero_dropped_and_unkept();
}

}  // namespace fastattn::ops
