// fastattn::Graph, what a built or loaded graph holds: its layout (slots.h: what execute
// checks and fills), the frontend graph, and what a launch through cuDNN's backend itself
// needs (packs.h). Includes cudnn-frontend: for attention.cpp and the headers it alone
// includes (each translation unit that includes cudnn-frontend takes a minute to compile,
// and the process must have one copy of its statics).
#pragma once

#include <cudnn_frontend.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "fastattn.h"
#include "slots.h"

namespace fastattn {
namespace detail {

namespace fe = cudnn_frontend;

// What a launch through cuDNN's backend itself needs (packs.h), read from the
// frontend graph once, when the graph is made or loaded.
struct DirectLaunch {
    bool usable  = false;  // false: every call goes through the frontend's execute
    uint64_t serial = 0;   // this graph's, never reused: the key of its cached variant packs
    cudnnBackendDescriptor_t plan = nullptr;  // the chosen plan, owned by the frontend graph
    int64_t fe_workspace = 0;                 // the frontend's share of the workspace, ahead of cuDNN's
    std::vector<int64_t> uids;                // the variant pack's uids, sorted
    std::vector<void *> fixed;                // its pointers that never change (pass-by-value scalars)
    std::vector<int> user;                    // the caller's i-th pointer (uid order) goes to pack index user[i]
    std::vector<std::pair<int, int64_t>> in_workspace;  // pack index, byte offset into the workspace
    // What the frontend's run_auxiliary_kernels does to the workspace before each
    // launch: `bytes` at `offset` zeroed, or copied from `from` (a device constant,
    // device.h's constant_bytes).
    struct Edit {
        int64_t offset = 0;
        int64_t bytes  = 0;
        bool zero      = false;
        intptr_t from  = 0;
    };
    std::vector<Edit> edits;
    // Its execute would copy host memory into the workspace (edits of kind 0). Where the
    // launch cannot be direct, a caller's capture of it is refused (attention.cpp's run),
    // saying why it is not direct.
    bool copies_from_host = false;
    std::string why_not;
};

}  // namespace detail

class Graph : public detail::Layout {
   public:
    std::shared_ptr<detail::fe::graph::Graph> g;
    detail::DirectLaunch direct;
};

}  // namespace fastattn
