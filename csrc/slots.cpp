// slots.h's tables and checks, and fastattn.h's slot and status names: what a config's
// graph takes, its variant pack's order, and why execute refused a call. Needs no
// cudnn-frontend: a translation unit of its own, compiled beside the one that does.
#include "slots.h"

#include <sstream>
#include <string>

#include "status.h"

namespace fastattn {
namespace detail {

uint64_t slot_mask(const Config &c, Direction dir) {
    const bool backward = dir == Direction::kBackward;
    uint64_t m          = bit(kSlotQ) | bit(kSlotK) | bit(kSlotV) | bit(kSlotO);
    if (backward) {
        m |= bit(kSlotStats) | bit(kSlotDO) | bit(kSlotDQ) | bit(kSlotDK) | bit(kSlotDV);
    } else if (c.training) {
        m |= bit(kSlotStats);
    }
    if (c.padding) m |= bit(kSlotSeqLenQ) | bit(kSlotSeqLenKV);
    if (c.ragged) m |= bit(kSlotRaggedQ) | bit(kSlotRaggedK) | bit(kSlotRaggedV) | bit(kSlotRaggedO);
    if (c.ragged && c.training) m |= bit(kSlotRaggedStats);
    if (c.bias_batch > 0) m |= bit(kSlotBias);
    if (backward && c.bias_grad) m |= bit(kSlotDBias);
    if (c.dropout > 0.0f) m |= bit(kSlotSeed) | bit(kSlotOffset);
    if (c.sinks) m |= bit(kSlotSink) | (backward ? bit(kSlotDSink) : 0u);
    if (!backward && c.page_size > 0) m |= bit(kSlotPageTableK) | bit(kSlotPageTableV);
    if (is_fp8(c.dtype)) {
        m |= bit(kSlotDescaleQ) | bit(kSlotDescaleK) | bit(kSlotDescaleV) | bit(kSlotDescaleS) | bit(kSlotScaleS);
        if (backward) {
            m |= bit(kSlotDescaleO) | bit(kSlotDescaleDO) | bit(kSlotDescaleDP) | bit(kSlotScaleDQ) |
                 bit(kSlotScaleDK) | bit(kSlotScaleDV) | bit(kSlotScaleDP) | bit(kSlotAmaxDQ) | bit(kSlotAmaxDK) |
                 bit(kSlotAmaxDV) | bit(kSlotAmaxDP);
        } else {
            m |= bit(kSlotScaleO) | bit(kSlotAmaxS) | bit(kSlotAmaxO);
        }
    }
    return m;
}

void set_layout(Layout &layout, const Config &c, Direction dir) {
    layout.dir      = dir;
    layout.slots    = slot_mask(c, dir);
    layout.by_value = c.host_seed ? bit(kSlotSeed) | bit(kSlotOffset) : uint64_t{0};
    // A padding graph takes its lengths from the caller, so full_lengths adds none there
    // (build_graph refuses the pair; this keeps the masks disjoint regardless).
    layout.owned = c.full_lengths && !c.padding ? bit(kSlotSeqLenQ) | bit(kSlotSeqLenKV) : uint64_t{0};
    layout.n     = 0;
    const uint64_t pack = layout.slots | layout.owned;
    for (int s = 0; s < kNumSlots; ++s) {
        if (pack & bit(static_cast<Slot>(s))) layout.order[layout.n++] = static_cast<int8_t>(s);
    }
    layout.ragged = ragged_index(c, layout.slots);
    layout.shape_override = c.shape_override;
    if (c.shape_override) layout.declared = c;
}

std::vector<int64_t> mask_uids(uint64_t mask) {
    std::vector<int64_t> uids;
    for (int s = 0; s < kNumSlots; ++s) {
        if (mask & bit(static_cast<Slot>(s))) uids.push_back(uid(static_cast<Slot>(s)));
    }
    return uids;
}

Status check_pointer(intptr_t p, const char *name) {
    if (p == 0) return error(Code::kInvalidArgument, std::string(name) + " is a null pointer");
    if (static_cast<uintptr_t>(p) % kAlignment != 0) {
        std::ostringstream msg;
        msg << name << "=0x" << std::hex << p << " is not " << std::dec << kAlignment << "-byte aligned";
        return error(Code::kInvalidArgument, msg.str());
    }
    return {};
}

Status slot_error(const Layout &g, const intptr_t *slots, intptr_t workspace) {
    // A ragged plan given cumulative lengths takes them in place of its index arrays.
    uint64_t takes = g.slots;
    if (g.ragged.n > 0 && (slots[kSlotCuSeqlensQ] != 0 || slots[kSlotCuSeqlensKV] != 0)) {
        takes = g.ragged.cu_slots;
        for (Slot s : kIndexSlots) {
            if (slots[s] != 0) {
                return error(Code::kInvalidArgument, std::string(kSlots[s].name) +
                                                         " given with cu_seqlens_q and cu_seqlens_kv, which fastattn "
                                                         "computes it from: give one or the other");
            }
        }
        for (Slot s : {kSlotCuSeqlensQ, kSlotCuSeqlensKV}) {
            if (slots[s] == 0) {
                return error(Code::kInvalidArgument, std::string(kSlots[s].name) +
                                                         " is null: give both cumulative lengths (the same array "
                                                         "twice for self-attention)");
            }
            if (slots[s] % 4 != 0) {
                std::ostringstream msg;
                msg << kSlots[s].name << "=0x" << std::hex << slots[s] << " is not 4-byte aligned (int32)";
                return error(Code::kInvalidArgument, msg.str());
            }
        }
    }
    for (int s = 0; s < kNumSlots; ++s) {
        if (slots[s] != 0 && !(takes & bit(static_cast<Slot>(s)))) {
            return error(Code::kInvalidArgument, std::string(kSlots[s].name) + " given, but " + kSlots[s].absent);
        }
    }
    for (int s = 0; s < kNumSlots; ++s) {
        if (!(takes & bit(static_cast<Slot>(s))) || (kCuSlots & bit(static_cast<Slot>(s)))) continue;
        if (g.by_value & bit(static_cast<Slot>(s))) {  // a host int64, read by cuDNN during the call
            if (slots[s] == 0) return error(Code::kInvalidArgument, std::string(kSlots[s].name) + " is null");
        } else {
            FA_RETURN_IF_ERROR(check_pointer(slots[s], kSlots[s].name));
        }
    }
    if (g.workspace > 0) return check_pointer(workspace, "workspace");
    return {};
}

}  // namespace detail

const char *slot_name(int slot) { return slot >= 0 && slot < kNumSlots ? detail::kSlots[slot].name : nullptr; }

#define FASTATTN_STATUS_NAME_(UPPER, Cpp, value, Python) {value, #Python},
const StatusName kStatusNames[] = {FASTATTN_STATUS_TABLE(FASTATTN_STATUS_NAME_)};
#undef FASTATTN_STATUS_NAME_
const int kNumStatusNames = sizeof kStatusNames / sizeof kStatusNames[0];

}  // namespace fastattn
