// A graph's tensors: each slot's uid and name, the slots a config's graph takes, the
// layout execute fills cuDNN's variant pack by, and execute's pointer checks. Needs no
// cudnn-frontend: slots.cpp is a translation unit of its own.
//
// A tensor's uid is its slot + 1: the sorted-pointer execute takes user pointers in
// uid order, which is then slot order.
#pragma once

#include <cstdint>
#include <vector>

#include "fastattn.h"
#include "ragged.h"

namespace fastattn::detail {

constexpr int64_t uid(Slot s) { return static_cast<int64_t>(s) + 1; }
constexpr uint64_t bit(Slot s) { return uint64_t{1} << s; }
static_assert(kNumSlots <= 64, "slot masks are 64-bit");

// Each slot's name in errors, and why a plan may not take it.
struct SlotSpec {
    const char *name;
    const char *absent;
};
inline constexpr SlotSpec kSlots[kNumSlots] = {
#define FASTATTN_SLOT_SPEC_(UPPER, Camel, name, absent) {name, absent},
    FASTATTN_SLOT_TABLE(FASTATTN_SLOT_SPEC_)
#undef FASTATTN_SLOT_SPEC_
};

inline constexpr uintptr_t kAlignment = 16;  // of every device pointer cuDNN takes

// The slots a graph of this config and direction takes at execute.
uint64_t slot_mask(const Config &c, Direction dir);

// What execute checks a call against and fills the variant pack by, fixed when a graph
// is made or loaded (fastattn::Graph is one, with the frontend graph beside it).
struct Layout {
    Direction dir     = Direction::kForward;
    uint64_t slots    = 0;  // bit s set: the graph takes the tensor of Slot s at execute
    uint64_t by_value = 0;  // host values (host_seed's seed and offset): not held to device alignment
    int64_t workspace = 0;  // bytes: cuDNN's, then a ragged graph's index arrays (place_index)
    // Slots the plan fills itself, never the caller (a full_lengths graph's seq_len_q and
    // seq_len_kv): in the variant pack (order, n) but not in `slots`, which is what the
    // caller gives. `lengths` holds their device arrays, by slot - kSlotSeqLenQ; they
    // are process-wide constants (device.h's constant_int32), never freed.
    uint64_t owned      = 0;
    intptr_t lengths[2] = {};
    // The variant pack's layout: order[i] is the slot of its i-th tensor in uid order
    // (cuDNN's sorted order), so execute writes each pointer straight to its place,
    // with no map, vector or search per call.
    int8_t order[kNumSlots] = {};
    int n                   = 0;
    RaggedIndex ragged;
    // A shape-override graph's config (Config::shape_override): the declared shapes that
    // execute_at overrides with a call's.
    bool shape_override = false;
    Config declared;
};

// Sets every field but the workspace, which cuDNN gives once the graph is built.
void set_layout(Layout &layout, const Config &c, Direction dir);

// The uids of a slot mask, sorted: what cuDNN's variant pack holds, in its order.
std::vector<int64_t> mask_uids(uint64_t mask);

Status check_pointer(intptr_t p, const char *name);

// execute's checks in one branch-free pass over the slots: a pointer the plan does not
// take, one it takes missing, a device pointer not 16-byte aligned, the workspace. True
// when the call may run; `derived`: it gave cumulative lengths in place of a ragged
// graph's index arrays. Inline, since every launch runs it; only a refusal looks for
// the culprit (slot_error), so a call pays no per-slot branches or Status objects.
inline bool slots_fit(const Layout &g, const intptr_t *slots, intptr_t workspace, bool *derived) {
    uint64_t given = 0, misaligned = 0;
    for (int s = 0; s < kNumSlots; ++s) {
        const auto p = static_cast<uintptr_t>(slots[s]);
        given |= static_cast<uint64_t>(p != 0) << s;
        misaligned |= static_cast<uint64_t>(p % kAlignment != 0) << s;
    }
    const auto ws            = static_cast<uintptr_t>(workspace);
    const bool bad_workspace = g.workspace > 0 && (ws == 0 || ws % kAlignment != 0);
    // Cumulative lengths are int32 arrays that may start anywhere 4-byte aligned.
    *derived          = g.ragged.n > 0 && given == g.ragged.cu_slots;
    const bool bad_cu = ((slots[kSlotCuSeqlensQ] | slots[kSlotCuSeqlensKV]) & 3) != 0;
    return (given == g.slots || *derived) && (misaligned & ~g.by_value & ~kCuSlots) == 0 && !bad_cu && !bad_workspace;
}

// A full_lengths graph's slots: the caller's, with the plan's own length arrays added.
inline void fill_owned(const Layout &g, const intptr_t *slots, intptr_t *full) {
    for (int s = 0; s < kNumSlots; ++s) full[s] = slots[s];
    full[kSlotSeqLenQ]  = g.lengths[0];
    full[kSlotSeqLenKV] = g.lengths[1];
}

// Why execute refused its pointers, slot by slot (execute's error path).
Status slot_error(const Layout &g, const intptr_t *slots, intptr_t workspace);

}  // namespace fastattn::detail
