#!/usr/bin/env bash
# vision_layers.sh - issue 23's single-input layer kinds and activations in a
# sequential model (tests/configs/vision_layers.cfg has every one): loom check's
# summary rows (Keras's output shapes and parameter counts), --gradcheck of every
# layer's backward, training bit-identical across intra-op thread counts, shape
# errors at the layer's file:line.
source "$(dirname "$0")/lib.sh"
CFG=tests/configs/vision_layers.cfg
S=(--set "run.model_dir=\"$WORK/vl\"")

out=$("$LOOM" check $CFG "${S[@]}" 2>&1)
row() { # NAME SHAPE PARAMS: the summary's row (the count follows the shape; "Connected to" ends it)
    if awk -v n="$1" -v s="$2" -v p="$3" 'index($0, n " ") == 1 && (i = index($0, s)) { split(substr($0, i + length(s)), r, " "); if (r[1] == p) f = 1 } END { exit !f }' <<<"$out"
    then pass "summary: $1 $2 $3"; else fail "summary: $1 $2 $3" "$(grep "^$1 " <<<"$out")"; fi
}
row "zero_padding2d_1" "(None, 31, 29, 1)" 0
row "conv2d_2" "(None, 15, 14, 8)" 80
row "conv2d_3" "(None, 15, 14, 8)" 296          # groups 2: 3*3*4*8 + 8
row "depthwise_conv2d_4" "(None, 15, 14, 16)" 160 # 3*3*8*2 + 16
row "separable_conv2d_5" "(None, 8, 7, 8)" 280   # 3*3*16 + 16*8 + 8
row "conv2d_transpose_6" "(None, 16, 14, 4)" 292 # 3*3*4*8 + 4
row "upsampling2d_8" "(None, 18, 32, 4)" 0
row "reshape_10" "(None, 288, 8)" 0
row "conv1d_11" "(None, 288, 6)" 150            # 3*8*6 + 6
row "reshape_12" "(None, 16, 18, 6)" 0
row "global_max_pooling2d_13" "(None, 6)" 0
contains "summary: total" "Total params: 1328" "$out"

out=$("$LOOM" check --gradcheck $CFG "${S[@]}" 2>&1); st=$?
[ $st -eq 0 ] && pass "gradcheck: exit 0" || fail "gradcheck: exit 0" "exit $st" "$(echo "$out" | tail -20)"
contains "gradcheck: every layer passes" "gradcheck: every layer passes" "$out"
n=$(grep -c ' pass$\| pass (' <<<"$out")
[ "$n" -eq 16 ] && pass "gradcheck: a row per layer, 16 pass" || fail "gradcheck: a row per layer" "$n rows pass" "$out"
contains "gradcheck: the separable's three tensors and input" "separable_conv2d_5 (separable_conv2d)" "$out"

# the built-in layers of the CNN with batch normalization pass too
out=$("$LOOM" check --gradcheck configs/fashion_mnist_cnn_bn.cfg --set "run.model_dir=\"$WORK/bn\"" 2>&1)
contains "gradcheck of conv2d, batch_normalization, max_pool2d, dropout, dense" "gradcheck: every layer passes" "$out"

# training: the same weights with 1 and 2 threads (every gradient one fixed sum over the batch)
for t in 1 2; do
    check "train 8 steps, $t thread(s)" "$LOOM" train $CFG --set "run.model_dir=\"$WORK/t$t\"" --set run.threads=$t \
        --set run.max_steps=8 --set run.eval_each_epoch=false
done
same_weights "1 and 2 threads: bit-identical weights after 8 steps" "$WORK/t1/ckpt-8.loom" "$WORK/t2/ckpt-8.loom"
contains "checkpoint: the separable's tensors by Keras's names" "separable_conv2d_5/pointwise_kernel" \
    "$("$LOOM" inspect "$WORK/t1/ckpt-8.loom")"
check "resume from the checkpoint" "$LOOM" train $CFG --set "run.model_dir=\"$WORK/t1\"" --set run.max_steps=10 \
    --set run.eval_each_epoch=false

# check --print writes every new setting back so that it loads to the same config
p1=$("$LOOM" check --print $CFG 2>/dev/null | tail -n +2); echo "$p1" > "$WORK/printed.cfg"
p2=$("$LOOM" check --print "$WORK/printed.cfg" 2>/dev/null | tail -n +2)
[ -n "$p1" ] && [ "$p1" = "$p2" ] && pass "check --print round-trips" || fail "check --print round-trips" "$(diff <(echo "$p1") <(echo "$p2") | head -5)"
contains "check --print: zero_padding2d's four sides" "padding = ([1, 2], [0, 1]);" "$p1"
contains "check --print: reshape's target" "target_shape = [16, -1, 6];" "$p1"

# shape errors at the layer's line
expect_fail 2 "groups that do not divide the input channels" \
    'vision_layers.cfg:30: layer "conv2d_3" (conv2d): groups = 3 must divide the input'"'"'s 8 channels and filters = 9' \
    "$LOOM" check $CFG "${S[@]}" --set 'model.layers.[3].groups=3' --set 'model.layers.[3].filters=9'
expect_fail 2 "a reshape that does not fit" \
    'vision_layers.cfg:27: layer "reshape_0" (reshape): the input (28, 28) (784 elements) does not fit target_shape (28, 27, 1)' \
    "$LOOM" check $CFG "${S[@]}" --set 'model.layers.[0].target_shape=[28, 27, 1]'
expect_fail 2 "conv1d on an image" 'layer "conv1d_11" (conv1d) needs a (steps, channels) input, got (18, 32, 4)' \
    "$LOOM" check $CFG "${S[@]}" --set 'model.layers.[10].target_shape=[18, 32, 4]'

# a device backend refuses what it cannot run, at the layer's line, before any device
D=(--set "run.model_dir=\"$WORK/dev\"" --set strategy.device_backend=cpu)
expect_fail 2 "device backend: a new kind refused at its line" \
    'vision_layers.cfg:27: layer "reshape_0" (reshape) is not implemented on the "cpu" device backend' \
    "$LOOM" check $CFG "${D[@]}"
expect_fail 2 "device backend: a new activation on conv2d refused" \
    'device_cnn.cfg:20: layer "conv2d_0" (conv2d, swish) is not implemented on the "cpu" device backend' \
    "$LOOM" check tests/configs/device_cnn.cfg "${D[@]}" --set 'model.layers.[0].activation="swish"'
expect_fail 2 "device backend: a dilated conv2d refused" \
    'device_cnn.cfg:20: layer "conv2d_0" (conv2d with groups or dilation_rate) is not implemented' \
    "$LOOM" check tests/configs/device_cnn.cfg "${D[@]}" --set 'model.layers.[0].dilation_rate=2'
finish
