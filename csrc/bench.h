// Benchmark hooks: not part of fastattn's production interface (fastattn.h, from
// which the C ABI handed to the PyTorch op library is drawn). Only benchmarks/ and the
// tests call them, through fastattn._core.bench_execute and its neighbours.
//
// A header of their own rather than a compile-time flag: the benchmark must measure
// the very binary users run (a flagged build is another binary, and the GPU machine
// would need a second build of that slow translation unit to get it); the hooks
// cost nothing unless called. They live in attention.cpp, the one translation unit
// that includes cudnn-frontend.
#pragma once

#include "fastattn.h"

namespace fastattn::bench {

enum class Mode : int {
    // fastattn::execute, the whole C++ call: pointer checks, device and stream, launch.
    kFastattn = 0,
    // cudnn-frontend's cheapest execute (sorted pointers) on the same plan, with none
    // of fastattn's work around it: the C++ floor.
    kFrontendSorted = 1,
    // cudnn-frontend's uid-to-pointer map execute, the map built per call as the
    // frontend's samples (and PyTorch's cuDNN attention) build theirs.
    kFrontendUidMap = 2,
    // kFrontendSorted with the launch preamble (device current, this thread's handle, its
    // stream bound) paid per call, as any caller of cudnn-frontend pays it: kFastattn
    // less its pointer checks.
    kFrontendSortedPreamble = 3,
    // kFastattn with CUDA graph replays off for the loop: every launch through its cached
    // variant pack (what a replay saves, measured).
    kFastattnPacksOnly = 4,
};

// Seconds for `iters` back-to-back launches of `g` in `mode`, looped in C++. `slots`
// as for execute (kNumSlots addresses indexed by Slot). Device and stream are set
// once outside the loop for kFrontendSorted and kFrontendUidMap, by each call for the others.
// Call i runs layer i % layers: the graph's device tensors at slots + layer * layer_bytes
// (a model's layers each with their own tensors; the workspace is shared).
Status time_execute(const Graph *g, Direction dir, int device, const intptr_t *slots, intptr_t workspace,
                    intptr_t stream, Mode mode, int iters, int layers, int64_t layer_bytes, double *seconds);

// Bit s set: the graph takes the tensor of Slot s (the order of its variant pack).
uint64_t graph_slots(const Graph *g);

// Whether execute launches g through cached variant packs (packs.h), not the frontend's execute.
bool direct_launch(const Graph *g);

// The calling thread's variant-pack cache: launches that found their pack, that made one,
// and that replayed the pack's launch as a CUDA graph.
void pack_counts(uint64_t *hits, uint64_t *misses, uint64_t *replays);

}  // namespace fastattn::bench
