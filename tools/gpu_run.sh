#!/usr/bin/env bash
# One call on the GPU machine: build the extension there, run the whole test suite
# (GPU tests must not skip: FASTATTN_REQUIRE_GPU=1), then the benchmarks. Full logs
# and JSON results go to $OUT/logs.tgz (the device tool brings back at most 8 files);
# a short summary is printed last.
#
#   bash tools/gpu_run.sh [pytest args...]   (default: tests)      (carry .whl: nvidia-cudnn-frontend, platformdirs, redis)
#     e.g. tests -m gpu (the GPU tests: tests/<area>/test_<topic>_gpu.py), tests/flash (one area), a file
#   FASTATTN_PREBUILT=1: use the carried fastattn/_core.cpython-312-*.so (tools/build_cp312.sh) instead of building
#   BENCH="core torch": the benchmarks to run after the tests (benchmarks/bench_core.py, ...; "" for none;
#     also by name only: numerics, shape_classes, sdpa_mode, transformers; NAME:--flag,--flag2 passes
#     the script its own arguments)
#   CRASH_BT=0: no second run under cuda-gdb after a crash (a whole-suite rerun costs minutes of device time)
#   ORDERS="file reverse shuffle:7": one pytest process per order (FASTATTN_TEST_ORDER), all at once on
#     the one GPU (each order is still one process, so what one test leaves behind reaches the next; three in turn cost ~3 x 560 s);
#     logs pytest-<order>.log, a summary line each; exit 0 only if every order passed
#   CUDNN="9.24.0.43 9.28.1.4": the cuDNN versions to test, each received on this machine beforehand
#     (tools/other_cudnn.sh pack / receive); "machine" is the machine's own. Each (version, order)
#     is one pytest process in a mount namespace that sees that cuDNN alone (other_cudnn.sh run),
#     all at once; logs pytest-VERSION-ORDER.log. Without ORDERS, the one pytest process runs on the
#     first version named. Default: "machine".
#   ALSO="cmd": a command run alongside the tests, once the setup is done (e.g. "bash
#     tools/run_flash_tests.sh": correctness runs only, never a timed one beside the tests);
#     its output in also.log, its last lines and exit status in the summary
set -uo pipefail
OUT=${OUT:-/tmp/fastattn-out}
LOGS=$(mktemp -d /tmp/fastattn-logs.XXXX)
mkdir -p "$OUT"
trap 'tar czf "$OUT/logs.tgz" -C "$LOGS" .' EXIT
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."

{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
  python3 -c 'import sys, torch; print(sys.version); print("torch", torch.__version__)'
  echo "kernel $(uname -r)"
} > "$LOGS/env.log" 2>&1

# The machine has no network: the frontend headers and platformdirs come as wheels.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  > "$LOGS/pip.log" 2>&1 || { echo "wheel install failed"; cat "$LOGS/pip.log"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD
export FASTATTN_CUDNN_FRONTEND_INCLUDE=/tmp/site/include
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export CFLAGS="${CFLAGS:-} -g"  # symbols for a backtrace if anything crashes

# The image's default g++ (/opt/gcc) links libstdc++ statically into the extension
# (seen 2026-11-29): two C++ runtimes in one process, and iostreams crash inside
# cudnn-frontend. Build with the system compiler, whose libstdc++ is shared.
if [ -x /usr/bin/g++ ]; then
  export CC=/usr/bin/gcc CXX=/usr/bin/g++ LDSHARED="/usr/bin/g++ -shared"
fi
{ echo "CXX=${CXX:-default}"; command -v g++; g++ --version | head -1; ls /usr/bin/g++* /opt/gcc/lib64/libstdc++* 2>&1; } >> "$LOGS/env.log" 2>&1

# FASTATTN_PREBUILT=1 runs a carried cp312 build instead (quick iterations while
# debugging); the run that counts builds here.
t0=$(date +%s)
if [ "${FASTATTN_PREBUILT:-0}" = "1" ]; then
  echo "build: skipped, using carried $(ls fastattn/_core*.so)"
elif ! python3 setup.py build_ext --inplace --force -j "$(nproc)" > "$LOGS/build.log" 2>&1; then
  echo "BUILD FAILED"; grep -E "error|Error" "$LOGS/build.log" | head -40; exit 1
else
  echo "build: $(( $(date +%s) - t0 )) s"
fi
so=$(ls fastattn/_core*.so)
if nm -C --defined-only "$so" | grep -q "std::locale::classic"; then
  echo "WARNING: $so carries its own copy of libstdc++ (statically linked)"
fi
echo "libstdc++: $(ldd "$so" | grep -o 'libstdc++[^ ]* => [^ ]*' || echo 'not dynamically linked')"
# Which cuDNN headers built the extension and which cuDNN it runs on (a carried build
# from tools/build_cp312.sh has the newest headers; the machine's cuDNN is older).
(cd /tmp && python3 -c 'import fastattn, fastattn._loader as l; l.ensure_loaded(); v = fastattn.versions(); print("versions:", {k: v[k] for k in sorted(v)})') \
  2>&1 | tee -a "$LOGS/env.log"

