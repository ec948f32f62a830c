// Ragged launches from cumulative lengths: the index arrays a ragged graph reads, their
// places in the tail of its workspace, and the kernel that writes them.
//
// cuDNN's ragged (THD) graph reads per-sequence lengths and the element offset of each
// sequence in q, k, v, o (and in the packed stats). Callers hold FlashAttention's
// cumulative lengths instead; deriving the rest took five to seven small PyTorch
// kernels per call, each costing more host time than the attention launch
// (benchmarks/profile_varlen.py: docs/history/benchmarks-log.md, "attention_varlen per
// call"). A ragged plan also takes the cumulative lengths themselves
// (kSlotCuSeqlensQ/KV): one kernel of fastattn's (ragged_indices.cu, shipped as PTX)
// writes every array the graph reads into the tail of the plan's workspace, on the
// launch's stream, just before the launch. A launch that repeats its pointers replays
// both kernels as one CUDA graph (packs.h), which reads the lengths at replay time,
// so new lengths behind the same pointers are always seen.
//
// Needs no cudnn-frontend: ragged.cpp is a translation unit of its own.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "fastattn.h"

namespace fastattn::detail {

// A ragged graph's index arrays, which fastattn computes from cumulative lengths:
// n = batch + 1 entries per row, rows `stride` int32 apart from byte `offset` of the
// workspace; the rows' multipliers; the slots such a launch takes.
struct RaggedIndex {
    int n = 0, stride = 0;  // n == 0: not a ragged graph
    int64_t offset = 0;
    int32_t mult[5] = {};   // token strides of q, k, v, o, stats (0: no packed stats)
    uint64_t cu_slots = 0;
};

// The index arrays of a ragged graph, in this order, `stride` int32 apart at the end
// of its workspace: what the kernel's rows are.
inline constexpr int kIndexRows               = 7;
inline constexpr Slot kIndexSlots[kIndexRows] = {kSlotSeqLenQ, kSlotSeqLenKV, kSlotRaggedQ, kSlotRaggedK,
                                                 kSlotRaggedV, kSlotRaggedO, kSlotRaggedStats};
inline constexpr uint64_t kCuSlots            = (uint64_t{1} << kSlotCuSeqlensQ) | (uint64_t{1} << kSlotCuSeqlensKV);

// The index of a graph of config `c` taking `slots` (n == 0 unless c is ragged); its
// offset comes from place_index, once cuDNN's share of the workspace is known. The
// multipliers are the tensors' token strides: the offset of token t is t * stride elements.
RaggedIndex ragged_index(const Config &c, uint64_t slots);

// The workspace a launch needs: `workspace` (cuDNN's) with r's arrays appended, whose
// offset it sets. Unchanged for a graph that is not ragged.
int64_t place_index(RaggedIndex &r, int64_t workspace);

// Loads the index kernel, once per process (the driver compiles its PTX for the GPU: a
// few ms), when the first ragged graph is made, so that no launch, and no caller's
// CUDA-graph capture, pays for it. Loaded into every device's context. Its status is
// the load's, kept: every launch_index returns it.
Status load_index_kernel();

// The cumulative lengths of a launch given them: the index kernel runs before it.
struct IndexLaunch {
    const RaggedIndex *index;
    intptr_t cu_q, cu_kv, workspace;
};

// Copies the kNumSlots `slots` (a graph taking `graph_slots`) to `out`, the cumulative
// lengths replaced by the index arrays' places in the workspace.
void fill_index_slots(const RaggedIndex &r, uint64_t graph_slots, const intptr_t *slots, intptr_t workspace,
                      intptr_t *out);

// Queues the index kernel on `stream` (device current, as in any launch).
Status launch_index(const IndexLaunch &x, cudaStream_t stream);

}  // namespace fastattn::detail
