/* The C ABI that fastattn._core hands to native code outside it (the PyTorch op
 * library, fastattn/torch/csrc/ops.cpp), as a PyCapsule named "fastattn._core.abi".
 *
 * Why a C ABI and not fastattn.h: cudnn-frontend keeps process-wide statics (the
 * loaded libcudnn, per-thread handles, its caches). They must exist once, in _core,
 * so no other library may compile cudnn-frontend; a table of C function pointers
 * crosses shared-library and compiler boundaries without sharing a C++ type.
 * Plain C, no includes beyond <stddef.h> and <stdint.h>: the op library is built
 * against the user's torch with the user's compiler.
 *
 * Versioned: a consumer checks `version` (bumped on any change to this struct or to
 * the meaning of a slot) and refuses a table it does not know.
 */
#ifndef FASTATTN_ABI_H
#define FASTATTN_ABI_H

#include <stddef.h>
#include <stdint.h>

#define FASTATTN_ABI_VERSION 5  /* 2: the FP8 slots; 3: stream_capturing; 4: the cumulative-length slots;
                                 5: the status codes defined here */
#define FASTATTN_ABI_CAPSULE "fastattn._core.abi"

/* The one table of the tensors a plan takes at execute, read by C (below), C++
 * (csrc/fastattn.h's Slot, csrc/attention.cpp's names and reasons) and, through the
 * core, Python (fastattn._core.SLOT_NAMES). X(UPPER, Camel, name, why a plan may not
 * take it). A slot's index is also its cuDNN tensor uid minus one, so the order is
 * the order of cuDNN's sorted variant pack: append, never reorder (and bump
 * FASTATTN_ABI_VERSION).
 *
 * FP8 (dtype fp8_*) takes float32 scalars: a descale multiplies a tensor read from FP8
 * back to its real values, a scale multiplies a value before it is stored as FP8, an
 * amax is the largest |value| of a tensor before its scale (for the next scale).
 * Forward: descale q, k, v, s; scale s, o; amax s, o. Backward: descale q, k, v, o,
 * d_o, s, d_p; scale s, d_q, d_k, d_v, d_p; amax d_q, d_k, d_v, d_p.
 *
 * CU_SEQLENS_* are not tensors of cuDNN's graph: a ragged plan takes either its lengths
 * and offsets (SEQ_LEN_*, RAGGED_*) or FlashAttention's int32 cumulative lengths (batch
 * + 1 each, 4-byte aligned), from which fastattn's index kernel writes them into the
 * plan's workspace on the launch's stream, ahead of the launch (csrc/ragged.h). */
#define FASTATTN_SLOT_TABLE(X) \
    /* the attention tensors and their gradients */ \
    X(Q, Q, "q", "") \
    X(K, K, "k", "") \
    X(V, V, "v", "") \
    X(O, O, "o", "") \
    X(STATS, Stats, "stats", "the plan was built with training=False and writes no softmax stats") \
    X(DO, DO, "d_o", "a forward graph takes no gradients") \
    X(DQ, DQ, "d_q", "a forward graph takes no gradients") \
    X(DK, DK, "d_k", "a forward graph takes no gradients") \
    X(DV, DV, "d_v", "a forward graph takes no gradients") \
    /* the features' index tensors, extra inputs and gradients */ \
    X(SEQ_LEN_Q, SeqLenQ, "seq_len_q", "the plan was built with padding=False") \
    X(SEQ_LEN_KV, SeqLenKV, "seq_len_kv", "the plan was built with padding=False") \
    X(RAGGED_Q, RaggedQ, "ragged_q", "the plan was built with ragged=False") \
    X(RAGGED_K, RaggedK, "ragged_k", "the plan was built with ragged=False") \
    X(RAGGED_V, RaggedV, "ragged_v", "the plan was built with ragged=False") \
    X(RAGGED_O, RaggedO, "ragged_o", "the plan was built with ragged=False") \
    X(BIAS, Bias, "bias", "the plan was built with bias='none'") \
    X(DBIAS, DBias, "d_bias", "only a backward graph built with bias_grad=True writes d_bias") \
    X(SEED, Seed, "seed", "the plan was built with dropout=0") \
    X(OFFSET, Offset, "offset", "the plan was built with dropout=0") \
    X(SINK, Sink, "sink", "the plan was built with sinks=False") \
    X(DSINK, DSink, "d_sink", "only the backward graph of a plan built with sinks=True writes d_sink") \
    X(PAGE_TABLE_K, PageTableK, "page_table_k", "the plan was built with page_size=0 (dense k and v)") \
    X(PAGE_TABLE_V, PageTableV, "page_table_v", "the plan was built with page_size=0 (dense k and v)") \
    X(RAGGED_STATS, RaggedStats, "ragged_stats", "only a plan built with ragged=True and training=True has packed stats") \
    /* FP8's float32 scalars: the forward's, then the backward's own */ \
    X(DESCALE_Q, DescaleQ, "descale_q", "only a plan with an FP8 dtype takes descales") \
    X(DESCALE_K, DescaleK, "descale_k", "only a plan with an FP8 dtype takes descales") \
    X(DESCALE_V, DescaleV, "descale_v", "only a plan with an FP8 dtype takes descales") \
    X(DESCALE_S, DescaleS, "descale_s", "only a plan with an FP8 dtype takes descales") \
    X(SCALE_S, ScaleS, "scale_s", "only a plan with an FP8 dtype takes scales") \
    X(SCALE_O, ScaleO, "scale_o", "only the forward graph of a plan with an FP8 dtype takes scale_o") \
    X(AMAX_S, AmaxS, "amax_s", "only the forward graph of a plan with an FP8 dtype writes amax_s") \
    X(AMAX_O, AmaxO, "amax_o", "only the forward graph of a plan with an FP8 dtype writes amax_o") \
    X(DESCALE_O, DescaleO, "descale_o", "only the backward graph of a plan with an FP8 dtype takes descale_o") \
    X(DESCALE_DO, DescaleDO, "descale_d_o", "only the backward graph of a plan with an FP8 dtype takes descale_d_o") \
    X(DESCALE_DP, DescaleDP, "descale_d_p", "only the backward graph of a plan with an FP8 dtype takes descale_d_p") \
    X(SCALE_DQ, ScaleDQ, "scale_d_q", "only the backward graph of a plan with an FP8 dtype takes scale_d_q") \
    X(SCALE_DK, ScaleDK, "scale_d_k", "only the backward graph of a plan with an FP8 dtype takes scale_d_k") \
    X(SCALE_DV, ScaleDV, "scale_d_v", "only the backward graph of a plan with an FP8 dtype takes scale_d_v") \
    X(SCALE_DP, ScaleDP, "scale_d_p", "only the backward graph of a plan with an FP8 dtype takes scale_d_p") \
    X(AMAX_DQ, AmaxDQ, "amax_d_q", "only the backward graph of a plan with an FP8 dtype writes amax_d_q") \
    X(AMAX_DK, AmaxDK, "amax_d_k", "only the backward graph of a plan with an FP8 dtype writes amax_d_k") \
    X(AMAX_DV, AmaxDV, "amax_d_v", "only the backward graph of a plan with an FP8 dtype writes amax_d_v") \
    X(AMAX_DP, AmaxDP, "amax_d_p", "only the backward graph of a plan with an FP8 dtype writes amax_d_p") \
    /* a ragged plan's cumulative lengths, in place of SEQ_LEN_* and RAGGED_* */ \
    X(CU_SEQLENS_Q, CuSeqlensQ, "cu_seqlens_q", "only a plan built with ragged=True takes cumulative lengths") \
    X(CU_SEQLENS_KV, CuSeqlensKV, "cu_seqlens_kv", "only a plan built with ragged=True takes cumulative lengths")