# fastattn.torch's op library, built once here against this torch by `fastattn warm`
# (as a deployment builds it: beside the default model configs' plans, into a cache of
# its own), and shared by the test sessions' isolated caches.
export FASTATTN_TORCH_OPS_DIR=/tmp/fastattn-torch-ops
t0=$(date +%s)
(cd /tmp && FASTATTN_CACHE_DIR=/tmp/fastattn-warm-cache python3 -m fastattn warm --no-progress --report "$LOGS/warm.json") \
  > "$LOGS/warm.log" 2>&1
echo "fastattn warm: exit $?, $(( $(date +%s) - t0 )) s; $(grep 'torch op library' "$LOGS/warm.log")" | tee -a "$LOGS/env.log"
# The op library's own build log: each unit's sources, flag and seconds, the link, and the
# compile-and-link total (warm's figure above adds importing torch and the generator).
for f in "$FASTATTN_TORCH_OPS_DIR"/*/build.log; do
  [ -f "$f" ] || continue
  cp "$f" "$LOGS/ops-build.log"
  echo "op library: $(grep -v '^  ' "$f" | paste -sd ';' | sed 's/;/; /g')" | tee -a "$LOGS/env.log"
done
(cd /tmp && python3 -c 'from fastattn import _opslib; from fastattn.torch import _native; print("op library found:", _opslib.find_built(), "; built:", _native.build())') \
  >> "$LOGS/env.log" 2>&1 || echo "TORCH OP LIBRARY BUILD FAILED (see env.log)"

# Each cuDNN brought for this run, proven the one a process sees (torch's and fastattn's alike).
CUDNN=${CUDNN:-machine}
for v in $CUDNN; do
  [ "$v" = machine ] && continue
  echo "cuDNN $v:" >> "$LOGS/env.log"
  bash tools/other_cudnn.sh run "$v" -- bash tools/other_cudnn.sh check "$v" >> "$LOGS/env.log" 2>&1 \
    && echo "cuDNN $v: $(grep '^check:' "$LOGS/env.log" | tail -n 1)" \
    || { echo "cuDNN $v: not usable here (see env.log)"; tail -n 5 "$LOGS/env.log"; exit 1; }
done

export FASTATTN_REQUIRE_GPU=1
# The machine has no redis-server: a carried one (.redis/, see docs/BENCHMARKS.md) makes
# the Redis tier's tests run there too, and required.
if [ -x .redis/redis-server ]; then
  export PATH="$PWD/.redis:$PATH" FASTATTN_REQUIRE_REDIS=1
fi
# Arguments name what to test (default: everything under tests/).
[ $# -gt 0 ] || set -- tests
also_pid=
if [ -n "${ALSO:-}" ]; then
  mkdir -p "$LOGS/also"
  (OUT="$LOGS/also" bash -c "$ALSO" > "$LOGS/also.log" 2>&1; echo "ALSO exit $?" >> "$LOGS/also.log") &
  also_pid=$!
fi
# A crash (an abort at exit included) leaves a core file, read below for the C++ stack:
# a rerun under cuda-gdb would cost the whole suite's time again.
ulimit -c unlimited 2>/dev/null && echo "/tmp/fastattn-core.%p" > /proc/sys/kernel/core_pattern 2>/dev/null
log_name() { local n=${1//:/-}; echo "${n//\//_}"; }  # an order as a file name: shuffle-7, list-tools_orders_a.txt
# The runs: one per (cuDNN, order); named by the order alone where only the machine's cuDNN runs.
runs=()
for v in $CUDNN; do for order in ${ORDERS:-}; do runs+=("$v|$order"); done; done
run_name() { local v=${1%%|*} o=${1#*|}; [ "$CUDNN" = machine ] && log_name "$o" || echo "$v-$(log_name "$o")"; }
if [ -n "${ORDERS:-}" ]; then
  # Each its own basetemp: pytest prunes other sessions' numbered temp directories.
  pids=()
  for r in "${runs[@]}"; do
    v=${r%%|*}; order=${r#*|}; name=$(run_name "$r")
    wrap=(); [ "$v" != machine ] && wrap=(bash tools/other_cudnn.sh run "$v" --)
    FASTATTN_TEST_ORDER=$([ "$order" = file ] && echo "" || echo "$order") \
      "${wrap[@]}" python3 -m pytest -q -rfEs --durations=25 -p no:cacheprovider --basetemp="/tmp/pt-$name" "$@" \
      > "$LOGS/pytest-$name.log" 2>&1 &
    pids+=($!)
  done
  rc=0
  declare -A order_rc
  i=0
  for r in "${runs[@]}"; do
    wait "${pids[$i]}"; x=$?
    order_rc[$r]=$x
    [ $x -gt $rc ] && rc=$x
    i=$((i + 1))
  done
  cat "$LOGS"/pytest-*.log > "$LOGS/pytest.log"
else
  v=${CUDNN%% *}; wrap=(); [ "$v" != machine ] && wrap=(bash tools/other_cudnn.sh run "$v" --)
  "${wrap[@]}" python3 -m pytest -q -rfEs --durations=25 -p no:cacheprovider "$@" > "$LOGS/pytest.log" 2>&1
  rc=$?
fi
for core in /tmp/fastattn-core.*; do
  [ -f "$core" ] || continue
  timeout 120 cuda-gdb -q -batch -ex "bt 40" "$(command -v python3)" "$core" > "$LOGS/core_bt.log" 2>&1
  echo "=== core dump $core: backtrace"; grep -E "^#" "$LOGS/core_bt.log" | head -40
  rm -f "$core"
done
if [ $rc -ge 128 ] && [ "${CRASH_BT:-1}" != "0" ]; then
  # A crash: run the suite again under cuda-gdb (there is no gdb there) for the C++ stack.
  timeout 400 cuda-gdb -q -batch -ex run -ex bt --args python3 -m pytest -x -q -p no:cacheprovider "$@" \
    > "$LOGS/crash_bt.log" 2>&1
  echo "=== crash backtrace"; grep -v "New Thread\|Thread 0x" "$LOGS/crash_bt.log" | tail -30
fi
[ -n "$also_pid" ] && wait "$also_pid"  # done before any benchmark: nothing else on the GPU while one times
# pip byte-compiles an installed package; the source tree here has no .pyc files, and
# compiling them inside a timed cold start would bill fastattn for it.
python3 -m compileall -q fastattn > /dev/null
# BENCH: what to run after the tests: benchmarks/bench_NAME.py or benchmarks/NAME.py for each NAME
# ("core coldstart torch warm features fp8 flash", and "remote" where a redis-server is carried; "" for none).
# Not in the default list, by name: numerics, shape_classes, sdpa_mode (the SDPA mode's host time and
# cold start), transformers (attn_implementation="fastattn": first logits, prefill, decode).
default_bench="core coldstart torch warm features fp8 flash"
[ -x .redis/redis-server ] && default_bench="$default_bench remote"
# A NAME may carry the script's own arguments after a colon, comma-separated:
# "transformers:--skip-coldstart,--skip-steady". Every comma splits, so an argument cannot
# hold one (bench_serving.py's "--peers fastattn,eager" becomes two arguments): run
# such a script by hand (PYTHONPATH=$PWD after this script's wheel install) or with ALSO.
for b in ${BENCH-$default_bench}; do
  name=${b%%:*}; args=""; [ "$name" != "$b" ] && args=${b#*:}
  script=benchmarks/bench_$name.py; [ -f "$script" ] || script=benchmarks/$name.py
  out=bench_$name; i=2  # a NAME given twice (other arguments) keeps both: bench_NAME-2.json, ...
  while [ -e "$LOGS/$out.log" ]; do out=bench_$name-$i; i=$((i + 1)); done
  # shellcheck disable=SC2086  # (the arguments, split on purpose)
  python3 "$script" ${args//,/ } --json "$LOGS/$out.json" > "$LOGS/$out.log" 2>&1 \
    || echo "$script failed (see $out.log)"
done

echo "=== env"; cat "$LOGS/env.log" | head -20
echo "=== pytest (failures)"; grep -E "^(FAILED|ERROR|SKIPPED)" "$LOGS/pytest.log" | head -40
grep -E "^E  " "$LOGS/pytest.log" | head -20
if [ -n "$also_pid" ]; then
  echo "=== ALSO ($ALSO): the last lines"; tail -n 15 "$LOGS/also.log"
fi
echo "=== bench"; for f in "$LOGS"/bench_*.log; do [ -f "$f" ] && sed -n '/^summary:/,$p' "$f"; done
# The summary line itself (a crash at exit, after it, would be the log's last line) and
# pytest's exit status: 0 passed, 1 failed, >= 128 a signal (the process crashed).
echo "=== pytest summary (exit $rc)"
if [ -n "${ORDERS:-}" ]; then
  for r in "${runs[@]}"; do
    name=$(run_name "$r")
    grep -m 2 "^fastattn: " "$LOGS/pytest-$name.log" | sed "s/^/$name: /"
    echo "$name (exit ${order_rc[$r]}): $(grep -E "^=*.* (passed|failed|error|errors|skipped|deselected)" "$LOGS/pytest-$name.log" | tail -n 1)"
  done
else
  grep -m 2 "^fastattn: " "$LOGS/pytest.log"
  grep -E "^=*.* (passed|failed|error|errors|skipped|deselected)" "$LOGS/pytest.log" | tail -n 1
fi
[ $rc -ge 128 ] && { echo "pytest was killed by signal $((rc - 128)); the log ends:"; tail -n 2 "$LOGS/pytest.log"; }
exit $rc
