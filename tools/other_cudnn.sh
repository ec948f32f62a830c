#!/usr/bin/env bash
# Another cuDNN on the GPU machine, which has no network and takes at most 64 MiB of files a
# call: a nvidia-cudnn-cu13 wheel travels in parts, in consecutive calls to one warm machine,
# and then a command runs with it as the only cuDNN it can see, for PyTorch and fastattn alike.
#
# Here, on a machine that reaches PyPI:
#   bash tools/other_cudnn.sh pack VERSION
#       downloads nvidia-cudnn-cu13==VERSION (e.g. 9.28.1.4) and splits the wheel into parts of
#       PART_MIB MiB (default 55: a part and the working tree stay under a call's 64 MiB) in
#       .cudnn/VERSION/ (git-ignored), with a MANIFEST (wheel name, sha256, number of parts);
#       prints the carry list of each call.
# There, from the repository root (each call carries the MANIFEST and one part):
#   bash tools/other_cudnn.sh receive VERSION
#       keeps the carried parts in /tmp/fastattn-cudnn/VERSION (a warm machine keeps /tmp between
#       calls, and goes back ~30 s after one: make the next call at once) and says which are missing.
#   bash tools/other_cudnn.sh run VERSION -- COMMAND...
#       COMMAND in a private mount namespace in which VERSION is bound over the machine's
#       nvidia/cudnn (files and metadata) and every other libcudnn* file on the machine (a system
#       copy) is covered with /dev/null: that process and its children see one cuDNN, VERSION,
#       while other processes beside it see the machine's own or another VERSION. So one call
#       tests several cuDNN versions at once (tools/gpu_run.sh's CUDNN="9.24.0.43 9.28.1.4").
#       The wheel is reassembled, checked and unpacked under /tmp/fastattn-cudnn once.
#   bash tools/other_cudnn.sh check [VERSION]
#       the proof, in one process as a user's: torch imported first, PyTorch's cuDNN attention and
#       fastattn's run, then every cuDNN file mapped in the process lies in one folder, PyTorch and
#       fastattn report the same version (VERSION's, where given), and `fastattn info` names it.
#       Needs fastattn importable (tools/gpu_run.sh sets PYTHONPATH). Exit 1 on any difference.
# tools/gpu_run.sh runs each pytest process through `run` when CUDNN="VERSION ..." is set. Nothing
# on the machine changes: the cover exists in the namespace of the command alone.
set -euo pipefail
cd "$(dirname "$0")/.."
cmd=${1:-}; version=${2:-}
WORK=${OTHER_CUDNN_WORK:-/tmp/fastattn-cudnn}  # (a test points it elsewhere)
PY=${PYTHON:-python3}

need_version() {
  [[ "$version" =~ ^9\.[0-9]+\.[0-9]+\.[0-9]+$ ]] || { echo "usage: $0 $cmd VERSION (e.g. 9.28.1.4), got '${version}'" >&2; exit 2; }
}
manifest() { sed -n "s/^$1 //p" "$WORK/$version/MANIFEST"; }  # (kept by receive)

# The site-packages that holds the installed nvidia-cudnn-cu13 (PyTorch's, on the GPU machine).
site_packages() {
  "$PY" - <<'PY'
import importlib.metadata as m, os
print(os.path.realpath(m.distribution("nvidia-cudnn-cu13").locate_file("")))
PY
}

# The received wheel, reassembled and checked, then unpacked into $WORK/$version/site (once).
unpack() {
  [ -f "$WORK/$version/MANIFEST" ] || { echo "no parts of $version were received on this machine" >&2; exit 2; }
  # Two runs of one version started together (a background run beside a foreground one)
  # both found no wheel and both reassembled it into one .partial; the first mv left the
  # second with nothing to move (seen on the GPU machine). One unpack at a time: the second
  # waits, then finds the wheel and the site there.
  exec 9> "$WORK/$version/.unpack.lock"
  flock 9
  wheel="$WORK/$(manifest wheel)"
  if [ ! -f "$wheel" ]; then
    cat "$WORK/$version"/part-* > "$wheel.partial"
    [ "$(sha256sum "$wheel.partial" | cut -d' ' -f1)" = "$(manifest sha256)" ] \
      || { echo "the reassembled wheel's sha256 differs from the MANIFEST's: a part is missing or damaged" >&2; rm -f "$wheel.partial"; exit 1; }
    mv "$wheel.partial" "$wheel"
  fi
  if [ ! -d "$WORK/$version/site/nvidia/cudnn/lib" ]; then
    "$PY" -m pip install -q --no-deps --no-index --no-compile --disable-pip-version-check --target "$WORK/$version/site" "$wheel" >&2
  fi
  flock -u 9
  exec 9>&-
}

