// Builds fastattn's kind of SDPA graph for a GPU known only by its cuDNN DeviceProperties JSON,
// with no cuDNN handle, and serializes the plan: the probe behind docs/DECISIONS.md's "Plans
// built without the GPU: what cuDNN allows". Run it through tools/deviceless_probe.sh, which
// builds it and chooses the cuDNN and the libcuda it sees.
//
//   deviceless_probe [--props FILE] [--dir fwd|bwd] [--out FILE] [--policy first|all]
//                    [--props-from-device] [--export-props FILE] [--no-sm-version]
//                    [--b B --h H --s S --d D] [--check PLAN]
//
// The graph: bf16 q, k, v of shape (b, h, s, d) in BHSD order (default 1, 8, 1024, 128), fp32
// intermediates, causal (top-left diagonal band, right bound 0), scale 1/sqrt(d); the forward
// generates stats (training), the backward takes o, dO and stats. Heuristics A then FALLBACK,
// the first plan that builds (as fastattn builds).
//
// Each step prints "STEP <name>: OK" or "STEP <name>: FAIL <code> <message>"; the exit status
// is 0 only when every step passed. --out also writes FILE.json, the blob as JSON.
// --export-props FILE writes device 0's DeviceProperties JSON (needs the GPU) and exits.
// --check PLAN (needs the GPU): loads PLAN (a blob --out wrote, for --dir) with a handle, runs it
// and the same graph built here on the device on the same random inputs (outputs poisoned with
// NaN first), and prints whether each output is bitwise equal ("CHECK ..."); the plan built
// here runs twice, so that a difference it has with itself (a nondeterministic backward) shows.
// Exit 0 only when every output is equal.
// --props-from-device takes the properties from device 0 instead of a file. Without --props,
// the built-in JSON describes an H100 SXM5 80GB (hand-written: a GPU's own export is what a
// plan meant for that GPU must be built from, since cuDNN checks a loaded plan's properties
// against the device's). --no-sm-version leaves the frontend to ask cudart for device 0's
// compute capability, as fastattn's build does today.
// cuDNN is loaded with dlopen("libcudnn.so.9"), so LD_LIBRARY_PATH picks the version.
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <cudnn_frontend.h>

namespace cudnn_frontend {
void *cudnn_dlhandle = nullptr;
}
namespace fe = cudnn_frontend;

// An H100 SXM5 80GB, hand-written in the key names cuDNN 9.28 requires (9.28 refuses a JSON
// without memoryBusWidth; the others are those XLA writes).
static const char *kH100 = R"({
  "deviceVer": 900,
  "multiProcessorCount": 132,
  "warpSize": 32,
  "maxSharedMemoryPerBlock": 49152,
  "maxSharedMemoryPerBlockOptin": 232448,
  "reservedSharedMemoryPerBlock": 1024,
  "maxRegistersPerSM": 65536,
  "maxCtasPerSM": 32,
  "maxThreadsPerBlock": 1024,
  "maxThreadsPerSM": 2048,
  "regsPerBlock": 65536,
  "totalGlobalMem": 84929347584,
  "smClockRateKHz": 1980000,
  "l2CacheSize": 52428800,
  "maxBlockSize": [1024, 1024, 64],
  "memClockRateKHz": 2619000,
  "memoryBusWidth": 5120,
  "maxGridSize": [2147483647, 65535, 65535],
  "supportCoopLaunch": 1,
  "pciDeviceId": 0,
  "isTccDriver": 0,
  "cudaDeviceId": 0,
  "driverVer": 13000,
  "deviceName": "NVIDIA H100 80GB HBM3"
})";

static bool step(const char *name, fe::error_t e) {
    if (e.is_good()) {
        std::printf("STEP %s: OK\n", name);
    } else {
        std::ostringstream c;
        c << e.get_code();
        std::printf("STEP %s: FAIL %s %s\n", name, c.str().c_str(), e.get_message().c_str());
    }
    std::fflush(stdout);
    return e.is_good();
}

static std::string read_file(const std::string &p);

