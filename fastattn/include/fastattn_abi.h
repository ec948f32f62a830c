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

#define FASTATTN_ABI_VERSION 4  /* 2: the FP8 slots; 3: stream_capturing; 4: the cumulative-length slots */
#define FASTATTN_ABI_CAPSULE "fastattn._core.abi"

/* Slots of the tensors a plan takes at execute: fastattn.h's Slot, in the same
 * order (a static_assert in _core checks the count). */
enum {
    FASTATTN_SLOT_Q, FASTATTN_SLOT_K, FASTATTN_SLOT_V, FASTATTN_SLOT_O, FASTATTN_SLOT_STATS,
    FASTATTN_SLOT_DO, FASTATTN_SLOT_DQ, FASTATTN_SLOT_DK, FASTATTN_SLOT_DV,
    FASTATTN_SLOT_SEQ_LEN_Q, FASTATTN_SLOT_SEQ_LEN_KV,
    FASTATTN_SLOT_RAGGED_Q, FASTATTN_SLOT_RAGGED_K, FASTATTN_SLOT_RAGGED_V, FASTATTN_SLOT_RAGGED_O,
    FASTATTN_SLOT_BIAS, FASTATTN_SLOT_DBIAS, FASTATTN_SLOT_SEED, FASTATTN_SLOT_OFFSET, FASTATTN_SLOT_SINK,
    FASTATTN_SLOT_DSINK, FASTATTN_SLOT_PAGE_TABLE_K, FASTATTN_SLOT_PAGE_TABLE_V, FASTATTN_SLOT_RAGGED_STATS,
    /* FP8's float32 scalars: the forward's, then the backward's own. */
    FASTATTN_SLOT_DESCALE_Q, FASTATTN_SLOT_DESCALE_K, FASTATTN_SLOT_DESCALE_V, FASTATTN_SLOT_DESCALE_S,
    FASTATTN_SLOT_SCALE_S, FASTATTN_SLOT_SCALE_O, FASTATTN_SLOT_AMAX_S, FASTATTN_SLOT_AMAX_O,
    FASTATTN_SLOT_DESCALE_O, FASTATTN_SLOT_DESCALE_DO, FASTATTN_SLOT_DESCALE_DP, FASTATTN_SLOT_SCALE_DQ,
    FASTATTN_SLOT_SCALE_DK, FASTATTN_SLOT_SCALE_DV, FASTATTN_SLOT_SCALE_DP,
    FASTATTN_SLOT_AMAX_DQ, FASTATTN_SLOT_AMAX_DK, FASTATTN_SLOT_AMAX_DV, FASTATTN_SLOT_AMAX_DP,
    /* A ragged plan's int32 cumulative lengths, in place of SEQ_LEN_* and RAGGED_*. */
    FASTATTN_SLOT_CU_SEQLENS_Q, FASTATTN_SLOT_CU_SEQLENS_KV,
    FASTATTN_NUM_SLOTS
};

enum { FASTATTN_FORWARD = 0, FASTATTN_BACKWARD = 1 };

typedef struct fastattn_abi {
    int version;     /* FASTATTN_ABI_VERSION */
    int num_slots;   /* FASTATTN_NUM_SLOTS */
    /* fastattn::execute: `graph` is a Plan's graph of `direction` (Plan._abi_graphs()),
     * `slots` FASTATTN_NUM_SLOTS device addresses (0: not given), `stream` a
     * cudaStream_t. Returns 0, or fastattn.h's status code with its message written
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
