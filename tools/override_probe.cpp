// cuDNN's shape override for SDPA (cuDNN >= 9.21): one forward plan declared
// for a class's longest length, run at shorter lengths by overriding q, k, v, o (and the
// stats) at execute, against a plan built for each length exactly. Answers, on the GPU machine
// and the cuDNN that LD_LIBRARY_PATH (or tools/other_cudnn.sh run) gives it:
//   - does cuDNN build an override-enabled SDPA plan, and run it at each length asked;
//   - is its output bitwise (or how near) the exact plan's, on the same random inputs;
//   - its kernel time (CUDA events, median of rounds) and host time per execute against the
//     exact plan's, and the exact plans' build time that the class plan saves.
//
//   override_probe [--b B] [--h H] [--hk HK] [--d D] [--smax S] [--lengths 1,64,100,...]
//                  [--causal] [--training] [--iters N] [--rounds R]
// K's override is in its declared (b, h, s, d) order; OVERRIDE_KT=1 gives it as K^T (b, h, d, s)
// instead, the composite SDPA node's view. The buffers are laid out for each run's length;
// OVERRIDE_STORAGE=1 lays them out for the declared length (the strides the plan was built with)
// and overrides the dims alone. (What each gave on an H100: docs/BENCHMARKS.md, "Shape classes".)
// Prints one `length` line per length and a `summary` line; exit 0 when every step ran (a
// refusal is a finding, printed with cuDNN's message), 1 on a failure to run at all.
// Built and run by tools/override_probe.sh.
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <cudnn_frontend.h>

namespace cudnn_frontend {
void *cudnn_dlhandle = nullptr;
}
namespace fe = cudnn_frontend;

namespace {

#define CUDA_OK(x)                                                                                    \
    do {                                                                                              \
        cudaError_t e_ = (x);                                                                         \
        if (e_ != cudaSuccess) {                                                                      \
            std::printf("FAIL %s: %s\n", #x, cudaGetErrorString(e_));                                \
            std::exit(1);                                                                             \
        }                                                                                             \
    } while (0)

enum Uid : int64_t { kQ = 1, kK = 2, kV = 3, kO = 4, kStats = 5 };

struct Shape {
    int64_t b, h, hk, d;
    bool causal, training;
};

// BSHD (a model's layout): the strides of (b, h, s, d) for length s.
std::vector<int64_t> bshd(int64_t s, int64_t heads, int64_t d) { return {s * heads * d, d, heads * d, 1}; }
std::vector<int64_t> stats_strides(int64_t s, int64_t heads) { return {heads * s, s, 1, 1}; }

std::string message(fe::error_t e) {
    std::ostringstream c;
    c << e.get_code() << " " << e.get_message();
    std::string m = c.str();
    std::replace(m.begin(), m.end(), '\n', ' ');
    return m.substr(0, 300);
}

struct Built {
    std::shared_ptr<fe::graph::Graph> g;
    std::string error;  // empty: built
    double build_ms = 0;
    int64_t workspace = 0;
    std::string plan;
};

// `storage`: the length the buffers are laid out for (the strides' length): s itself, or the
// class's declared length (OVERRIDE_STORAGE=declared), where rows past s are never read.
Built build(cudnnHandle_t handle, const Shape &x, int64_t s, int64_t storage, bool override_shapes) {
    Built r;
    auto t0 = std::chrono::steady_clock::now();
    r.g = std::make_shared<fe::graph::Graph>();
    auto &g = *r.g;
    g.set_io_data_type(fe::DataType_t::BFLOAT16)
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    if (override_shapes) g.set_override_shape_enabled(true);
    auto tensor = [&](const char *name, int64_t uid, int64_t heads) {
        return g.tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim({x.b, heads, s, x.d})
                            .set_stride(bshd(storage, heads, x.d)));
    };
    auto q = tensor("Q", kQ, x.h), k = tensor("K", kK, x.hk), v = tensor("V", kV, x.hk);
    auto a = fe::graph::SDPA_attributes().set_name("sdpa").set_generate_stats(x.training)
                 .set_attn_scale(1.0f / std::sqrt(static_cast<float>(x.d)));
    if (x.causal) a.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT).set_diagonal_band_right_bound(0);
    auto [o, stats] = g.sdpa(q, k, v, a);
    o->set_output(true).set_uid(kO).set_dim({x.b, x.h, s, x.d}).set_stride(bshd(storage, x.h, x.d));
    if (x.training) {
        stats->set_output(true).set_uid(kStats).set_data_type(fe::DataType_t::FLOAT).set_dim({x.b, x.h, s, 1})
            .set_stride(stats_strides(storage, x.h));
    }
    if (auto e = g.validate(); e.is_bad()) return r.error = "validate: " + message(e), r;
    if (auto e = g.build_operation_graph(handle); e.is_bad()) return r.error = "build_operation_graph: " + message(e), r;
    if (auto e = g.create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}); e.is_bad())
        return r.error = "create_execution_plans: " + message(e), r;
    if (auto e = g.check_support(handle); e.is_bad()) return r.error = "check_support: " + message(e), r;
    if (auto e = g.build_plans(fe::BuildPlanPolicy_t::HEURISTICS_CHOICE); e.is_bad())
        return r.error = "build_plans: " + message(e), r;
    if (auto e = g.get_workspace_size(r.workspace); e.is_bad()) return r.error = "get_workspace_size: " + message(e), r;
    (void)g.get_plan_name(r.plan);
    r.build_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    return r;
}

