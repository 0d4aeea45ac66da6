#!/bin/bash
# mwm_bench.sh - multi_worker_mirrored against PyTorch DDP (gloo) and against
# Loom's own mirrored in one process, side by side, in one run.
#
#   tests/bench/mwm_bench.sh [--runs N] [--steps N] [--build DIR] [--set KEY=VALUE ...]
#
# The MLP of configs/fashion_mnist_multi_worker.cfg (784-256-128-10), global
# batch 128, on Fashion-MNIST:
#   loom mwm    `loom launch --local --workers 2` (2 processes, 1 replica and
#               1 compute thread each, the cluster transport's ring), its
#               update sharded across the workers (the default)
#   mwm whole   the same with LOOM_SHARDED_UPDATE=0: every worker applies the
#               whole update (as before the sharded update)
#   loom mirr   `loom train` with mirrored, 2 replicas in one process
#   torch ddp   tests/bench/ddp_ref.py: DistributedDataParallel, gloo, 2 processes
#               (only where python3 has torch)
#   loom mpi    `mpirun -np 2 --mca btl tcp,self loom train` with strategy.communication
#               = "mpi" (the mpi plugin's MPI_Allreduce instead of the ring), and the
#   mpirun ring same under mpirun with the ring: mpirun pins each rank to a core
#               (--bind-to core, its default for 2 ranks), which launch does not, so
#               compare the mpi op with the ring under the same launcher. Only where
#               mpirun and the plugin are; no target.
# Samples/s over the training steps (Loom: the chief's metrics.jsonl "end"
# line, the job's examples over its training time; DDP: steps x 128 over the
# slowest rank's time), medians of N runs (default 3), the three alternating
# so load from other processes falls on all alike. Targets (issue 13):
# mwm >= 4x DDP, mwm >= 0.9x mirrored (issue 22). Not part of the test suite.
# --set applies to the mwm job only, e.g. --set strategy.bytes_per_pack=65536
# (two packs, reduced across the workers while backward runs; LOOM_OVERLAP=0
# in the environment reduces the same packs after backward).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
RUNS=3
STEPS=400
MWM_SETS=()
while [ $# -gt 0 ]; do
    case "$1" in
    --runs) RUNS=$2; shift ;;
    --steps) STEPS=$2; shift ;;
    --build) BUILD=$2; shift ;;
    --set) MWM_SETS+=(--set "$2"); shift ;;
    *) sed -n '2,30p' "${BASH_SOURCE[0]}"; exit 2 ;;
    esac
    shift
done
bench_loom mwm_bench.sh
CFG=$ROOT/configs/fashion_mnist_multi_worker.cfg
W=$(mktemp -d /tmp/loom_mwm_bench_XXXXXX)
trap 'rm -rf "$W"' EXIT
cd "$ROOT"
COMMON=(--set run.max_steps=$STEPS --set run.eval_steps=1 --set run.threads=1 --set run.progress='"none"'
        --set run.checkpoint_steps=0)

sps() { # the samples/s of a model_dir's last "end" line
    python3 -c 'import json,sys; print([json.loads(l) for l in open(sys.argv[1]) if "\"end\"" in l][-1]["samples_per_sec"])' "$1/metrics.jsonl"
}

