#!/bin/bash
# ctr_bench.sh - the CTR model: Loom in one process, Loom with 2 workers + 2
# ps (parameter_server, sparse pulls and pushes of the table), and PyTorch
# (nn.EmbeddingBag, sparse=True, Adagrad), the same model and data, in one run.
#
#   tests/bench/ctr_bench.sh [--examples N] [--runs N] [--threads N] [--no-ps] [--build DIR] [--keep]
#
# The data: `loom records convert --config configs/ctr.cfg --count N` writes
# the synthetic CTR set (26 columns hashed into 2^20 rows) to TFRecord once;
# both sides train configs/ctr.cfg's model (embedding 2^20 x 16, flatten,
# dense 256 relu, dense 128 relu, the output; Adagrad lr 0.05, batch 1024)
# for one pass over those files. Loom reads them through its tfrecord source
# (parsing included in its time); PyTorch (tests/bench/ctr_torch_ref.py)
# parses them beforehand and trains from tensors in memory. Runs alternate
# (so load from other processes falls on both alike); medians of --runs
# (default 3) are printed with the ratio (target: Loom >= 2x) and the bytes
# an update touches per step, sparse (the batch's distinct rows: weights,
# gradients and Adagrad accumulator) against the whole table.
# The parameter-server run: configs/ctr_parameter_server.cfg on the same
# files, `loom launch --local --workers 2 --ps 2` (a coordinator, 2 workers
# of 1 thread each, the table split over the 2 ps tasks, asynchronous), one
# pass of the coordinator's epoch (the same number of applied steps of 1024
# examples); its samples/s are applied examples per second, and the bytes
# its workers' pulls and pushes moved per step are printed beside those of
# moving every variable whole (the coordinator's count). --no-ps skips it.
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
PY=/usr/bin/python3
RUNS=${BENCH_RUNS:-3}
N=102400
THREADS=2
KEEP=0
PS=1
usage() { sed -n '2,27p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }
while [ $# -gt 0 ]; do
    case "$1" in
    --examples) N=$2; shift ;;
    --runs) RUNS=$2; shift ;;
    --threads) THREADS=$2; shift ;;
    --build) BUILD=$2; shift ;;
    --keep) KEEP=1 ;;
    --no-ps) PS=0 ;;
    -h | --help) usage 0 ;;
    *) echo "ctr_bench.sh: unknown argument '$1'" >&2; usage ;;
    esac
    shift
done
bench_loom ctr_bench.sh
SCR=$(mktemp -d /tmp/loom_ctr_bench_XXXXXX)
[ "$KEEP" = 1 ] && echo "scratch: $SCR" || trap 'rm -rf "$SCR"' EXIT
cd "$ROOT"

# the loss of configs/ctr.cfg, so both sides train the same thing
LOSS=$(sed -n 's/^ *loss = "\([a-z_]*\)".*/\1/p' configs/ctr.cfg | head -1)
case "$LOSS" in
sparse_softmax_cross_entropy) TLOSS=softmax ;;
*) TLOSS=bce ;;
esac

echo "data: $N synthetic CTR examples (configs/ctr.cfg) to TFRecord"
"$LOOM" records convert --config configs/ctr.cfg --count "$N" --output "$SCR/data/ctr" -q >/dev/null
# configs/ctr.cfg with the files as its source, one pass, no eval, no checkpoint on the way
sed -e '/^  eval: {/,/^  };/d' \
    -e 's|source: { type = "synthetic"; count = -1; ctr = .*|source: { type = "tfrecord"; files = ["'"$SCR"'/data/ctr-*.tfrecord"]; features: { ids = { dtype = "int64"; shape = [26]; }; label = { dtype = "float32"; shape = []; }; }; };|' \
    -e 's|{ op = "take"; count = 1000000; },||' \
    -e 's|epochs = 2;|epochs = 1; threads = '"$THREADS"'; progress = "none"; checkpoint_steps = 0;|' \
    configs/ctr.cfg >"$SCR/ctr_bench.cfg"
# the same for the parameter-server job; every task 1 thread (2 workers on 2 cores)
sed -e '/^  eval: {/,/^  };/d' \
    -e 's|source: { type = "synthetic"; count = -1; ctr = .*|source: { type = "tfrecord"; files = ["'"$SCR"'/data/ctr-*.tfrecord"]; features: { ids = { dtype = "int64"; shape = [26]; }; label = { dtype = "float32"; shape = []; }; }; };|' \
    -e 's|{ op = "take"; count = 1000000; },||' \
    -e 's|epochs = 2;|epochs = 1; threads = 1; progress = "none"; checkpoint_steps = 0;|' \
    configs/ctr_parameter_server.cfg >"$SCR/ctr_ps_bench.cfg"