// fastattn's graph as the probe builds it: bf16 q, k, v (b, h, s, d) in BHSD, fp32 stats,
// causal; uids 1 q, 2 k, 3 v, 4 o, 5 stats, 6 dO, 7 dQ, 8 dK, 9 dV.
// `configure` runs before the nodes exist: a node copies the graph's context (its SM version)
// when it is made.
static std::shared_ptr<fe::graph::Graph> make_graph(const std::string &dir, int64_t b, int64_t h, int64_t s,
                                                    int64_t d,
                                                    const std::function<void(fe::graph::Graph &)> &configure = {}) {
    auto g = std::make_shared<fe::graph::Graph>();
    g->set_io_data_type(fe::DataType_t::BFLOAT16)
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    if (configure) configure(*g);
    std::vector<int64_t> dims{b, h, s, d}, strd{h * s * d, s * d, d, 1};
    std::vector<int64_t> sdims{b, h, s, 1}, sstrd{h * s, s, 1, 1};
    auto tensor = [&](const char *name, int64_t uid, std::vector<int64_t> dm, std::vector<int64_t> st) {
        return g->tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim(dm).set_stride(st));
    };
    auto q = tensor("Q", 1, dims, strd), k = tensor("K", 2, dims, strd), v = tensor("V", 3, dims, strd);
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    if (dir == "fwd") {
        auto a = fe::graph::SDPA_attributes().set_name("sdpa").set_generate_stats(true).set_attn_scale(scale);
        a.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT).set_diagonal_band_right_bound(0);
        auto [o, stats] = g->sdpa(q, k, v, a);
        o->set_output(true).set_uid(4).set_dim(dims).set_stride(strd);
        stats->set_output(true).set_uid(5).set_dim(sdims).set_stride(sstrd).set_data_type(fe::DataType_t::FLOAT);
    } else {
        auto o = tensor("O", 4, dims, strd), d_o = tensor("dO", 6, dims, strd);
        auto stats = tensor("Stats", 5, sdims, sstrd);
        stats->set_data_type(fe::DataType_t::FLOAT);
        auto a = fe::graph::SDPA_backward_attributes().set_name("sdpa_backward").set_attn_scale(scale);
        a.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT).set_diagonal_band_right_bound(0);
        auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, d_o, stats, a);
        dq->set_output(true).set_uid(7).set_dim(dims).set_stride(strd);
        dk->set_output(true).set_uid(8).set_dim(dims).set_stride(strd);
        dv->set_output(true).set_uid(9).set_dim(dims).set_stride(strd);
    }
    return g;
}

static bool cuda_step(const char *name, cudaError_t e) {
    if (e == cudaSuccess) return true;
    std::printf("STEP %s: FAIL %s\n", name, cudaGetErrorString(e));
    return false;
}

