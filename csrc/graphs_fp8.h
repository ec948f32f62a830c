// Config -> cudnn-frontend FP8 graph (dtype fp8_e4m3 / fp8_e5m2): sdpa_fp8 forward and
// sdpa_fp8_backward, with their per-tensor float32 descales, scales and amaxes as
// slots, over graphs.h's make_common, apply_mask, apply_features and apply_paging.
// Includes cudnn-frontend: for attention.cpp alone.
//
// cuDNN decides what combines with FP8 (masks, windows, GQA, padding, ragged, paged,
// dropout, sinks, output dtypes): these builders pass every feature the frontend's FP8
// attributes can carry and let validate / check_support give cuDNN's reason. Only what
// the frontend's FP8 backward attributes cannot express at all is refused here, with
// that reason, since building without it would compute a different function.

#pragma once

#include <cudnn_frontend.h>

#include <memory>
#include <stdexcept>
#include <string>

#include "fastattn.h"
#include "graphs.h"
#include "slots.h"

namespace fastattn::detail {

// A per-tensor float32 scalar, (1, 1, 1, 1): a descale or scale input.
inline TensorPtr fp8_scalar(fe::graph::Graph &g, Slot slot) {
    auto t = input(g, slot, {1, 1, 1, 1}, {1, 1, 1, 1});
    t->set_data_type(fe::DataType_t::FLOAT);
    return t;
}

// An amax output: the largest |value| of a tensor before its scale, float32 (1, 1, 1, 1).
inline void set_amax_output(const TensorPtr &t, Slot slot) {
    set_output(t, slot, {1, 1, 1, 1}, {1, 1, 1, 1});
    t->set_data_type(fe::DataType_t::FLOAT);
}

// Thrown inside make_graph, which build_graph guards as "not supported".
[[noreturn]] inline void refuse(const std::string &why) { throw std::invalid_argument(why); }

// sdpa_fp8 has no score modifier (graphs.h's score_modifier): an option that needs one
// is refused by name, never built without it.
inline void refuse_score_modifier(const Config &c) {
    if (const char *option = score_modifier(c)) {
        refuse(std::string(option) + ": fastattn's FP8 graphs (cudnn-frontend's sdpa_fp8) take no score modifier");
    }
}

inline std::shared_ptr<fe::graph::Graph> make_fp8_forward_graph(const Config &c) {
    refuse_score_modifier(c);
    Common m = make_common(c);
    auto &g  = *m.g;
    auto a   = fe::graph::SDPA_fp8_attributes()
                 .set_name("sdpa_fp8")
                 .set_generate_stats(c.training)
                 .set_attn_scale(c.scale);
    // sdpa_fp8 assumes e4m3 inputs unless told; the attribute has no public setter in
    // 1.28 (SDPA_fp8_attributes is SDPA_attributes with this mode), so e5m2 inputs
    // must name their type here or run e4m3 kernels on e5m2 bits.
    if (c.dtype == DType::kFp8E5m2) a._set_mma_core_mode(fe::DataType_t::FP8_E5M2);
    apply_mask(c, a);
    apply_features(c, m, a);
    apply_paging(c, g, a);
    auto descale_q = fp8_scalar(g, kSlotDescaleQ);
    auto descale_k = fp8_scalar(g, kSlotDescaleK);
    auto descale_v = fp8_scalar(g, kSlotDescaleV);
    auto descale_s = fp8_scalar(g, kSlotDescaleS);
    auto scale_s   = fp8_scalar(g, kSlotScaleS);
    auto scale_o   = fp8_scalar(g, kSlotScaleO);
    auto [o, stats, amax_s, amax_o] =
        g.sdpa_fp8(m.q, m.k, m.v, descale_q, descale_k, descale_v, descale_s, scale_s, scale_o, a);
    set_output(o, kSlotO, m.o_dims, strides(c.o_stride));
    o->set_data_type(fe_type(c.out_dtype));
    if (c.ragged) o->set_ragged_offset(m.ragged[3]);
    if (c.training) {
        set_output(stats, kSlotStats, m.s_dims, m.s_strides);
        stats->set_data_type(fe::DataType_t::FLOAT);
        if (c.ragged) stats->set_ragged_offset(m.ragged_stats);
    }
    set_amax_output(amax_s, kSlotAmaxS);
    set_amax_output(amax_o, kSlotAmaxO);
    return m.g;
}

inline std::shared_ptr<fe::graph::Graph> make_fp8_backward_graph(const Config &c) {
    refuse_score_modifier(c);
    // SDPA_fp8_backward_attributes (1.28) has no ALiBi, no d_bias output and no
    // max_total_seq_len: a graph without them would be another function.
    if (c.alibi) refuse("sdpa_fp8_backward (cudnn-frontend 1.28) takes no ALiBi mask");
    if (c.bias_grad) refuse("sdpa_fp8_backward (cudnn-frontend 1.28) writes no bias gradient (d_bias)");
    Common m         = make_common(c);
    auto &g          = *m.g;
    const auto grad  = fe_type(c.grad_dtype);
    auto o           = input(g, kSlotO, m.o_dims, strides(c.o_stride));
    auto d_o         = input(g, kSlotDO, m.o_dims, strides(c.o_stride));
    auto stats       = input(g, kSlotStats, m.s_dims, m.s_strides);
    o->set_data_type(fe_type(c.out_dtype));
    d_o->set_data_type(grad);
    stats->set_data_type(fe::DataType_t::FLOAT);
    if (c.ragged) {
        o->set_ragged_offset(m.ragged[3]);
        d_o->set_ragged_offset(m.ragged[3]);
        stats->set_ragged_offset(m.ragged_stats);
    }
    auto a = fe::graph::SDPA_fp8_backward_attributes()
                 .set_name("sdpa_fp8_backward")
                 .set_attn_scale(c.scale)
                 .set_deterministic_algorithm(c.deterministic);
    apply_mask(c, a);
    if (c.padding) a.set_padding_mask(true).set_seq_len_q(m.seq_len_q).set_seq_len_kv(m.seq_len_kv);
    if (m.bias) a.set_bias(m.bias);
    if (m.seed) a.set_dropout(c.dropout, m.seed, m.offset);
    if (m.sink) {
        auto d_sink = input(g, kSlotDSink, m.sink_dims, m.sink_strides);
        d_sink->set_data_type(fe::DataType_t::FLOAT);
        a.set_sink_token(m.sink).set_dsink_token(d_sink);
    }
    auto descale_q  = fp8_scalar(g, kSlotDescaleQ);
    auto descale_k  = fp8_scalar(g, kSlotDescaleK);
    auto descale_v  = fp8_scalar(g, kSlotDescaleV);
    auto descale_o  = fp8_scalar(g, kSlotDescaleO);
    auto descale_do = fp8_scalar(g, kSlotDescaleDO);
    auto descale_s  = fp8_scalar(g, kSlotDescaleS);
    auto descale_dp = fp8_scalar(g, kSlotDescaleDP);
    auto scale_s    = fp8_scalar(g, kSlotScaleS);
    auto scale_dq   = fp8_scalar(g, kSlotScaleDQ);
    auto scale_dk   = fp8_scalar(g, kSlotScaleDK);
    auto scale_dv   = fp8_scalar(g, kSlotScaleDV);
    auto scale_dp   = fp8_scalar(g, kSlotScaleDP);
    auto [d_q, d_k, d_v, amax_dq, amax_dk, amax_dv, amax_dp] =
        g.sdpa_fp8_backward(m.q, m.k, m.v, o, d_o, stats, descale_q, descale_k, descale_v, descale_o, descale_do,
                            descale_s, descale_dp, scale_s, scale_dq, scale_dk, scale_dv, scale_dp, a);
    set_output(d_q, kSlotDQ, m.q_dims, strides(c.q_stride));
    set_output(d_k, kSlotDK, m.k_dims, strides(c.k_stride));
    set_output(d_v, kSlotDV, m.v_dims, strides(c.v_stride));
    for (const auto &t : {d_q, d_k, d_v}) t->set_data_type(grad);
    if (c.ragged) {
        d_q->set_ragged_offset(m.ragged[0]);
        d_k->set_ragged_offset(m.ragged[1]);
        d_v->set_ragged_offset(m.ragged[2]);
    }
    set_amax_output(amax_dq, kSlotAmaxDQ);
    set_amax_output(amax_dk, kSlotAmaxDK);
    set_amax_output(amax_dv, kSlotAmaxDV);
    set_amax_output(amax_dp, kSlotAmaxDP);
    return m.g;
}

}  // namespace fastattn::detail
