#!/bin/bash
# netns_allreduce_bench.sh - all-reduce between emulated hosts (network
# namespaces, tests/integration/netns_lib.sh) over token-bucket links of
# RATE (default 1 Gbit/s, both directions of every host's link): Loom's ring
# (tests/bench/cluster_allreduce, one rank per host), Open MPI's
# MPI_Allreduce (mpi_allreduce.c; mpirun in host 1 starting the other ranks
# through an rsh agent that enters their host's namespace) and torch's gloo
# where /usr/bin/python3 has it, side by side in one run; then the ring's
# bound 2(n-1)/n x bytes / rate, each side's fraction of it and Loom's
# ratios; the loopback 4 KiB latency of Loom and MPI (issue 13's figure);
# and strategy.compression: a 2-host MLP's steady-state step time (loom
# train, 2 workers on hosts 1 and 2) in float32, bf16 and fp16, the median
# of --runs runs each and the ratios (target 1.6x), and each format's eval
# accuracy after --acc-epochs epochs (target: within 0.3%; 0 skips it).
# Needs root (namespaces); not part of the test suite.
#
#   tests/bench/netns_allreduce_bench.sh [--hosts 3] [--rate 1gbit] [--sizes B,...] [--reps R]
#       [--build DIR] [--no-mpi] [--no-gloo] [--no-train] [--steps 80] [--runs 3] [--acc-epochs 1]
set -uo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
BUILD=${BUILD:-$ROOT/build}
N=3
RATE=1gbit
SIZES=1048576,4194304,16777216,67108864
REPS=3
MPI=1
GLOO=1
TRAIN=1
STEPS=80
TRAIN_RUNS=3
ACC_EPOCHS=1
usage() { sed -n '2,20p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }
while [ $# -gt 0 ]; do
    case "$1" in
    --hosts) N=$2; shift ;;
    --rate) RATE=$2; shift ;;
    --sizes) SIZES=$2; shift ;;
    --reps) REPS=$2; shift ;;
    --build) BUILD=$2; shift ;;
    --steps) STEPS=$2; shift ;;
    --runs) TRAIN_RUNS=$2; shift ;;
    --acc-epochs) ACC_EPOCHS=$2; shift ;;
    --no-mpi) MPI=0 ;;
    --no-gloo) GLOO=0 ;;
    --no-train) TRAIN=0 ;;
    -h | --help) usage 0 ;;
    *) echo "netns_allreduce_bench.sh: unknown argument '$1'" >&2; usage ;;
    esac
    shift
