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
# and strategy.compression: a 2-host MLP's step time (loom train, 2 workers
# on hosts 1 and 2) in float32, bf16 and fp16, and the ratios (target 1.6x).
# Needs root (namespaces); not part of the test suite.
#
#   tests/bench/netns_allreduce_bench.sh [--hosts 3] [--rate 1gbit] [--sizes B,...] [--reps R]
#       [--build DIR] [--no-mpi] [--no-gloo] [--no-train] [--steps N]
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
STEPS=60
usage() { sed -n '2,18p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }
while [ $# -gt 0 ]; do
    case "$1" in
    --hosts) N=$2; shift ;;
    --rate) RATE=$2; shift ;;
    --sizes) SIZES=$2; shift ;;
    --reps) REPS=$2; shift ;;
    --build) BUILD=$2; shift ;;
    --steps) STEPS=$2; shift ;;
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
    # an MLP of 2.9 M parameters (11.6 MB of gradients a step) on a global batch of 64: a step's
    # 2 x 32 examples cost 0.6 GFLOP, its float32 all-reduce 93 ms at 1 Gbit/s: the wire sets the pace
    MLP='model.layers=({type="flatten";},{type="dense";units=1536;activation="relu";},{type="dense";units=1024;activation="relu";},{type="dense";units=10;})'
    step_time() { # FORMAT: seconds per step (from the chief's "done" line over STEPS steps)
        local i
        for i in 1 2; do
            netns_exec "$i" env LOOM_CLUSTER_SECRET="$SECRET" timeout 600 "$LOOM" train "$CFG" --task worker:$((i - 1)) \
                --model-dir "$WORK/train_$1" --fresh --set "cluster.worker=[\"$NETNS_NET.1:$PORT\", \"$NETNS_NET.2:$PORT\"]" \
                --set "$MLP" --set 'data.train.transforms.[1].size=64' --set run.max_steps="$STEPS" --set run.eval_steps=1 --set run.checkpoint_steps=0 \
                --set run.progress='"none"' --set strategy.compression="$1" >"$WORK/train_$1.$i" 2>&1 &
        done
        wait
        sed -n 's/.*done: step [0-9]*, .*, \([0-9.]*\) s,.*/\1/p' "$WORK/train_$1.1" | awk -v n="$STEPS" '{ printf "%.4f", $1 / n }'
    }
    f32=$(step_time none); b16=$(step_time bf16); h16=$(step_time fp16)
    echo
    awk -v a="$f32" -v b="$b16" -v c="$h16" -v r="$RATE" 'BEGIN {
        printf "# 2 hosts at %s, MLP of 2.9 M parameters, global batch 64: step time float32 %.1f ms, bf16 %.1f ms (%.2fx), fp16 %.1f ms (%.2fx); target >= 1.6x\n",
            r, a * 1e3, b * 1e3, (b > 0 ? a / b : 0), c * 1e3, (c > 0 ? a / c : 0) }'
    [ -n "$f32" ] && [ -n "$b16" ] || { echo "# training failed:"; tail -3 "$WORK/train_none.1" "$WORK/train_bf16.1" | sed 's/^/#   /'; }
fi
