#!/usr/bin/env bash
# plugin_data.sh - a plugin's dataset source and transforms through the loom
# binary: configs/fashion_mnist_npy.cfg (the image_ops plugin's "npy" source
# over Fashion-MNIST converted to .npy here, and its C cutout map) trains and
# learns; parallel 1 and 2 give bit-identical weights; a run resumed
# mid-epoch equals an uninterrupted one; unknown sources and providers get
# did-you-mean, bad arguments and files their file:line.
source "$(dirname "$0")/lib.sh"

# --- the arrays, converted from the IDX files as the config's comment says ---------------------
N="$WORK/npy"; mkdir -p "$N"
check "Fashion-MNIST converted to .npy (tests/fixtures/make_fmnist_npy.c)" "${LOOM_MAKE_FMNIST_NPY:-$(dirname "$LOOM")/tests/make_fmnist_npy}" "$N"
CFG="$WORK/fm.cfg"
sed "s|\.\./runs/fashion_mnist_npy/|$N/|g" configs/fashion_mnist_npy.cfg > "$CFG"

out=$("$LOOM" plugins 2>&1)
contains "loom plugins names the four provider kinds" \
    "provider kinds a plugin may register (plugin ABI 2): cross-device ops, strategy, dataset source, transform" "$out"
contains "loom plugins lists image_ops" "image_ops 1.0" "$out"
contains "... providing the npy source" 'provides dataset source "npy"' "$out"
contains "... and the image_ops transforms" 'provides transform "image_ops"' "$out"
contains "... and the built-in sources beside the plugins' (one registry)" 'dataset source "list_files"' "$out"
contains "... the built-in transforms beside the plugins' providers (one registry)" 'transform "shuffle" (op)' "$out"
contains "... and the built-in map fns" 'transform "normalize" (map fn)' "$out"
out=$("$LOOM" check "$CFG" 2>&1)
contains "the plan reads the plugin's source and map" "plan: npy -> shuffle -> map(image_ops:cutout) -> batch" "$out"
contains "with the cardinality the source reports" "469 batches per epoch" "$out"

# --- it trains, deterministically, and resumes exactly ---------------------------------------
check "fashion_mnist_npy.cfg trains 300 steps" "$LOOM" train "$CFG" --model-dir "$WORK/t" --set run.max_steps=300 \
    --set run.eval_steps=4 --set run.progress='"none"'
acc=$(tail -1 "$WORK/t/metrics.jsonl" | sed -n 's/.*"eval_accuracy": \([0-9.]*\).*/\1/p')
if awk -v a="$acc" 'BEGIN { exit !(a > 0.75) }'; then pass "it learns (eval accuracy $acc > 0.75 on 2000 test images)"; else fail "it learns" "eval accuracy '$acc'"; fi
weights() { "$LOOM" inspect "$1" | grep '^tensor'; }
run() { "$LOOM" train "$1" --model-dir "$2" --set run.progress='"none"' --set run.eval_steps=1 "${@:3}" 2>/dev/null; }
sed 's/parallel = 2;/parallel = 1;/' "$CFG" > "$WORK/p1.cfg"
# Same compute threads for both: only the map's parallelism differs (how the trainer splits its
# matrix products across threads may change rounding with some BLAS kernels).
run "$CFG" "$WORK/d2" --set run.max_steps=40 && run "$WORK/p1.cfg" "$WORK/d1" --set run.max_steps=40
if [ -n "$(weights "$WORK/d1/ckpt-40.loom")" ] && [ "$(weights "$WORK/d1/ckpt-40.loom")" = "$(weights "$WORK/d2/ckpt-40.loom")" ]; then
    pass "cutout with parallel 1 and parallel 2 give bit-identical weights"
else fail "cutout with parallel 1 and parallel 2 give bit-identical weights"; fi
run "$CFG" "$WORK/r" --set run.max_steps=17 && run "$CFG" "$WORK/r" --set run.max_steps=40
if [ -e "$WORK/r/ckpt-17.loom" ] && [ "$(weights "$WORK/d2/ckpt-40.loom")" = "$(weights "$WORK/r/ckpt-40.loom")" ]; then
    pass "a run resumed mid-epoch (step 17 of 469) equals an uninterrupted one"
else fail "a run resumed mid-epoch equals an uninterrupted one"; fi

# --- errors ----------------------------------------------------------------------------------------
expect_fail 2 "an unknown source type lists the plugins' sources" \
    'data.train.source.type: unknown dataset source "npz" (available: idx, catalog, tfrecord, csv, text, synthetic, list_files, npy' \
    "$LOOM" check "$CFG" --set data.train.source.type='"npz"'
expect_fail 2 "... and suggests the nearest" 'did you mean "npy"?' \
    "$LOOM" check "$CFG" --set data.train.source.type='"npz"'
sed 's/image_ops:cutout/image_opz:cutout/' "$CFG" > "$WORK/typo.cfg"
line=$(grep -n 'image_opz:cutout' "$WORK/typo.cfg" | cut -d: -f1)
expect_fail 2 "an unknown transform provider names its line and suggests the nearest" \
    "typo.cfg:$line: data.train.transforms.[1].plugin: unknown transform \"image_opz\"" "$LOOM" check "$WORK/typo.cfg"
expect_fail 2 "... did you mean" 'did you mean "image_ops"?' "$LOOM" check "$WORK/typo.cfg"
expect_fail 2 "... listing the providers, not the built-in transforms" \
    "data.train.transforms.[1].plugin: unknown transform \"image_opz\" (available: lua, image_ops)" "$LOOM" check "$WORK/typo.cfg"
sed 's/image_ops:cutout/normalize:cutout/' "$CFG" > "$WORK/builtin.cfg"
expect_fail 2 "a built-in map fn named as a provider is refused as such" \
    "data.train.transforms.[1].plugin: \"normalize\" is a built-in transform or map fn, not a transform provider" \
    "$LOOM" check "$WORK/builtin.cfg"
sed 's/size = 8;/size = 0;/' "$CFG" > "$WORK/size.cfg"
expect_fail 2 "a bad argument names its file:line" \
    "size.cfg:$line: data.train: map plugin = \"image_ops:cutout\" ($WORK/size.cfg:$line): args.size: expected a number in [1, 1.04858e+06], got \"0\"" \
    "$LOOM" check "$WORK/size.cfg"
sed 's|/y_train.npy|/y_test.npy|' "$CFG" > "$WORK/mismatch.cfg"
sline=$(grep -n 'y_test.npy' "$WORK/mismatch.cfg" | head -1 | cut -d: -f1)
expect_fail 2 "arrays of different lengths name the option's file:line" \
    "mismatch.cfg:$sline: data.train: source \"npy\": $N/y_test.npy holds 10000 elements, $N/x_train.npy holds 60000: they must agree" \
    "$LOOM" check "$WORK/mismatch.cfg"
printf 'not numpy' > "$N/bad.npy"
sed 's|/y_train.npy|/bad.npy|' "$CFG" > "$WORK/badfile.cfg"
expect_fail 2 "a file that is not .npy is named" "$N/bad.npy: data.train: source \"npy\": not a NumPy .npy file" \
    "$LOOM" check "$WORK/badfile.cfg"
finish
