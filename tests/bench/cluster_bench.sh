#!/bin/bash
# cluster_bench.sh - all-reduce between processes over loopback TCP: Loom's
# ring (loom_group, tests/bench/cluster_allreduce) against torch.distributed
# gloo (gloo_allreduce.py, Debian's python3-torch) and Open MPI over TCP
# (mpi_allreduce.c, compiled here with mpicc; mpirun --mca btl tcp,self),
# same sizes, side by side in one run, and a loopback TCP stream measured in
# the same run as the bound.
#
#   tests/bench/cluster_bench.sh [--ranks 2,3] [--sizes B,B,...] [--reps R] [--runs K] [--build DIR] [--no-gloo] [--no-mpi]
#
#   --ranks  process counts (default 2,3)
#   --sizes  all-reduce sizes in bytes (default 4 KiB, 64 KiB, 1, 4, 16, 64 MiB)
#   --reps   all-reduces per size within a run, median taken (default 5)
#   --runs   runs of each side, interleaved; the median of the runs' medians is reported (default 3)
#   --build  meson build dir holding tests/bench/cluster_allreduce (default BUILD or ./build)
#
# Prints, per process count and size: each side's median time, bus bandwidth
# (nccl-tests: 2(n-1)/n * bytes / time), Loom's ratios to gloo and MPI, and
# Loom's fraction of the stream bound; then the verdicts on the targets
# (issue 13): bus bandwidth at >= 1 MiB at least 2x gloo's and above MPI's,
# and at 4 KiB a latency no worse than MPI's. Not part of the test suite: run
# it on a quiet machine (the figures swing with load; the load is printed).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
BUILD=${BUILD:-$ROOT/build}
RANKS=2,3
SIZES=4096,65536,1048576,4194304,16777216,67108864
REPS=5
RUNS=3
GLOO=1
MPI=1
usage() { sed -n '2,23p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }
while [ $# -gt 0 ]; do
    case "$1" in
    --ranks) RANKS=$2; shift ;;
    --sizes) SIZES=$2; shift ;;
    --reps) REPS=$2; shift ;;
    --runs) RUNS=$2; shift ;;
    --build) BUILD=$2; shift ;;
    --no-gloo) GLOO=0 ;;
    --no-mpi) MPI=0 ;;
    -h | --help) usage 0 ;;
    *) echo "cluster_bench.sh: unknown argument '$1'" >&2; usage ;;
    esac
    shift
