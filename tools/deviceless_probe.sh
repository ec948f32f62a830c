#!/usr/bin/env bash
# What cuDNN allows without the GPU: builds tools/deviceless_probe.cpp (fastattn's kind of SDPA
# graph, built with no cuDNN handle for a GPU given by its DeviceProperties JSON, then
# serialized) and runs it against a chosen cuDNN and a chosen libcuda. The evidence it gave is
# in docs/DECISIONS.md ("Plans built without the GPU: what cuDNN allows").
#
#   bash tools/deviceless_probe.sh build
#       compiles the probe into $BUILD (default /tmp/fastattn-deviceless), with cudnn-frontend's,
#       cuDNN's, CUDA's and NVRTC's headers found in $PYTHON's site-packages (default python3)
#       or given as FE_INC, CUDNN_INC, CUDA_INC, NVRTC_INC.
#   bash tools/deviceless_probe.sh run DRIVER [probe arguments...]
#       runs it with $CUDNN_LIB (default: $PYTHON's nvidia/cudnn/lib) and $EXTRA_LIB (default:
#       $PYTHON's nvidia/cu13/lib, whose libcublasLt cuDNN 9.19 needs) first on LD_LIBRARY_PATH,
#       then the libcuda that DRIVER names:
#         system  whatever the machine has (none on a CPU machine; the real one on a GPU machine)
#         stub    a stand-in for the CUDA toolkit's stub libcuda.so: every entry point cuda.h
#                 declares returns CUDA_ERROR_STUB_LIBRARY (34), as the toolkit's does
#         fake    the stub, except cuInit, cuDeviceGetCount (1 device), cuDriverGetVersion
#                 (13000), cuLibraryLoadData, cuLibraryGetKernel, cuLibraryUnload (opaque
#                 handles) and cuGetErrorString/Name, which succeed: what cuDNN's plan finalize
#                 calls. Not a driver: it loads and runs nothing.
#       A stub or fake placed first on LD_LIBRARY_PATH also hides a real driver, so on the GPU
#       machine "stub" and "fake" are processes that cannot see it. Both log every driver call
#       they receive ("STUB name"). cuDNN's own log (CUDNN_LOGLEVEL_DBG=3) and the frontend's
#       go to $BUILD/logs/<tag>.err; the probe's STEP lines to stdout and <tag>.out.
#   bash tools/deviceless_probe.sh matrix
#       the table's runs, for each cuDNN library folder in $CUDNN_LIBS (colon-separated; default
#       $CUDNN_LIB): drivers system, stub and fake, forward and backward, plus
#       CUDNN_LIB_CONFIG=GRAPH_JIT_ONLY, the frontend's own compute-capability query
#       (--no-sm-version) and properties from the device (--props-from-device).
#
#   bash tools/deviceless_probe.sh gpu-check
#       on the GPU machine, DECISIONS.md's verification, steps 1 to 3: the GPU's own properties
#       (--export-props), each direction built from them with the stand-in libcuda and with the
#       real driver (the same plan, rawData left out?), and the stand-in's plan loaded with a
#       handle and run against the plan built there on the same inputs (--check: bitwise?).
#   bash tools/deviceless_probe.sh gpu-check-fields
#       step 4: the GPU's properties with one field changed at a time (a smaller part, an older
#       driver, another name, SM 8.0, ...), a forward plan built from each by the stand-in, then
#       loaded with a handle and run there: which fields cuDNN checks at load.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${BUILD:-/tmp/fastattn-deviceless}"
PYTHON="${PYTHON:-python3}"

PROBE=deviceless_probe
. "$ROOT/tools/probe_paths.sh"