case "$cmd" in
pack)
  need_version
  part_mib=${PART_MIB:-55}
  mkdir -p .cudnn/wheels
  wheel=$(ls .cudnn/wheels/nvidia_cudnn_cu13-"$version"-*.whl 2>/dev/null | head -n 1 || true)
  if [ -z "$wheel" ]; then
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      -d .cudnn/wheels "nvidia-cudnn-cu13==$version"
    wheel=$(ls .cudnn/wheels/nvidia_cudnn_cu13-"$version"-*.whl | head -n 1)
  fi
  rm -rf ".cudnn/$version"; mkdir -p ".cudnn/$version"
  split -b "${part_mib}M" -d -a 2 "$wheel" ".cudnn/$version/part-"
  n=$(ls ".cudnn/$version"/part-* | wc -l)
  { echo "wheel $(basename "$wheel")"; echo "sha256 $(sha256sum "$wheel" | cut -d' ' -f1)"; echo "parts $n"; } \
    > ".cudnn/$version/MANIFEST"
  cat ".cudnn/$version/MANIFEST"
  for p in ".cudnn/$version"/part-*; do
    echo "call: carry [\".cudnn/$version/MANIFEST\", \"$p\"], command: bash tools/other_cudnn.sh receive $version"
  done
  ;;
receive)
  need_version
  [ -f ".cudnn/$version/MANIFEST" ] || { echo "no .cudnn/$version/MANIFEST was carried" >&2; exit 2; }
  mkdir -p "$WORK/$version"
  cp ".cudnn/$version/MANIFEST" "$WORK/$version/"
  for p in ".cudnn/$version"/part-*; do [ -f "$p" ] && cp "$p" "$WORK/$version/"; done
  n=$(manifest parts); missing=""
  for i in $(seq 0 $((n - 1))); do
    [ -f "$WORK/$version/part-$(printf %02d "$i")" ] || missing="$missing $(printf %02d "$i")"
  done
  echo "cuDNN $version: $(ls "$WORK/$version"/part-* | wc -l) of $n parts here${missing:+; missing:$missing}"
  ;;
run)
  need_version
  shift 2; [ "${1:-}" = "--" ] && shift
  [ $# -gt 0 ] || { echo "usage: $0 run VERSION -- COMMAND..." >&2; exit 2; }
  unpack
  site=$(site_packages)
  new_meta=$(ls -d "$WORK/$version/site"/nvidia_cudnn_cu13-*.dist-info)
  old_meta=$(ls -d "$site"/nvidia_cudnn_cu13-*.dist-info)
  # The metadata too: `fastattn info` names the wheel and its version from it. (The folder keeps
  # the machine's name; the version is read from the METADATA inside.)
  # Every other cuDNN file on the machine (a system copy in /usr/lib: 9.14 on the GPU machine)
  # is covered with /dev/null in the namespace: a loader that found one reads no library there.
  others=$(find / \( -path /proc -o -path /sys -o -path /dev -o -path "$WORK" -o -path "$site/nvidia/cudnn" \) -prune \
    -o -name 'libcudnn*.so*' -type f -print 2>/dev/null | tr '\n' ' ')
  exec unshare -m --propagation private bash -c \
    'mount --bind "$1/nvidia/cudnn" "$2/nvidia/cudnn" && mount --bind "$3" "$4" || exit 1
     for f in $5; do mount --bind /dev/null "$f" || exit 1; done
     shift 5 && exec "$@"' \
    _ "$WORK/$version/site" "$site" "$new_meta" "$old_meta" "$others" "$@"
  ;;
check)
  "$PY" - "$version" <<'PY'
import json, subprocess, sys
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from fastattn import _loader
from fastattn.torch import attention

want = sys.argv[1]
q = torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.bfloat16)
with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
    torch.nn.functional.scaled_dot_product_attention(q, q, q)
attention(q, q, q, layout="bhsd")
torch.cuda.synchronize()
libs = _loader.ensure_loaded()
files = _loader.mapped_cudnn()
torch_v = _loader.version_text(int(torch.backends.cudnn.version()))
ours = _loader.version_text(libs.cudnn_version)
info = json.loads(subprocess.run([sys.executable, "-m", "fastattn", "info", "--json"], capture_output=True,
                                 text=True, check=True).stdout)
print(f"torch {torch.__version__}: cuDNN {torch_v}; fastattn: cuDNN {ours} from {libs.cudnn}")
print("mapped:", " ".join(files))
print("fastattn info:", json.dumps(info.get("cudnn_in_process")), json.dumps(info.get("cudnn_library")))
problems = []
if _loader.cudnn_copies_problem(files):
    problems.append(_loader.cudnn_copies_problem(files))
if torch_v != ours:
    problems.append(f"PyTorch reports cuDNN {torch_v}, fastattn {ours}")
if want and ours != ".".join(want.split(".")[:3]):
    problems.append(f"cuDNN {ours} is loaded, not {want}")
if (info.get("cudnn_in_process") or {}).get("fastattn") != ours:
    problems.append(f"fastattn info names {info.get('cudnn_in_process')}")
print("check:", "; ".join(problems) or "one cuDNN, " + ours + ", in torch and fastattn alike")
sys.exit(1 if problems else 0)
PY
  ;;
*)
  sed -n '2,29p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
  ;;
esac
