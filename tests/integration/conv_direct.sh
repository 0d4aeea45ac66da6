#!/usr/bin/env bash
# conv_direct.sh - conv2d 5x5 / 7x7 "same" with 16k channels (up to 64) runs direct
# (appliance/nn/conv_direct.c) on AVX2 and AVX-512 CPUs (tests/configs/conv_direct.cfg:
# 16 -> 32 and 32 -> 64 fused with their pools, 64 -> 16 7x7): --gradcheck passes with
# the AVX-512 and the AVX2 kernels; training is bit-identical with 1 and 2 threads
# and within 1e-4 of the im2col + GEMM path's after 8 steps; the trained model's predictions match the im2col + GEMM path's
# (LOOM_TEST_CPU=baseline) within 1e-5.
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/conv_lib.sh"
CFG=tests/configs/conv_direct.cfg

conv_gradcheck "" $CFG '^conv2d_[1246] (conv2d) .* pass' 4 "the four convolutions"
conv_train "" $CFG t1 1
conv_train "" $CFG t2 2
same_weights "1 and 2 threads: bit-identical weights after 8 steps" "$WORK/t1/ckpt-8.loom" "$WORK/t2/ckpt-8.loom"
# (the AVX2 kernels' thread bits: test_nn_conv's conv_direct tests, which the CI also runs under
# LOOM_TEST_CPU=avx2; here the dense layer's OpenBLAS Haswell sgemm changes the last bits with
# the rows each thread gets, 1e-8 after 2 steps, as in the MLP config)

# the direct kernel gradients against im2col + GEMM's: training under LOOM_TEST_CPU=baseline ends close by
conv_train "" $CFG base 1 baseline
weights_within "" $CFG t1 base 1e-4 "the direct and the GEMM path"
predict_vs_gemm "" $CFG t1
finish
