#!/usr/bin/env bash
# A gpu_run.sh longer than one device call (600 s): started in a process session of its
# own, which outlives the call (the device README), and collected by the next call on
# the same warm machine (it goes back ~30 s after a call: make the next one at once).
#
#   bash tools/gpu_bg.sh start [gpu_run.sh args...]   starts it, then waits as `wait` does
#   bash tools/gpu_bg.sh wait                         waits up to WAIT s (default 570);
#       once it has ended: its output, and its logs.tgz copied into $OUT; exit 75 while it
#       still runs, 76 at once where no run was started on this machine
#   bash tools/gpu_bg.sh stop                         ends the run (its whole process
#       session), keeping what pytest logged so far in $OUT; exit 76 where none was started.
#       (Not `pkill -f PATTERN` in a device call: the pattern matches that call's own
#       command line, and the call ends at once.)
# The run's environment (FASTATTN_PREBUILT, BENCH, FASTATTN_TEST_ORDER, ...) is passed on.
# BG=/tmp/fastattn-bg-NAME keeps a second run apart from the first (two at once on one machine:
# e.g. a cuDNN whose parts arrive while the first run goes on, CUDNN=... in each).
set -uo pipefail
cd "$(dirname "$0")/.."
BG=${BG:-/tmp/fastattn-bg}
cmd=${1:-wait}; shift || true
if [ "$cmd" = start ]; then
  rm -rf "$BG"; mkdir -p "$BG/out" "$BG/src"
  # The run works in a copy of the tree: a later call replaces the tree here and removes
  # the carried paths it does not name (.whl, .redis, the extension), which a run in this
  # tree lost under it; with the copy, later calls carry only what they need.
  tar --exclude=./.cudnn -cf - . | tar -xf - -C "$BG/src"
  OUT="$BG/out" setsid bash -c 'cd "$1" && shift && bash tools/gpu_run.sh "$@" > '"$BG"'/run.log 2>&1; echo $? > '"$BG"'/rc' \
    _ "$BG/src" "$@" < /dev/null > /dev/null 2>&1 &
  echo $! > "$BG/pid"  # setsid's process leads the run's session (a background job leads no group)
  echo "started $(date +%T)"
fi
if [ ! -d "$BG" ]; then
  # Nothing was started on this machine: a bare one (the last went back after its idle
  # time, ~30 s) or `wait` without `start`. Waiting would spend device time on nothing
  # (570 s, twice so far): say so at once.
  echo "no run was started on this machine (a fresh one: the previous machine went back, or no start)"
  exit 76
fi
if [ "$cmd" = stop ]; then
  for f in /tmp/fastattn-logs.*/pytest*.log /tmp/fastattn-logs.*/also.log; do
    [ -f "$f" ] && cp "$f" "${OUT:-/tmp}/so-far-$(basename "$f")"
  done
  kill -TERM -- "-$(cat "$BG/pid")" 2>/dev/null && echo "stopped the run's session $(cat "$BG/pid")" \
    || echo "the run had ended"
  exit 0
fi
deadline=$(( $(date +%s) + ${WAIT:-570} ))
while [ ! -f "$BG/rc" ] && [ "$(date +%s)" -lt "$deadline" ]; do sleep 5; done
if [ ! -f "$BG/rc" ]; then
  echo "still running at $(date +%T); its output and pytest's progress end:"
  tail -n 3 "$BG/run.log"; for f in /tmp/fastattn-logs.*/pytest*.log; do [ -f "$f" ] && { echo "$f:"; tail -c 300 "$f"; echo; }; done
  # What it has so far, in case the machine goes back before the next call: pytest's logs,
  # ALSO's, and the benchmarks' (bench_serving.py writes its JSON after each process).
  for f in /tmp/fastattn-logs.*/pytest*.log /tmp/fastattn-logs.*/also.log /tmp/fastattn-logs.*/bench_*; do
    [ -f "$f" ] && cp "$f" "${OUT:-/tmp}/so-far-$(basename "$f")"
  done
  exit 75
fi
cp "$BG"/out/* "${OUT:-/tmp}/" 2>/dev/null
cat "$BG/run.log"
exit "$(cat "$BG/rc")"