build() {
    local sp; sp="$(site)"
    local fe cudnn cuda nvrtc
    fe="${FE_INC:-$(first_dir_with cudnn_frontend.h "$sp/include" "$sp/cudnn_frontend/include")}"
    cudnn="${CUDNN_INC:-$(first_dir_with cudnn.h "$sp/nvidia/cudnn/include" /usr/include)}"
    cuda="${CUDA_INC:-$(first_dir_with cuda_runtime.h "$sp/nvidia/cu13/include" /usr/local/cuda/include)}"
    nvrtc="${NVRTC_INC:-$(first_dir_with nvrtc.h "$sp/nvidia/cu13/include" /usr/local/cuda/include)}"
    # cudart for --check's buffers; the CUDA toolkit's libcudart stub is enough to link, and a
    # machine without the driver never calls it (only --check does, on the GPU machine).
    local cudart; cudart="$(first_dir_with libcudart.so.13 "$cuda/../lib" /usr/local/cuda/lib64 /usr/local/cuda/lib)"
    mkdir -p "$BUILD"
    # -I order: cuda_fp16.h needs <nv/target> and the crt headers, which the cu13 folder has.
    g++ -std=c++17 -O1 -DNV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING -I "$fe" -I "$cudnn" -I "$cuda" \
        -I "$nvrtc" -I /usr/local/cuda/include "$ROOT/tools/deviceless_probe.cpp" -o "$BUILD/deviceless_probe" \
        -L "$cudart" -l:libcudart.so.13 -ldl
    echo "built $BUILD/deviceless_probe"
}

libcuda() {  # libcuda stub|fake: writes $BUILD/$1/libcuda.so.1 from cuda.h's declarations
    local kind="$1" inc
    inc="${CUDA_INC:-$(first_dir_with cuda.h "$(site)/nvidia/cu13/include" /usr/local/cuda/include)}"
    mkdir -p "$BUILD/$kind"
    "$PYTHON" - "$inc" "$kind" "$BUILD/$kind/libcuda.c" <<'EOF'
import re, subprocess, sys
inc, kind, out = sys.argv[1:]
names = set(re.findall(r"\b(cu[A-Z]\w*)\s*\(", open(f"{inc}/cuda.h").read()))
for extra in ([], ["-DCUDA_API_PER_THREAD_DEFAULT_STREAM=1"]):  # the _v2 and _ptds/_ptsz names
    pre = subprocess.run(["gcc", "-E", "-I", inc, *extra, "-"], input="#include <cuda.h>\n",
                         capture_output=True, text=True, check=True).stdout
    names |= set(re.findall(r"\bCUresult (?:CUDAAPI )?(cu[A-Z]\w*) ?\(", re.sub(r"\s+", " ", pre)))
succeed = {
    "cuInit": "int cuInit(unsigned f) { say(\"cuInit (ok)\"); return 0; }",
    "cuDeviceGetCount": "int cuDeviceGetCount(int *n) { say(\"cuDeviceGetCount (ok: 1)\"); *n = 1; return 0; }",
    "cuDriverGetVersion": "int cuDriverGetVersion(int *v) { say(\"cuDriverGetVersion (ok: 13000)\"); *v = 13000; return 0; }",
    "cuLibraryLoadData": "int cuLibraryLoadData(void **l, const void *c, void *a, void *b, unsigned n, void *d, void *e, unsigned m) { static long k; say(\"cuLibraryLoadData (ok)\"); *l = (void *)(0x1000 + ++k); return 0; }",
    "cuLibraryGetKernel": "int cuLibraryGetKernel(void **k, void *l, const char *name) { say(\"cuLibraryGetKernel (ok)\"); say(name); *k = (void *)0x2000; return 0; }",
    "cuLibraryUnload": "int cuLibraryUnload(void *l) { say(\"cuLibraryUnload (ok)\"); return 0; }",
    "cuGetErrorString": "int cuGetErrorString(int e, const char **s) { say(\"cuGetErrorString\"); *s = \"stand-in libcuda: not a driver\"; return 0; }",
    "cuGetErrorName": "int cuGetErrorName(int e, const char **s) { say(\"cuGetErrorName\"); *s = \"CUDA_ERROR_STUB_LIBRARY\"; return 0; }",
} if kind == "fake" else {}
with open(out, "w") as f:
    f.write("#include <stdio.h>\nstatic int say(const char *n) { fprintf(stderr, \"STUB %s\\n\", n); return 34; }\n")
    for n in sorted(names):
        f.write(succeed.get(n, f"int {n}(void) {{ return say(\"{n}\"); }}") + "\n")
EOF
    gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$BUILD/$kind/libcuda.so.1" "$BUILD/$kind/libcuda.c"
}

