#!/usr/bin/env bash
# cuDNN's shape override for SDPA, measured (tools/override_probe.cpp says what it answers).
#
# Here (a machine with g++ and the headers; the binary runs on the GPU machine, whose C and
# C++ runtimes are newer):
#   bash tools/override_probe.sh build
#       compiles it into .probes/override_probe (git-ignored; a device call carries it:
#       carry [".probes/override_probe"]), with cudnn-frontend's, cuDNN's, CUDA's and NVRTC's
#       headers from $PYTHON's site-packages (default python3), or FE_INC, CUDNN_INC, CUDA_INC.
# There (override needs cuDNN >= 9.21: the machine's 9.19 refuses it, so run it on a brought one):
#   bash tools/other_cudnn.sh run 9.24.0.43 -- bash tools/override_probe.sh run [probe arguments]
#       e.g. --smax 4096 --lengths 64,100,511,1000,2049,3000,4096 --causal
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
PROBE=override_probe
. "$ROOT/tools/probe_paths.sh"
case "${1:-}" in
build)
    sp="$(site)"
    fe="${FE_INC:-$(first_dir_with cudnn_frontend.h "$sp/include" /tmp/site/include)}"
    cudnn="${CUDNN_INC:-$(first_dir_with cudnn.h "$sp/nvidia/cudnn/include" /usr/include)}"
    cuda="${CUDA_INC:-$(first_dir_with cuda_runtime.h "$sp/nvidia/cu13/include" /usr/local/cuda/include)}"
    cudart="$(first_dir_with libcudart.so.13 "$cuda/../lib" /usr/local/cuda/lib64 /usr/local/cuda/lib)"
    mkdir -p "$ROOT/.probes"
    g++ -std=c++17 -O1 -DNV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING -I "$fe" -I "$cudnn" -I "$cuda" \
        "$ROOT/tools/override_probe.cpp" -o "$ROOT/.probes/override_probe" -L "$cudart" -l:libcudart.so.13 -ldl
    echo "built $ROOT/.probes/override_probe"
    ;;
run)
    shift
    sp="$(site)"
    # libcudnn.so.9 by name (dlopen): the cuDNN of this process's site-packages, which
    # other_cudnn.sh's namespace replaces; cuDNN 9.19 also needs the cu13 libraries beside it.
    export LD_LIBRARY_PATH="$sp/nvidia/cudnn/lib:$sp/nvidia/cu13/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    exec "$ROOT/.probes/override_probe" "$@"
    ;;
*) sed -n '2,12p' "${BASH_SOURCE[0]}"; exit 2 ;;
esac
