#!/bin/bash
# strategy_bench.sh - training samples/s of the distribution strategies, side
# by side in one run, on real Fashion-MNIST:
#   one_device (1 core)   taskset to one core, run.threads = 1
#   one_device (2 cores)  run.threads = 0: intra-op threads on every core
#   mirrored(2)           2 replicas, one per core (cross_device_ops = "auto": ring)
#   central_storage(2)    2 replicas, variables on the host
# for the MLP (configs/fashion_mnist_mlp.cfg) and the CNN (fashion_mnist_cnn.cfg).
#
#   tests/bench/strategy_bench.sh [--quick] [--models mlp,cnn] [--runs N] [--build DIR] [--keep]
#
#   --quick   MLP 300 steps, CNN 40 steps (default: MLP 1 epoch, CNN 100 steps)
#   --runs N  repetitions (default 3); the configurations alternate within a
#             repetition, so load from other processes falls on all alike
# Reports medians of `samples_per_sec` from metrics.jsonl's end line (time in
# training steps, input included, evaluation and checkpoints excluded), then
# the ratios the issue targets: mirrored(2) / one_device(2 cores) >= 0.95 and
# mirrored(2) / one_device(1 core) >= 1.8; then the same strategies timed step
# by step in process (strategy_steps: 10th percentile, input excluded).
# Prints "json: {...}" last.
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
RUNS=${BENCH_RUNS:-3}
MODELS=mlp,cnn
QUICK=0
KEEP=0
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; exit "${1:-2}"; }
while [ $# -gt 0 ]; do
    case "$1" in
    --quick) QUICK=1 ;;
    --models) MODELS=$2; shift ;;
    --runs) RUNS=$2; shift ;;
    --build) BUILD=$2; shift ;;
    --keep) KEEP=1 ;;
    -h | --help) usage 0 ;;
    *) echo "strategy_bench.sh: unknown argument '$1'" >&2; usage ;;
    esac
    shift
done
bench_loom strategy_bench.sh
command -v taskset >/dev/null || { echo "strategy_bench.sh: taskset (util-linux) is needed for the 1-core run" >&2; exit 1; }
TMP=$(mktemp -d "${TMPDIR:-/tmp}/loom_sbench.XXXXXX")
if [ "$KEEP" = 1 ]; then echo "scratch: $TMP" >&2; else trap 'rm -rf "$TMP"' EXIT; fi
cd "$ROOT"

steps_for() { # model -> max_steps
    if [ "$1" = mlp ]; then [ "$QUICK" = 1 ] && echo 300 || echo 469; else [ "$QUICK" = 1 ] && echo 40 || echo 100; fi
}

# run MODEL NAME RUN -> samples/s on stdout
run() {
    local model=$1 name=$2 i=$3 dir="$TMP/$1-$2-$3" pre=() sets=()
    case "$name" in
    one_1core) pre=(taskset -c 0); sets=(--set run.threads=1) ;;
    one_2cores) sets=(--set run.threads=0) ;;
    mirrored2) sets=(--set strategy.type=mirrored --set strategy.replicas=2 --set strategy.cross_device_ops=auto) ;;
    central2) sets=(--set strategy.type=central_storage --set strategy.replicas=2) ;;
    esac
    if ! "${pre[@]}" "$LOOM" train "configs/fashion_mnist_$model.cfg" --model-dir "$dir" "${sets[@]}" \
        --set run.max_steps="$(steps_for "$model")" --set run.checkpoint_steps=0 --set run.eval_each_epoch=false \
        --set run.progress='"none"' >"$dir.log" 2>&1; then
        echo "strategy_bench.sh: loom train failed ($model, $name):" >&2; tail -5 "$dir.log" >&2; exit 1
    fi
    grep '"event": "end"' "$dir/metrics.jsonl" | sed 's/.*"samples_per_sec": \([0-9.e+]*\).*/\1/'
}


CONFIGS="one_1core one_2cores mirrored2 central2"
json="{\"cores\": $(nproc), \"runs\": $RUNS, \"quick\": $QUICK"
printf '%-6s %-20s %12s   %s\n' model configuration samples/s "runs"
for model in ${MODELS//,/ }; do
    declare -A all=()
    for i in $(seq 1 "$RUNS"); do
        for c in $CONFIGS; do all[$c]+="$(run "$model" "$c" "$i") "; done
    done
    declare -A med=()
    for c in $CONFIGS; do
        med[$c]=$(tr ' ' '\n' <<<"${all[$c]}" | grep . | median)
        printf '%-6s %-20s %12.0f   %s\n' "$model" "$c" "${med[$c]}" "${all[$c]}"
        json+=", \"${model}_$c\": ${med[$c]}"
    done
    r2=$(awk "BEGIN{printf \"%.3f\", ${med[mirrored2]} / ${med[one_2cores]}}")
    r1=$(awk "BEGIN{printf \"%.3f\", ${med[mirrored2]} / ${med[one_1core]}}")
    rc=$(awk "BEGIN{printf \"%.3f\", ${med[central2]} / ${med[one_2cores]}}")
    printf '%-6s mirrored(2) / one_device(2 cores) = %s (target >= 0.95)\n' "$model" "$r2"
    printf '%-6s mirrored(2) / one_device(1 core)  = %s (target >= 1.8)\n' "$model" "$r1"
    printf '%-6s central_storage(2) / one_device(2 cores) = %s\n' "$model" "$rc"
    json+=", \"${model}_mirrored_vs_one_2cores\": $r2, \"${model}_mirrored_vs_one_1core\": $r1"
    unset all med
done
# in process: the 10th percentile of single-step times, which a busy machine
# disturbs less than the samples/s of whole runs (tests/bench/strategy_steps.c)
STEPS=$BUILD/tests/bench/strategy_steps
if [ -x "$STEPS" ]; then
    for model in ${MODELS//,/ }; do
        if [ "$model" = mlp ]; then n=300; else n=$([ "$QUICK" = 1 ] && echo 15 || echo 40); fi
        echo "--- $model, in process: $n steps per strategy, best of $RUNS runs"
        out=$("$STEPS" "configs/fashion_mnist_$model.cfg" "$n" "$RUNS")
        grep -v '^json: ' <<<"$out"
        json+=", \"${model}_steps\": $(sed -n 's/^json: //p' <<<"$out")"
    done
fi
echo "json: $json}"
