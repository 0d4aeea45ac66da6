#!/bin/bash
# generate_bench.sh - `loom generate` beside PyTorch's same model generating
# with the same loop, at batch 1, in one run; two models:
#
#   tests/bench/generate_bench.sh [--tokens N] [--runs N] [--build DIR] [--keep]
#
#   mlp:  configs/fortunes_char_embed.cfg (embedding 100 x 16 over the last
#         16 characters, flatten, dense 256 relu, dense 100), trained 300
#         steps: each token a forward over the window (Loom's generic path;
#         PyTorch the same);
#   lstm: configs/fortunes_char_lstm.cfg (embedding 64, lstm 256, dense 100
#         on each step), trained 20 steps: each token one LSTM step from
#         the carried state (Loom's incremental path; PyTorch's nn.LSTM with
#         (h, c) carried);
#   transformer: configs/fortunes_char_transformer.cfg (2 causal pre-norm
#         blocks, 4 heads x 16, window 64), trained 5 steps: samples of 60
#         tokens after the 4 of the prompt, the window, each token one
#         position with a KV cache (Loom's incremental path; PyTorch's same
#         blocks stepping with a cache of keys and values).
# Each is sampled for --tokens tokens (default 20000; temperature 1, seed 1,
# stdout to /dev/null): Loom's tokens/s as `loom generate` reports them (the
# loop: forward, draw, detokenise, write and flush each token), PyTorch's
# from generate_torch_ref.py (the same layers and loop, 1 thread, as Loom's
# decoder). Runs alternate; medians of --runs (default 3) and the ratios
# (issue 24's target: Loom >= 1.5x with a KV cache or state).
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
PY=/usr/bin/python3
RUNS=${BENCH_RUNS:-3}
N=20000
KEEP=0
usage() { sed -n '2,25p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }
while [ $# -gt 0 ]; do
    case "$1" in
    --tokens) N=$2; shift ;;
    --runs) RUNS=$2; shift ;;
    --build) BUILD=$2; shift ;;
    --keep) KEEP=1 ;;
    -h | --help) usage 0 ;;
    *) echo "generate_bench.sh: unknown argument '$1'" >&2; usage ;;
    esac
    shift
done
bench_loom generate_bench.sh
ls /usr/share/games/fortunes/*.u8 >/dev/null 2>&1 || { echo "generate_bench.sh: apt-get install fortunes" >&2; exit 1; }
SCR=$(mktemp -d /tmp/loom_generate_bench_XXXXXX)
[ "$KEEP" = 1 ] && echo "scratch: $SCR" || trap 'rm -rf "$SCR"' EXIT
cd "$ROOT"

# train MODEL CONFIG STEPS: a checkpoint to sample from in $SCR/MODEL
train() {
    echo "training $2 $3 steps"
    if ! "$LOOM" train "$2" --model-dir "$SCR/$1" --set run.max_steps="$3" --set run.progress='"none"' \
        --set run.status_port=0 --set run.eval_steps=1 >"$SCR/train.log" 2>&1; then
        cat "$SCR/train.log" >&2
        exit 1
    fi
}
train mlp configs/fortunes_char_embed.cfg 300
train lstm configs/fortunes_char_lstm.cfg 20
train transformer configs/fortunes_char_transformer.cfg 5
MODELS="mlp lstm transformer"
for model in $MODELS; do
    : >"$SCR/loom_$model.txt"
    : >"$SCR/torch_$model.txt"
done
for ((r = 1; r <= RUNS; r++)); do
    for model in $MODELS; do
        cfg=configs/fortunes_char_embed.cfg
        [ $model = lstm ] && cfg=configs/fortunes_char_lstm.cfg
        len=(--max-tokens "$N")
        tlen=(--tokens "$N")
        if [ $model = transformer ]; then
            cfg=configs/fortunes_char_transformer.cfg
            len=(--max-tokens 60 --samples $(((N + 59) / 60)))
            tlen=(--context 64 --samples $(((N + 59) / 60)))
        fi
        if ! "$LOOM" generate $cfg --model-dir "$SCR/$model" --prompt "The " "${len[@]}" --seed 1 \
            >/dev/null 2>"$SCR/gen_$model.log"; then
            cat "$SCR/gen_$model.log" >&2
            exit 1
        fi
        sed -n 's/.*(\([0-9.]*\) tokens\/s).*/\1/p' "$SCR/gen_$model.log" >>"$SCR/loom_$model.txt"
        $PY "$HERE/generate_torch_ref.py" --model $model "${tlen[@]}" >/dev/null 2>"$SCR/torch.json"
        $PY -c 'import json,sys; print(json.load(open(sys.argv[1]))["tokens_per_sec"])' "$SCR/torch.json" \
            >>"$SCR/torch_$model.txt"
        echo "run $r $model: loom $(tail -1 "$SCR/loom_$model.txt") tokens/s ($(grep -o '[a-z]* path' \
            "$SCR/gen_$model.log")), pytorch $(tail -1 "$SCR/torch_$model.txt") tokens/s"
    done
done
printf '%-34s %12s %12s %8s\n' "batch 1, $N tokens, tokens/s" loom pytorch ratio
for model in $MODELS; do
    L=$(median <"$SCR/loom_$model.txt")
    P=$(median <"$SCR/torch_$model.txt")
    awk -v m="$model" -v l="$L" -v p="$P" 'BEGIN { printf "%-34s %12.0f %12.0f %7.2fx\n", m, l, p, l / p }'
done
echo "(target: loom >= 1.5x pytorch)"
