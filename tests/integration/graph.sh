#!/usr/bin/env bash
# graph.sh - models as graphs (issue 23): a residual MLP on real data
# (tests/configs/graph_mlp.cfg: h = dense 64
# relu; dense 64 - batch normalization (sync) added to h; relu; a
# concatenation of that and h; dense 10). loom check prints the summary with
# "Connected to" and the trainable / non-trainable counts; mirrored(2) with
# sync batch normalization ends within 1e-6 of one_device; a run stopped and
# resumed ends with the bits of a straight run; evaluate, predict, npz and
# ONNX export work (onnxruntime checks the numbers: export_interop.py); the
# cpu device backend refuses a graph, naming the layer; shapes that do not
# merge fail check at the layer's file:line naming both shapes; an unused layer is a warning. Two model inputs
# (configs/ctr_wide_deep.cfg): mirrored(2) within 1e-6 of one_device,
# predict, the input errors. Each run under `timeout`.
source "$(dirname "$0")/lib.sh"
DIFF="${LOOM_CKPT_DIFF:-$(dirname "$LOOM")/tests/ckpt_diff}"
CHK="${LOOM_CHECK_EXPORT:-$(dirname "$LOOM")/tests/check_export}"
CFG=tests/configs/graph_mlp.cfg
G=()
S=(--set run.max_steps=40 --set run.eval_steps=1 --set run.checkpoint_steps=20)
run() { # NAME ARGS...: trains into $WORK/NAME, status checked
    local name=$1 out; shift
    if out=$(timeout 120 "$LOOM" train $CFG --model-dir "$WORK/$name" "${G[@]}" "$@" 2>&1); then
        pass "$name: training ends with status 0"
    else
        fail "$name: training ends with status 0" "$(echo "$out" | tail -4)"
    fi
}

out=$("$LOOM" check $CFG "${G[@]}" 2>&1)
contains "check: the summary's Connected to column" "Connected to" "$out"
contains "check: the add's two inputs" "sum (add)                                (None, 64)                        0   bn, h" "$out"
contains "check: the concatenation's shape" "cat (concatenate)                        (None, 128)" "$out"
contains "check: moving statistics are not trainable" "Non-trainable params: 128 " "$out"
contains "check: the total counts them (Keras: 50240 + 4096 + 256 + 1290)" "Total params: 55882 " "$out"
contains "check: trainable params" "Trainable params: 55754 " "$out"

run one "${S[@]}"
run m2 "${S[@]}" --set strategy.type=mirrored --set strategy.replicas=2
if d=$("$DIFF" $CFG "$WORK/one/ckpt-40.loom" "$WORK/m2/ckpt-40.loom" 2>&1) &&
        awk -v d="$d" 'BEGIN { exit !(d <= 1e-6) }'; then
    pass "mirrored(2), sync: one_device's weights within 1e-6 ($d apart)"
else
    fail "mirrored(2), sync: one_device's weights within 1e-6" "$d"
fi
# stopped at 20 and resumed to 40: the bits of the straight run
run half --set run.max_steps=20 --set run.eval_steps=1 --set run.checkpoint_steps=20
run half "${S[@]}"
same_weights "resumed at step 20: the straight run's weights at 40, bit for bit" "$WORK/one/ckpt-40.loom" \
    "$WORK/half/ckpt-40.loom"

check "evaluate the graph" timeout 120 "$LOOM" evaluate $CFG --model-dir "$WORK/one" "${G[@]}"
check "predict with the graph" timeout 120 "$LOOM" predict $CFG --model-dir "$WORK/one" "${G[@]}" --output "$WORK/pred.csv"
rows=$(wc -l < "$WORK/pred.csv" 2>/dev/null)
[ "$rows" = 1001 ] && pass "predict: a row per eval example (and a header)" || fail "predict: 1001 lines" "got $rows"
check "export npz of a graph" timeout 120 "$LOOM" export $CFG --model-dir "$WORK/one" "${G[@]}" --format npz \
    --output "$WORK/g.npz"
check "export onnx of a graph" timeout 120 "$LOOM" export $CFG --model-dir "$WORK/one" "${G[@]}" --format onnx \
    --output "$WORK/g.onnx"
out=$("$CHK" onnx "$WORK/g.onnx" 2>&1)
contains "g.onnx: the graph's nodes read their inputs: dense, dense, batch norm, Add, Relu, Concat, dense, softmax" \
    "ops Flatten,Gemm,Relu,MatMul,BatchNormalization,Add,Relu,Concat,Gemm,Softmax" "$out"
expect_fail 2 "the cpu device backend refuses a graph, naming the layer" \
    'layer "sum" makes the model a graph (its inputs, or a merge); the "cpu" device backend runs a plain stack' \
    "$LOOM" check $CFG "${G[@]}" --set strategy.device_backend='"cpu"'

