#!/bin/bash
# summary_bench.sh - the cost of TensorBoard summaries on the MLP config
# (configs/fashion_mnist_mlp.cfg), on and off side by side in one run.
#
#   tests/bench/summary_bench.sh [--runs N] [--epochs E] [--build DIR]
#
# "on" is run.summary_steps = 100 (the default: 5 scalars every 100 steps,
# eval scalars per epoch, the config text) plus run.histogram_epochs = 1 (a
# histogram of every variable each epoch, the costliest part); "off" is
# run.summary_steps = 0 (no event file). Runs alternate on/off so load from
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
    for mode in on off; do
        if [ $mode = on ]; then set_=(--set run.summary_steps=100 --set run.histogram_epochs=1)
        else set_=(--set run.summary_steps=0); fi
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
on_s, off_s = med("on", "seconds"), med("off", "seconds")
on_sps, off_sps = med("on", "samples_per_sec"), med("off", "samples_per_sec")
writer_ms = med("on", "summary_ms")
print(f"MLP (configs/fashion_mnist_mlp.cfg), {epochs} epochs, medians of {runs} runs, on/off alternating")
print(f"{'':24}{'summaries on':>14}{'off':>12}")
print(f"{'run seconds':24}{on_s:14.3f}{off_s:12.3f}")
print(f"{'train samples/s':24}{on_sps:14.0f}{off_sps:12.0f}")
print(f"time in the summary writer: {writer_ms:.2f} ms = {100 * writer_ms / 1e3 / on_s:.2f}% of the run (target < 1%)")
print(f"wall difference (noisy on a shared machine): {100 * (on_s - off_s) / off_s:+.2f}%")
print("json: " + json.dumps({"on_seconds": on_s, "off_seconds": off_s, "on_sps": on_sps, "off_sps": off_sps,
                             "writer_ms": writer_ms, "writer_share": writer_ms / 1e3 / on_s}))
PY