mwm=() whole=() mir=() ddp=() mpi=() mring=()
DDP=0
if /usr/bin/python3 -c 'import torch' 2>/dev/null; then DDP=1; fi
MPI=0
if command -v mpirun >/dev/null && [ -f "$BUILD/plugins/mpi.so" ]; then MPI=1; fi
for ((r = 1; r <= RUNS; r++)); do
    env -u OPENBLAS_CORETYPE timeout 300 "$LOOM" launch --local "$CFG" --workers 2 --model-dir "$W/mwm$r" "${COMMON[@]}" ${MWM_SETS[@]+"${MWM_SETS[@]}"} \
        >"$W/mwm$r.log" 2>&1 || { echo "loom launch failed:"; tail -5 "$W/mwm$r.log"; exit 1; }
    mwm+=("$(sps "$W/mwm$r")")
    env -u OPENBLAS_CORETYPE LOOM_SHARDED_UPDATE=0 timeout 300 "$LOOM" launch --local "$CFG" --workers 2 \
        --model-dir "$W/whole$r" "${COMMON[@]}" ${MWM_SETS[@]+"${MWM_SETS[@]}"} \
        >"$W/whole$r.log" 2>&1 || { echo "loom launch (whole update) failed:"; tail -5 "$W/whole$r.log"; exit 1; }
    whole+=("$(sps "$W/whole$r")")
    env -u OPENBLAS_CORETYPE timeout 300 "$LOOM" train "$CFG" --model-dir "$W/mir$r" "${COMMON[@]}" \
        --set strategy.type=mirrored --set strategy.replicas=2 --set run.threads=2 --set "cluster.worker=[]" \
        >"$W/mir$r.log" 2>&1 || { echo "loom train (mirrored) failed:"; tail -5 "$W/mir$r.log"; exit 1; }
    mir+=("$(sps "$W/mir$r")")
    if [ "$DDP" = 1 ]; then
        timeout 600 /usr/bin/python3 "$HERE/ddp_ref.py" --world 2 --port $((29500 + RANDOM % 500)) --steps "$STEPS" \
            >"$W/ddp$r.json" 2>"$W/ddp$r.log" || { echo "ddp_ref.py failed:"; tail -5 "$W/ddp$r.log"; exit 1; }
        ddp+=("$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["samples_per_sec"])' "$W/ddp$r.json")")
    else
        ddp+=(0)
    fi
    if [ "$MPI" = 1 ]; then
        for c in mpi ring; do
            env -u OPENBLAS_CORETYPE timeout 300 mpirun --allow-run-as-root --oversubscribe -np 2 --mca btl tcp,self \
                "$LOOM" train "$CFG" --model-dir "$W/mpi_$c$r" "${COMMON[@]}" --set "cluster.worker=[]" \
                --set cluster.port_base=$((30000 + RANDOM % 20000)) --set strategy.communication=$c \
                >"$W/mpi_$c$r.log" 2>&1 || { echo "mpirun loom train (communication = $c) failed:"; tail -5 "$W/mpi_$c$r.log"; exit 1; }
        done
        mpi+=("$(sps "$W/mpi_mpi$r")")
        mring+=("$(sps "$W/mpi_ring$r")")
    fi
    echo "run $r: mwm ${mwm[-1]}  whole ${whole[-1]}  mirrored ${mir[-1]}  ddp ${ddp[-1]}${mpi:+  mpirun+mpi ${mpi[-1]}  mpirun+ring ${mring[-1]}} samples/s"
done
m=$(median "${mwm[@]}") w=$(median "${whole[@]}") i=$(median "${mir[@]}") d=$(median "${ddp[@]}")
printf '%-44s %12s\n' "MLP, global batch 128, $STEPS steps (median of $RUNS)" "samples/s"
printf '%-44s %12.0f\n' "loom launch --local --workers 2 (mwm)" "$m"
printf '%-44s %12.0f\n' "the same, whole update (LOOM_SHARDED_UPDATE=0)" "$w"
printf '%-44s %12.0f\n' "loom mirrored, 2 replicas in one process" "$i"
printf '%-44s %12.0f\n' "PyTorch DDP, gloo, 2 processes" "$d"
p=null q=null
if [ "$MPI" = 1 ]; then
    p=$(median "${mpi[@]}") q=$(median "${mring[@]}")
    printf '%-44s %12.0f\n' "mpirun -np 2, communication = mpi" "$p"
    printf '%-44s %12.0f\n' "mpirun -np 2, communication = ring" "$q"
fi
awk -v m="$m" -v w="$w" -v i="$i" -v d="$d" 'BEGIN {
    if (d > 0) printf "mwm / DDP      %.2fx (target >= 4x)\n", m / d
    else print "mwm / DDP      n/a (no torch for python3)"
    printf "mwm / mirrored %.2fx (target >= 0.9x)\n", m / i
    printf "whole / mirrored %.2fx (the update not sharded)\n", w / i }'
[ "$MPI" = 1 ] && awk -v q="$q" -v p="$p" 'BEGIN { printf "mpi / ring under mpirun %.2fx\n", p / q }'
echo "json: {\"mwm\": $m, \"mwm_whole\": $w, \"mirrored\": $i, \"ddp\": $d, \"mpirun_mpi\": $p, \"mpirun_ring\": $q}"
