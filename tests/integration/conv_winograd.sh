#!/usr/bin/env bash
# conv_winograd.sh - conv2d 5x5 and 3x3 "same" with 16k channels run by Winograd F(2x2, 5x5) and
# F(4x4, 3x3) (appliance/nn/conv_winograd.c: forward, input gradient, 3x3 kernel gradient) on AVX2 and AVX-512 CPUs
# (tests/configs/conv_winograd.cfg and conv_winograd3.cfg: 16 -> 32 and 32 -> 64 fused with their
# pools, 64 -> 16 on 7x7 planes): --gradcheck passes with the AVX-512 and the AVX2 kernels; training is
# bit-identical with 1 and 2 threads and within 1e-4 (5x5; 3x3: 2e-3 with ReLU and max-pool ties, 1e-6
# without) of the im2col + GEMM path's after 8 steps;
# the trained model's predictions match the im2col + GEMM path's (LOOM_TEST_CPU=baseline) within
# 1e-5; algorithm = "winograd" on a shape it cannot take is a config error naming the layer.
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/conv_lib.sh"
CFG=tests/configs/conv_winograd.cfg

for cfg in $CFG tests/configs/conv_winograd3.cfg; do
    # 3x3: F(4x4, 3x3) gives an output whose 3x3 window is all zeros (Fashion-MNIST's background) rounding
    # noise (~1e-9) from the rest of its 6x6 tile where a direct sum gives exactly 0; ReLU and max-pool ties
    # then route a few gradients elsewhere (9e-5 apart after one step). The smooth variant below: 2e-8.
    case $cfg in *3.cfg) p="3x3: " d=w3 tol=2e-3 ;; *) p="" d=w5 tol=1e-4 ;; esac
    conv_gradcheck "$p" $cfg '^conv2d_[1246] (conv2d) .* pass' 4 "the four convolutions"
    conv_train "$p" $cfg $d.t1 1
    conv_train "$p" $cfg $d.t2 2
    same_weights "${p}1 and 2 threads: bit-identical weights after 8 steps" "$WORK/$d.t1/ckpt-8.loom" "$WORK/$d.t2/ckpt-8.loom"

    # the Winograd gradients against im2col + GEMM's: training under LOOM_TEST_CPU=baseline ends close by
    conv_train "$p" $cfg $d.base 1 baseline
    weights_within "$p" $cfg $d.t1 $d.base $tol "the Winograd and the GEMM path"
    predict_vs_gemm "$p" $cfg $d.t1
done

# 3x3 without kinks (tanh, average pooling): the Winograd and the GEMM path's weights within 1e-6 after 8 steps
sed -e 's/activation = "relu"/activation = "tanh"/' -e 's/type = "max_pool2d"/type = "average_pooling2d"/' \
    tests/configs/conv_winograd3.cfg >"$WORK/w3s.cfg"
conv_train "3x3 smooth: " "$WORK/w3s.cfg" w3s.t1 1
conv_train "3x3 smooth: " "$WORK/w3s.cfg" w3s.base 1 baseline
weights_within "3x3 smooth: " "$WORK/w3s.cfg" w3s.t1 w3s.base 1e-6 "the Winograd and the GEMM path"

# the kernel gradient by Winograd on the 16 -> 32 layer too ("auto" keeps conv_fast.c's under 32 input channels):
# gradcheck, and 1 and 2 threads bit-identical
sed 's/filters = 32; kernel_size = 3; padding = "same";/filters = 32; kernel_size = 3; padding = "same"; algorithm = "winograd";/' \
    tests/configs/conv_winograd3.cfg >"$WORK/w3k.cfg"
grep -q 'algorithm = "winograd"' "$WORK/w3k.cfg" || fail "w3k.cfg: the 16 -> 32 layer set to Winograd" "" ""
conv_gradcheck "3x3 all Winograd: " "$WORK/w3k.cfg" '^conv2d_[1246] (conv2d) .* pass' 4 "the four convolutions"
conv_train "3x3 all Winograd: " "$WORK/w3k.cfg" w3k.t1 1
conv_train "3x3 all Winograd: " "$WORK/w3k.cfg" w3k.t2 2
same_weights "3x3 all Winograd: 1 and 2 threads: bit-identical weights after 8 steps" "$WORK/w3k.t1/ckpt-8.loom" \
    "$WORK/w3k.t2/ckpt-8.loom"

# algorithm = "winograd" where it cannot run (a 7x7 kernel): refused at check, naming the layer
sed 's/filters = 64; kernel_size = 5; padding = "same";/filters = 64; kernel_size = 7; padding = "same"; algorithm = "winograd";/' \
    $CFG >"$WORK/w7.cfg"
expect_fail 2 "algorithm = \"winograd\" on a 7x7 kernel: a config error" 'algorithm = "winograd" needs a 3x3 or 5x5 kernel' \
    "$LOOM" check "$WORK/w7.cfg"
finish