done
case "$BUILD" in /*) ;; *) BUILD=$ROOT/$BUILD ;; esac
BIN=$BUILD/tests/bench/cluster_allreduce
LOOM=$BUILD/loom
[ -x "$BIN" ] && [ -x "$LOOM" ] || { echo "netns_allreduce_bench.sh: build first (ninja -C $BUILD)" >&2; exit 1; }
source "$ROOT/tests/integration/netns_lib.sh"
[ "$(id -u)" = 0 ] || { echo "netns_allreduce_bench.sh: needs root (network namespaces)" >&2; exit 1; }
WORK=$(mktemp -d /tmp/loom-netns-bench.XXXXXX)
netns_up "$N" "$RATE" || { echo "netns_allreduce_bench.sh: cannot set up $N hosts" >&2; netns_down; exit 1; }
trap 'netns_down; rm -rf "$WORK"' EXIT
RATE_BPS=$(awk -v r="$RATE" 'BEGIN { m = 1; if (r ~ /gbit$/) m = 1e9; else if (r ~ /mbit$/) m = 1e6; sub(/[a-z]+$/, "", r); print r * m / 8 }')
HOSTS=$(seq -s, 1 "$N" | sed "s/\([0-9]*\)/$NETNS_NET.\1/g")
PORT=29600

echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# $N emulated hosts ($HOSTS), every link $RATE (tc tbf, both directions); medians of $REPS all-reduces"

# ---- Loom: one cluster_allreduce rank per host ----------------------------------------------
loom_run() { # OUT [ARGS]: rank 0's lines into OUT
    local out=$1 i pids=(); shift
    for ((i = N; i >= 1; i--)); do
        netns_exec "$i" timeout 600 "$BIN" --hosts "$HOSTS" --rank $((i - 1)) --port $PORT --sizes "$SIZES" --reps "$REPS" "$@" \
            >"$out.$i" 2>"$WORK/loom.err.$i" &
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || { echo "# loom failed:"; cat "$WORK"/loom.err.* | head -5 | sed 's/^/#   /'; }; done
    cp "$out.1" "$out"
}
loom_run "$WORK/loom"
loom_run "$WORK/loom_bf16" --wire bf16

# ---- Open MPI: mpirun in host 1, the others through an agent entering their namespace ------
if [ "$MPI" = 1 ]; then
    if ! command -v mpicc >/dev/null || ! command -v mpirun >/dev/null; then
        echo "# MPI: mpicc/mpirun not found (apt-get install openmpi-bin libopenmpi-dev); skipped"; MPI=0
    elif ! mpicc -O2 "$HERE/mpi_allreduce.c" -o "$WORK/mpi_allreduce" 2>"$WORK/mpicc.log"; then
        echo "# MPI: mpicc failed"; MPI=0
    fi
fi
if [ "$MPI" = 1 ]; then
    cat >"$WORK/agent" <<EOF
#!/bin/bash
# rsh agent for mpirun: [OPTIONS] HOST COMMAND -> COMMAND in that host's namespace
while [ "\${1#-}" != "\$1" ]; do shift; done
host=\$1; shift
exec ip netns exec "$NETNS_ID-h\${host##*.}" /bin/sh -c "\$*"
EOF
    chmod +x "$WORK/agent"
    netns_exec 1 timeout 900 mpirun --allow-run-as-root --oversubscribe --host "$HOSTS" -np "$N" \
        --mca plm_rsh_agent "$WORK/agent" --mca routed direct --mca btl tcp,self --mca pml ob1 \
        --mca btl_tcp_if_include eth0 --mca oob_tcp_if_include eth0 \
        "$WORK/mpi_allreduce" "$SIZES" "$REPS" >"$WORK/mpi" 2>"$WORK/mpi.err" \
        || { echo "# MPI failed:"; tail -5 "$WORK/mpi.err" | sed 's/^/#   /'; MPI=0; }
fi

# ---- gloo ------------------------------------------------------------------------------------
if [ "$GLOO" = 1 ] && ! /usr/bin/python3 -c 'import torch.distributed as d; assert d.is_gloo_available()' 2>/dev/null; then
    echo "# gloo: /usr/bin/python3 cannot import torch.distributed with gloo (apt-get install python3-torch); skipped"
    GLOO=0
fi
if [ "$GLOO" = 1 ]; then
    for ((i = N; i >= 1; i--)); do
        netns_exec "$i" env MASTER_ADDR="$NETNS_NET.1" MASTER_PORT=$((PORT + 50)) RANK=$((i - 1)) WORLD_SIZE="$N" \
            GLOO_SOCKET_IFNAME=eth0 timeout 900 /usr/bin/python3 "$HERE/gloo_allreduce.py" "$N" "$SIZES" "$REPS" \
            >"$WORK/gloo.$i" 2>"$WORK/gloo.err.$i" &
    done
    wait
    cp "$WORK/gloo.1" "$WORK/gloo"
    [ -s "$WORK/gloo" ] || { echo "# gloo failed:"; tail -3 "$WORK/gloo.err.1" | sed 's/^/#   /'; }
fi

val() { [ -f "$1" ] && awk -v s="$2" '$1 == s {print $2}' "$1"; }
echo
printf '%10s | %9s %6s %5s | %9s %6s %5s | %9s %6s %5s | %9s %6s | %9s %6s %6s\n' bytes "loom" GB/s bound "mpi" GB/s bound \
    "gloo" GB/s bound "loom bf16" GB/s "bound" "x mpi" "x gloo"
for size in ${SIZES//,/ }; do
    awk -v n="$N" -v b="$size" -v r="$RATE_BPS" -v l="$(val "$WORK/loom" "$size")" -v h="$(val "$WORK/loom_bf16" "$size")" \
        -v m="$(val "$WORK/mpi" "$size")" -v g="$(val "$WORK/gloo" "$size")" '
        function bw(t) { return t == "" ? "" : b * 2 * (n - 1) / n / t / 1e9 }
        function tm(t) { return t == "" ? "-" : sprintf("%.1f ms", t * 1e3) }
        function f(x) { return x == "" ? "-" : sprintf("%.3f", x) }
        function pc(t) { return t == "" ? "-" : sprintf("%.0f%%", 100 * bound / t) }
        BEGIN {
            bound = b * 2 * (n - 1) / n / r   # the ring over links of r bytes/s
            printf "%10d | %9s %6s %5s | %9s %6s %5s | %9s %6s %5s | %9s %6s | %7.1f ms %6s %6s\n", b, tm(l), f(bw(l)), pc(l),
                tm(m), f(bw(m)), pc(m), tm(g), f(bw(g)), pc(g), tm(h), f(bw(h)), bound * 1e3,
                (m == "" || l == "") ? "-" : sprintf("%.2f", m / l), (g == "" || l == "") ? "-" : sprintf("%.2f", g / l)
        }'
done
echo "# GB/s: bus bandwidth 2(n-1)/n x bytes / time; bound: the fraction of the ring's bound (target >= 90% for loom);"
echo "# loom bf16: strategy.compression's all-reduce (half the bytes: above 100% of the float32 bound is possible)"

# ---- loopback, 4 KiB (issue 13's small-message figure) ---------------------------------------
l4=$(timeout 120 "$BIN" --ranks 3 --sizes 4096 --reps 21 | awk '{print $2}')
m4=""
[ "$MPI" = 1 ] && m4=$(timeout 120 mpirun --allow-run-as-root --oversubscribe --mca btl tcp,self --mca pml ob1 \
    --mca btl_tcp_if_include lo -np 3 "$WORK/mpi_allreduce" 4096 21 2>/dev/null | awk '{print $2}')
awk -v l="$l4" -v m="$m4" 'BEGIN { printf "# loopback, 3 ranks, 4 KiB: loom %.1f us, mpi %s\n", l * 1e6, m == "" ? "-" : sprintf("%.1f us (%.2fx loom)", m * 1e6, m / l) }'

# ---- strategy.compression: a 2-host MLP step over the links ---------------------------------
if [ "$TRAIN" = 1 ]; then
    CFG=$ROOT/configs/fashion_mnist_multi_worker.cfg
    SECRET=$(openssl rand -hex 32)
    # an MLP of 2.8 M parameters (784-1536-1024-10; 11.2 MB of float32 gradients a step) on a global
    # batch of 64: a step's 2 x 32 examples cost 0.5 GFLOP, its float32 all-reduce 89 ms at 1 Gbit/s
    # (2 hosts: each link carries the whole buffer once): the wire sets the pace on an idle machine
    MLP='model.layers=({type="flatten";},{type="dense";units=1536;activation="relu";},{type="dense";units=1024;activation="relu";},{type="dense";units=10;})'
    # the formats, each at its defaults: float32 (one pack, the sharded update), bf16 with error
    # feedback and fp16 (both: 8 packs overlapping backward); and float32 in 8 packs, for reference
    FMTS=(f32 bf16 fp16 f32p8)
    fmt_sets() {
        case "$1" in
        f32) ;;
        bf16) echo "--set strategy.compression=bf16 --set strategy.compression_error_feedback=true" ;;
        fp16) echo "--set strategy.compression=fp16" ;;
        f32p8) echo "--set strategy.num_packs=8" ;;
        esac
    }
    # step_time FMT: ms per step in the steady state: metrics.jsonl's summaries (every 10 steps) from
    # step 20 to STEPS, so the start (data decode, connecting, the first step) is not counted
    step_time() {
        local i d="$WORK/train_$1"
        for i in 1 2; do
            # shellcheck disable=SC2046
            netns_exec "$i" env LOOM_CLUSTER_SECRET="$SECRET" timeout 600 "$LOOM" train "$CFG" --task worker:$((i - 1)) \
                --model-dir "$d" --fresh --set "cluster.worker=[\"$NETNS_NET.1:$PORT\", \"$NETNS_NET.2:$PORT\"]" \
                --set "$MLP" --set 'data.train.transforms.[1].size=64' --set run.max_steps="$STEPS" --set run.eval_steps=1 \
                --set run.checkpoint_steps=0 --set run.summary_steps=10 --set run.progress='"none"' $(fmt_sets "$1") \
                >"$d.$i.log" 2>&1 &
        done
        wait
        awk -v s="$STEPS" '/"summary"/ {
                match($0, /"step": [0-9]+/); st = substr($0, RSTART + 8, RLENGTH - 8) + 0
                match($0, /"wall_time": [0-9.]+/); t[st] = substr($0, RSTART + 13, RLENGTH - 13) }
            END { if ((20 in t) && (s in t)) printf "%.1f", (t[s] - t[20]) / (s - 20) * 1e3 }' "$d/metrics.jsonl" 2>/dev/null
    }
    median() { tr ' ' '\n' | grep . | sort -g | awk '{ v[NR] = $1 } END { if (NR) print (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2) }'; }
    declare -A RUNS
    for ((k = 1; k <= TRAIN_RUNS; k++)); do # the formats interleaved, so a change of load hits them alike
        for f in "${FMTS[@]}"; do
            t=$(step_time "$f")
            [ -n "$t" ] || { echo "# training $f failed:"; tail -3 "$WORK/train_$f.1.log" | sed 's/^/#   /'; }
            RUNS[$f]="${RUNS[$f]:-} $t"
        done
    done
    echo
    echo "# 2 hosts at $RATE, MLP 784-1536-1024-10 (2.8 M parameters), global batch 64, ms per step (steps 20-$STEPS) in $TRAIN_RUNS runs; load average $(cut -d' ' -f1-3 /proc/loadavg)"
    for f in "${FMTS[@]}"; do
        printf '#   %-6s %-30s median %s ms\n' "$f" "${RUNS[$f]# }" "$(median <<<"${RUNS[$f]}")"
    done
    awk -v a="$(median <<<"${RUNS[f32]}")" -v b="$(median <<<"${RUNS[bf16]}")" -v c="$(median <<<"${RUNS[fp16]}")" \
        -v p="$(median <<<"${RUNS[f32p8]}")" 'function r(x, y) { return (x > 0 && y > 0) ? sprintf("%.2fx", x / y) : "-" }
        BEGIN { printf "# step time: bf16 %s, fp16 %s faster than float32 (target >= 1.6x); than float32 in 8 packs: bf16 %s, fp16 %s\n",
            r(a, b), r(a, c), r(p, b), r(p, c) }'

    # accuracy: the same MLP and batch, ACC_EPOCHS epochs (the cosine schedule run to its end), each
    # format's eval accuracy on the Fashion-MNIST test set; over loopback (loom launch --local): the
    # weights do not depend on the network (the same bits), only the time does
    if [ "$ACC_EPOCHS" -gt 0 ]; then
        acc() {
            local d="$WORK/acc_$1"
            # shellcheck disable=SC2046
            timeout 3600 "$LOOM" launch --local "$CFG" --model-dir "$d" --set "$MLP" --set 'data.train.transforms.[1].size=64' \
                --set run.epochs="$ACC_EPOCHS" --set optimizer.schedule.decay_steps=$((ACC_EPOCHS * 938)) \
                --set run.checkpoint_steps=0 --set run.progress='"none"' $(fmt_sets "$1") >"$d.log" 2>&1
            sed -n 's/.*done: step [0-9]*, eval accuracy \([0-9.]*\).*/\1/p' "$d.log" | tail -1
        }
        a32=$(acc f32); a16=$(acc bf16); ah=$(acc fp16)
        awk -v a="$a32" -v b="$a16" -v c="$ah" -v e="$ACC_EPOCHS" 'function d(x) { return x == "" || a == "" ? "-" : sprintf("%+.2f%%", (x - a) * 100) }
            BEGIN { printf "# eval accuracy after %d epoch%s: float32 %s, bf16 + error feedback %s (%s), fp16 %s (%s); target: within 0.3%%\n",
                e, e == 1 ? "" : "s", a == "" ? "-" : a, b == "" ? "-" : b, d(b), c == "" ? "-" : c, d(c) }'
    fi
fi
