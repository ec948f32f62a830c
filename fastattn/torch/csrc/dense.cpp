// attention()'s kernels: the work on CUDA (a plan from the table, outputs, the launch),
// the shapes on Meta (torch.compile's fake tensors), an error on CPU, and its autograd
// node, DenseBackward, shared by the eager entry (eager.cpp) and the Autograd kernel.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/zeros.h>
#include <c10/core/SymInt.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <array>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "ops.h"

namespace fastattn::ops {

using torch::autograd::variable_list;

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
    return lookup(key, [&] { return miss_dense(direction, q, k, v, o, seq_len_q, seq_len_kv, bias, sink, opt); });
}

std::array<int64_t, 4> out_shape(const Tensor &q, const Tensor &v, const std::array<int, 4> &ax) {
    const auto qs = q.sizes();
    std::array<int64_t, 4> shape{qs[0], qs[1], qs[2], qs[3]};
    shape[ax[3]] = v.size(ax[3]);
    return shape;
}

namespace {

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

}  // namespace

// stats undefined when not training: the op's kernel, forward_cuda, returns an empty
// tensor in its place (a schema's Tensor is defined).
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

namespace {

Tensor like(const Tensor &t) { return empty_cuda(t.sizes(), t.strides(), t.scalar_type(), t); }

}  // namespace

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

namespace {
Tensor like_meta(const Tensor &t) { return at::empty_strided_symint(t.sym_sizes(), t.sym_strides(), t.options()); }
}  // namespace

Tensor d_sink_like(const OptTensor &sink, const Tensor &q) {
    return given(sink) ? at::empty_like(*sink) : at::empty({0}, q.options().dtype(at::kFloat));
}

Grads backward_meta(const Tensor &, const Tensor &, const Tensor &, const Tensor &q, const Tensor &k, const Tensor &v,
                    const OptTensor &, const OptTensor &, const OptTensor &bias, const OptTensor &sink,
                    const OptTensor &, FA_DENSE_PARAMS) {
    return {like_meta(q), like_meta(k), like_meta(v),
            bias_grad ? at::empty_like(*bias, at::MemoryFormat::Contiguous) : at::empty({0}, q.options()),
            d_sink_like(sink, q)};
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

[[noreturn]] void cpu_error(const Tensor &q) {
    TORCH_CHECK_VALUE(false, "fastattn: q is on ", q.device(), ": fastattn runs on CUDA tensors");
}

// ---- autograd ---------------------------------------------------------------------------------
// attention()'s autograd in C++: one definition for the eager entry (eager.cpp) and the
// Autograd kernel of fastattn::native_attention_forward (the custom op's calls:
// torch.ops, torch.compile).
//
// A torch::autograd::Node of its own, as PyTorch's generated ops have (its cuDNN
// attention's is ScaledDotProductCudnnAttentionBackward0), not a
// torch::autograd::Function: a Function packs its inputs into a variable list, keeps
// the options in a string-keyed map of IValues and wraps its outputs generically on
// every forward, and unpacks all of that again in backward. This node holds its saved
// tensors and options as members. What a Function gave for free is kept: SavedVariable
// (the "modified by an inplace operation" check, saved-tensor hooks, a second backward
// refused after the graph was freed), undefined gradients where none flows.

namespace {

Grads call_backward(const Tensor &d_o, const Tensor &o, const Tensor &stats, const Tensor &q, const Tensor &k,
                    const Tensor &v, const OptTensor &seq_len_q, const OptTensor &seq_len_kv, const OptTensor &bias,
                    const OptTensor &sink, const OptTensor &rng, FA_DENSE_PARAMS) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("fastattn::native_attention_backward", "")
                               .typed<decltype(backward_cuda)>();
    return op.call(d_o, o, stats, q, k, v, seq_len_q, seq_len_kv, bias, sink, rng, FA_DENSE_ARGS);
}

std::tuple<Tensor, Tensor> call_forward(const Tensor &q, const Tensor &k, const Tensor &v, const OptTensor &seq_len_q,
                                        const OptTensor &seq_len_kv, const OptTensor &bias, const OptTensor &sink,
                                        const OptTensor &rng, FA_DENSE_PARAMS) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("fastattn::native_attention_forward", "")
                               .typed<decltype(forward_cuda)>();
    return op.call(q, k, v, seq_len_q, seq_len_kv, bias, sink, rng, FA_DENSE_ARGS);
}

using torch::autograd::SavedVariable;
// How torch owns nodes: std::shared_ptr<Node> up to 2.12, c10::intrusive_ptr<Node> since.
using NodePtr = decltype(std::declval<torch::autograd::Node &>().getptr());

template <class T>
void delete_node(T *node) {
    deleteNode(node);  // torch::autograd::deleteNode (found by ADL; only torch's with shared_ptr nodes has it)
}

template <class T>
auto new_node() {
    if constexpr (std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>) {
        // As torch's own: deleteNode frees a long chain of nodes without deep recursion.
        return std::shared_ptr<T>(new T(), [](T *node) { delete_node(node); });
    } else {
        return c10::make_intrusive<T>();
    }
}

