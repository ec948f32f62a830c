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

#include "config_gen.h"    // Config and its enums, generated from AttentionConfig's field registry
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

// Whether q, k, v are FP8: the graphs are then cudnn-frontend's FP8 ones (graphs_fp8.h).
inline bool is_fp8(DType t) { return t == DType::kFp8E4m3 || t == DType::kFp8E5m2; }

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
// fastattn's own refusals of that graph alone, without asking cuDNN (and so without a
// device): what build_graph would refuse before cuDNN is asked. build_plan checks a
// training plan's backward so before it spends a forward build.
Status check_graph(const Config &cfg, Direction dir);

// Plans for a GPU this process does not have (`fastattn warm --for`). The GPU is known by
// cuDNN's DeviceProperties JSON, exported on it by export_device_properties; build_graph_for
// then builds the graph build_graph would build there, with no device and no cuDNN handle,
// and serializes its plan (what serialize_graph gives). cuDNN still needs a libcuda that
// accepts the kernels it generates (fastattn/target.py loads a stand-in for that).
Status export_device_properties(int device, std::string *json);
Status build_graph_for(const Config &cfg, Direction dir, const std::string &properties, int sm_version,
                       std::vector<uint8_t> *blob, GraphInfo *info);

// Plan blob without graph structure: what the persistent cache stores.
Status serialize_graph(const Graph *g, std::vector<uint8_t> *blob);
// `cfg` must be the config the blob was built from: it says which tensors the plan takes.
Status deserialize_graph(const uint8_t *data, size_t size, const Config &cfg, Direction dir, int device,
                         GraphPtr *out, GraphInfo *info);

// This thread's cuDNN handle for `device`, handed to the next thread that needs one (its
// first launch then skips cudnnCreate): for a thread done with cuDNN on that device.
Status hand_on_thread_handle(int device);

// Loads the kernels of a built or loaded graph, which CUDA's lazy module loading loads at
// their first launch: launches it once on a private stream, in relaxed capture mode, on
// zeroed scratch tensors of `bytes[slot]` bytes each (kNumSlots entries; every slot the
// graph takes needs its size), allocated stream-ordered there and freed before the return,
// which waits for that stream alone; its lengths (seq_len_q, seq_len_kv: int32 arrays of
// bytes / 4) are `seq_len_q` and `seq_len_kv`, which must fit the scratch (a ragged
// graph's sequences all start at offset 0). Refused where that scratch would take more
// than half of the device's free memory. Touches no caller's stream and makes no
// context of its own (the device's primary one must exist). For a thread beside the
// caller's work (the warm-up), so that the caller's first launch of the graph does not
// load them.
Status prime_graph(const Graph *g, int device, const int64_t *bytes, int32_t seq_len_q, int32_t seq_len_kv);
// The hot path: validates pointers, then runs. No allocation, synchronization or
// copy. `slots` holds kNumSlots raw addresses indexed by Slot (0: not given); the
// stream is a raw address too (0: the default stream). `dir` must be the graph's.
Status execute(const Graph *g, Direction dir, int device, const intptr_t *slots, intptr_t workspace,
               intptr_t stream);

// A call of a shape-override plan (Config::shape_override, forward only) at lengths of its
// own: at most the config's seqlen_q and seqlen_kv, and on the same side of seqlen_q == 1
// (cuDNN's override does not cross it). Strides in (batch, head, seq, dim) order, the
// config's own along every dimension of more than one element: the tensors lie in buffers
// laid out for the declared lengths (cuDNN may read them all), of which the call uses the
// first seqlen_q and seqlen_kv rows.
struct CallShape {
    int64_t seqlen_q = 0, seqlen_kv = 0;
    int64_t q_stride[4] = {}, k_stride[4] = {}, v_stride[4] = {}, o_stride[4] = {};
};

// execute at `shape`: the same checks, then cuDNN's execute with the shapes and strides
// overridden (through the frontend's execute, which builds a map per call: a shape-
// override launch costs about a microsecond more than execute's).
Status execute_at(const Graph *g, Direction dir, int device, const intptr_t *slots, intptr_t workspace,
                  intptr_t stream, const CallShape &shape);

}  // namespace fastattn
