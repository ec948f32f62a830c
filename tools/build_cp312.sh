#!/usr/bin/env bash
# Builds fastattn/_core for the GPU machine's Python 3.12 here, from the tracked
# sources, against the newest headers pip resolves (what `pip install .` builds
# against), stripped of debug info, into fastattn/ (git-ignored). tools/gpu_run.sh
# runs it there with FASTATTN_PREBUILT=1: the suite then also proves that an
# extension built against newer cuDNN headers runs on the machine's older cuDNN.
#
#   bash tools/build_cp312.sh [PY312]   (default: /root/.pyenv/versions/3.12.1/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
py=${1:-/root/.pyenv/versions/3.12.1/bin/python}
venv=${FASTATTN_BUILD_VENV:-/tmp/fastattn-build312}
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
# The build requirements of pyproject.toml, newest matching versions.
"$venv/bin/pip" install -q cython "setuptools>=77" "nvidia-cudnn-frontend==1.28.0" "nvidia-cudnn-cu13>=9.19,<10" \
  "nvidia-cuda-runtime>=13,<14" "nvidia-cuda-crt>=13,<14" "nvidia-cuda-cccl>=13,<14" "nvidia-cuda-nvrtc>=13,<14"
src=$(mktemp -d)
git ls-files -z | xargs -0 cp --parents -t "$src"
(cd "$src" && "$venv/bin/python" setup.py -q build_ext --inplace -j 2 >/dev/null)
for so in "$src"/fastattn/_core.cpython-312-*.so "$src"/fastattn/_nodriver.cpython-312-*.so; do
  strip --strip-debug "$so"
  cp "$so" fastattn/
done
"$venv/bin/python" - <<'PY'
from importlib import metadata
print("built against nvidia-cudnn-cu13", metadata.version("nvidia-cudnn-cu13"),
      "and nvidia-cudnn-frontend", metadata.version("nvidia-cudnn-frontend"))
PY
ls -la fastattn/_core.cpython-312-*.so fastattn/_nodriver.cpython-312-*.so
rm -rf "$src"