: >"$SCR/loom.txt"
: >"$SCR/torch.txt"
: >"$SCR/ps.txt"
: >"$SCR/ps_bytes.txt"
PSBYTES=""
for ((r = 1; r <= RUNS; r++)); do
    rm -rf "$SCR/run"
    if ! env -u OPENBLAS_CORETYPE "$LOOM" train "$SCR/ctr_bench.cfg" --model-dir "$SCR/run" >"$SCR/loom.log" 2>&1; then
        cat "$SCR/loom.log" >&2
        exit 1
    fi
    grep '"event": "end"' "$SCR/run/metrics.jsonl" | sed 's/.*"samples_per_sec": \([0-9.e+]*\).*/\1/' >>"$SCR/loom.txt"
    $PY "$HERE/ctr_torch_ref.py" --files "$SCR/data/ctr-*.tfrecord" --threads "$THREADS" --loss "$TLOSS" >"$SCR/torch.json"
    $PY -c 'import json,sys; print(json.load(open(sys.argv[1]))["samples_per_sec"])' "$SCR/torch.json" >>"$SCR/torch.txt"
    PSMSG=""
    if [ "$PS" = 1 ]; then
        rm -rf "$SCR/psrun"
        if ! env -u OPENBLAS_CORETYPE timeout 900 "$LOOM" launch --local "$SCR/ctr_ps_bench.cfg" --workers 2 --ps 2 \
            --model-dir "$SCR/psrun" >"$SCR/ps.log" 2>&1; then
            cat "$SCR/ps.log" >&2
            exit 1
        fi
        grep '"event": "end"' "$SCR/psrun/metrics.jsonl" | sed 's/.*"samples_per_sec": \([0-9.e+]*\).*/\1/' >>"$SCR/ps.txt"
        PSBYTES=$(grep -o 'bytes_per_step=[0-9]*.*whole_bytes_per_step=[0-9]*' "$SCR/ps.log" | tail -1)
        echo "$PSBYTES" >>"$SCR/ps_bytes.txt"
        PSMSG=", loom 2 workers + 2 ps $(tail -1 "$SCR/ps.txt") samples/s"
    fi
    echo "run $r: loom $(tail -1 "$SCR/loom.txt") samples/s$PSMSG, pytorch $(tail -1 "$SCR/torch.txt") samples/s"
done
P=$([ "$PS" = 1 ] && median <"$SCR/ps.txt" || echo 0)
PSB=$(grep -o '^bytes_per_step=[0-9]*' "$SCR/ps_bytes.txt" 2>/dev/null | cut -d= -f2 | median || true)
PSW=$(grep -o 'whole_bytes_per_step=[0-9]*' "$SCR/ps_bytes.txt" 2>/dev/null | tail -1 | cut -d= -f2 || true)
L=$(median <"$SCR/loom.txt")
T=$(median <"$SCR/torch.txt")
ROWS=$($PY -c 'import json,sys; print(json.load(open(sys.argv[1]))["mean_distinct_rows"])' "$SCR/torch.json")
$PY - "$L" "$T" "$ROWS" "$THREADS" "$N" "$P" "${PSB:-0}" "${PSW:-0}" "$(cut -d' ' -f1 /proc/loadavg)" <<'EOF'
import sys
l, t, rows, threads, n = float(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
p, psb, psw, load = float(sys.argv[6]), float(sys.argv[7] or 0), float(sys.argv[8] or 0), sys.argv[9]
table_rows, dim = 1 << 20, 16
row_bytes = dim * 4 * 3  # weights, gradient, Adagrad accumulator
sparse, dense = rows * row_bytes, table_rows * row_bytes
print("\nCTR model, one machine, %d threads each, %d examples, batch 1024, medians:" % (threads, n))
print("  %-44s %12.0f samples/s" % ("Loom (tfrecord source, embedding, Adagrad)", l))
if p > 0:
    print("  %-44s %12.0f samples/s" % ("Loom 2 workers + 2 ps (1 thread each, async)", p))
print("  %-44s %12.0f samples/s" % ("PyTorch (EmbeddingBag sparse=True, Adagrad)", t))
print("  ratio Loom / PyTorch: %.2fx (target >= 2x): %s" % (l / t, "met" if l / t >= 2 else "NOT met"))
if p > 0:
    print("  ratio Loom 2 workers + 2 ps / PyTorch: %.2fx (target >= 2x): %s; / Loom one process: %.2fx"
          % (p / t, "met" if p / t >= 2 else "NOT met", p / l))
if psb > 0 and psw > 0:
    print("  parameter_server bytes moved per step (workers' pulls + pushes): %.2f MiB vs %.1f MiB for every"
          " variable whole both ways: %.0fx less" % (psb / 2**20, psw / 2**20, psw / psb))
print("  (load average %s when done: this 2-core machine is shared, so single runs swing)" % load)
print("  bytes an update touches per step: sparse %.2f MiB (%.0f distinct rows of the batch's 26624 ids)"
      " vs the whole table %.1f MiB: %.0fx less" % (sparse / 2**20, rows, dense / 2**20, dense / sparse))
print('json: {"loom_sps": %.1f, "torch_sps": %.1f, "ratio": %.3f, "distinct_rows": %.1f, "sparse_bytes": %d, "table_bytes": %d,'
      ' "ps_sps": %.1f, "ps_bytes_per_step": %d, "ps_whole_bytes_per_step": %d}'
      % (l, t, l / t, rows, sparse, dense, p, psb, psw))
EOF