// --check: the blob at `plan` against the same graph built on this device, on one set of inputs.
static int check(const std::string &plan, const std::string &dir, int64_t b, int64_t h, int64_t s, int64_t d) {
    cudnnHandle_t handle;
    if (fe::detail::create_handle(&handle) != CUDNN_STATUS_SUCCESS) {
        std::printf("STEP cudnnCreate: FAIL\n");
        return 1;
    }
    auto built_here = [&](const std::string &which) -> std::shared_ptr<fe::graph::Graph> {
        auto g = make_graph(which, b, h, s, d);
        if (!step("validate(here)", g->validate()) || !step("build_operation_graph(here)", g->build_operation_graph(handle)) ||
            !step("create_execution_plans(here)", g->create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK})) ||
            !step("check_support(here)", g->check_support(handle)) ||
            !step("build_plans(here)", g->build_plans(fe::BuildPlanPolicy_t::HEURISTICS_CHOICE)))
            return nullptr;
        return g;
    };
    auto normal = built_here(dir);
    if (!normal) return 1;
    std::string blob_text = read_file(plan);
    std::vector<uint8_t> blob(blob_text.begin(), blob_text.end());
    auto loaded = std::make_shared<fe::graph::Graph>();
    if (!step("deserialize(handle)", loaded->deserialize(handle, blob))) return 1;
    // A deserialized graph's plan name is not asked: on cuDNN 9.19 that query crashes the
    // process (docs/DECISIONS.md, "Plans built without the GPU").
    std::string n1;
    (void)normal->get_plan_name(n1);
    std::printf("plan built here %s\n", n1.c_str());
    std::fflush(stdout);

    const size_t n = static_cast<size_t>(b * h * s * d), ns = static_cast<size_t>(b * h * s);
    std::mt19937 rng(11);
    std::normal_distribution<float> normal_dist(0.0f, 1.0f);
    auto random_bf16 = [&](size_t count) {
        std::vector<uint16_t> x(count);
        for (auto &e : x) {
            float f = normal_dist(rng);
            uint32_t u;
            std::memcpy(&u, &f, 4);
            e = static_cast<uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
        }
        return x;
    };
    std::vector<void *> owned;
    auto device_copy = [&](const void *src, size_t bytes) -> void * {
        void *p = nullptr;
        if (!cuda_step("cudaMalloc", cudaMalloc(&p, bytes))) std::exit(1);
        owned.push_back(p);
        if (src) cuda_step("cudaMemcpy", cudaMemcpy(p, src, bytes, cudaMemcpyHostToDevice));
        return p;
    };
    auto hq = random_bf16(n), hk = random_bf16(n), hv = random_bf16(n), hdo = random_bf16(n);
    void *q = device_copy(hq.data(), n * 2), *k = device_copy(hk.data(), n * 2), *v = device_copy(hv.data(), n * 2);
    int64_t ws1 = 0, ws2 = 0;
    (void)normal->get_workspace_size(ws1);
    (void)loaded->get_workspace_size(ws2);
    void *ws = device_copy(nullptr, static_cast<size_t>(std::max<int64_t>({ws1, ws2, 1})) + 4096);
    std::unordered_map<int64_t, void *> base{{1, q}, {2, k}, {3, v}};
    // Outputs per run: uid -> bytes.
    std::vector<std::pair<int64_t, size_t>> outs;
    if (dir == "fwd") {
        outs = {{4, n * 2}, {5, ns * 4}};
    } else {
        // The backward's inputs o and stats from the forward built here, and a random dO.
        auto fwd = built_here("fwd");
        if (!fwd) return 1;
        void *o = device_copy(nullptr, n * 2), *stats = device_copy(nullptr, ns * 4);
        int64_t wsf = 0;
        (void)fwd->get_workspace_size(wsf);
        void *wsfp = device_copy(nullptr, static_cast<size_t>(std::max<int64_t>(wsf, 1)));
        std::unordered_map<int64_t, void *> fpack{{1, q}, {2, k}, {3, v}, {4, o}, {5, stats}};
        if (!step("execute forward (inputs of the backward)", fwd->execute(handle, fpack, wsfp))) return 1;
        base[4] = o;
        base[5] = stats;
        base[6] = device_copy(hdo.data(), n * 2);
        outs = {{7, n * 2}, {8, n * 2}, {9, n * 2}};
    }
    auto run = [&](const std::shared_ptr<fe::graph::Graph> &g, const char *what) {
        auto pack = base;
        std::vector<std::vector<uint8_t>> got;
        for (auto [uid, bytes] : outs) {
            void *p = device_copy(nullptr, bytes);
            cuda_step("cudaMemset", cudaMemset(p, 0xff, bytes));  // NaN: an unwritten element shows
            pack[uid] = p;
        }
        if (!step(what, g->execute(handle, pack, ws))) std::exit(1);
        cuda_step("cudaDeviceSynchronize", cudaDeviceSynchronize());
        for (auto [uid, bytes] : outs) {
            got.emplace_back(bytes);
            cuda_step("cudaMemcpy", cudaMemcpy(got.back().data(), pack[uid], bytes, cudaMemcpyDeviceToHost));
        }
        return got;
    };
    auto a = run(normal, "execute(built here)");
    auto a2 = run(normal, "execute(built here, again)");
    auto l = run(loaded, "execute(loaded)");
    bool all = true;
    for (size_t i = 0; i < outs.size(); ++i) {
        const bool here_again = a[i] == a2[i], same = a[i] == l[i];
        all = all && same;
        std::printf("CHECK %s uid %lld: built-here twice bitwise_equal=%d; loaded vs built-here bitwise_equal=%d\n",
                    dir.c_str(), (long long)outs[i].first, here_again, same);
    }
    for (void *p : owned) cudaFree(p);
    return all ? 0 : 1;
}