uint16_t to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u += 0x7fff + ((u >> 16) & 1);  // round to nearest even
    return static_cast<uint16_t>(u >> 16);
}

float from_bf16(uint16_t h) {
    uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

}  // namespace

int main(int argc, char **argv) {
    Shape x{2, 16, 4, 128, true, false};
    int64_t smax = 4096;
    std::vector<int64_t> lengths{64, 100, 511, 1000, 2049, 3000, 4096};
    int iters = 20, rounds = 5;
    for (int i = 1; i < argc; ++i) {
        std::string a = argv[i];
        auto next = [&]() { return std::string(argv[++i]); };
        if (a == "--b") x.b = std::stoll(next());
        else if (a == "--h") x.h = std::stoll(next());
        else if (a == "--hk") x.hk = std::stoll(next());
        else if (a == "--d") x.d = std::stoll(next());
        else if (a == "--smax") smax = std::stoll(next());
        else if (a == "--causal") x.causal = true;
        else if (a == "--no-causal") x.causal = false;
        else if (a == "--training") x.training = true;
        else if (a == "--iters") iters = std::stoi(next());
        else if (a == "--rounds") rounds = std::stoi(next());
        else if (a == "--lengths") {
            lengths.clear();
            std::stringstream ss(next());
            for (std::string t; std::getline(ss, t, ',');) lengths.push_back(std::stoll(t));
        } else {
            std::fprintf(stderr, "unknown argument %s\n", a.c_str());
            return 2;
        }
    }
    void *lib = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_GLOBAL);
    if (!lib) {
        std::printf("FAIL dlopen: %s\n", dlerror());
        return 1;
    }
    fe::cudnn_dlhandle = lib;
    std::printf("cudnn %zu, frontend headers %d; b=%lld h=%lld hk=%lld d=%lld smax=%lld causal=%d training=%d\n",
                (size_t)fe::detail::get_backend_version(), CUDNN_FRONTEND_VERSION, (long long)x.b, (long long)x.h,
                (long long)x.hk, (long long)x.d, (long long)smax, x.causal, x.training);
    CUDA_OK(cudaSetDevice(0));
    cudnnHandle_t handle;
    if (fe::detail::create_handle(&handle) != CUDNN_STATUS_SUCCESS) {
        std::printf("FAIL cudnnCreate\n");
        return 1;
    }
    cudaStream_t stream;
    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    (void)fe::detail::set_stream(handle, stream);

    const bool declared_storage = std::getenv("OVERRIDE_STORAGE") != nullptr;
    std::printf("buffers laid out for %s\n", declared_storage ? "the declared length (OVERRIDE_STORAGE)" : "each run's length");
    Built cls = build(handle, x, smax, smax, true);
    if (!cls.error.empty()) {
        std::printf("class plan (override, declared %lld): REFUSED %s\nsummary refused\n", (long long)smax,
                    cls.error.c_str());
        return 0;
    }
    std::printf("class plan (override, declared %lld): built in %.1f ms, workspace %lld, plan %s\n",
                (long long)smax, cls.build_ms, (long long)cls.workspace, cls.plan.c_str());

    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    double exact_build_ms = 0;
    int equal = 0, ran = 0;
    for (int64_t s : lengths) {
        const int64_t st = declared_storage ? smax : s;
        const size_t nq = x.b * st * x.h * x.d, nk = x.b * st * x.hk * x.d;
        std::vector<uint16_t> hq(nq), hk(nk), hv(nk);
        for (auto *buf : {&hq, &hk, &hv})
            for (auto &e : *buf) e = to_bf16(normal(rng));
        void *dq, *dk, *dv, *o_cls, *o_exact, *stats, *ws;
        CUDA_OK(cudaMalloc(&dq, nq * 2));
        CUDA_OK(cudaMalloc(&dk, nk * 2));
        CUDA_OK(cudaMalloc(&dv, nk * 2));
        CUDA_OK(cudaMalloc(&o_cls, nq * 2));
        CUDA_OK(cudaMalloc(&o_exact, nq * 2));
        CUDA_OK(cudaMalloc(&stats, x.b * x.h * st * 4 + 16));
        CUDA_OK(cudaMemcpy(dq, hq.data(), nq * 2, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(dk, hk.data(), nk * 2, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(dv, hv.data(), nk * 2, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemset(o_cls, 0xff, nq * 2));  // NaN: an element never written shows
        CUDA_OK(cudaMemset(o_exact, 0xff, nq * 2));

        Built exact = build(handle, x, s, st, false);
        exact_build_ms += exact.build_ms;
        const int64_t wsz = std::max(cls.workspace, exact.error.empty() ? exact.workspace : 0) + 256;
        CUDA_OK(cudaMalloc(&ws, wsz));

        std::unordered_map<int64_t, void *> pack_cls{{kQ, dq}, {kK, dk}, {kV, dv}, {kO, o_cls}};
        std::unordered_map<int64_t, void *> pack_exact{{kQ, dq}, {kK, dk}, {kV, dv}, {kO, o_exact}};
        std::vector<int64_t> uids{kQ, kK, kV, kO};
        // K in the graph's declared (b, h, s, d) order: cudnn-frontend 1.28's unified SDPA node
        // (the one it picks with cuDNN >= 9.21) keeps K so; only its composite node swaps K to
        // K^T (b, h, d, s), which OVERRIDE_KT gives instead (measured wrong, docs/BENCHMARKS.md).
        auto kt = bshd(st, x.hk, x.d);
        std::swap(kt[2], kt[3]);
        const bool as_kt = std::getenv("OVERRIDE_KT") != nullptr;
        std::vector<std::vector<int64_t>> shapes{{x.b, x.h, s, x.d},
                                                 as_kt ? std::vector<int64_t>{x.b, x.hk, x.d, s}
                                                       : std::vector<int64_t>{x.b, x.hk, s, x.d},
                                                 {x.b, x.hk, s, x.d}, {x.b, x.h, s, x.d}};
        std::vector<std::vector<int64_t>> strides{bshd(st, x.h, x.d), as_kt ? kt : bshd(st, x.hk, x.d),
                                                  bshd(st, x.hk, x.d), bshd(st, x.h, x.d)};
        if (x.training) {
            pack_cls[kStats] = stats;
            pack_exact[kStats] = stats;
            uids.push_back(kStats);
            shapes.push_back({x.b, x.h, s, 1});
            strides.push_back(stats_strides(st, x.h));
        }
        auto run_cls = [&]() { return cls.g->execute(handle, pack_cls, ws, uids, shapes, strides); };
        auto run_exact = [&]() { return exact.g->execute(handle, pack_exact, ws); };
        fe::error_t e = run_cls();
        if (e.is_bad()) {
            std::printf("length %lld: class plan REFUSED at execute: %s\n", (long long)s, message(e).c_str());
        } else if (!exact.error.empty()) {
            std::printf("length %lld: class plan ran; exact plan refused: %s\n", (long long)s, exact.error.c_str());
        } else if ((e = run_exact()).is_bad()) {
            std::printf("length %lld: exact plan failed at execute: %s\n", (long long)s, message(e).c_str());
        } else {
            CUDA_OK(cudaStreamSynchronize(stream));
            std::vector<uint16_t> a(nq), b(nq);
            CUDA_OK(cudaMemcpy(a.data(), o_cls, nq * 2, cudaMemcpyDeviceToHost));
            CUDA_OK(cudaMemcpy(b.data(), o_exact, nq * 2, cudaMemcpyDeviceToHost));
            size_t unwritten = 0;
            double max_abs = 0;
            for (size_t i = 0; i < nq; ++i) {
                if ((i / (x.h * x.d)) % st >= static_cast<size_t>(s)) continue;  // a row past s: not o's
                const float fa = from_bf16(a[i]), fb = from_bf16(b[i]);
                if (std::isnan(fa)) ++unwritten;
                max_abs = std::max(max_abs, static_cast<double>(std::fabs(fa - fb)));
            }
            const bool same = max_abs == 0 && unwritten == 0;
            // Kernel time (events) and host time per execute, interleaved rounds, medians.
            cudaEvent_t e0, e1;
            CUDA_OK(cudaEventCreate(&e0));
            CUDA_OK(cudaEventCreate(&e1));
            std::vector<double> k_cls, k_exact, h_cls, h_exact;
            for (int r = 0; r < rounds; ++r) {
                for (int which = 0; which < 2; ++which) {
                    CUDA_OK(cudaStreamSynchronize(stream));
                    auto t0 = std::chrono::steady_clock::now();
                    CUDA_OK(cudaEventRecord(e0, stream));
                    for (int i = 0; i < iters; ++i) (void)(which == 0 ? run_cls() : run_exact());
                    CUDA_OK(cudaEventRecord(e1, stream));
                    const double host_us =
                        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / iters;
                    CUDA_OK(cudaEventSynchronize(e1));
                    float ms = 0;
                    CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
                    (which == 0 ? k_cls : k_exact).push_back(1000.0 * ms / iters);
                    (which == 0 ? h_cls : h_exact).push_back(host_us);
                }
            }
            ++ran;
            equal += same;
            std::printf("length %lld: bitwise_equal=%d max_abs=%.3g unwritten=%zu kernel_us class=%.1f exact=%.1f "
                        "(%.3fx) host_us class=%.1f exact=%.1f exact_build_ms=%.1f exact_plan=%s\n",
                        (long long)s, same, max_abs, unwritten, median(k_cls), median(k_exact),
                        median(k_cls) / median(k_exact), median(h_cls), median(h_exact), exact.build_ms,
                        exact.plan.c_str());
            CUDA_OK(cudaEventDestroy(e0));
            CUDA_OK(cudaEventDestroy(e1));
        }
        for (void *p : {dq, dk, dv, o_cls, o_exact, stats, ws}) CUDA_OK(cudaFree(p));
    }
    std::printf("summary ran %d of %zu lengths, %d bitwise equal to the exact plan; class plan build %.1f ms, "
                "exact plans' builds %.1f ms in all\n",
                ran, lengths.size(), equal, cls.build_ms, exact_build_ms);
    return 0;
}
