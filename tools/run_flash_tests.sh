#!/usr/bin/env bash
# FlashAttention 2.8.3's own tests/test_flash_attn.py against fastattn.flash, on
# the GPU machine, after tools/gpu_run.sh has built the extension and the op
# library there (same machine, same checkout). Their file is not ours and is never
# committed: it lives in the git-ignored .peer/ (carry it), from
#   git -C <flash-attention mirror> show v2.8.3:tests/test_flash_attn.py
# tools/flash_shim/ puts a `flash_attn` package on the path whose functions are
# fastattn.flash's (see its __init__), and the pytest plugin fa_subset.py there runs a
# seeded sample of the file's 508,772 cases in bounded time.
#
#   bash tools/run_flash_tests.sh [pytest args...]      (e.g. -k kvcache)
#   FA_PER_FUNC=30  cases drawn per test function (14 functions; 0: every case)
#   FA_SEED=0       which cases are drawn (the same on every machine)
#   FA_BUDGET_S=180 no case starts after this many seconds (those left: "not reached")
#   FA_CASE_S=30    a case running longer is interrupted and fails, saying so
#   FA_SHARDS=1     pytest processes at once, each every FA_SHARDS-th case (fa_subset's
#                   FA_SHARD): most of a case's time is its plan's build, on the CPU
#   FA_WARM=FILE    `fastattn warm FILE` first: an earlier run's $OUT/flash_configs.jsonl
#                   (every config its cases asked for, FASTATTN_RECORD)
#   FA_TESTS=.peer/flash-attention-2.8.3/tests/test_flash_attn.py
#
# A crash (an abort inside a library) ends pytest's process: the run goes on in a new
# one, without the cases already started (the crashed one is reported "crashed"), until
# the budget is spent. Writes $OUT/flash_tests.md (the per-function table and the top
# failure reasons) and $OUT/flash_tests.tgz (the full pytest log, the per-case records,
# the summary as JSON); prints a short summary last. Exit 0 when every case that ran
# passed, was skipped by the test file itself or was the S_dmask refusal.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fastattn-out}
LOGS=$(mktemp -d /tmp/fastattn-flash-tests.XXXX)
mkdir -p "$OUT"
trap 'tar czf "$OUT/flash_tests.tgz" -C "$LOGS" .' EXIT
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

FA_TESTS=${FA_TESTS:-.peer/flash-attention-2.8.3/tests/test_flash_attn.py}
[ -f "$FA_TESTS" ] || { echo "no $FA_TESTS: carry .peer (see the top of this script)"; exit 2; }
export FA_PER_FUNC=${FA_PER_FUNC:-30} FA_SEED=${FA_SEED:-0} FA_CASE_S=${FA_CASE_S:-30}
budget=${FA_BUDGET_S:-180}
export FA_RESULTS="$LOGS/results.jsonl"

# What tools/gpu_run.sh set up: the carried wheels in /tmp/site, the extension built in
# place, the op library in /tmp/fastattn-torch-ops. Plans go to a cache of this run's own.
export PYTHONPATH="/tmp/site:$PWD:$PWD/tools/flash_shim${PYTHONPATH:+:$PYTHONPATH}"
export FASTATTN_TORCH_OPS_DIR=${FASTATTN_TORCH_OPS_DIR:-/tmp/fastattn-torch-ops}
export FASTATTN_CACHE_DIR=${FASTATTN_CACHE_DIR:-$(mktemp -d /tmp/fastattn-fa-cache.XXXX)}
# Their file imports einops, which the machine may lack: the carried wheel (.whl/) then.
if ! "$PY" -c 'import einops' 2> /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/fa-site .whl/einops-*.whl \
    > "$LOGS/pip.log" 2>&1 || { echo "einops is missing and .whl/einops-*.whl did not install"; cat "$LOGS/pip.log"; exit 2; }
  export PYTHONPATH="$PYTHONPATH:/tmp/fa-site"
