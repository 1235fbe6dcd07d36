#!/usr/bin/env bash
# The fault harness as a soak (#47): bins/kvevent-subscriber/tests/faults.rs with release
# binaries, RUNS seeds side by side (two engines, two sidecars and a router each) for MINUTES
# each, then the figures of all of them together: faults, wrong exact answers (must be 0),
# convergence p50 / p99 / max, runs that failed.
# Usage: bash benches/faults.sh [MINUTES=35] [RUNS=3] [FIRST_SEED=100]
set -euo pipefail
cd "$(dirname "$0")/.."
minutes=${1:-35}
runs=${2:-3}
first=${3:-100}
export KVEVENT_PYTHON="${KVEVENT_PYTHON:-$PWD/.venv/bin/python}"
cargo test --release --locked -q -p kvevent-subscriber --test faults --no-run
logs=$(mktemp -d)
echo "soak: $runs runs of $minutes min, seeds $first.., logs in $logs"
for i in $(seq 0 $((runs - 1))); do
  KVEVENT_FAULTS_SEED=$((first + i)) KVEVENT_FAULTS_SECONDS=$((minutes * 60)) \
    cargo test --release --locked -q -p kvevent-subscriber --test faults -- --nocapture \
    >"$logs/run-$i.log" 2>&1 &
done
failed=0
for job in $(jobs -p); do wait "$job" || failed=$((failed + 1)); done
grep -h "^seed [0-9]*: " "$logs"/run-*.log || true
python3 - "$logs" "$failed" <<'PY'
import glob, re, sys
faults = wrong = 0
times = []
for path in glob.glob(sys.argv[1] + "/run-*.log"):
    text = open(path).read()
    for m in re.finditer(r"^seed \d+: (\d+) faults .*?wrong exact answers (\d+);", text, re.M):
        faults += int(m.group(1)); wrong += int(m.group(2))
    for m in re.finditer(r"^seed \d+ convergence ms: ([\d,]*)$", text, re.M):
        times += [int(x) for x in m.group(1).split(",") if x]
times.sort()
q = lambda f: times[round((len(times) - 1) * f)] if times else 0
print(f"all runs: {faults} faults, {wrong} wrong exact answers, convergence p50 {q(0.5)} ms, "
      f"p99 {q(0.99)} ms, max {times[-1] if times else 0} ms, {sys.argv[2]} runs failed")
PY
