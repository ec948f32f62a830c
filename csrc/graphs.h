// Config -> cudnn-frontend graph, forward and backward: the 16-bit builders
// (make_forward_graph, make_backward_graph over make_common) and the pieces the FP8 ones
// (graphs_fp8.h) share; attention.cpp's make_graph picks between them. Includes
// cudnn-frontend: for attention.cpp alone (the one translation unit that does).
#pragma once

#include <cudnn_frontend.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

#include "fastattn.h"
#include "slots.h"

namespace fastattn::detail {

namespace fe = cudnn_frontend;

inline std::vector<int64_t> strides(const int64_t s[4]) { return {s[0], s[1], s[2], s[3]}; }

inline fe::DataType_t fe_type(DType t) {
    switch (t) {
        case DType::kBf16: return fe::DataType_t::BFLOAT16;
        case DType::kFp8E4m3: return fe::DataType_t::FP8_E4M3;
        case DType::kFp8E5m2: return fe::DataType_t::FP8_E5M2;
        default: return fe::DataType_t::HALF;
    }
}

using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

inline TensorPtr input(fe::graph::Graph &g, Slot slot, std::vector<int64_t> dims, std::vector<int64_t> stride) {
    return g.tensor(fe::graph::Tensor_attributes()
                        .set_name(kSlots[slot].name)
                        .set_uid(uid(slot))
                        .set_dim(dims)
                        .set_stride(stride));
}

// Per-sequence lengths and ragged offsets: int32 columns of n entries.
inline TensorPtr index_input(fe::graph::Graph &g, Slot slot, int64_t n) {
    auto t = input(g, slot, {n, 1, 1, 1}, {1, 1, 1, 1});
    t->set_data_type(fe::DataType_t::INT32);
    return t;
}

inline void set_output(const TensorPtr &t, Slot slot, std::vector<int64_t> dims, std::vector<int64_t> stride) {
    t->set_output(true).set_name(kSlots[slot].name).set_uid(uid(slot)).set_dim(dims).set_stride(stride);
}

// The keys a query sees, as the causal mask and the window bound them (the config's
// rule, AttentionConfig's docstring), in the frontend's convention: its left bound
// counts the diagonal (it keeps keys j > i - left), the config's does not. The one
// reading of that rule, for the attributes (apply_mask) and the softcap modifier.
struct Band {
    fe::DiagonalAlignment_t alignment;
    std::optional<int64_t> left, right;  // unset: unbounded on that side
};

inline Band band(const Config &c) {
    const bool bottom_right = c.bottom_right || c.mask == Mask::kCausalBottomRight;
    Band b{bottom_right ? fe::DiagonalAlignment_t::BOTTOM_RIGHT : fe::DiagonalAlignment_t::TOP_LEFT, {}, {}};
    if (c.mask != Mask::kNone) {
        b.right = 0;
    } else if (c.window_right >= 0) {
        b.right = c.window_right;
    }
    if (c.window_left >= 0) b.left = c.window_left + 1;
    return b;
}

// The band as the attributes' mask, shared by both directions. The alignment is set only
// where a bound uses it, and top left (the frontend's default) only where it was set
// before the alignment field existed, so that the graphs of existing configs stay what
// they were.
template <class Attributes>
void apply_mask(const Config &c, Attributes &a) {
    const Band b = band(c);
    if (b.right || (b.left && b.alignment == fe::DiagonalAlignment_t::BOTTOM_RIGHT)) {
        a.set_diagonal_alignment(b.alignment);
    }
    if (b.right) a.set_diagonal_band_right_bound(static_cast<int>(*b.right));
    if (b.left) a.set_diagonal_band_left_bound(static_cast<int>(*b.left));
}

// What both directions' graphs share: the io types, q, k, v, the shapes and the
// feature inputs (lengths, offsets, bias, dropout, sinks) with their tensors.
struct Common {
    std::shared_ptr<fe::graph::Graph> g;
    std::vector<int64_t> q_dims, k_dims, v_dims, o_dims, s_dims, s_strides, b_dims, b_strides;
    std::vector<int64_t> sink_dims, sink_strides;
    TensorPtr q, k, v, seq_len_q, seq_len_kv, ragged[4], ragged_stats, bias, seed, offset, sink;
};

// The GPU a graph is built for when it is not this process's (attention.cpp's
// build_graph_for), set on one thread for one build. The graph builders take what the
// graph computes (a Config); where it is built is not part of that. Set before any node
// is added: each node copies the graph's context (its SM version) when it is made.
struct Target {
    std::shared_ptr<const fe::DeviceProperties> properties;
    int32_t sm_version = 0;
};
inline thread_local const Target *t_target = nullptr;

inline Common make_common(const Config &c) {
    Common m;
    m.g = std::make_shared<fe::graph::Graph>();
    auto &g = *m.g;
    if (t_target != nullptr) g.set_device_properties(t_target->properties).set_sm_version(t_target->sm_version);
    g.set_io_data_type(fe_type(c.dtype))
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    // (cudnn-frontend refuses it below cuDNN 9.21 with its reason: the probe's answer there)
    if (c.shape_override) g.set_override_shape_enabled(true);

    // A paged k or v is a pool of pages; the page tables say which hold a sequence.
    const int64_t kv_batch = c.page_size > 0 ? c.num_pages : c.batch;
    const int64_t kv_seq   = c.page_size > 0 ? c.page_size : c.seqlen_kv;
    m.q_dims = {c.batch, c.heads_q, c.seqlen_q, c.head_dim_qk};
    m.k_dims = {kv_batch, c.heads_kv, kv_seq, c.head_dim_qk};
    m.v_dims = {kv_batch, c.heads_kv, kv_seq, c.head_dim_v};
    m.o_dims = {c.batch, c.heads_q, c.seqlen_q, c.head_dim_v};
    m.s_dims = {c.batch, c.heads_q, c.seqlen_q, 1};
    // Packed sequences pack their stats too: (tokens, heads), each sequence at its offset.
    m.s_strides = c.ragged ? std::vector<int64_t>{c.heads_q * c.seqlen_q, 1, c.heads_q, 1}
                           : std::vector<int64_t>{c.heads_q * c.seqlen_q, c.seqlen_q, 1, 1};
    // A bias of one row (bias_seq_q 1, a key-padding bias) broadcasts over the queries.
    const int64_t bias_rows = c.bias_seq_q > 0 ? c.bias_seq_q : c.seqlen_q;
    m.b_dims    = {c.bias_batch, c.bias_heads, bias_rows, c.seqlen_kv};
    m.b_strides = {c.bias_heads * bias_rows * c.seqlen_kv, bias_rows * c.seqlen_kv, c.seqlen_kv, 1};
    m.sink_dims = {1, c.heads_q, 1, 1};
    m.sink_strides = {c.heads_q, 1, 1, 1};

    m.q = input(g, kSlotQ, m.q_dims, strides(c.q_stride));
    m.k = input(g, kSlotK, m.k_dims, strides(c.k_stride));
    m.v = input(g, kSlotV, m.v_dims, strides(c.v_stride));
    if (c.padding || c.full_lengths) {
        m.seq_len_q  = index_input(g, kSlotSeqLenQ, c.batch);
        m.seq_len_kv = index_input(g, kSlotSeqLenKV, c.batch);
    }
    if (c.ragged) {  // q, k, v, o; each gradient shares its tensor's offsets
        for (int i = 0; i < 4; ++i) m.ragged[i] = index_input(g, static_cast<Slot>(kSlotRaggedQ + i), c.batch + 1);
        m.q->set_ragged_offset(m.ragged[0]);
        m.k->set_ragged_offset(m.ragged[1]);
        m.v->set_ragged_offset(m.ragged[2]);
        if (c.training) m.ragged_stats = index_input(g, kSlotRaggedStats, c.batch + 1);
    }
    if (c.bias_batch > 0) m.bias = input(g, kSlotBias, m.b_dims, m.b_strides);
    if (c.dropout > 0.0f) {
        m.seed   = input(g, kSlotSeed, {1, 1, 1, 1}, {1, 1, 1, 1});
        m.offset = input(g, kSlotOffset, {1, 1, 1, 1}, {1, 1, 1, 1});
        m.seed->set_data_type(fe::DataType_t::INT64).set_is_pass_by_value(c.host_seed);
        m.offset->set_data_type(fe::DataType_t::INT64).set_is_pass_by_value(c.host_seed);
    }
    if (c.sinks) {
        m.sink = input(g, kSlotSink, m.sink_dims, m.sink_strides);
        m.sink->set_data_type(fe::DataType_t::FLOAT);
    }
    return m;
}

// The option whose score modifier (the frontend's score_mod) this config's graphs need,
// or nullptr: with one, the modifier applies the masks too (apply_scores), and a graph
// that takes no modifier (the FP8 graphs) refuses the config, naming the option.
inline const char *score_modifier(const Config &c) { return c.softcap > 0.0f ? "softcap" : nullptr; }

// What both directions' attributes share beyond the mask. With a score modifier the
// padding mask is the modifier's (apply_softcap); the lengths are the graph's either way. A
// full_lengths graph (a defect's remedy) masks exactly as a padding graph does.
template <class Attributes>
void apply_features(const Config &c, const Common &m, Attributes &a) {
    if (c.padding || c.full_lengths) {
        if (score_modifier(c) == nullptr) a.set_padding_mask(true);
        a.set_seq_len_q(m.seq_len_q).set_seq_len_kv(m.seq_len_kv);
    }
    if (c.ragged) a.set_max_total_seq_len_q(c.max_tokens_q).set_max_total_seq_len_kv(c.max_tokens_kv);
    if (c.alibi) a.set_alibi_mask(true);
    if (m.bias) a.set_bias(m.bias);
    if (m.seed) a.set_dropout(c.dropout, m.seed, m.offset);
    if (m.sink) a.set_sink_token(m.sink);
}

// A paged KV cache's page tables (forward only; SDPA_attributes, which the FP8
// forward shares).
inline void apply_paging(const Config &c, fe::graph::Graph &g, fe::graph::SDPA_attributes &a) {
    if (c.page_size == 0) return;
    const int64_t pages = (c.seqlen_kv + c.page_size - 1) / c.page_size;
    auto table_k        = input(g, kSlotPageTableK, {c.batch, 1, pages, 1}, {pages, pages, 1, 1});
    auto table_v        = input(g, kSlotPageTableV, {c.batch, 1, pages, 1}, {pages, pages, 1, 1});
    table_k->set_data_type(fe::DataType_t::INT32);
    table_v->set_data_type(fe::DataType_t::INT32);
    a.set_paged_attention_k_table(table_k)
        .set_paged_attention_v_table(table_v)
        .set_paged_attention_max_seq_len_kv(static_cast<int>(c.seqlen_kv));
}

// Logit soft-capping through the frontend's score modifier: scores become softcap *
// tanh(score / softcap) after scaling, before any mask. Beside a modifier the frontend
// turns its own masks off (cudnn-frontend 1.28 refuses both: "Attention score mod enabled
// and hence other subgraphs are disabled"), so the modifier applies them itself, after
// the cap, in the frontend's order (padding, then the window) and with its own helpers.
// ALiBi it leaves to the frontend, which refuses the pair with that reason. Backward:
// d/ds [c tanh(s / c)] = 1 - tanh(s / c)^2, from the tanh that the forward modifier made
// when the backward graph recomputed the scores (the frontend applies it first).
template <class Attributes>
void apply_softcap(const Config &c, const Common &m, Attributes &a) {
    using fe::graph::Pointwise_attributes;
    using Mode = fe::PointwiseMode_t;
    auto tanh  = std::make_shared<TensorPtr>();  // shared by the two modifiers of one graph
    const float cap = c.softcap;
    const Config cfg = c;
    const Band b = band(c);
    const TensorPtr seq_len_q = m.seq_len_q, seq_len_kv = m.seq_len_kv;
    a.set_score_mod([=](std::shared_ptr<fe::graph::Graph> g, TensorPtr score) {
        auto scalar = [&](float x) { return std::make_shared<fe::graph::Tensor_attributes>(x); };
        auto x = g->pointwise(score, scalar(cap), Pointwise_attributes().set_name("softcap_div").set_mode(Mode::DIV));
        *tanh  = g->pointwise(x, Pointwise_attributes().set_name("softcap_tanh").set_mode(Mode::TANH_FWD));
        auto out = g->pointwise(*tanh, scalar(cap), Pointwise_attributes().set_name("softcap_mul").set_mode(Mode::MUL));
        if (cfg.padding || cfg.full_lengths) {
            out = fe::graph::attn::score_modifiers::padding_mask(g, out, seq_len_kv, seq_len_q);
        }
        if (b.left || b.right) {
            out = fe::graph::attn::score_modifiers::sliding_window_mask(
                g, out, b.alignment, b.left, b.right, cfg.seqlen_q, cfg.seqlen_kv, seq_len_q, seq_len_kv, nullptr,
                nullptr);
        }
        return out;
    });
    if constexpr (std::is_same_v<Attributes, fe::graph::SDPA_backward_attributes>) {
        // grad * (1 - t^2) as grad - (grad * t) * t: tensors only, no scalar operand first.
        a.set_score_mod_bprop([=](std::shared_ptr<fe::graph::Graph> g, TensorPtr grad) {
            auto gt  = g->pointwise(grad, *tanh, Pointwise_attributes().set_name("softcap_gt").set_mode(Mode::MUL));
            auto gtt = g->pointwise(gt, *tanh, Pointwise_attributes().set_name("softcap_gtt").set_mode(Mode::MUL));
            return g->pointwise(grad, gtt, Pointwise_attributes().set_name("softcap_grad").set_mode(Mode::SUB));
        });
    }
}

// The mask and window, or with softcap the score modifier that applies them.
template <class Attributes>
void apply_scores(const Config &c, const Common &m, Attributes &a) {
    if (score_modifier(c) != nullptr) {
        apply_softcap(c, m, a);
    } else {
        apply_mask(c, a);
    }
}

inline std::shared_ptr<fe::graph::Graph> make_forward_graph(const Config &c) {
    Common m = make_common(c);
    auto &g  = *m.g;
    auto a   = fe::graph::SDPA_attributes().set_name("sdpa").set_generate_stats(c.training).set_attn_scale(c.scale);
    apply_scores(c, m, a);
    apply_features(c, m, a);
    apply_paging(c, g, a);
    auto [o, stats] = g.sdpa(m.q, m.k, m.v, a);
    set_output(o, kSlotO, m.o_dims, strides(c.o_stride));
    if (c.ragged) o->set_ragged_offset(m.ragged[3]);
    if (c.training) {
        set_output(stats, kSlotStats, m.s_dims, m.s_strides);
        stats->set_data_type(fe::DataType_t::FLOAT);
        if (c.ragged) stats->set_ragged_offset(m.ragged_stats);
    }
    return m.g;
}

inline std::shared_ptr<fe::graph::Graph> make_backward_graph(const Config &c) {
    Common m   = make_common(c);
    auto &g    = *m.g;
    auto o     = input(g, kSlotO, m.o_dims, strides(c.o_stride));
    auto d_o   = input(g, kSlotDO, m.o_dims, strides(c.o_stride));
    auto stats = input(g, kSlotStats, m.s_dims, m.s_strides);
    stats->set_data_type(fe::DataType_t::FLOAT);
    if (c.ragged) {
        o->set_ragged_offset(m.ragged[3]);
        d_o->set_ragged_offset(m.ragged[3]);
        stats->set_ragged_offset(m.ragged_stats);
    }
    auto a = fe::graph::SDPA_backward_attributes()
                 .set_name("sdpa_backward")
                 .set_attn_scale(c.scale)
                 .set_deterministic_algorithm(c.deterministic);
    apply_scores(c, m, a);
    apply_features(c, m, a);
    if (c.bias_grad) a.set_dbias(input(g, kSlotDBias, m.b_dims, m.b_strides));
    if (c.sinks) {
        auto d_sink = input(g, kSlotDSink, m.sink_dims, m.sink_strides);
        d_sink->set_data_type(fe::DataType_t::FLOAT);
        a.set_dsink_token(d_sink);
    }
    auto [d_q, d_k, d_v] = g.sdpa_backward(m.q, m.k, m.v, o, d_o, stats, a);
    set_output(d_q, kSlotDQ, m.q_dims, strides(c.q_stride));
    set_output(d_k, kSlotDK, m.k_dims, strides(c.k_stride));
    set_output(d_v, kSlotDV, m.v_dims, strides(c.v_stride));
    if (c.ragged) {
        d_q->set_ragged_offset(m.ragged[0]);
        d_k->set_ragged_offset(m.ragged[1]);
        d_v->set_ragged_offset(m.ragged[2]);
    }
    return m.g;
}

}  // namespace fastattn::detail
