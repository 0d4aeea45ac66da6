#!/usr/bin/env bash
# conv_direct.sh - conv2d 5x5 / 7x7 "same" with 16k channels (up to 64) runs direct
# (appliance/nn/conv_direct.c) on AVX2 and AVX-512 CPUs (tests/configs/conv_direct.cfg:
# 16 -> 32 and 32 -> 64 fused with their pools, 64 -> 16 7x7): --gradcheck passes with
# the AVX-512 and the AVX2 kernels; training is bit-identical with 1 and 2 threads
# and within 1e-4 of the im2col + GEMM path's after 8 steps; the trained model's predictions match the im2col + GEMM path's
# (LOOM_TEST_CPU=baseline) within 1e-5.
source "$(dirname "$0")/lib.sh"
CFG=tests/configs/conv_direct.cfg
DIFF="${LOOM_CKPT_DIFF:-$(dirname "$LOOM")/tests/ckpt_diff}"

for cpu in "" avx2; do
    out=$(LOOM_TEST_CPU=$cpu "$LOOM" check --gradcheck $CFG 2>&1)
    contains "gradcheck, ${cpu:-native} kernels: every layer passes" "gradcheck: every layer passes" "$out"
    n=$(grep -c '^conv2d_[1246] (conv2d) .* pass' <<<"$out")
    [ "$n" = 4 ] && pass "gradcheck, ${cpu:-native}: the four convolutions pass" || fail "gradcheck: four conv rows pass" "$n" "$out"
done

for t in 1 2; do
    check "train 8 steps, $t thread(s)" timeout 120 "$LOOM" train $CFG --model-dir "$WORK/t$t" --set run.threads=$t \
        --set run.max_steps=8 --set run.eval_each_epoch=false
done
same_weights "1 and 2 threads: bit-identical weights after 8 steps" "$WORK/t1/ckpt-8.loom" "$WORK/t2/ckpt-8.loom"
# (the AVX2 kernels' thread bits: test_nn's conv_direct tests, which the CI also runs under
# LOOM_TEST_CPU=avx2; here the dense layer's OpenBLAS Haswell sgemm changes the last bits with
# the rows each thread gets, 1e-8 after 2 steps, as in the MLP config)

# the direct kernel gradients against im2col + GEMM's: training under LOOM_TEST_CPU=baseline ends close by
check "train 8 steps, im2col + GEMM (LOOM_TEST_CPU=baseline)" env LOOM_TEST_CPU=baseline timeout 120 "$LOOM" train $CFG \
    --model-dir "$WORK/base" --set run.threads=1 --set run.max_steps=8 --set run.eval_each_epoch=false
if d=$("$DIFF" $CFG "$WORK/t1/ckpt-8.loom" "$WORK/base/ckpt-8.loom" 2>&1) && awk -v d="$d" 'BEGIN { exit !(d <= 1e-4) }'; then
    pass "weights after 8 steps: the direct and the GEMM path within 1e-4 ($d)"
else
    fail "weights after 8 steps: the direct and the GEMM path within 1e-4" "$d"
fi

check "predict, direct kernels" timeout 120 "$LOOM" predict $CFG --model-dir "$WORK/t1" --output "$WORK/fast.csv"
check "predict, im2col + GEMM (LOOM_TEST_CPU=baseline)" env LOOM_TEST_CPU=baseline timeout 120 "$LOOM" predict $CFG \
    --model-dir "$WORK/t1" --output "$WORK/gemm.csv"
d=$(paste -d, "$WORK/fast.csv" "$WORK/gemm.csv" | awk -F, 'NR > 1 { h = NF / 2; for (i = 3; i <= h; i++) { e = $i - $(i + h); if (e < 0) e = -e; if (e > m) m = e } n++ } END { if (n != 64) print "rows " n; else printf "%.3g\n", m }')
awk -v d="$d" 'BEGIN { exit !(d + 0 == d && d <= 1e-5) }' && pass "predictions: the direct and the GEMM path within 1e-5 ($d)" ||
    fail "predictions: the direct and the GEMM path within 1e-5" "$d"
finish
