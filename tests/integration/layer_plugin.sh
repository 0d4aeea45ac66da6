#!/usr/bin/env bash
# layer_plugin.sh - a plugin's layer kind in a model (docs/plugins.md "Write
# a layer"): tests/configs/prelu_mlp.cfg uses the shipped plugin layer_prelu's
# "prelu". loom check shows its row; --gradcheck passes on it and fails on a
# build of it with a wrong backward; it trains, the same bits on 1 and 2
# threads; its settings and an unknown type are refused with messages naming
# them; ONNX export emits the node its onnx() names (PRelu; onnxruntime checks
# the numbers in fixtures/export_interop.py), and without onnx() refuses the
# model naming the layer.
source "$(dirname "$0")/lib.sh"
BUILD="${LOOM_BUILD_ROOT:-$(dirname "$LOOM")}"
FIX="$BUILD/tests/plugins"
CFG=tests/configs/prelu_mlp.cfg
Q=(--set run.progress='"none"')

out=$("$LOOM" check $CFG 2>&1)
contains "loom check shows the plugin layer's row: type, shape, parameters" \
    "act (prelu)                              (None, 64)                       64   dense_1" "$out"
contains "... in the totals" "Trainable params: 50954" "$out"
out=$("$LOOM" check --gradcheck $CFG 2>&1)
if grep -qE '^act \(prelu\) +80 .* pass$' <<<"$out" && grep -q 'gradcheck: every layer passes' <<<"$out"; then
    pass "--gradcheck checks the plugin layer's input and alpha gradients, and they pass"
else
    fail "--gradcheck passes on the plugin layer" "$(echo "$out" | tail -6)"
fi
L="$WORK/broken"; mkdir -p "$L"; cp "$FIX/layer_prelu_broken.so" "$L/"
expect_fail 1 "--gradcheck fails a plugin layer whose backward is wrong" "act (prelu_broken)" \
    env LOOM_PLUGIN_PATH="$L" "$LOOM" check --gradcheck $CFG --set 'model.layers.[2].type="prelu_broken"'
out=$(LOOM_PLUGIN_PATH="$L" "$LOOM" check --gradcheck $CFG --set 'model.layers.[2].type="prelu_broken"' 2>&1)
if grep -qE '^act \(prelu_broken\) +80 .*FAIL' <<<"$out"; then pass "... on its row"; else fail "... on its row" "$(echo "$out" | tail -6)"; fi

check "it trains" "$LOOM" train $CFG --model-dir "$WORK/t2" "${Q[@]}" --set run.threads=2
acc=$("$LOOM" evaluate $CFG --model-dir "$WORK/t2" 2>&1 | grep -o 'accuracy [0-9.]*' | tail -1 | cut -d' ' -f2)
if awk -v a="$acc" 'BEGIN { exit !(a > 0.65) }'; then pass "and learns (eval accuracy $acc)"; else fail "learns" "accuracy '$acc'"; fi
a0=$("$LOOM" inspect "$WORK/t2/ckpt-64.loom" | grep 'tensor act/alpha ')
check "1 thread" "$LOOM" train $CFG --model-dir "$WORK/t1" "${Q[@]}" --set run.threads=1
same_weights "the same bits on 1 and 2 threads" "$WORK/t1/ckpt-64.loom" "$WORK/t2/ckpt-64.loom"
check "alpha is checkpointed" test -n "$a0"

check "under mirrored, 2 replicas" "$LOOM" train $CFG --model-dir "$WORK/mir" "${Q[@]}" --set run.max_steps=6 \
    --set strategy.type='"mirrored"' --set strategy.replicas=2

expect_fail 2 "a setting the layer does not take is refused, naming it" 'layer "act" (prelu) has no setting "slope"' \
    "$LOOM" check $CFG --set 'model.layers.[2].slope=1'
expect_fail 2 "the plugin checks its settings" 'alpha_init = x is not a number' \
    "$LOOM" check $CFG --set 'model.layers.[2].alpha_init="x"'
