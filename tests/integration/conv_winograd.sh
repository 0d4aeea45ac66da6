#!/usr/bin/env bash
# conv_winograd.sh - conv2d 5x5 "same" with 16k channels runs by Winograd F(2x2, 5x5)
# (appliance/nn/conv_winograd.c: forward and input gradient) on AVX2 and AVX-512 CPUs
# (tests/configs/conv_winograd.cfg: 16 -> 32 and 32 -> 64 fused with their pools, 64 -> 16 on
# 7x7 planes): --gradcheck passes with the AVX-512 and the AVX2 kernels; training is
# bit-identical with 1 and 2 threads and within 1e-4 of the im2col + GEMM path's after 8 steps;
# the trained model's predictions match the im2col + GEMM path's (LOOM_TEST_CPU=baseline) within
# 1e-5; algorithm = "winograd" on a shape it cannot take is a config error naming the layer.
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/conv_lib.sh"
CFG=tests/configs/conv_winograd.cfg

conv_gradcheck "" $CFG '^conv2d_[1246] (conv2d) .* pass' 4 "the four convolutions"
conv_train "" $CFG t1 1
conv_train "" $CFG t2 2
same_weights "1 and 2 threads: bit-identical weights after 8 steps" "$WORK/t1/ckpt-8.loom" "$WORK/t2/ckpt-8.loom"

# the Winograd gradients against im2col + GEMM's: training under LOOM_TEST_CPU=baseline ends close by
conv_train "" $CFG base 1 baseline
weights_within "" $CFG t1 base 1e-4 "the Winograd and the GEMM path"
predict_vs_gemm "" $CFG t1

# algorithm = "winograd" where it cannot run (a 3x3 kernel): refused at check, naming the layer
sed 's/filters = 64; kernel_size = 5; padding = "same";/filters = 64; kernel_size = 3; padding = "same"; algorithm = "winograd";/' \
    $CFG >"$WORK/w3.cfg"
expect_fail 2 "algorithm = \"winograd\" on a 3x3 kernel: a config error" 'algorithm = "winograd" needs a 5x5 kernel' \
    "$LOOM" check "$WORK/w3.cfg"
finish
