#!/bin/bash
# summary_bench.sh - the cost of TensorBoard summaries on the MLP config
# (configs/fashion_mnist_mlp.cfg), on and off side by side in one run.
#
#   tests/bench/summary_bench.sh [--runs N] [--epochs E] [--build DIR]
#
# "on" is run.summary_steps = 100 (the default: 5 scalars every 100 steps,
# eval scalars per epoch, the config text); "hist" adds run.histogram_epochs
# = 1 (a histogram of every variable each epoch, the costliest part); "off"
# is run.summary_steps = 0 (no event file). Runs alternate so load from
# other processes falls on both alike; medians of N (default 3) runs of E
# (default 2) epochs. Reported: the run's training time ("seconds" of
# metrics.jsonl's end line: the train loop with its evaluations and
# checkpoints), its samples/s, and the time spent inside the summary writer
# (the end line's summary_ms, measured in the trainer) as a share of the run:
# that share is the cost, free of the run-to-run noise of a shared machine.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
BUILD=${BUILD:-$ROOT/build}
RUNS=3
EPOCHS=2
while [ $# -gt 0 ]; do
    case "$1" in
        --runs) RUNS=$2; shift 2 ;;
        --epochs) EPOCHS=$2; shift 2 ;;
        --build) BUILD=$2; shift 2 ;;
        *) echo "usage: $0 [--runs N] [--epochs E] [--build DIR]" >&2; exit 2 ;;
    esac
done
LOOM=$BUILD/loom
TMP=$(mktemp -d /tmp/loom_summary_bench_XXXXXX)
trap 'rm -rf "$TMP"' EXIT
cd "$ROOT"
for i in $(seq 1 "$RUNS"); do
    for mode in on hist off; do
        case $mode in
            on) set_=(--set run.summary_steps=100) ;;
            hist) set_=(--set run.summary_steps=100 --set run.histogram_epochs=1) ;;
            off) set_=(--set run.summary_steps=0) ;;
        esac
        env -u OPENBLAS_CORETYPE timeout 600 "$LOOM" train configs/fashion_mnist_mlp.cfg --model-dir "$TMP/$mode$i" \
            --set run.epochs="$EPOCHS" --set run.progress='"none"' "${set_[@]}" >/dev/null 2>&1
        tail -1 "$TMP/$mode$i/metrics.jsonl" > "$TMP/$mode$i.end"
    done
done
python3 - "$TMP" "$RUNS" "$EPOCHS" <<'PY'
import json, statistics, sys
tmp, runs, epochs = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def med(mode, key):
    return statistics.median(json.load(open(f"{tmp}/{mode}{i}.end")).get(key) or 0 for i in range(1, runs + 1))
modes = ["on", "hist", "off"]
sec = {m: med(m, "seconds") for m in modes}
sps = {m: med(m, "samples_per_sec") for m in modes}
wms = {m: med(m, "summary_ms") for m in modes}
print(f"MLP (configs/fashion_mnist_mlp.cfg), {epochs} epochs, medians of {runs} runs, modes alternating")
print(f"{'':28}{'on (default)':>14}{'on+histograms':>15}{'off':>10}")
print(f"{'run seconds':28}{sec['on']:14.3f}{sec['hist']:15.3f}{sec['off']:10.3f}")
print(f"{'train samples/s':28}{sps['on']:14.0f}{sps['hist']:15.0f}{sps['off']:10.0f}")
print(f"{'ms in the summary writer':28}{wms['on']:14.2f}{wms['hist']:15.2f}{'-':>10}")
print(f"{'share of the run':28}{100 * wms['on'] / 1e3 / sec['on']:13.3f}%{100 * wms['hist'] / 1e3 / sec['hist']:14.3f}%{'-':>10}"
      "   (target < 1%)")
print(f"{'wall vs off (noisy here)':28}{100 * (sec['on'] - sec['off']) / sec['off']:+13.2f}%"
      f"{100 * (sec['hist'] - sec['off']) / sec['off']:+14.2f}%")
print("json: " + json.dumps({"seconds": sec, "samples_per_sec": sps, "writer_ms": wms}))
PY
