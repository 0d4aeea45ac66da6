#!/usr/bin/env bash
# conv_stem.sh - conv2d on 2-4 input channels without padding of its own (ResNet-50's stem) runs direct
# (appliance/nn/conv_stem.c) on AVX2 and AVX-512 CPUs (tests/configs/conv_stem.cfg: 3 -> 64 7x7 stride 2 first,
# 4 -> 80 3x3 after a 1x1 conv): --gradcheck passes with the AVX-512 and the AVX2 kernels; training is
# bit-identical with 1 and 2 threads and on AVX2 and AVX-512 (the same chains), and within 1e-4 of the im2col +
# GEMM path's (LOOM_TEST_CPU=baseline) after 8 steps; the trained model's predictions match the GEMM path's
# within 1e-5.
source "$(dirname "$0")/lib.sh"
CFG=tests/configs/conv_stem.cfg
DIFF="${LOOM_CKPT_DIFF:-$(dirname "$LOOM")/tests/ckpt_diff}"

for cpu in "" avx2; do
    out=$(LOOM_TEST_CPU=$cpu "$LOOM" check --gradcheck $CFG 2>&1)
    contains "gradcheck, ${cpu:-native} kernels: every layer passes" "gradcheck: every layer passes" "$out"
    n=$(grep -c '^conv2d_[02] (conv2d) .* pass' <<<"$out")
    [ "$n" = 2 ] && pass "gradcheck, ${cpu:-native}: both narrow convolutions pass" || fail "gradcheck: two conv rows pass" "$n" "$out"
done

for t in 1 2; do
    check "train 8 steps, $t thread(s)" timeout 120 "$LOOM" train $CFG --model-dir "$WORK/t$t" --set run.threads=$t \
        --set run.max_steps=8 --set run.eval_each_epoch=false
done
same_weights "1 and 2 threads: bit-identical weights after 8 steps" "$WORK/t1/ckpt-8.loom" "$WORK/t2/ckpt-8.loom"
check "train 8 steps, AVX2 kernels (LOOM_TEST_CPU=avx2)" env LOOM_TEST_CPU=avx2 timeout 120 "$LOOM" train $CFG \
    --model-dir "$WORK/avx2" --set run.threads=2 --set run.max_steps=8 --set run.eval_each_epoch=false
# the other layers' GEMMs are OpenBLAS's Haswell kernels there: close, not the same bits
if d=$("$DIFF" $CFG "$WORK/t2/ckpt-8.loom" "$WORK/avx2/ckpt-8.loom" 2>&1) && awk -v d="$d" 'BEGIN { exit !(d <= 1e-4) }'; then
    pass "weights after 8 steps: the AVX-512 and the AVX2 kernels within 1e-4 ($d)"
else
    fail "weights after 8 steps: the AVX-512 and the AVX2 kernels within 1e-4" "$d"
fi

# the direct kernels against im2col + GEMM's: training under LOOM_TEST_CPU=baseline ends close by
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
