#!/bin/bash
# lm_bench.sh - the character LSTM language model of issue 24
# (configs/fortunes_char_lstm.cfg's model), Loom and PyTorch side by side in
# one run: the same text (Debian's fortunes as lines, every tenth block of 50
# lines held out), the same vocabulary (Loom adapts it; lm_torch_ref.py reads
# Loom's adapt.txt), the same windows of 64 + 1 characters, the same model
# (embedding 64 -> lstm 256 -> dense 100 per step; the same initialisers),
# the same schedule (Adam 0.002, clip_norm 1, batch 64, STEPS steps, 2
# threads each). Prints each side's training samples/s and tokens/s, the
# eval loss (nats/char) over the whole held-out set, and the ratios.
# `--cell transformer` runs the character transformer instead (what
# transformer_bench.sh runs: embedding + learned positions -> BLOCKS causal
# pre-norm blocks of 4 heads of 16 and a feed-forward of 256 -> layer norm ->
# dense 100, Adam 0.001; transformer_torch_ref.py beside it).
#
#   tests/bench/lm_bench.sh [--steps N] [--build DIR] [--cell lstm|gru|transformer] [--units H] [--blocks N]
#
# The issue's targets: eval loss within 2% of PyTorch's, samples/s >= 1.5x.
# The figures mean little on a loaded machine (the load average is printed).
# TORCH_PYTHON names a python3 with PyTorch (default /usr/bin/python3).
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
STEPS=300
CELL=lstm
UNITS=256
BLOCKS=2
PY=${TORCH_PYTHON:-/usr/bin/python3}
while [ $# -gt 0 ]; do
    case $1 in
        --steps) STEPS=$2; shift 2 ;;
        --build) BUILD=$2; shift 2 ;;
        --cell) CELL=$2; shift 2 ;;
        --units) UNITS=$2; shift 2 ;;
        --blocks) BLOCKS=$2; shift 2 ;;
        *) echo "usage: $0 [--steps N] [--build DIR] [--cell lstm|gru|transformer] [--units H] [--blocks N]" >&2; exit 2 ;;
    esac
