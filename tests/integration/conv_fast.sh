#!/usr/bin/env bash
# conv_fast.sh - conv2d 3x3 "same" with 16k channels in and out runs direct
# (appliance/nn/conv_fast.c) on AVX2 and AVX-512 CPUs (tests/configs/conv_fast.cfg:
# 16 -> 16, 16 -> 32 with a bias, 32 -> 16 on 7x7 planes): --gradcheck passes with
# the AVX-512 and the AVX2 kernels; training is bit-identical with 1 and 2 threads
# and within 1e-4 of the im2col + GEMM path's after 8 steps; the trained model's predictions match the im2col + GEMM path's
# (LOOM_TEST_CPU=baseline) within 1e-5. The same for stride 2 (tests/configs/conv_fast_s2.cfg), and
# its training with the AVX2 kernels close to the AVX-512 ones'.
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/conv_lib.sh"
CFG=tests/configs/conv_fast.cfg

conv_gradcheck "" $CFG '^conv2d_[1257] (conv2d) .* pass' 4 "the four convolutions"
conv_train "" $CFG t1 1
conv_train "" $CFG t2 2
same_weights "1 and 2 threads: bit-identical weights after 8 steps" "$WORK/t1/ckpt-8.loom" "$WORK/t2/ckpt-8.loom"

# the direct kernel gradients against im2col + GEMM's: training under LOOM_TEST_CPU=baseline ends close by
conv_train "" $CFG base 1 baseline
weights_within "" $CFG t1 base 1e-4 "the direct and the GEMM path"
predict_vs_gemm "" $CFG t1

# stride 2 (tests/configs/conv_fast_s2.cfg: 28x28 and 14x14 "same" with the bottom and right padded,
# 7x7 "same", 4x4 "valid"): forward and kernel gradient direct, the input gradient by GEMM
S2=tests/configs/conv_fast_s2.cfg
conv_gradcheck "stride 2: " $S2 '^conv2d_[2567] (conv2d) .* pass' 4 "the four stride-2 convolutions"
conv_train "stride 2: " $S2 s2_1 1
conv_train "stride 2: " $S2 s2_2 2
conv_train "stride 2: " $S2 s2_avx2 1 avx2
conv_train "stride 2: " $S2 s2_base 1 baseline
same_weights "stride 2: 1 and 2 threads bit-identical" "$WORK/s2_1/ckpt-8.loom" "$WORK/s2_2/ckpt-8.loom"
# (AVX2 against AVX-512 is not bit-identical here: the input gradient's GEMM is another BLAS kernel)
weights_within "stride 2: " $S2 s2_1 s2_avx2 1e-4 "the AVX2 and the native kernels"
weights_within "stride 2: " $S2 s2_1 s2_base 1e-4 "the direct and the GEMM path"
predict_vs_gemm "stride 2: " $S2 s2_1
finish