run() {  # run [TAG=...] DRIVER ARGS...
    local driver="$1"; shift
    [ -x "$BUILD/deviceless_probe" ] || build >&2
    local sp; sp="$(site)"
    local path="${CUDNN_LIB:-$sp/nvidia/cudnn/lib}:${EXTRA_LIB:-$sp/nvidia/cu13/lib}"
    case "$driver" in
        system) ;;
        stub|fake) [ -e "$BUILD/$driver/libcuda.so.1" ] || libcuda "$driver"; path="$path:$BUILD/$driver" ;;
        *) echo "deviceless_probe: DRIVER is system, stub or fake" >&2; return 2 ;;
    esac
    local tag="${TAG:-$driver}"
    mkdir -p "$BUILD/logs"
    local rc=0
    env LD_LIBRARY_PATH="$path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CUDNN_LOGLEVEL_DBG=3 CUDNN_LOGDEST_DBG=stderr \
        CUDNN_FRONTEND_LOG_INFO=1 CUDNN_FRONTEND_LOG_FILE=stderr \
        "$BUILD/deviceless_probe" "$@" >"$BUILD/logs/$tag.out" 2>"$BUILD/logs/$tag.err" || rc=$?
    echo "=== $tag (driver $driver, exit $rc): $*"
    grep -E '^(cudnn_backend_version|STEP .*FAIL|candidate|plan_name|serialized_bytes|wrote)' "$BUILD/logs/$tag.out" || true
    grep -E '^e! .*Reason|^Unable to load' "$BUILD/logs/$tag.err" | sort -u | head -8 || true
    echo "driver calls: $(grep '^STUB' "$BUILD/logs/$tag.err" | sort | uniq -c | tr -s ' ' | tr '\n' ';')"
    return $rc
}

matrix() {
    local sp; sp="$(site)"
    local libs="${CUDNN_LIBS:-${CUDNN_LIB:-$sp/nvidia/cudnn/lib}}" lib v i=0
    IFS=: read -ra dirs <<<"$libs"
    for lib in "${dirs[@]}"; do
        v="cudnn$((++i))"  # a label; each run prints the version it loaded
        echo "##### $v: $lib"
        for driver in system stub fake; do
            for dir in fwd bwd; do
                CUDNN_LIB="$lib" TAG="$v-$driver-$dir" run "$driver" --dir "$dir" --out "$BUILD/logs/$v-$driver-$dir.plan" || true
            done
        done
        CUDNN_LIB="$lib" TAG="$v-jit-only-system" CUDNN_LIB_CONFIG=GRAPH_JIT_ONLY run system --dir fwd || true
        CUDNN_LIB="$lib" TAG="$v-jit-only-stub" CUDNN_LIB_CONFIG=GRAPH_JIT_ONLY run stub --dir fwd || true
        CUDNN_LIB="$lib" TAG="$v-no-sm-version-fake" run fake --dir fwd --no-sm-version || true
        for driver in system stub fake; do
            CUDNN_LIB="$lib" TAG="$v-props-from-device-$driver" run "$driver" --dir fwd --props-from-device || true
        done
    done
}