done
case "$BUILD" in /*) ;; *) BUILD=$ROOT/$BUILD ;; esac
BIN=$BUILD/tests/bench/cluster_allreduce
if [ ! -x "$BIN" ]; then
    echo "cluster_bench.sh: $BIN not found; build first: meson setup build && ninja -C build" >&2
    exit 1
fi
WORK=$(mktemp -d /tmp/loom-cluster-bench.XXXXXX)
trap 'rm -rf "$WORK"' EXIT

if [ "$GLOO" = 1 ] && ! /usr/bin/python3 -c 'import torch.distributed as d; assert d.is_gloo_available()' 2>/dev/null; then
    echo "# gloo: /usr/bin/python3 cannot import torch.distributed with gloo (apt-get install python3-torch); skipped"
    GLOO=0
fi
if [ "$MPI" = 1 ]; then
    if ! command -v mpicc >/dev/null || ! command -v mpirun >/dev/null; then
        echo "# MPI: mpicc/mpirun not found (apt-get install openmpi-bin libopenmpi-dev); skipped"
        MPI=0
    elif ! mpicc -O2 "$HERE/mpi_allreduce.c" -o "$WORK/mpi_allreduce" 2>"$WORK/mpicc.log"; then
        echo "# MPI: mpicc failed:"; sed 's/^/#   /' "$WORK/mpicc.log"; MPI=0
    fi
fi
MPIRUN=(mpirun --allow-run-as-root --oversubscribe --mca btl tcp,self --mca pml ob1 --mca btl_tcp_if_include lo)

echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# medians of $RUNS runs of $REPS all-reduces each (float32 SUM, each after a barrier, timed on rank 0)"

# One run of each side per round, interleaved so load swings hit all alike.
for n in ${RANKS//,/ }; do
    for run in $(seq "$RUNS"); do
        timeout 600 "$BIN" --ranks "$n" --sizes "$SIZES" --reps "$REPS" >"$WORK/loom.$n.$run"
        if [ "$GLOO" = 1 ]; then
            timeout 900 /usr/bin/python3 "$HERE/gloo_allreduce.py" "$n" "$SIZES" "$REPS" >"$WORK/gloo.$n.$run" 2>"$WORK/gloo.err" \
                || { echo "# gloo failed:"; tail -5 "$WORK/gloo.err" | sed 's/^/#   /'; GLOO=0; }
        fi
        if [ "$MPI" = 1 ]; then
            timeout 900 "${MPIRUN[@]}" -np "$n" "$WORK/mpi_allreduce" "$SIZES" "$REPS" >"$WORK/mpi.$n.$run" 2>"$WORK/mpi.err" \
                || { echo "# MPI failed:"; tail -5 "$WORK/mpi.err" | sed 's/^/#   /'; MPI=0; }
        fi
    done
done
for run in $(seq "$RUNS"); do "$BIN" --stream 67108864 --reps 5 >>"$WORK/stream"; done
STREAM=$(awk '{print $2}' "$WORK/stream" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')
printf '# loopback TCP stream (one connection, 64 MiB): %.2f GB/s\n' "$(awk -v s="$STREAM" 'BEGIN {print s/1e9}')"

# median over runs of side's time for (n, size); "" when missing
med() {
    local side=$1 n=$2 size=$3
    cat "$WORK/$side.$n".* 2>/dev/null | awk -v s="$size" '$1 == s {print $2}' | sort -g |
        awk '{a[NR]=$1} END {if (NR) print a[int((NR+1)/2)]}'
}
status=0
for n in ${RANKS//,/ }; do
    echo
    printf '%-2s %10s | %10s %7s | %10s %7s | %10s %7s | %7s %7s %7s\n' n bytes "loom time" GB/s "gloo time" GB/s \
        "mpi time" GB/s "x gloo" "x mpi" "stream"
    for size in ${SIZES//,/ }; do
        l=$(med loom "$n" "$size"); g=$(med gloo "$n" "$size"); m=$(med mpi "$n" "$size")
        awk -v n="$n" -v b="$size" -v l="$l" -v g="$g" -v m="$m" -v st="$STREAM" 'function bw(t) {return t == "" ? "" : b / t * 2 * (n - 1) / n / 1e9}
            function tm(t) {return t == "" ? "-" : (t < 1e-3 ? sprintf("%.1f us", t * 1e6) : sprintf("%.2f ms", t * 1e3))}
            function f(x) {return x == "" ? "-" : sprintf("%.2f", x)}
            BEGIN {
                lb = bw(l); gb = bw(g); mb = bw(m)
                printf "%-2d %10d | %10s %7s | %10s %7s | %10s %7s | %7s %7s %6.0f%%\n", n, b, tm(l), f(lb), tm(g), f(gb), tm(m), f(mb),
                    (g == "" || l == "") ? "-" : f(g / l), (m == "" || l == "") ? "-" : f(m / l), 100 * lb * 1e9 / st
            }'
        # Verdicts on the targets.
        if [ -n "$l" ] && [ "$size" -ge 1048576 ]; then
            [ -n "$g" ] && awk -v l="$l" -v g="$g" 'BEGIN {exit !(g / l >= 2)}' || { [ -n "$g" ] && echo "   below target: $n ranks, $size bytes: less than 2x gloo's bus bandwidth" && status=1; }
            [ -n "$m" ] && awk -v l="$l" -v m="$m" 'BEGIN {exit !(m / l > 1)}' || { [ -n "$m" ] && echo "   below target: $n ranks, $size bytes: not above MPI's bus bandwidth" && status=1; }
        fi
        if [ -n "$l" ] && [ -n "$m" ] && [ "$size" = 4096 ]; then
            awk -v l="$l" -v m="$m" 'BEGIN {exit !(l <= m)}' || { echo "   below target: $n ranks, 4 KiB: latency above MPI's"; status=1; }
        fi
    done
done
echo
[ "$status" = 0 ] && echo "# every target met in this run" || echo "# some targets missed in this run (see above)"
exit 0
