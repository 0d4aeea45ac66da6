#!/bin/bash
# mwm_bench.sh - multi_worker_mirrored against PyTorch DDP (gloo) and against
# Loom's own mirrored in one process, side by side, in one run.
#
#   tests/bench/mwm_bench.sh [--runs N] [--steps N] [--build DIR] [--set KEY=VALUE ...]
#
# The MLP of configs/fashion_mnist_multi_worker.cfg (784-256-128-10), global
# batch 128, on Fashion-MNIST:
#   loom mwm    `loom launch --local --workers 2` (2 processes, 1 replica and
#               1 compute thread each, the cluster transport's ring)
#   loom mirr   `loom train` with mirrored, 2 replicas in one process
#   torch ddp   tests/bench/ddp_ref.py: DistributedDataParallel, gloo, 2 processes
# Samples/s over the training steps (Loom: the chief's metrics.jsonl "end"
# line, the job's examples over its training time; DDP: steps x 128 over the
# slowest rank's time), medians of N runs (default 3), the three alternating
# so load from other processes falls on all alike. Targets (issue 13):
# mwm >= 4x DDP, mwm >= 0.8x mirrored. Not part of the test suite.
# --set applies to the mwm job only, e.g. --set strategy.bytes_per_pack=65536
# (two packs, reduced across the workers while backward runs; LOOM_OVERLAP=0
# in the environment reduces the same packs after backward).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
BUILD=${BUILD:-$ROOT/build}
RUNS=3
STEPS=400
MWM_SETS=()
while [ $# -gt 0 ]; do
    case "$1" in
    --runs) RUNS=$2; shift ;;
    --steps) STEPS=$2; shift ;;
    --build) BUILD=$2; shift ;;
    --set) MWM_SETS+=(--set "$2"); shift ;;
    *) sed -n '2,20p' "${BASH_SOURCE[0]}"; exit 2 ;;
    esac
    shift
done
LOOM=$BUILD/loom
CFG=$ROOT/configs/fashion_mnist_multi_worker.cfg
W=$(mktemp -d /tmp/loom_mwm_bench_XXXXXX)
trap 'rm -rf "$W"' EXIT
cd "$ROOT"
COMMON=(--set run.max_steps=$STEPS --set run.eval_steps=1 --set run.threads=1 --set run.progress='"none"'
        --set run.checkpoint_steps=0)

sps() { # the samples/s of a model_dir's last "end" line
    python3 -c 'import json,sys; print([json.loads(l) for l in open(sys.argv[1]) if "\"end\"" in l][-1]["samples_per_sec"])' "$1/metrics.jsonl"
}
median() { printf '%s\n' "$@" | sort -g | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }'; }

mwm=() mir=() ddp=()
for ((r = 1; r <= RUNS; r++)); do
    env -u OPENBLAS_CORETYPE timeout 300 "$LOOM" launch --local "$CFG" --workers 2 --model-dir "$W/mwm$r" "${COMMON[@]}" ${MWM_SETS[@]+"${MWM_SETS[@]}"} \
        >"$W/mwm$r.log" 2>&1 || { echo "loom launch failed:"; tail -5 "$W/mwm$r.log"; exit 1; }
    mwm+=("$(sps "$W/mwm$r")")
    env -u OPENBLAS_CORETYPE timeout 300 "$LOOM" train "$CFG" --model-dir "$W/mir$r" "${COMMON[@]}" \
        --set strategy.type=mirrored --set strategy.replicas=2 --set run.threads=2 --set "cluster.worker=[]" \
        >"$W/mir$r.log" 2>&1 || { echo "loom train (mirrored) failed:"; tail -5 "$W/mir$r.log"; exit 1; }
    mir+=("$(sps "$W/mir$r")")
    timeout 600 /usr/bin/python3 "$HERE/ddp_ref.py" --world 2 --port $((29500 + RANDOM % 500)) --steps "$STEPS" \
        >"$W/ddp$r.json" 2>"$W/ddp$r.log" || { echo "ddp_ref.py failed:"; tail -5 "$W/ddp$r.log"; exit 1; }
    ddp+=("$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["samples_per_sec"])' "$W/ddp$r.json")")
    echo "run $r: mwm ${mwm[-1]}  mirrored ${mir[-1]}  ddp ${ddp[-1]} samples/s"
done
m=$(median "${mwm[@]}") i=$(median "${mir[@]}") d=$(median "${ddp[@]}")
printf '%-44s %12s\n' "MLP, global batch 128, $STEPS steps (median of $RUNS)" "samples/s"
printf '%-44s %12.0f\n' "loom launch --local --workers 2 (mwm)" "$m"
printf '%-44s %12.0f\n' "loom mirrored, 2 replicas in one process" "$i"
printf '%-44s %12.0f\n' "PyTorch DDP, gloo, 2 processes" "$d"
awk -v m="$m" -v i="$i" -v d="$d" 'BEGIN {
    printf "mwm / DDP      %.2fx (target >= 4x)\n", m / d
    printf "mwm / mirrored %.2fx (target >= 0.8x)\n", m / i }'
echo "json: {\"mwm\": $m, \"mirrored\": $i, \"ddp\": $d}"