fi
# flash_attn must be the shim, not a FlashAttention installed on the machine.
"$PY" -c 'import flash_attn, einops, fastattn, torch, sys
print("flash_attn:", flash_attn.__file__, flash_attn.__version__); print("einops", einops.__version__)
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "python", sys.version.split()[0])
sys.exit(0 if flash_attn.__version__.endswith("+fastattn.shim") else "flash_attn is not tools/flash_shim")' \
  2>&1 | tee "$LOGS/env.log"
[ "${PIPESTATUS[0]}" = 0 ] || exit 2
uname -r >> "$LOGS/env.log"
echo "FA_PER_FUNC=$FA_PER_FUNC FA_SEED=$FA_SEED FA_BUDGET_S=$budget FA_CASE_S=$FA_CASE_S FA_SHARDS=${FA_SHARDS:-1} $FA_TESTS $*" | tee -a "$LOGS/env.log"

# FA_WARM=FILE: the configs an earlier run's cases asked for (its flash_configs.jsonl)
# built first by `fastattn warm`, in parallel, so that the cases load their plans. Not
# counted in the budget; not recorded again.
if [ -n "${FA_WARM:-}" ]; then
  t0=$(date +%s)
  FASTATTN_RECORD= "$PY" -m fastattn warm --no-progress --no-torch-ops "$FA_WARM" > "$LOGS/warm.log" 2>&1
  echo "FA_WARM=$FA_WARM: fastattn warm exit $?, $(( $(date +%s) - t0 )) s; $(grep -E 'configs|built|loaded' "$LOGS/warm.log" | tail -n 1)" \
    | tee -a "$LOGS/env.log"
fi
# Every config the cases ask for (FASTATTN_RECORD), into $OUT/flash_configs.jsonl: a
# later run's FA_WARM.
export FASTATTN_RECORD="$LOGS/flash_configs.jsonl"
t_start=$(date +%s)
export FA_DEADLINE=$(( t_start + budget ))

shards=${FA_SHARDS:-1}
run_shard() {  # shard $1 of $shards: its own results and log, rerun after a crash
  local attempt=0 rc left
  while :; do
    attempt=$((attempt + 1))
    # The outer timeout only backs up the plugin's own limits (a hang inside a C call).
    left=$(( FA_DEADLINE - $(date +%s) + FA_CASE_S + 30 ))
    FA_SHARD="$1/$shards" FA_RESULTS="$LOGS/results-$1.jsonl" timeout --signal=KILL "$left" \
      "$PY" -m pytest -p fa_subset -p no:cacheprovider -q --tb=short -rfE "$FA_TESTS" "${@:2}" \
      >> "$LOGS/pytest-$1.log" 2>&1
    rc=$?
    echo "shard $1/$shards, pytest attempt $attempt: exit $rc after $(( $(date +%s) - t_start )) s" | tee -a "$LOGS/env.log"
    # 0 passed, 1 failures, >= 128 a signal (a crash, or the timeout's KILL: 137).
    [ $rc -ge 128 ] && [ $(( FA_DEADLINE - $(date +%s) )) -gt 20 ] && [ $attempt -lt 5 ] || break
    echo "=== shard $1: pytest's process died (exit $rc); the log ends:"; tail -n 3 "$LOGS/pytest-$1.log"
  done
}
for ((i = 0; i < shards; i++)); do run_shard "$i" "$@" & done
wait
cat "$LOGS"/results-*.jsonl > "$FA_RESULTS" 2> /dev/null
cat "$LOGS"/pytest-*.log > "$LOGS/pytest.log" 2> /dev/null

"$PY" tools/flash_shim/fa_report.py "$LOGS/results.jsonl" --md "$LOGS/flash_tests.md" --json "$LOGS/summary.json" \
  > "$LOGS/summary.txt" 2>&1
report_rc=$?
cp "$LOGS/flash_tests.md" "$OUT/flash_tests.md" 2> /dev/null
cp "$LOGS/flash_configs.jsonl" "$OUT/flash_configs.jsonl" 2> /dev/null
echo "=== pytest (last lines)"; grep -E "^=*.* (passed|failed|error|errors|skipped|deselected)" "$LOGS/pytest.log" | tail -n 3
echo "=== flash tests: $(( $(date +%s) - t_start )) s"; cat "$LOGS/summary.txt"
exit $report_rc
