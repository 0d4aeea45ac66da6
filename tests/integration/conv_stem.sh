#!/usr/bin/env bash
# conv_stem.sh - conv2d on 2-4 input channels without padding of its own (ResNet-50's stem) runs direct
# (appliance/nn/conv_stem.c) on AVX2 and AVX-512 CPUs (tests/configs/conv_stem.cfg: 3 -> 64 7x7 stride 2 first,
# 4 -> 80 3x3 after a 1x1 conv): --gradcheck passes with the AVX-512 and the AVX2 kernels; training is
# bit-identical with 1 and 2 threads and on AVX2 and AVX-512 (the same chains), and within 1e-4 of the im2col +
# GEMM path's (LOOM_TEST_CPU=baseline) after 8 steps; the trained model's predictions match the GEMM path's
# within 1e-5.
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/conv_lib.sh"
CFG=tests/configs/conv_stem.cfg

conv_gradcheck "" $CFG '^conv2d_[02] (conv2d) .* pass' 2 "both narrow convolutions"
conv_train "" $CFG t1 1
conv_train "" $CFG t2 2
same_weights "1 and 2 threads: bit-identical weights after 8 steps" "$WORK/t1/ckpt-8.loom" "$WORK/t2/ckpt-8.loom"
conv_train "" $CFG avx2 2 avx2
# the other layers' GEMMs are OpenBLAS's Haswell kernels there: close, not the same bits
weights_within "" $CFG t2 avx2 1e-4 "the AVX-512 and the AVX2 kernels"

# the direct kernels against im2col + GEMM's: training under LOOM_TEST_CPU=baseline ends close by
conv_train "" $CFG base 1 baseline
weights_within "" $CFG t1 base 1e-4 "the direct and the GEMM path"
predict_vs_gemm "" $CFG t1
finish