#define FASTATTN_SLOT_ENUM_(UPPER, Camel, name, absent) FASTATTN_SLOT_##UPPER,
enum { FASTATTN_SLOT_TABLE(FASTATTN_SLOT_ENUM_) FASTATTN_NUM_SLOTS };
#undef FASTATTN_SLOT_ENUM_

/* The status codes of every call into the core. X(UPPER, Cpp, value, Python):
 * fastattn::Code::k<Cpp> in C++, the class fastattn.errors.<Python> (errors.py keeps the
 * code -> class table; tests/runtime/test_core.py holds the two equal). */
#define FASTATTN_STATUS_TABLE(X)                                                                      \
    X(OK, Ok, 0, None)                                                                                \
    X(INVALID_ARGUMENT, InvalidArgument, 1, InvalidArgumentError) /* bad pointer, value or call */   \
    X(NOT_SUPPORTED, NotSupported, 2, NotSupportedError)          /* cuDNN refuses: its reason */    \
    X(LIBRARY_ERROR, LibraryError, 3, LibraryError)               /* cuDNN, CUDA or driver unusable */ \
    X(CUDA_ERROR, CudaError, 4, CudaError)                        /* a CUDA call failed */           \
    X(CUDNN_ERROR, CudnnError, 5, CudnnError)                     /* cuDNN failed running a plan */  \
    X(CORRUPT_PLAN, CorruptPlan, 6, CorruptPlanError)             /* a plan blob could not load */   \
    X(INTERNAL, Internal, 7, InternalError)                       /* a bug in fastattn */

#define FASTATTN_STATUS_ENUM_(UPPER, Cpp, value, Python) FASTATTN_STATUS_##UPPER = value,
enum { FASTATTN_STATUS_TABLE(FASTATTN_STATUS_ENUM_) };
#undef FASTATTN_STATUS_ENUM_

enum { FASTATTN_FORWARD = 0, FASTATTN_BACKWARD = 1 };

typedef struct fastattn_abi {
    int version;     /* FASTATTN_ABI_VERSION */
    int num_slots;   /* FASTATTN_NUM_SLOTS */
    /* fastattn::execute: `graph` is a Plan's graph of `direction` (Plan._abi_graphs()),
     * `slots` FASTATTN_NUM_SLOTS device addresses (0: not given), `stream` a
     * cudaStream_t. Returns FASTATTN_STATUS_OK, or a FASTATTN_STATUS_* code with its message written
     * (NUL-terminated, truncated) into message[0 .. message_size). Never throws, never
     * takes the GIL, never synchronizes. */
    int (*execute)(const void *graph, int direction, int device, const intptr_t *slots, intptr_t workspace,
                   intptr_t stream, char *message, size_t message_size);
    /* Whether `stream` (a cudaStream_t) is capturing a CUDA graph: 1 yes, 0 no, -1 the
     * query failed (the caller then assumes it is: see ops.cpp's workspace()). Never
     * throws, never takes the GIL, never synchronizes. */
    int (*stream_capturing)(intptr_t stream);
} fastattn_abi;

#endif /* FASTATTN_ABI_H */
