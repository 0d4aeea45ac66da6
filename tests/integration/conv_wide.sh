#!/usr/bin/env bash
# conv_wide.sh - a 1x1 conv2d without padding at stride 2 (16-512 channels) takes its kernel gradient direct
# (appliance/nn/conv_wide.c) on AVX-512 CPUs (tests/configs/conv_wide.cfg: 16 -> 80 and 80 -> 32, both stride 2;
# on AVX2 the GEMM path): --gradcheck passes with the AVX-512 and the AVX2 kernels; training is bit-identical with 1, 2
# and 3 threads (3: the 16 kernel rows split 5/5/6) and within 1e-4 of the im2col + GEMM path's (LOOM_TEST_CPU=baseline)
# after 8 steps; the trained model's predictions match the GEMM path's within 1e-5.
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/conv_lib.sh"
CFG=tests/configs/conv_wide.cfg

conv_gradcheck "" $CFG '^conv2d_[12] (conv2d) .* pass' 2 "both 1x1 convolutions"
conv_train "" $CFG t1 1
conv_train "" $CFG t2 2
conv_train "" $CFG t3 3
same_weights "1 and 2 threads: bit-identical weights after 8 steps" "$WORK/t1/ckpt-8.loom" "$WORK/t2/ckpt-8.loom"
same_weights "1 and 3 threads: bit-identical weights after 8 steps" "$WORK/t1/ckpt-8.loom" "$WORK/t3/ckpt-8.loom"
conv_train "" $CFG avx2 2 avx2
# the GEMM path and OpenBLAS's Haswell kernels there: close, not the same bits
weights_within "" $CFG t2 avx2 1e-4 "the native and the AVX2 kernels"

# the direct kernel against im2col + GEMM's: training under LOOM_TEST_CPU=baseline ends close by
conv_train "" $CFG base 1 baseline
weights_within "" $CFG t1 base 1e-4 "the direct and the GEMM path"
predict_vs_gemm "" $CFG t1
finish