static std::string read_file(const std::string &p) {
    std::ifstream f(p, std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
}

int main(int argc, char **argv) {
    std::string props_file, dir = "fwd", out, policy = "first", export_props, check_plan;
    bool from_device = false, sm_version = true;
    int64_t b = 1, h = 8, s = 1024, d = 128;
    for (int i = 1; i < argc; ++i) {
        std::string a = argv[i];
        auto next = [&]() { return std::string(argv[++i]); };
        if (a == "--props") props_file = next();
        else if (a == "--dir") dir = next();
        else if (a == "--out") out = next();
        else if (a == "--policy") policy = next();
        else if (a == "--props-from-device") from_device = true;
        else if (a == "--export-props") export_props = next();
        else if (a == "--no-sm-version") sm_version = false;
        else if (a == "--b") b = std::stoll(next());
        else if (a == "--h") h = std::stoll(next());
        else if (a == "--s") s = std::stoll(next());
        else if (a == "--d") d = std::stoll(next());
        else if (a == "--check") check_plan = next();
        else { std::fprintf(stderr, "unknown argument %s\n", a.c_str()); return 2; }
    }
    try {
        void *lib = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_GLOBAL);
        if (!lib) { std::printf("STEP dlopen: FAIL %s\n", dlerror()); return 1; }
        fe::cudnn_dlhandle = lib;
        std::printf("cudnn_backend_version %zu (frontend headers %d)\n",
                    (size_t)fe::detail::get_backend_version(), CUDNN_FRONTEND_VERSION);
        if (!check_plan.empty()) return check(check_plan, dir, b, h, s, d);

        // 1. The target GPU's properties: from a JSON (no device), or from device 0.
        auto props = std::make_shared<fe::DeviceProperties>();
        if (from_device || !export_props.empty()) {
            if (!step("device_properties_from_device", props->set_device_id(0).build())) return 1;
        } else {
            std::string js = props_file.empty() ? std::string(kH100) : read_file(props_file);
            std::vector<uint8_t> buf(js.begin(), js.end());
            if (!step("device_properties_deserialize", props->deserialize(buf))) return 1;
        }
        std::vector<uint8_t> back;
        if (step("device_properties_serialize", props->serialize(back))) {
            std::printf("device_properties_json %s\n", std::string(back.begin(), back.end()).c_str());
        }
        if (!export_props.empty()) {
            std::ofstream(export_props, std::ios::binary).write(reinterpret_cast<const char *>(back.data()), back.size());
            std::printf("wrote %s\n", export_props.c_str());
            return back.empty() ? 1 : 0;
        }

        // 2. fastattn's graph (make_graph), for the properties' GPU.
        auto g = make_graph(dir, b, h, s, d, [&](fe::graph::Graph &graph) {
            graph.set_device_properties(props);
            if (sm_version) graph.set_sm_version(90);  // else the frontend asks cudart for device 0's CC
        });

        if (!step("validate", g->validate())) return 1;
        if (!step("build_operation_graph(no handle)", g->build_operation_graph())) return 1;
        if (!step("create_execution_plans(A,FALLBACK)", g->create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}))) return 1;
        std::printf("execution_plan_count %lld\n", (long long)g->get_execution_plan_count());
        for (int64_t i = 0; i < g->get_execution_plan_count(); ++i) {
            std::string n;
            if (g->get_plan_name_at_index(i, n).is_good()) std::printf("candidate %lld %s\n", (long long)i, n.c_str());
        }
        if (!step("check_support(no handle)", g->check_support())) return 1;
        auto pol = policy == "all" ? fe::BuildPlanPolicy_t::ALL : fe::BuildPlanPolicy_t::HEURISTICS_CHOICE;
        if (!step("build_plans(no handle)", g->build_plans(pol))) return 1;
        std::string name;
        if (step("get_plan_name", g->get_plan_name(name))) std::printf("plan_name %s\n", name.c_str());
        int64_t ws = -1;
        if (step("get_workspace_size", g->get_workspace_size(ws))) std::printf("workspace_size %lld\n", (long long)ws);

        std::vector<uint8_t> blob;
        if (!step("serialize", g->serialize(blob))) return 1;
        std::printf("serialized_bytes %zu\n", blob.size());
        if (!out.empty()) {
            std::ofstream(out, std::ios::binary).write(reinterpret_cast<const char *>(blob.data()), blob.size());
            std::printf("wrote %s\n", out.c_str());
            std::ofstream(out + ".json") << nlohmann::json::from_ubjson(blob).dump(1);
        }

        // 3. Round trip without a handle, against the same DeviceProperties.
        auto g2 = std::make_shared<fe::graph::Graph>();
        g2->set_device_properties(props);
        if (!step("deserialize(no handle)", g2->deserialize(blob))) return 1;
    } catch (const std::exception &e) {
        std::printf("STEP exception: FAIL %s\n", e.what());
        return 1;
    }
    return 0;
}
