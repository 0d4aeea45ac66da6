# conv_lib.sh - what the direct-convolution tests (conv_fast.sh, conv_direct.sh, conv_stem.sh)
# share: each runs a config whose convolutions take a direct kernel against the same config
# on im2col + GEMM (LOOM_TEST_CPU=baseline). Source it after lib.sh. Every function takes a
# label prefix P ("" or e.g. "stride 2: ") for its test names.
DIFF="${LOOM_CKPT_DIFF:-$(dirname "$LOOM")/tests/ckpt_diff}"

# conv_gradcheck P CFG ROWS N WHAT: `loom check --gradcheck` with the native and the AVX2
# kernels passes every layer, and N rows matching ROWS (a grep pattern) say pass.
conv_gradcheck() {
    local p=$1 cfg=$2 rows=$3 want=$4 what=$5 cpu out n
    for cpu in "" avx2; do
        out=$(LOOM_TEST_CPU=$cpu "$LOOM" check --gradcheck "$cfg" 2>&1)
        contains "${p}gradcheck, ${cpu:-native} kernels: every layer passes" "gradcheck: every layer passes" "$out"
        n=$(grep -c "$rows" <<<"$out")
        [ "$n" = "$want" ] && pass "${p}gradcheck, ${cpu:-native}: $what pass" ||
            fail "${p}gradcheck: $want conv rows pass" "$n" "$out"
    done
}

# conv_train P CFG DIR THREADS [CPU]: 8 steps into $WORK/DIR (CPU: LOOM_TEST_CPU, default native).
conv_train() {
    check "${1}train 8 steps, $4 thread(s), ${5:-native} kernels" env LOOM_TEST_CPU="$5" timeout 120 "$LOOM" train "$2" \
        --model-dir "$WORK/$3" --set run.threads="$4" --set run.max_steps=8 --set run.eval_each_epoch=false
}

# weights_within P CFG DIR_A DIR_B LIMIT WHAT: the checkpoints after 8 steps differ by at most LIMIT.
weights_within() {
    local p=$1 cfg=$2 a=$3 b=$4 lim=$5 what=$6 d
    if d=$("$DIFF" "$cfg" "$WORK/$a/ckpt-8.loom" "$WORK/$b/ckpt-8.loom" 2>&1) &&
        awk -v d="$d" -v l="$lim" 'BEGIN { exit !(d <= l) }'; then
        pass "${p}weights after 8 steps: $what within $lim ($d)"
    else
        fail "${p}weights after 8 steps: $what within $lim" "$d"
    fi
}

# predict_vs_gemm P CFG DIR: the model in $WORK/DIR predicts (64 rows) with the direct kernels
# and with im2col + GEMM within 1e-5.
predict_vs_gemm() {
    local p=$1 cfg=$2 dir=$3 d
    check "${p}predict, direct kernels" timeout 120 "$LOOM" predict "$cfg" --model-dir "$WORK/$dir" --output "$WORK/$dir.fast.csv"
    check "${p}predict, im2col + GEMM (LOOM_TEST_CPU=baseline)" env LOOM_TEST_CPU=baseline timeout 120 "$LOOM" predict \
        "$cfg" --model-dir "$WORK/$dir" --output "$WORK/$dir.gemm.csv"
    d=$(paste -d, "$WORK/$dir.fast.csv" "$WORK/$dir.gemm.csv" | awk -F, 'NR > 1 { h = NF / 2; for (i = 3; i <= h; i++) { e = $i - $(i + h); if (e < 0) e = -e; if (e > m) m = e } n++ } END { if (n != 64) print "rows " n; else printf "%.3g\n", m }')
    awk -v d="$d" 'BEGIN { exit !(d + 0 == d && d <= 1e-5) }' && pass "${p}predictions: the direct and the GEMM path within 1e-5 ($d)" ||
        fail "${p}predictions: the direct and the GEMM path within 1e-5" "$d"
}
