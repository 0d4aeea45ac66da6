#!/bin/bash
# text_bench.sh - the tokenize/window pipeline of issue 24, side by side in one
# run: Loom vs tf.data (TextVectorization + window, AUTOTUNE; text_ref.py) on
# the same files (Debian's fortunes, as lines), the same vocabulary rule
# (characters, max_tokens 100, adapted before the clock starts) and the same
# (input, target) windows of 64 + 1 ids in batches of 64; one pass each.
#
#   tests/bench/text_bench.sh [--runs N] [--build DIR] [--epochs N]
#
# The implementations alternate within each run; medians are reported, with
# the 1-minute load average (the figures mean little on a loaded machine),
# then one JSON line (prefix "json: "). The target: Loom >= 10x tf.data.
# TF_PYTHON names a python3 with TensorFlow (default python3); without it
# only Loom's figure is printed.
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
RUNS=${BENCH_RUNS:-3}
EPOCHS=1
TF_PY=${TF_PYTHON:-python3}
while [ $# -gt 0 ]; do
    case $1 in
        --runs) RUNS=$2; shift 2 ;;
        --build) BUILD=$2; shift 2 ;;
        --epochs) EPOCHS=$2; shift 2 ;;
        *) echo "usage: $0 [--runs N] [--build DIR] [--epochs N]" >&2; exit 2 ;;
    esac
done
bench_loom text_bench.sh
FILES='/usr/share/games/fortunes/*.u8'
ls $FILES >/dev/null 2>&1 || { echo "text_bench.sh: no fortunes: apt-get install fortunes" >&2; exit 1; }
SCRATCH=$(mktemp -d /tmp/loom_text_bench.XXXXXX)
trap 'rm -rf "$SCRATCH"' EXIT
cat > "$SCRATCH/text.cfg" <<CFG
version = 1;
data: { train: {
  source: { type = "text"; files = ["$FILES"]; max_length = 4096; truncate = true; };
  transforms = (
    { op = "map"; fn = "tokenize"; feature = "line"; mode = "utf8_chars"; adapt = true; max_tokens = 100; },
    { op = "select"; features = ["line"]; },
    { op = "unbatch"; },
    { op = "window"; size = 65; shift = 64; drop_remainder = true; },
    { op = "lm_pairs"; feature = "line"; },
    { op = "batch"; size = 64; drop_remainder = true; }
  ); }; };
model: { input = "input"; label = "target"; layers = ({ type = "flatten"; }, { type = "dense"; units = 2; }); };
optimizer: { type = "sgd"; learning_rate = 0.1; };
run: { model_dir = "$SCRATCH/m"; epochs = 1; };
CFG
has_tf=0
"$TF_PY" -c "import tensorflow" 2>/dev/null && has_tf=1
loom_sps=(); tf_sps=(); loads=()
for r in $(seq 1 "$RUNS"); do
    # a whole pass: profile stops at the pass's end (steps beyond it are not run)
    out=$("$LOOM" profile "$SCRATCH/text.cfg" --steps $((EPOCHS * 1000000)) 2>/dev/null | grep '^profile data.train')
    loom_sps+=("$(sed 's/.* elements (\([0-9]*\) samples) in \([0-9.]*\) s.*/\1 \2/' <<<"$out" | awk '{ printf "%.1f", $1 / $2 }')")
    if [ $has_tf = 1 ]; then
        tf_sps+=("$("$TF_PY" "$HERE/text_ref.py" --files "$FILES" --epochs "$EPOCHS" | sed 's/.*"samples_per_sec": \([0-9.]*\).*/\1/')")
    fi
    loads+=("$(cut -d' ' -f1 /proc/loadavg)")
done
L=$(median "${loom_sps[@]}")
printf '%-10s %14s %14s\n' impl "windows/s" "tokens/s"
printf '%-10s %14.0f %14.0f\n' loom "$L" "$(awk -v s="$L" 'BEGIN { print s * 64 }')"
if [ $has_tf = 1 ]; then
    T=$(median "${tf_sps[@]}")
    printf '%-10s %14.0f %14.0f\n' tf.data "$T" "$(awk -v s="$T" 'BEGIN { print s * 64 }')"
    R=$(awk -v l="$L" -v t="$T" 'BEGIN { printf "%.1f", l / t }')
    echo "loom / tf.data: ${R}x (target >= 10x); load average $(median "${loads[@]}")"
    echo "json: {\"loom_samples_per_sec\": $L, \"tfdata_samples_per_sec\": $T, \"ratio\": $R, \"runs\": $RUNS}"
else
    echo "tf.data: skipped ($TF_PY has no TensorFlow; set TF_PYTHON); load average $(median "${loads[@]}")"
    echo "json: {\"loom_samples_per_sec\": $L, \"runs\": $RUNS}"
fi