same_plan() {  # same_plan A.json B.json: equal once kernelParams' rawData (host bytes) is left out
    "$PYTHON" - "$1" "$2" <<'EOF'
import json, sys
def strip(x):
    # cudnn_backend_data is JSON inside a string: its rawData is left out too.
    if isinstance(x, str) and x[:1] in "{[":
        try:
            return strip(json.loads(x))
        except ValueError:
            return x
    if isinstance(x, dict):
        return {k: strip(v) for k, v in x.items() if k != "rawData"}
    return [strip(v) for v in x] if isinstance(x, list) else x
def diff(x, y, at="$"):
    if type(x) is not type(y) or not isinstance(x, (dict, list)):
        if x != y:
            yield f"{at}: {str(x)[:80]!r} vs {str(y)[:80]!r}"
        return
    keys = sorted(set(x) | set(y)) if isinstance(x, dict) else range(max(len(x), len(y)))
    for k in keys:
        if isinstance(x, dict) and (k not in x or k not in y):
            yield f"{at}.{k}: only in {'the second' if k not in x else 'the first'}"
        elif isinstance(x, list) and k >= min(len(x), len(y)):
            yield f"{at}[{k}]: only in one"
        else:
            yield from diff(x[k], y[k], f"{at}.{k}" if isinstance(x, dict) else f"{at}[{k}]")
a, b = (strip(json.load(open(p))) for p in sys.argv[1:])
print(f"same plan (rawData left out): {a == b}: {sys.argv[1]} {sys.argv[2]}")
for line in list(diff(a, b))[:20]:
    print(f"  differs at {line}")
sys.exit(0 if a == b else 1)
EOF
}

gpu_check() {  # DECISIONS.md's steps 1 to 3, on the GPU machine
    local rc=0
    TAG=export-props run system --export-props "$BUILD/gpu.json" || return 1
    for dir in fwd bwd; do
        TAG="fake-$dir" run fake --props "$BUILD/gpu.json" --dir "$dir" --out "$BUILD/$dir-fake.plan" || rc=1
        TAG="system-$dir" run system --props "$BUILD/gpu.json" --dir "$dir" --out "$BUILD/$dir-system.plan" || rc=1
        same_plan "$BUILD/$dir-fake.plan.json" "$BUILD/$dir-system.plan.json" || rc=1
        TAG="check-$dir" run system --dir "$dir" --check "$BUILD/$dir-fake.plan" || rc=1
        grep -h '^CHECK\|^plan built here' "$BUILD/logs/check-$dir.out" || true
    done
    return $rc
}

gpu_check_fields() {  # DECISIONS.md's step 4, on the GPU machine, after gpu-check (its gpu.json)
    # One field of the GPU's own properties changed at a time: a forward plan built from them
    # by the stand-in libcuda, then loaded with a handle and run here (--check): which fields
    # does cuDNN check at load (refused), and which change the plan it builds?
    [ -f "$BUILD/gpu.json" ] || TAG=export-props run system --export-props "$BUILD/gpu.json" || return 1
    local field
    for field in multiProcessorCount driverVer deviceName deviceVer maxSharedMemoryPerBlockOptin l2CacheSize \
            smClockRateKHz totalGlobalMem; do
        "$PYTHON" - "$BUILD/gpu.json" "$field" "$BUILD/gpu-$field.json" <<'EOF'
import json, sys
props, field, out = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3]
v = props[field]
# another GPU's value: a smaller part of the same family, an older driver, another name,
# another architecture (SM 8.0)
props[field] = {"deviceVer": 800, "driverVer": 12040, "deviceName": str(v) + " (another)"}.get(
    field, v // 2 if isinstance(v, int) else v)
json.dump(props, open(out, "w"))
print(f"{field}: {v!r} -> {props[field]!r}")
EOF
        TAG="fake-fwd-$field" run fake --props "$BUILD/gpu-$field.json" --dir fwd --out "$BUILD/fwd-$field.plan" || true
        TAG="check-fwd-$field" run system --dir fwd --check "$BUILD/fwd-$field.plan" || true
        grep -h '^CHECK\|^plan built here\|^STEP .*FAIL' "$BUILD/logs/check-fwd-$field.out" || true
        grep -h 'e! .*Reason\|isCompatible' "$BUILD/logs/check-fwd-$field.err" | sort -u | head -3 || true
    done
}

case "${1:-}" in
    build) build ;;
    run) shift; run "$@" ;;
    matrix) matrix ;;
    gpu-check) gpu_check ;;
    gpu-check-fields) gpu_check_fields ;;
    *) sed -n '2,40p' "${BASH_SOURCE[0]}"; exit 2 ;;
esac
