#!/usr/bin/env bash
# threads.sh - the same bits whatever the intra-op thread count (run.threads),
# on the machine's kernels and under LOOM_TEST_CPU=avx2 (OpenBLAS's Haswell
# kernels, what a Zen 3 machine runs). There a product's rows get other bits
# when a BLAS call starts mid-tile (tiles of 12 rows), so the batch's chunks
# and the gradient pass's parts are cut at multiples of the row quantum the
# BLAS was probed for at start (loom devices names it); before, 1, 2 and 3
# threads trained three different MLPs there. Also a dense layer on a 3-D
# input (its kernel shared by the rows) with the optimizer inside the step:
# the parts' update ranges took the kernel as (28*28, 24*28) and 2 threads
# stopped on an internal assertion.
source "$(dirname "$0")/lib.sh"
S=(--set run.max_steps=3 --set run.checkpoint_steps=3 --set run.eval_each_epoch=false --set run.eval_steps=1
   --set run.progress='"none"')
train() { # NAME CFG THREADS [ENV...]: 3 steps into $WORK/NAME
    local name=$1 cfg=$2 t=$3; shift 3
    check "$name: 3 steps on $t thread(s)" env "$@" timeout 120 "$LOOM" train "$cfg" --model-dir "$WORK/$name" \
        --set run.threads=$t "${S[@]}"
}
q=$(LOOM_TEST_CPU=avx2 "$LOOM" devices 2>&1 | sed -n 's/.*split at multiples of \([0-9]*\) rows.*/\1/p')
if [ -n "$q" ] && [ "$q" -ge 1 ]; then pass "loom devices names the BLAS's row quantum under avx2 ($q)"
else fail "loom devices names the BLAS's row quantum" "$(LOOM_TEST_CPU=avx2 "$LOOM" devices 2>&1 | head -4)"; fi

for t in 1 2 3; do train mlp_avx2_$t configs/fashion_mnist_mlp.cfg $t LOOM_TEST_CPU=avx2; done
same_weights "MLP under avx2: 1 and 2 threads, the same bits" "$WORK/mlp_avx2_1/ckpt-3.loom" "$WORK/mlp_avx2_2/ckpt-3.loom"
same_weights "MLP under avx2: 1 and 3 threads, the same bits" "$WORK/mlp_avx2_1/ckpt-3.loom" "$WORK/mlp_avx2_3/ckpt-3.loom"
for t in 1 3; do train mlp_$t configs/fashion_mnist_mlp.cfg $t; done
same_weights "MLP: 1 and 3 threads, the same bits" "$WORK/mlp_1/ckpt-3.loom" "$WORK/mlp_3/ckpt-3.loom"

for t in 1 2; do train cnn_avx2_$t configs/fashion_mnist_cnn.cfg $t LOOM_TEST_CPU=avx2; done
same_weights "CNN under avx2: 1 and 2 threads, the same bits" "$WORK/cnn_avx2_1/ckpt-3.loom" "$WORK/cnn_avx2_2/ckpt-3.loom"

# the gradient passes' row parts in the other layer families: a separable conv's pointwise kernel (8 rows
# of 16 per part), an LSTM's input and recurrent kernels
for t in 1 2; do train vision_avx2_$t tests/configs/vision_layers.cfg $t LOOM_TEST_CPU=avx2; done
same_weights "vision layers under avx2: 1 and 2 threads, the same bits" "$WORK/vision_avx2_1/ckpt-3.loom" \
    "$WORK/vision_avx2_2/ckpt-3.loom"
for t in 1 2; do train lstm_avx2_$t configs/fortunes_char_lstm.cfg $t LOOM_TEST_CPU=avx2; done
same_weights "LSTM under avx2: 1 and 2 threads, the same bits" "$WORK/lstm_avx2_1/ckpt-3.loom" "$WORK/lstm_avx2_2/ckpt-3.loom"

for t in 1 2; do train rows_$t tests/configs/dense_over_rows.cfg $t; done
same_weights "dense on each row, optimizer in the step: 1 and 2 threads, the same bits" \
    "$WORK/rows_1/ckpt-3.loom" "$WORK/rows_2/ckpt-3.loom"
finish
