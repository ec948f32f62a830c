// The narrow interface of fastattn's C++ core.
//
// Only csrc/attention.cpp includes cudnn-frontend (each file that does is slow to
// compile); everything else, the Cython module included, sees this header alone.
// Errors are values: no function here throws, and every exception cudnn-frontend
// raises is caught inside the core and returned as a Status.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fastattn_abi.h"  // the slot and status tables, shared with C and Python

namespace fastattn {

// fastattn_abi.h's status table: a code selects the Python exception class (fastattn.errors).
enum class Code : int {
#define FASTATTN_CODE_(UPPER, Cpp, value, Python) k##Cpp = FASTATTN_STATUS_##UPPER,
    FASTATTN_STATUS_TABLE(FASTATTN_CODE_)
#undef FASTATTN_CODE_
};

// [[nodiscard]]: a dropped status is a dropped error (a failed launch that looks
// like success), so the compiler flags every call whose status nobody reads.
struct [[nodiscard]] Status {
    Code code = Code::kOk;
    std::string message;

    bool ok() const { return code == Code::kOk; }
};

// AttentionConfig.dtype (q, k, v), out_dtype (o) and grad_dtype (d_o, d_q, d_k, d_v).
// The FP8 types select cudnn-frontend's FP8 graphs (sdpa_fp8, sdpa_fp8_backward) with
// their per-tensor float32 scale, descale and amax tensors.
enum class DType : int { kFp16 = 0, kBf16 = 1, kFp8E4m3 = 2, kFp8E5m2 = 3 };

inline bool is_fp8(DType t) { return t == DType::kFp8E4m3 || t == DType::kFp8E5m2; }

// AttentionConfig.mask.
enum class Mask : int {
    kNone              = 0,
    kCausal            = 1,  // top-left diagonal: query i sees keys j <= i
    kCausalBottomRight = 2,  // bottom-right diagonal: shifted by seqlen_kv - seqlen_q
};

// Plain data mirror of fastattn.config.AttentionConfig. Python validates and
// canonicalizes before filling it, so the core trusts its values.
struct Config {
    int64_t batch = 0, heads_q = 0, heads_kv = 0, seqlen_q = 0, seqlen_kv = 0;
    int64_t head_dim_qk = 0, head_dim_v = 0;
    DType dtype = DType::kFp16;
    // Element strides of q, k, v, o in (batch, head, seq, dim) order. The
    // gradients share the strides of their tensors: dq of q, dk of k, dv of v, do of o.
    int64_t q_stride[4] = {}, k_stride[4] = {}, v_stride[4] = {}, o_stride[4] = {};
    Mask mask = Mask::kNone;
    // FlashAttention's convention: query i sees keys j with i - left <= j <= i + right
    // (shifted by seqlen_kv - seqlen_q for the bottom-right diagonal); -1 is unbounded.
    int64_t window_left = -1, window_right = -1;
    // AttentionConfig.alignment: the window's diagonal at the bottom right (shifted by
    // each sequence's seqlen_kv - seqlen_q), without a causal mask; kCausalBottomRight
    // implies it.
    bool bottom_right = false;
    float scale        = 1.0f;
    bool training      = false;  // forward writes softmax stats; a backward graph exists
    bool deterministic = false;  // backward uses cuDNN's deterministic algorithm
    // Per-sequence lengths: int32 device arrays seq_len_q and seq_len_kv of `batch`
    // entries, given at execute; queries and keys past them are ignored.
    bool padding = false;
    // ALiBi: scores get slope[h] * (j - i) after scaling, with cuDNN's slopes for
    // heads_q heads (copied from host memory into the workspace at each execute).
    bool alibi = false;
    // Packed variable-length sequences (THD): q, k, v, o, their gradients and stats
    // start each sequence at an element offset given at execute (int32, batch + 1
    // entries each); stats are then packed too, (tokens, heads_q). Needs padding.
    // max_tokens_* bound the packed tokens (cuDNN sizes its workspace by them).
    bool ragged          = false;
    int64_t max_tokens_q = 0, max_tokens_kv = 0;
    // Additive bias after scaling, (bias_batch, bias_heads, bias_seq_q, seqlen_kv),
    // contiguous, in dtype; bias_batch is 1 or batch, bias_heads 1 or heads_q; 0: none.
    // bias_seq_q is 1 (one row broadcast over the queries: a key-padding bias) or
    // seqlen_q; 0 means seqlen_q.
    int64_t bias_batch = 0, bias_heads = 0, bias_seq_q = 0;
    bool bias_grad     = false;  // backward also writes d_bias, of the bias's shape
    // Dropout probability on the softmax; Philox seed and offset are int64 device
    // scalars given at execute (the same ones to backward: the same mask).
    float dropout = 0.0f;
    // Seed and offset are host int64 values passed by value (read at each execute on
    // the host, so fixed inside a captured CUDA graph) instead of device scalars.
    bool host_seed = false;
    // Attention sinks: a learnable float32 logit per query head, (1, heads_q, 1, 1),
    // in every softmax denominator; backward also writes its gradient d_sink.
    bool sinks = false;
    // Paged KV cache (forward only): k and v are pools of num_pages pages of
    // page_size tokens, (num_pages, heads_kv, page_size, dim) at k_stride / v_stride;
    // int32 page tables (batch, 1, ceil(seqlen_kv / page_size), 1) map each
    // sequence's pages; needs padding. 0: k and v are dense.
    int64_t page_size = 0, num_pages = 0;
    // The dtypes of o and of the gradients (d_o, d_q, d_k, d_v); `dtype` above is
    // then the dtype of q, k and v. Python sets both to `dtype` unless an FP8 config
    // names others. With an FP8 dtype the graphs are cuDNN's FP8 ones and take the
    // FP8 slots (per-tensor float32 descales, scales and amaxes, (1, 1, 1, 1)).
    DType out_dtype = DType::kFp16, grad_dtype = DType::kFp16;
    // Logit soft-capping: scores become softcap * tanh(score / softcap) after scaling,
    // before any mask (Gemma 2, Grok); 0: none.
    float softcap = 0.0f;
    // A known cuDNN defect's remedy (fastattn/defects.py): the graph masks with padding
    // as if `padding` were set, over lengths the plan owns (every sequence its full
    // seqlen_q, seqlen_kv), which execute passes itself: callers give no seq_len slots.
    // Only for graphs without lengths of their own (not padding, ragged, paged or FP8).
    bool full_lengths = false;
};

// The tensors a plan can take at execute (fastattn_abi.h's slot table). A graph takes
// the subset its config implies; the others must be 0. The slot is also the tensor's
// uid minus one, so the order is the order of cuDNN's sorted variant pack.
enum Slot : int {
#define FASTATTN_SLOT_(UPPER, Camel, name, absent) kSlot##Camel = FASTATTN_SLOT_##UPPER,
    FASTATTN_SLOT_TABLE(FASTATTN_SLOT_)
#undef FASTATTN_SLOT_
    kNumSlots = FASTATTN_NUM_SLOTS
};

// A slot's name (the keyword of Plan.forward / backward, in errors and cuDNN's tensor
// names), or nullptr past kNumSlots: what fastattn._core reads at import.
const char *slot_name(int slot);

// fastattn_abi.h's status table, for fastattn._core to check fastattn.errors against.
struct StatusName {
    int code;
    const char *python;  // the exception class's name in fastattn.errors ("None" for kOk)
};
extern const StatusName kStatusNames[];
extern const int kNumStatusNames;

enum class Direction : int { kForward = 0, kBackward = 1 };

// What a built or loaded graph reports about itself.
struct GraphInfo {
    int64_t workspace_size = 0;  // bytes the caller must provide at execute (a ragged plan's index arrays included)
    std::string engine_name;     // cuDNN's name of the chosen plan (empty after deserialize)
    double build_ms = 0.0;       // wall time of build or deserialize
};

struct DeviceInfo {
    std::string name;
    int major = 0, minor = 0, sm_count = 0;
    int driver_version = 0, runtime_version = 0;
};

class Graph;  // a built cuDNN graph with one execution plan; opaque outside the core

struct GraphDeleter {
    void operator()(Graph *g) const;
};
using GraphPtr = std::unique_ptr<Graph, GraphDeleter>;

// Makes the cuDNN library at `path` (already loaded by the Python loader, which
// also made its dependencies loadable) the one cudnn-frontend calls. Idempotent.
Status load_cudnn(const std::string &path, int64_t *version);
int64_t cudnn_version();          // runtime version, 0 before load_cudnn
int64_t cudnn_header_version();   // CUDNN_VERSION of the headers built against
int64_t frontend_version();       // CUDNN_FRONTEND_VERSION built against
// How build_graph picks a plan among cuDNN's candidates; part of every cache key.
const char *plan_policy();

Status device_count(int *count);
Status current_device(int *device);
// Whether `stream` (a cudaStream_t; 0 the default stream) is capturing a CUDA graph.
Status stream_capturing(intptr_t stream, bool *capturing);
Status device_info(int device, DeviceInfo *out);

// Builds the graph for one direction of `cfg` on `device` and one execution plan
// for it. The probe, the plan cache and the runtime all call this one function,
// so a probed plan is the plan that runs. kNotSupported carries cuDNN's reason.
Status build_graph(const Config &cfg, Direction dir, int device, GraphPtr *out, GraphInfo *info);

// Plan blob without graph structure: what the persistent cache stores.
Status serialize_graph(const Graph *g, std::vector<uint8_t> *blob);
// `cfg` must be the config the blob was built from: it says which tensors the plan takes.
Status deserialize_graph(const uint8_t *data, size_t size, const Config &cfg, Direction dir, int device,
                         GraphPtr *out, GraphInfo *info);

// The hot path: validates pointers, then runs. No allocation, synchronization or
// copy. `slots` holds kNumSlots raw addresses indexed by Slot (0: not given); the
// stream is a raw address too (0: the default stream). `dir` must be the graph's.
Status execute(const Graph *g, Direction dir, int device, const intptr_t *slots, intptr_t workspace,
               intptr_t stream);

}  // namespace fastattn
