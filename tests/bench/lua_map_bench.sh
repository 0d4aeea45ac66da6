#!/bin/bash
# lua_map_bench.sh - how a Lua map scales with the data threads: Fashion-MNIST
# through lua/augment.lua (flip, brightness, cutout; the C tensor ops do the
# pixel work, one Lua interpreter per parallel call) with parallel = 1 and
# parallel = 2, measured by `loom profile` in the same run.
#
#   tests/bench/lua_map_bench.sh [--runs N] [--steps N] [--build DIR]
#
#   --runs N   repetitions (default 5); the settings alternate within a run,
#              so load from other processes falls on all alike; medians reported
#   --steps N  batches of 128 per measurement (default 200)
#   --build    meson build dir with `loom` (default BUILD or ./build)
#
# Two pipelines, run.threads = 2, no shuffle (so the map dominates):
#   batch:   catalog -> batch 128 -> map(augment_batch)  (one call per batch, as
#            configs/fashion_mnist_lua.cfg does)
#   element: catalog -> map(augment) -> batch 128        (one call per image)
# For each: samples/s with parallel 1 and 2 and the speed-up, and the CPU time
# (user + sys) per sample the map costs (above the same pipeline without it).
# On a machine busy with other work the wall-clock speed-up says little, while
# parallel = 2 costing the CPU of parallel = 1 is what lets two idle cores
# give twice the rate; per element, handing each image to a thread costs about
# as much as augmenting it. Prints the load average and one JSON line
# ("json: ..."). Exits 1 when loom fails; the figures are reported, not judged.
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
RUNS=5
STEPS=200
usage() { sed -n '2,24p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }
while [ $# -gt 0 ]; do
    case "$1" in
        --runs) RUNS=$2; shift 2 ;;
        --steps) STEPS=$2; shift 2 ;;
        --build) BUILD=$2; shift 2 ;;
        -h|--help) usage 0 ;;
        *) usage ;;
    esac
done
bench_loom lua_map_bench.sh
W=$(mktemp -d /tmp/loom_lua_bench_XXXXXX)
trap 'rm -rf "$W"' EXIT

# cfg NAME PARALLEL: the config of pipeline NAME (none | batch | element)
cfg() {
    local map="" tail=""
    case "$1" in
        batch) tail="{ op = \"map\"; lua = \"$ROOT/lua/augment.lua:augment_batch\"; parallel = $2; }," ;;
        element) map="{ op = \"map\"; lua = \"$ROOT/lua/augment.lua:augment\"; parallel = $2; }," ;;
    esac
    cat > "$W/$1_$2.cfg" <<EOF
version = 1;
data: { train: {
  source: { type = "catalog"; name = "fashion_mnist"; split = "train"; };
  transforms = ( $map { op = "batch"; size = 128; }, $tail );
}; };
model: { layers = ( { type = "flatten"; }, { type = "dense"; units = 10; } ); };
optimizer: { type = "sgd"; learning_rate = 0.1; };
run: { model_dir = "$W/model"; threads = 2; };
EOF
    sed -i 's/},[[:space:]]*)/} )/' "$W/$1_$2.cfg"
    echo "$W/$1_$2.cfg"
}

# "samples/s cpu_seconds" of one `loom profile` of config $1
measure() {
    local out
    out=$(/usr/bin/time -f "cpu %U %S" "$LOOM" profile "$1" --steps "$STEPS" 2>&1) ||
        { echo "loom profile failed:" >&2; echo "$out" >&2; exit 1; }
    echo "$(sed -n 's/.* elements\/s, \([0-9.]*\) samples\/s.*/\1/p' <<<"$out" | head -1)" \
         "$(awk '/^cpu / {print $2 + $3}' <<<"$out")"
}

declare -A S C
NAMES="none_1 batch_1 batch_2 element_1 element_2"
load0=$(cut -d' ' -f1 /proc/loadavg)
for ((r = 1; r <= RUNS; r++)); do
    line="run $r:"
    for n in $NAMES; do
        read -r s c <<<"$(measure "$(cfg "${n%_*}" "${n#*_}")")"
        S[$n]+="$s "; C[$n]+="$c "
        line+=" $n $s samples/s ${c} cpu s;"
    done
    echo "$line"
done
load1=$(cut -d' ' -f1 /proc/loadavg)
med() { tr ' ' '\n' <<<"$1" | grep . | median; }
json="{\"runs\": $RUNS, \"steps\": $STEPS, \"load_before\": $load0"
k0=$(med "${C[none_1]}")
for p in batch element; do
    m1=$(med "${S[${p}_1]}"); m2=$(med "${S[${p}_2]}")
    k1=$(med "${C[${p}_1]}"); k2=$(med "${C[${p}_2]}")
    read -r speedup u1 u2 ratio <<<"$(awk -v a="$m1" -v b="$m2" -v z="$k0" -v x="$k1" -v y="$k2" -v n="$((STEPS * 128))" \
        'BEGIN {printf "%.2f %.1f %.1f %.2f", b / a, (x - z) / n * 1e6, (y - z) / n * 1e6, (y - z) / (x - z)}')"
    echo "$p: median samples/s parallel 1 = $m1, parallel 2 = $m2: speed-up ${speedup}x (target >= 1.8x);" \
         "map CPU per sample $u1 us vs $u2 us (x$ratio)"
    json+=", \"$p\": {\"parallel1\": $m1, \"parallel2\": $m2, \"speedup\": $speedup, \"cpu_us1\": $u1, \"cpu_us2\": $u2}"
done
echo "cores: $(nproc); load average: $load0 before, $load1 after (other processes skew the wall-clock figures)"
echo "json: $json, \"load_after\": $load1}"
