// attention_varlen's ops: packed sequences (tokens, heads, dim) with cumulative
// lengths, the C++ twin of the Python executor of fastattn/torch/_specs.py's VARLEN; and
// attention_paged's op: forward against a paged KV cache, the twin of PAGED's. The same plan table,
// run and conventions as attention()'s (dense.cpp). A varlen plan is keyed by the
// tensors' shapes past the token count, their strides, the batch size and the options
// (whose max_q and max_kv are already bucketed by attention_varlen), never by the token
// count. cuDNN has no paged backward, so paged has no autograd: its Autograd key falls
// through (ops.cpp).
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/core/SymInt.h>
#include <torch/csrc/autograd/custom_function.h>

#include <tuple>
#include <vector>

#include "ops.h"

namespace fastattn::ops {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// ---- attention_varlen -------------------------------------------------------------------------
// Its options: FA_VARLEN_PARAMS, _ARGS, _SCHEMA, VarlenOptions (fastattn_options.h).

namespace {

void put_packed(std::vector<int64_t> &key, const Tensor &t) {
    key.push_back(static_cast<int64_t>(t.scalar_type()));
    key.push_back(static_cast<int64_t>(t.device().type()) * 1024 + t.device().index());
    key.push_back(t.dim());
    for (int64_t i = 1; i < t.dim(); ++i) key.push_back(t.size(i));
    for (int64_t s : t.strides()) key.push_back(s);
}

const Entry &find_varlen_plan(int direction, const Tensor &q, const Tensor &k, const Tensor &v, const Tensor &cu_q,
                              const Tensor &cu_kv, const OptTensor &sink, const OptTensor &rng, FA_VARLEN_PARAMS) {
    thread_local std::vector<int64_t> key;
    key.clear();
    key.push_back(kVarlen);
    key.push_back(direction);
    put_packed(key, q);
    put_packed(key, k);
    put_packed(key, v);
    put_tensor(key, cu_q);
    put_tensor(key, cu_kv);
    put_optional(key, sink);
    key.push_back(given(rng));
    const VarlenOptions opt{FA_VARLEN_ARGS};
    FA_VARLEN_WORDS(key, opt);
    return lookup(key, [&] { return miss_varlen(direction, q, k, v, cu_q.size(0) - 1, sink, opt); });
}

// The launch's cumulative lengths (the plan derives cuDNN's lengths and offsets from
// them in its own kernel: _core's csrc/ragged.h) and dropout's Philox seed and offset.
// The index kernel reads them as contiguous int32 arrays of batch + 1 on q's device:
// attention_varlen checks that first, and so does this, for callers of the ops.
void check_cumulative(const Tensor &cu, const char *name, const Tensor &q) {
    TORCH_CHECK_VALUE(cu.scalar_type() == at::kInt && cu.dim() == 1 && cu.is_contiguous() && cu.device() == q.device(),
                      "fastattn: ", name, ": expected a contiguous int32 tensor of batch + 1 cumulative lengths on ",
                      q.device(), ", got ", cu.scalar_type(), " ", cu.sizes(), " strides ", cu.strides(), " on ",
                      cu.device());
}

void put_cumulative(intptr_t *slots, const Tensor &q, const Tensor &cu_q, const Tensor &cu_kv, const OptTensor &sink,
                    const OptTensor &rng) {
    check_cumulative(cu_q, "cu_seqlens_q", q);
    check_cumulative(cu_kv, "cu_seqlens_kv", q);
    TORCH_CHECK_VALUE(cu_q.size(0) == cu_kv.size(0), "fastattn: cu_seqlens_q has ", cu_q.size(0),
                      " entries, cu_seqlens_kv ", cu_kv.size(0));
    slots[FASTATTN_SLOT_CU_SEQLENS_Q]  = ptr(cu_q);
    slots[FASTATTN_SLOT_CU_SEQLENS_KV] = ptr(cu_kv);
    slots[FASTATTN_SLOT_SINK] = ptr(sink);
    if (given(rng)) {  // Philox's seed at element 0, its offset at element 2 (16-byte aligned)
        slots[FASTATTN_SLOT_SEED]   = ptr(rng);
        slots[FASTATTN_SLOT_OFFSET] = ptr(rng) + 16;
    }
}

}  // namespace

std::tuple<Tensor, Tensor> varlen_forward_cuda(const Tensor &q, const Tensor &k, const Tensor &v, const Tensor &cu_q,
                                               const Tensor &cu_kv, const OptTensor &sink, const OptTensor &rng,
                                               FA_VARLEN_PARAMS) {
    const Entry &e = find_varlen_plan(FASTATTN_FORWARD, q, k, v, cu_q, cu_kv, sink, rng, FA_VARLEN_ARGS);
    Tensor o = at::empty({q.size(0), q.size(1), v.size(2)}, q.options());
    Tensor stats = at::empty(training ? std::vector<int64_t>{q.size(0), q.size(1)} : std::vector<int64_t>{0},
                             q.options().dtype(at::kFloat));
    intptr_t slots[FASTATTN_NUM_SLOTS] = {};
    slots[FASTATTN_SLOT_Q] = ptr(q);
    slots[FASTATTN_SLOT_K] = ptr(k);
    slots[FASTATTN_SLOT_V] = ptr(v);
    slots[FASTATTN_SLOT_O] = ptr(o);
    slots[FASTATTN_SLOT_STATS] = training ? ptr(stats) : 0;
    put_cumulative(slots, q, cu_q, cu_kv, sink, rng);
    run(e, FASTATTN_FORWARD, q, slots);
    return {o, stats};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> varlen_backward_cuda(const Tensor &d_o_in, const Tensor &o,
                                                                const Tensor &stats, const Tensor &q, const Tensor &k,
                                                                const Tensor &v, const Tensor &cu_q,
                                                                const Tensor &cu_kv, const OptTensor &sink,
                                                                const OptTensor &rng, FA_VARLEN_PARAMS) {
    const Tensor d_o = d_o_in.contiguous();  // the plan reads d_o at o's (packed) strides
    const Entry &e = find_varlen_plan(FASTATTN_BACKWARD, q, k, v, cu_q, cu_kv, sink, rng, FA_VARLEN_ARGS);
    Tensor d_q = at::empty_like(q), d_k = at::empty_like(k), d_v = at::empty_like(v);
    Tensor d_sink = d_sink_like(sink, q);
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
    if (given(sink)) slots[FASTATTN_SLOT_DSINK] = ptr(d_sink);
    put_cumulative(slots, q, cu_q, cu_kv, sink, rng);
    run(e, FASTATTN_BACKWARD, q, slots);
    return {d_q, d_k, d_v, d_sink};
}

std::tuple<Tensor, Tensor> varlen_forward_meta(const Tensor &q, const Tensor &, const Tensor &v, const Tensor &,
                                               const Tensor &, const OptTensor &, const OptTensor &,
                                               FA_VARLEN_PARAMS) {
    std::vector<c10::SymInt> stats{0};
    if (training) stats = {q.sym_size(0), q.sym_size(1)};
    return {at::empty_symint({q.sym_size(0), q.sym_size(1), v.sym_size(2)}, q.options()),
            at::empty_symint(stats, q.options().dtype(at::kFloat))};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> varlen_backward_meta(const Tensor &, const Tensor &, const Tensor &,
                                                                const Tensor &q, const Tensor &k, const Tensor &v,
                                                                const Tensor &, const Tensor &, const OptTensor &sink,
                                                                const OptTensor &, FA_VARLEN_PARAMS) {
    return {at::empty_like(q), at::empty_like(k), at::empty_like(v),
            d_sink_like(sink, q)};
}

std::tuple<Tensor, Tensor> varlen_forward_cpu(const Tensor &q, const Tensor &, const Tensor &, const Tensor &,
                                              const Tensor &, const OptTensor &, const OptTensor &, FA_VARLEN_PARAMS) {
    cpu_error(q);
}

std::tuple<Tensor, Tensor, Tensor, Tensor> varlen_backward_cpu(const Tensor &, const Tensor &, const Tensor &,
                                                               const Tensor &q, const Tensor &, const Tensor &,
                                                               const Tensor &, const Tensor &, const OptTensor &,
                                                               const OptTensor &, FA_VARLEN_PARAMS) {
    cpu_error(q);
}

namespace {

// The C++ twin of _varlen.RULE: gradients for q, k, v and the sinks; none for cu_q, cu_kv,
// rng and the options.
struct VarlenFunction : torch::autograd::Function<VarlenFunction> {
    static constexpr size_t kTensors = 7;  // q, k, v, cu_q, cu_kv, sink, rng

    static variable_list forward(AutogradContext *ctx, const Tensor &q, const Tensor &k, const Tensor &v,
                                 const Tensor &cu_q, const Tensor &cu_kv, const OptTensor &sink, const OptTensor &rng,
                                 FA_VARLEN_PARAMS) {
        at::AutoDispatchBelowADInplaceOrView below;
        static const auto op = c10::Dispatcher::singleton()
                                   .findSchemaOrThrow("fastattn::native_varlen_forward", "")
                                   .typed<decltype(varlen_forward_cuda)>();
        auto [o, stats] = op.call(q, k, v, cu_q, cu_kv, sink, rng, FA_VARLEN_ARGS);
        ctx->save_for_backward({q, k, v, o, stats, cu_q, cu_kv, rng.value_or(Tensor()), sink.value_or(Tensor())});
        const VarlenOptions opt{FA_VARLEN_ARGS};
        FA_VARLEN_SAVE(ctx->saved_data, opt);
        ctx->mark_non_differentiable({stats});
        ctx->set_materialize_grads(false);  // as DenseBackward: no zeros for stats' gradient
        return {o, stats};
    }

    static variable_list backward(AutogradContext *ctx, variable_list grads) {
        const VarlenOptions opt = FA_VARLEN_LOAD(ctx->saved_data);
        TORCH_CHECK(opt.training, "fastattn: backward through a call made without gradients enabled");
        if (!grads[0].defined()) return variable_list(kTensors + FA_VARLEN_COUNT);
        const auto s = ctx->get_saved_variables();
        at::AutoDispatchBelowADInplaceOrView below;
        static const auto op = c10::Dispatcher::singleton()
                                   .findSchemaOrThrow("fastattn::native_varlen_backward", "")
                                   .typed<decltype(varlen_backward_cuda)>();
        const OptTensor sink = saved(s[8]);
        auto [d_q, d_k, d_v, d_sink] = op.call(grads[0], s[3], s[4], s[0], s[1], s[2], s[5], s[6], sink, saved(s[7]),
                                               FA_VARLEN_OF(opt));
        variable_list out(kTensors + FA_VARLEN_COUNT);  // the tensors, then the options
        out[0] = d_q;
        out[1] = d_k;
        out[2] = d_v;
        if (given(sink)) out[5] = d_sink;
        return out;
    }
};

}  // namespace

std::tuple<Tensor, Tensor> varlen_forward_autograd(const Tensor &q, const Tensor &k, const Tensor &v,
                                                   const Tensor &cu_q, const Tensor &cu_kv, const OptTensor &sink,
                                                   const OptTensor &rng, FA_VARLEN_PARAMS) {
    if (!training) {
        at::AutoDispatchBelowADInplaceOrView below;
        static const auto op = c10::Dispatcher::singleton()
                                   .findSchemaOrThrow("fastattn::native_varlen_forward", "")
                                   .typed<decltype(varlen_forward_cuda)>();
        return op.call(q, k, v, cu_q, cu_kv, sink, rng, FA_VARLEN_ARGS);
    }
    auto out = VarlenFunction::apply(q, k, v, cu_q, cu_kv, sink, rng, FA_VARLEN_ARGS);
    return {out[0], out[1]};
}

// ---- attention_paged ---------------------------------------------------------------------------
// Its options: FA_PAGED_PARAMS, _ARGS, _SCHEMA, PagedOptions (fastattn_options.h).

Tensor paged_forward_cuda(const Tensor &q, const Tensor &k_cache, const Tensor &v_cache, const Tensor &table,
                          const Tensor &cache_seqlens, const OptTensor &seq_lens_q, FA_PAGED_PARAMS) {
    thread_local std::vector<int64_t> key;  // everything _paged.plan_for's key holds
    key.clear();
    key.push_back(kPaged);
    key.push_back(FASTATTN_FORWARD);
    put_tensor(key, q);
    put_tensor(key, k_cache);
    put_tensor(key, v_cache);
    put_tensor(key, table);
    put_tensor(key, cache_seqlens);
    put_optional(key, seq_lens_q);
    const PagedOptions opt{FA_PAGED_ARGS};
    FA_PAGED_WORDS(key, opt);
    const Entry &e =
        lookup(key, [&] { return miss_paged(q, k_cache, v_cache, table, seq_lens_q, cache_seqlens, opt); });
    std::vector<int64_t> shape(q.sizes().begin(), q.sizes().end());
    shape[3] = v_cache.size(3);
    // Rows past a query length are zero (see forward_cuda). Without lengths, every
    // query counts: a tensor of seqlen_q per sequence (made per call, so that one made
    // inside a CUDA graph capture is filled by the graph itself).
    Tensor o = given(seq_lens_q) ? at::zeros(shape, q.options()) : at::empty(shape, q.options());
    Tensor lengths = given(seq_lens_q) ? *seq_lens_q : at::full({q.size(0)}, q.size(1), q.options().dtype(at::kInt));
    intptr_t slots[FASTATTN_NUM_SLOTS] = {};
    slots[FASTATTN_SLOT_Q] = ptr(q);
    slots[FASTATTN_SLOT_K] = ptr(k_cache);
    slots[FASTATTN_SLOT_V] = ptr(v_cache);
    slots[FASTATTN_SLOT_O] = ptr(o);
    slots[FASTATTN_SLOT_SEQ_LEN_Q] = ptr(lengths);
    slots[FASTATTN_SLOT_SEQ_LEN_KV] = ptr(cache_seqlens);
    slots[FASTATTN_SLOT_PAGE_TABLE_K] = ptr(table);
    slots[FASTATTN_SLOT_PAGE_TABLE_V] = ptr(table);
    run(e, FASTATTN_FORWARD, q, slots);
    return o;
}

Tensor paged_forward_meta(const Tensor &q, const Tensor &, const Tensor &v_cache, const Tensor &, const Tensor &,
                          const OptTensor &, FA_PAGED_PARAMS) {
    std::vector<c10::SymInt> shape(q.sym_sizes().begin(), q.sym_sizes().end());
    shape[3] = v_cache.sym_size(3);
    return at::empty_symint(shape, q.options());
}

Tensor paged_forward_cpu(const Tensor &q, const Tensor &, const Tensor &, const Tensor &, const Tensor &,
                         const OptTensor &, FA_PAGED_PARAMS) {
    cpu_error(q);
}

}  // namespace fastattn::ops