done
bench_loom lm_bench.sh
ls /usr/share/games/fortunes/*.u8 >/dev/null 2>&1 || { echo "lm_bench.sh: no fortunes: apt-get install fortunes" >&2; exit 1; }
"$PY" -c "import torch" 2>/dev/null || { echo "lm_bench.sh: $PY has no torch (set TORCH_PYTHON)" >&2; exit 1; }
case $CELL in lstm | gru | transformer) ;; *) echo "lm_bench.sh: --cell $CELL: lstm, gru or transformer" >&2; exit 2 ;; esac
SCRATCH=$(mktemp -d /tmp/loom_lm_bench.XXXXXX)
trap 'rm -rf "$SCRATCH"' EXIT
cat /usr/share/games/fortunes/*.u8 |
    awk -v tr="$SCRATCH/train.txt" -v ev="$SCRATCH/eval.txt" '{ print > (int((NR - 1) / 50) % 10 == 0 ? ev : tr) }'
pipeline() { # $1: train or eval
    cat <<CFG
    source: { type = "text"; files = ["$SCRATCH/$1.txt"]; max_length = 4096; truncate = true; };
    transforms = (
      { op = "map"; fn = "tokenize"; feature = "line"; mode = "utf8_chars"; adapt = true; max_tokens = 100; },
      { op = "select"; features = ["line"]; },
      { op = "unbatch"; },
      { op = "window"; size = 65; shift = 64; drop_remainder = true; },
      { op = "lm_pairs"; feature = "line"; input = "context"; target = "next"; },
CFG
    if [ "$1" = train ]; then
        echo '      { op = "shuffle"; buffer = 4096; }, { op = "repeat"; },'
        echo '      { op = "batch"; size = 64; drop_remainder = true; }'
    else
        echo '      { op = "batch"; size = 256; }'
    fi
    echo '    );'
}
layers() { # the layers between the embedding and the output
    if [ "$CELL" != transformer ]; then
        echo "    { type = \"$CELL\"; units = $UNITS; return_sequences = true; },"
        return
    fi
    echo '    { type = "positional_embedding"; max_length = 64; },'
    for b in $(seq 1 "$BLOCKS"); do
        echo "    { type = \"transformer_block\"; name = \"block$b\"; num_heads = 4; key_dim = 16; ff_dim = 256; causal = true; norm_first = true; },"
    done
    echo '    { type = "layer_normalization"; epsilon = 1e-5; },'
}
if [ "$CELL" = transformer ]; then
    LR=0.001 REF=(transformer_torch_ref.py --blocks "$BLOCKS") WHAT="transformer ($BLOCKS blocks)"
else
    LR=0.002 REF=(lm_torch_ref.py --units "$UNITS" --cell "$CELL") WHAT="$CELL $UNITS"
fi
cat > "$SCRATCH/lm.cfg" <<CFG
version = 1;
data: {
  train: {
$(pipeline train)
  };
  eval: {
$(pipeline eval)
  };
};
model: {
  input = "context"; label = "next";
  metrics = ["accuracy", "perplexity"];
  layers = (
    { type = "embedding"; input_dim = 100; output_dim = 64; },
$(layers)
    { type = "dense"; units = 100; }
  );
};
optimizer: { type = "adam"; learning_rate = $LR; clip_norm = 1.0; };
run: { model_dir = "$SCRATCH/m"; max_steps = $STEPS; threads = 2; log_steps = 100; };
CFG
load0=$(cut -d' ' -f1 /proc/loadavg)
"$LOOM" train "$SCRATCH/lm.cfg" >"$SCRATCH/loom.log" 2>&1 || { tail -5 "$SCRATCH/loom.log" >&2; exit 1; }
end=$(grep '"event": "end"' "$SCRATCH/m/metrics.jsonl")
num() { sed "s/.*\"$1\": \([-0-9.e+]*\).*/\1/" <<<"$end"; }
L_SPS=$(num samples_per_sec) L_LOSS=$(num eval_loss)
T_JSON=$("$PY" "$HERE/${REF[0]}" "${REF[@]:1}" --train "$SCRATCH/train.txt" --eval "$SCRATCH/eval.txt" \
    --vocab "$SCRATCH/m/adapt.txt" --steps "$STEPS" --threads 2)
tnum() { sed "s/.*\"$1\": \([-0-9.e+]*\).*/\1/" <<<"$T_JSON"; }
T_SPS=$(tnum samples_per_sec) T_LOSS=$(tnum eval_loss)
load1=$(cut -d' ' -f1 /proc/loadavg)
printf '%-8s %12s %12s %16s\n' impl "samples/s" "tokens/s" "eval nats/char"
printf '%-8s %12.1f %12.0f %16.4f\n' loom "$L_SPS" "$(awk -v s="$L_SPS" 'BEGIN { print s * 64 }')" "$L_LOSS"
printf '%-8s %12.1f %12.0f %16.4f\n' pytorch "$T_SPS" "$(awk -v s="$T_SPS" 'BEGIN { print s * 64 }')" "$T_LOSS"
R=$(awk -v l="$L_SPS" -v t="$T_SPS" 'BEGIN { printf "%.2f", l / t }')
D=$(awk -v l="$L_LOSS" -v t="$T_LOSS" 'BEGIN { printf "%+.2f", 100 * (l - t) / t }')
echo "$WHAT, $STEPS steps of 64 x 64 characters: loom / pytorch samples/s ${R}x (target >= 1.5x); eval loss ${D}% (target within 2%); load average $load0 -> $load1"
echo "json: {\"loom_samples_per_sec\": $L_SPS, \"torch_samples_per_sec\": $T_SPS, \"ratio\": $R, \"loom_eval_loss\": $L_LOSS, \"torch_eval_loss\": $T_LOSS, \"steps\": $STEPS, \"cell\": \"$CELL\", \"units\": $UNITS, \"blocks\": $BLOCKS}"