expect_fail 2 "an unknown layer type lists the built-in ones" '; expected one of: dense, conv2d,' \
    "$LOOM" check $CFG --set 'model.layers.[2].type="prelux"'
expect_fail 2 "... and the plugins' ones" "(plugins' layers: " \
    "$LOOM" check $CFG --set 'model.layers.[2].type="prelux"'
expect_fail 2 "... naming the nearest" 'did you mean "prelu"?' "$LOOM" check $CFG --set 'model.layers.[2].type="prelux"'
# a built-in's typo is known only once plugins are loaded, still named with the nearest type
expect_fail 2 "a built-in's typo is refused" 'model.layers.[2].type: unknown value "dense2"' \
    "$LOOM" check $CFG --set 'model.layers.[2].type="dense2"'
expect_fail 2 "... naming the nearest built-in" 'did you mean "dense"?' "$LOOM" check $CFG --set 'model.layers.[2].type="dense2"'
expect_fail 2 "type = \"plugin\" is no type" 'name the plugin' "$LOOM" check $CFG --set 'model.layers.[2].type="plugin"'
check "ONNX export: the plugin's onnx() names the node" \
    "$LOOM" export $CFG --model-dir "$WORK/t2" --format onnx --output "$WORK/m.onnx"
CHK="${LOOM_CHECK_EXPORT:-$(dirname "$LOOM")/tests/check_export}"
out=$("$CHK" onnx "$WORK/m.onnx" 2>&1)
contains "... a PRelu node with alpha as its slope" "ops Flatten,Gemm,PRelu,Gemm,Softmax" "$out"
L2="$WORK/noonnx"; mkdir -p "$L2"; cp "$FIX/layer_prelu_broken.so" "$L2/"
check "a model with the broken build trains (for its export)" env LOOM_PLUGIN_PATH="$L2" "$LOOM" train $CFG \
    --model-dir "$WORK/nb" "${Q[@]}" --set run.max_steps=2 --set 'model.layers.[2].type="prelu_broken"'
expect_fail 2 "a plugin layer without onnx(): ONNX export refuses the model, naming the layer" \
    'layer "act" (prelu_broken) has no ONNX form: its plugin has no onnx function' \
    env LOOM_PLUGIN_PATH="$L2" "$LOOM" export $CFG --model-dir "$WORK/nb" --format onnx --output "$WORK/nb.onnx" \
    --set 'model.layers.[2].type="prelu_broken"'
# a plugin's failure inside a step fails the step, naming the layer (it was only logged, and training went
# on from outputs the plugin had not written); prelu refuses a slope that is not finite
out=$("$LOOM" train $CFG --model-dir "$WORK/nanalpha" "${Q[@]}" --set run.max_steps=3 --set 'model.layers.[2].alpha_init=nan' 2>&1)
st=$?
if [ $st -ne 0 ] && grep -q 'prelu_mlp.cfg:[0-9]*: layer "act" (prelu) forward failed: alpha of channel 0 is nan' <<<"$out" &&
    ! grep -q "loss is not finite" <<<"$out" && [ ! -e "$WORK/nanalpha/ckpt-3.loom" ]; then
    pass "a plugin layer's failed forward stops training with its message (status $st)"
else
    fail "a plugin layer's failed forward stops training with its message" "status $st" "$(tail -3 <<<"$out")"
fi

# plugins/layer_examples: "weighted_add" takes two layers (several inputs), "running_norm" keeps state (a moving
# mean, trainable = 0) and runs on the whole batch (issue 23: both were refused, "not run by the model yet")
PG=tests/configs/plugin_graph_mlp.cfg
out=$("$LOOM" check $PG 2>&1)
contains "a plugin layer of two inputs: its row names both" \
    "mix (weighted_add)                       (None, 64)                        2   a, b" "$out"
