#!/bin/bash
# mwm_overlap_bench.sh - multi_worker_mirrored with its gradient reduction
# overlapping the backward pass, against the same packs reduced after it and
# against one pack, in one run.
#
#   tests/bench/mwm_overlap_bench.sh [--runs N] [--steps N] [--bytes-per-pack B] [--build DIR]
#
# `loom launch --local --workers 2` on configs/fashion_mnist_multi_worker.cfg
# (MLP 784-256-128-10, global batch 128), three ways, alternating so load
# from other processes falls on all alike:
#   one pack   the default: one all-reduce of the gradients after backward
#   after      strategy.bytes_per_pack = B (default 65536: two packs, the
#              last two layers' 134 KiB and the first layer's 785 KiB),
#              all-reduced after backward (LOOM_OVERLAP=0)
#   overlap    the same packs, the first all-reduced while backward computes
#              the first layer's gradients
# Samples/s from the chief's metrics.jsonl "end" line; medians of N runs
# (default 5). All three give the same weights (tests/integration/mwm_overlap.sh).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
RUNS=5 STEPS=400 BPP=65536
while [ $# -gt 0 ]; do
    case "$1" in
    --runs) RUNS=$2; shift ;;
    --steps) STEPS=$2; shift ;;
    --bytes-per-pack) BPP=$2; shift ;;
    --build) BUILD=$2; shift ;;
    *) sed -n '2,20p' "${BASH_SOURCE[0]}"; exit 2 ;;
    esac
    shift
done
bench_loom mwm_overlap_bench.sh
CFG=$ROOT/configs/fashion_mnist_multi_worker.cfg
W=$(mktemp -d /tmp/loom_overlap_bench_XXXXXX)
trap 'rm -rf "$W"' EXIT
cd "$ROOT"
COMMON=(--set run.max_steps=$STEPS --set run.eval_steps=1 --set run.threads=1 --set run.progress='"none"'
        --set run.checkpoint_steps=0)
sps() { python3 -c 'import json,sys; print([json.loads(l) for l in open(sys.argv[1]) if "\"end\"" in l][-1]["samples_per_sec"])' "$1/metrics.jsonl"; }
job() { # NAME RUN [ENV...] -- ARGS...
    local name=$1 r=$2; shift 2
    local envs=()
    while [ "$1" != "--" ]; do envs+=("$1"); shift; done
    shift
    env -u OPENBLAS_CORETYPE ${envs[@]+"${envs[@]}"} timeout 300 "$LOOM" launch --local "$CFG" --workers 2 \
        --model-dir "$W/$name$r" "${COMMON[@]}" "$@" >"$W/$name$r.log" 2>&1 ||
        { echo "$name failed:"; tail -5 "$W/$name$r.log"; exit 1; }
    sps "$W/$name$r"
}
one=() after=() over=()
echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
for ((r = 1; r <= RUNS; r++)); do
    one+=("$(job one "$r" -- )")
    after+=("$(job after "$r" LOOM_OVERLAP=0 -- --set strategy.bytes_per_pack=$BPP)")
    over+=("$(job over "$r" -- --set strategy.bytes_per_pack=$BPP)")
    echo "run $r: one pack ${one[-1]}  after ${after[-1]}  overlap ${over[-1]} samples/s"
done
o=$(median "${one[@]}") a=$(median "${after[@]}") v=$(median "${over[@]}")
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
printf '%-52s %10s\n' "MLP, 2 workers, batch 128, $STEPS steps (median of $RUNS)" "samples/s"
printf '%-52s %10.0f\n' "one pack, after backward (default)" "$o"
printf '%-52s %10.0f\n' "bytes_per_pack $BPP, after backward (LOOM_OVERLAP=0)" "$a"
printf '%-52s %10.0f\n' "bytes_per_pack $BPP, overlapping backward" "$v"
awk -v o="$o" -v a="$a" -v v="$v" 'BEGIN { printf "overlap / after %.3f, overlap / one pack %.3f\n", v / a, v / o }'
