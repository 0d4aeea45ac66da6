#!/bin/bash
# torch_sweep.sh - finds PyTorch's best settings on this machine, by measurement.
#
#   tests/bench/torch_sweep.sh [mlp|cnn] [rounds]     (default: mlp 3)
#
# Tries every combination of OPENBLAS_CORETYPE (as installed / SkylakeX /
# Haswell), OPENBLAS_NUM_THREADS (1, 2), torch.set_num_threads (1, 2) and, for
# the CNN, oneDNN on/off and NCHW vs channels_last. Configurations run round-robin, one round at a time,
# so load from other processes spreads over all of them; prints the median
# samples/s of each (MLP: one epoch; CNN: SWEEP_CNN_STEPS steps, default 100),
# best first, and which kernel OpenBLAS actually ran.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PY=/usr/bin/python3
MODEL=${1:-mlp}
ROUNDS=${2:-3}
OUT=$(mktemp "${TMPDIR:-/tmp}/torch_sweep.XXXXXX")
trap 'rm -f "$OUT"' EXIT

# A configuration: coretype_obthreads_torchthreads_variant; variant for the
# CNN: on (oneDNN, NCHW), cl (oneDNN, channels_last), off (oneDNN disabled).
configs=()
if [ "$MODEL" = cnn ]; then
    # The convolutions do not touch OpenBLAS with oneDNN on; only the dense layers do.
    for ob in 1 2; do
        for tt in 1 2; do configs+=("installed_${ob}_${tt}_on" "installed_${ob}_${tt}_cl"); done
    done
    # oneDNN off (installed_2_2_off) measured ~3x slower than on; add it back to re-check.
else
    for core in installed SkylakeX Haswell; do
        for ob in 1 2; do
            for tt in 1 2; do configs+=("${core}_${ob}_${tt}_on"); done
        done
    done
fi

for round in $(seq 1 "$ROUNDS"); do
    for c in "${configs[@]}"; do
        read -r core ob tt dnn <<<"${c//_/ }"
        envs=(OPENBLAS_NUM_THREADS="$ob")
        [ "$core" != installed ] && envs+=(OPENBLAS_CORETYPE="$core")
        args=(--model "$MODEL" --threads "$tt" --no-eval --seed "$round")
        if [ "$MODEL" = cnn ]; then args+=(--epochs 1 --max-steps "${SWEEP_CNN_STEPS:-100}"); else args+=(--epochs 1); fi
        [ "$dnn" = off ] && args+=(--no-mkldnn)
        [ "$dnn" = cl ] && args+=(--channels-last)
        line=$(env -u OPENBLAS_CORETYPE "${envs[@]}" "$PY" "$HERE/torch_ref.py" "${args[@]}" | tail -1)
        echo "$c $line" >>"$OUT"
        echo "round $round: $c $(echo "$line" | "$PY" -c 'import json,sys; d=json.load(sys.stdin); print(d["samples_per_sec"], d["blas_core"])')" >&2
    done
done

"$PY" - "$OUT" <<'EOF'
import json, statistics, sys
runs = {}
for l in open(sys.argv[1]):
    c, j = l.split(" ", 1)
    runs.setdefault(c, []).append(json.loads(j))
rows = []
for c, v in runs.items():
    core, ob, tt, dnn = c.split("_")
    s = [d["samples_per_sec"] for d in v]
    rows.append((statistics.median(s), core, ob, tt, dnn, v[0]["blas_core"], min(s), max(s)))
rows.sort(reverse=True)
print(f"{'median sps':>10} {'min':>8} {'max':>8}  OPENBLAS_CORETYPE  OPENBLAS_NUM_THREADS  torch_threads  oneDNN  (OpenBLAS ran)")
print("(oneDNN: on = NCHW, cl = channels_last, off = disabled)")
for m, core, ob, tt, dnn, ran, lo, hi in rows:
    print(f"{m:10.0f} {lo:8.0f} {hi:8.0f}  {core:17}  {ob:20}  {tt:13}  {dnn:6}  ({ran})")
EOF