contains "a plugin layer's state: in its row's count" "norm (running_norm)                      (None, 64)                      128   mix" "$out"
contains "... and non-trainable in the totals" "Non-trainable params: 64 " "$out"
out=$("$LOOM" check --gradcheck $PG 2>&1)
if grep -qE '^mix \(weighted_add\) +all .* pass \(2 inputs' <<<"$out"; then
    pass "--gradcheck: the two-input plugin layer by the plugin check, every element, passes"
else
    fail "--gradcheck: the two-input plugin layer passes" "$(grep -E '^mix|FAIL' <<<"$out")"
fi
if grep -qE '^norm \(running_norm\) +80 .* pass$' <<<"$out" && grep -q 'gradcheck: every layer passes' <<<"$out"; then
    pass "--gradcheck: the whole-batch layer's input and gamma gradients (not its state) pass"
else
    fail "--gradcheck: the whole-batch layer passes" "$(grep -E '^norm|gradcheck:' <<<"$out")"
fi
check "the example layers train" "$LOOM" train $PG --model-dir "$WORK/pg2" "${Q[@]}" --set run.threads=2
acc=$("$LOOM" evaluate $PG --model-dir "$WORK/pg2" 2>&1 | grep -o '"eval_accuracy": [0-9.]*' | tail -1 | cut -d' ' -f2)
if awk -v a="$acc" 'BEGIN { exit !(a > 0.65) }'; then pass "and learn, evaluated with the moving mean (accuracy $acc)"
else fail "learn, evaluated with the moving mean" "accuracy '$acc'"; fi
check "1 thread" "$LOOM" train $PG --model-dir "$WORK/pg1" "${Q[@]}" --set run.threads=1
same_weights "the state and weights: the same bits on 1 and 2 threads" "$WORK/pg1/ckpt-64.loom" "$WORK/pg2/ckpt-64.loom"
m16=$("$LOOM" inspect "$WORK/pg2/ckpt-16.loom" | grep 'tensor norm/moving_mean ')
m64=$("$LOOM" inspect "$WORK/pg2/ckpt-64.loom" | grep 'tensor norm/moving_mean ')
if [ -n "$m16" ] && [ "$m16" != "$m64" ]; then pass "the moving mean is checkpointed and moves in training"
else fail "the moving mean is checkpointed and moves" "$m16 / $m64"; fi
# resumed at step 16: the straight run's state and weights at 64
check "stopped at step 16" "$LOOM" train $PG --model-dir "$WORK/pgr" "${Q[@]}" --set run.threads=2 --set run.max_steps=16
check "resumed from step 16" "$LOOM" train $PG --model-dir "$WORK/pgr" "${Q[@]}" --set run.threads=2
same_weights "resumed: the straight run's state and weights" "$WORK/pgr/ckpt-64.loom" "$WORK/pg2/ckpt-64.loom"
# in a plain stack (no graph): running_norm in prelu's place, segments around it as around batch normalization
RN=(--set 'model.layers.[2]={ type = "running_norm"; name = "act"; momentum = 0.5; }')
out=$("$LOOM" check --gradcheck $CFG "${RN[@]}" 2>&1)
if grep -qE '^act \(running_norm\) +80 .* pass$' <<<"$out"; then pass "a stack's whole-batch layer: --gradcheck passes"
else fail "a stack's whole-batch layer: --gradcheck passes" "$(tail -3 <<<"$out")"; fi
check "a stack's whole-batch layer trains, 1 thread" "$LOOM" train $CFG --model-dir "$WORK/rn1" "${Q[@]}" "${RN[@]}" \
    --set run.threads=1 --set run.max_steps=20
check "... 2 threads" "$LOOM" train $CFG --model-dir "$WORK/rn2" "${Q[@]}" "${RN[@]}" --set run.threads=2 \
    --set run.max_steps=20
same_weights "... the same bits" "$WORK/rn1/ckpt-20.loom" "$WORK/rn2/ckpt-20.loom"
check "under mirrored, 2 replicas (each replica's moving mean as batch norm's)" "$LOOM" train $PG \
    --model-dir "$WORK/pgm" "${Q[@]}" --set run.max_steps=6 --set strategy.type='"mirrored"' --set strategy.replicas=2

finish