struct DenseBackward final : torch::autograd::Node {
    enum Edge { kQ, kK, kV, kBias, kSink, kEdges };  // its next edges: the differentiable inputs

    std::string name() const override { return "fastattn::DenseBackward"; }

    void release_variables() override {
        std::lock_guard<std::mutex> lock(mutex_);
        for (SavedVariable *s : {&q, &k, &v, &o, &stats, &seq_len_q, &seq_len_kv, &bias, &sink, &rng}) s->reset_data();
    }

    variable_list apply(variable_list &&grads) override {
        std::lock_guard<std::mutex> lock(mutex_);  // as torch's generated nodes: saved tensors are shared state
        variable_list out(kEdges);
        if (!grads[0].defined()) return out;  // o unused: no gradient flows
        const Tensor q_ = q.unpack(), k_ = k.unpack(), v_ = v.unpack(), o_ = o.unpack(getptr());
        const Tensor stats_ = stats.unpack();
        const OptTensor seq_len_q_ = saved(seq_len_q.unpack()), seq_len_kv_ = saved(seq_len_kv.unpack()),
                        bias_ = saved(bias.unpack()), sink_ = saved(sink.unpack()), rng_ = saved(rng.unpack());
        at::AutoDispatchBelowADInplaceOrView below;
        auto [d_q, d_k, d_v, d_bias, d_sink] = (direct ? backward_work : call_backward)(
            grads[0], o_, stats_, q_, k_, v_, seq_len_q_, seq_len_kv_, bias_, sink_, rng_, FA_DENSE_OF(opt));
        out[kQ] = d_q;
        out[kK] = d_k;
        out[kV] = d_v;
        if (opt.bias_grad) out[kBias] = d_bias;
        if (given(sink_)) out[kSink] = d_sink;
        return out;
    }

    SavedVariable q, k, v, o, stats, seq_len_q, seq_len_kv, bias, sink, rng;
    DenseOptions opt{};      // layout points at kLayouts: static, unlike the caller's string
    bool direct = false;  // backward_work itself (the eager entry's calls), else the op through the dispatcher
};

}  // namespace

// The node and its next edges, the work (direct: the eager entry's plain CUDA tensors,
// forward_work itself; else the op below Autograd, which fake tensors under
// torch.compile take to Meta), o's history, what backward needs.
std::tuple<Tensor, Tensor> forward_recorded(bool direct, const Tensor &q, const Tensor &k, const Tensor &v,
                                            const OptTensor &seq_len_q, const OptTensor &seq_len_kv,
                                            const OptTensor &bias, const OptTensor &sink, const OptTensor &rng,
                                            const DenseOptions &opt) {
    auto node = new_node<DenseBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(q, k, v, bias, sink));
    Tensor o, stats;
    {
        at::AutoDispatchBelowADInplaceOrView below;
        std::tie(o, stats) = (direct ? forward_work : call_forward)(q, k, v, seq_len_q, seq_len_kv, bias, sink, rng,
                                                                    FA_DENSE_OF(opt));
    }
    const NodePtr base = node;
    torch::autograd::set_history(o, base);  // stats: not differentiable, no history
    node->q = SavedVariable(q, false);
    node->k = SavedVariable(k, false);
    node->v = SavedVariable(v, false);
    node->o = SavedVariable(o, true);
    node->stats = SavedVariable(stats, false);
    node->seq_len_q = SavedVariable(seq_len_q.value_or(Tensor()), false);
    node->seq_len_kv = SavedVariable(seq_len_kv.value_or(Tensor()), false);
    node->bias = SavedVariable(bias.value_or(Tensor()), false);
    node->sink = SavedVariable(sink.value_or(Tensor()), false);
    node->rng = SavedVariable(rng.value_or(Tensor()), false);
    node->opt = opt;
    node->opt.layout = kLayouts[layout_id(opt.layout)];
    node->opt.training = true;
    node->direct = direct;
    return {o, stats};
}

// The Autograd kernel of fastattn::native_attention_forward.
std::tuple<Tensor, Tensor> forward_autograd(const Tensor &q, const Tensor &k, const Tensor &v,
                                            const OptTensor &seq_len_q, const OptTensor &seq_len_kv,
                                            const OptTensor &bias, const OptTensor &sink, const OptTensor &rng,
                                            FA_DENSE_PARAMS) {
    if (training && torch::autograd::compute_requires_grad(q, k, v, bias, sink)) {
        return forward_recorded(false, q, k, v, seq_len_q, seq_len_kv, bias, sink, rng, DenseOptions{FA_DENSE_ARGS});
    }
    // No node: inference, or no input wants a gradient. Nothing saved; straight to the kernel.
    at::AutoDispatchBelowADInplaceOrView below;
    return call_forward(q, k, v, seq_len_q, seq_len_kv, bias, sink, rng, FA_DENSE_ARGS);
}

}  // namespace fastattn::ops