BAD='model.layers=(
  { type = "flatten"; },
  { type = "dense"; name = "h"; units = 64; },
  { type = "dense"; name = "b"; units = 32; },
  { type = "add"; name = "sum"; inputs = ["b", "h"]; },
  { type = "dense"; units = 10; })'
expect_fail 2 "shapes that do not merge: check fails at the layer, naming both shapes" \
    'layer "sum" (add): shapes (32,) and (64,) (input "h") do not merge' "$LOOM" check $CFG --set "$BAD"
UNUSED='model.layers=(
  { type = "flatten"; },
  { type = "dense"; name = "h"; units = 64; },
  { type = "dense"; name = "spare"; units = 8; },
  { type = "dense"; units = 10; inputs = ["h"]; })'
out=$("$LOOM" check $CFG --set "$UNUSED" 2>&1)
contains "an unused layer is a warning" 'layer "spare" is not used: the model'"'"'s output (its last layer, "dense_3") does not depend on it' "$out"
contains "and the model checks without it" ": ok" "$out"

# Keras' ResNet50 (weights=None, 1000 classes) layer by layer: Keras' own counts
out=$("$LOOM" check configs/resnet50.cfg 2>&1)
contains "resnet50: Keras' total parameter count" "Total params: 25636712 " "$out"
contains "resnet50: Keras' trainable count" "Trainable params: 25583592 " "$out"
contains "resnet50: a block's add names its shortcut and branch" "conv2_block1_add (add)                   (None, 56, 56, 256)               0   conv2_block1_0_bn, conv2_block1_3_bn" "$out"

# ResNet-20 (configs/fashion_mnist_resnet.cfg): its batch normalizations run on the pool in fixed blocks
# of rows (bn_pass.c), the adds fan the gradient out: the same bits with 1 thread and with 3 (chunk
# bounds that fall inside a block)
for t in 1 3; do
    check "resnet20: 2 steps, $t thread(s)" timeout 300 "$LOOM" train configs/fashion_mnist_resnet.cfg \
        --model-dir "$WORK/r20_$t" --set run.threads=$t --set run.max_steps=2 --set run.checkpoint_steps=2 \
        --set run.eval_each_epoch=false --set run.eval_steps=1 --set run.progress='"none"'
done
same_weights "resnet20: 1 and 3 threads, bit-identical weights" "$WORK/r20_1/ckpt-2.loom" "$WORK/r20_3/ckpt-2.loom"

# two model inputs (configs/ctr_wide_deep.cfg: ids through an embedding, numeric features through dense
# layers, concatenated): mirrored(2) ends within 1e-6 of one_device; predict; a model input missing from the data
WD=configs/ctr_wide_deep.cfg
WS=(--set run.max_steps=20 --set run.eval_steps=2 --set run.checkpoint_steps=20 --set run.progress='"none"'
    --set run.status_port=0 --set data.train.source.ctr.id_space=65536 --set data.eval.source.ctr.id_space=65536
    --set 'model.layers.[0].input_dim=65536')
check "wide and deep: one_device trains" timeout 300 "$LOOM" train $WD --model-dir "$WORK/wd1" "${WS[@]}"
check "wide and deep: mirrored(2) trains" timeout 300 "$LOOM" train $WD --model-dir "$WORK/wd2" "${WS[@]}" \
    --set strategy.type=mirrored --set strategy.replicas=2
if d=$("$DIFF" $WD "$WORK/wd1/ckpt-20.loom" "$WORK/wd2/ckpt-20.loom" "${WS[@]}" 2>&1) &&
        awk -v d="$d" 'BEGIN { exit !(d <= 1e-6) }'; then
    pass "wide and deep: mirrored(2) within 1e-6 of one_device ($d apart)"
else
    fail "wide and deep: mirrored(2) within 1e-6 of one_device" "$d"
fi
check "wide and deep: predict" timeout 300 "$LOOM" predict $WD --model-dir "$WORK/wd2" "${WS[@]}" \
    --set strategy.type=mirrored --set strategy.replicas=2 --output "$WORK/wd.csv"
rows=$(wc -l < "$WORK/wd.csv" 2>/dev/null)
[ "$rows" = 50001 ] && pass "wide and deep: a prediction per eval example" || fail "wide and deep: 50001 lines" "got $rows"
sed 's/numeric = { dtype/numerics = { dtype/' $WD > "$WORK/wd_bad.cfg"
expect_fail 2 "a model input that is not a feature of the data" \
    'model.inputs: the train pipeline has no feature "numeric" (it yields ids: int64 (1024, 26)' \
    "$LOOM" check "$WORK/wd_bad.cfg"
expect_fail 2 "model.input and model.inputs together" \
    'model.inputs: give model.input (one feature) or model.inputs (several), not both' \
    "$LOOM" check $WD --set 'model.input="ids"'
expect_fail 2 "several inputs under parameter_server: refused, saying where they run" \
    'model.inputs names 2 features; here the model is given 1' "$LOOM" check $WD --set strategy.type=parameter_server
finish
