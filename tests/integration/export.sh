#!/usr/bin/env bash
# export.sh - `loom export`: ONNX and npz files that read back (walked by
# tests/fixtures/check_export, no onnx or numpy needed), and its errors:
# an unwritable path, a checkpoint of another model, a map with no ONNX form.
# A graph's ONNX ops.
# onnxruntime and numpy check the numbers in the interop suite (export_interop.py).
source "$(dirname "$0")/lib.sh"
CHK="${LOOM_CHECK_EXPORT:-$(dirname "$LOOM")/tests/check_export}"
MLP=tests/configs/small_mlp.cfg
CNN=configs/fashion_mnist_cnn.cfg
Q=(--set run.progress='"none"' --set run.eval_each_epoch=false)
params() { "$LOOM" inspect "$1" | awk '$1 == "tensor" && $2 !~ /\/(momentum|m|v)$/ {print $2}'; }

check "train the small MLP" "$LOOM" train $MLP --model-dir "$WORK/mlp" --set run.max_steps=20 "${Q[@]}"
check "train the CNN (3 steps)" "$LOOM" train $CNN --model-dir "$WORK/cnn" --set run.max_steps=3 "${Q[@]}"

check "export the MLP as ONNX" "$LOOM" export $MLP --model-dir "$WORK/mlp" --format onnx --output "$WORK/mlp.onnx"
out=$("$CHK" onnx "$WORK/mlp.onnx" 2>&1)
contains "mlp.onnx: well-formed protobuf, IR 8, opset 17" "ir_version 8 opset 17" "$out"
contains "mlp.onnx: input \"input\", output \"output\"" "inputs input outputs output" "$out"
contains "mlp.onnx: flatten, dense+relu, dropout as identity, dense, softmax" "ops Flatten,Gemm,Relu,Gemm,Softmax" "$out"
contains "mlp.onnx: every parameter (50890 floats)" "floats 50890 " "$out"

t0=$(date +%s%N)
check "export the CNN as ONNX" "$LOOM" export $CNN --model-dir "$WORK/cnn" --format onnx --output "$WORK/cnn.onnx"
echo "# CNN export: $(( ($(date +%s%N) - t0) / 1000000 )) ms wall, the whole process"
out=$("$CHK" onnx "$WORK/cnn.onnx" 2>&1)
contains "cnn.onnx: NHWC in, transposed for Conv/MaxPool and back before flatten" \
    "ops Transpose,Conv,Relu,MaxPool,Conv,Relu,MaxPool,Transpose,Flatten,Gemm,Relu,Gemm,Softmax" "$out"
contains "cnn.onnx: every parameter" "floats $("$LOOM" check $CNN 2>&1 | sed -n 's/^Total params: \([0-9]*\).*/\1/p') " "$out"

check "export the CNN with --include-preprocessing" "$LOOM" export $CNN --model-dir "$WORK/cnn" --format onnx \
    --include-preprocessing --output "$WORK/cnn_pp.onnx"
out=$("$CHK" onnx "$WORK/cnn_pp.onnx" 2>&1)
contains "cnn_pp.onnx: uint8 in, cast and scale folded in, reshaped to (28, 28, 1)" "ops Cast,Mul,Add,Reshape,Transpose,Conv" "$out"

# issue 23's layers (tests/configs/vision_layers.cfg): each kind's direct ONNX form
VL=tests/configs/vision_layers.cfg
check "train the model of every issue 23 layer (3 steps)" "$LOOM" train $VL --model-dir "$WORK/vl" --set run.max_steps=3 "${Q[@]}"
check "export it as ONNX" "$LOOM" export $VL --model-dir "$WORK/vl" --format onnx --output "$WORK/vl.onnx"
out=$("$CHK" onnx "$WORK/vl.onnx" 2>&1)
contains "vl.onnx: Pad, Conv with groups and dilations, HardSwish, Elu, depthwise and pointwise Conv, swish as x*Sigmoid(x), ConvTranspose, Softplus, Resize, 1-D Conv, GlobalMaxPool, Reshape" \
    "ops Reshape,Pad,Transpose,Conv,Sigmoid,Mul,Conv,HardSwish,Conv,Elu,Conv,Conv,Sigmoid,Mul,ConvTranspose,Softplus,Pad,Resize,Tanh,Transpose,Reshape,Transpose,Conv,Transpose,Sigmoid,Reshape,Transpose,GlobalMaxPool,Flatten,Softplus,Gemm,Softmax" "$out"
contains "vl.onnx: every parameter and the 4 Resize scales" "floats 1332 " "$out"

# a graph (tests/configs/graph_conv.cfg): every merge kind, each node reading its inputs by name, a merge's
# inputs brought to one layout (NCHW after a conv, NHWC after a layer norm), a pooled vector broadcast to an image
GC=tests/configs/graph_conv.cfg
check "train the residual conv graph (3 steps)" "$LOOM" train $GC --model-dir "$WORK/gc" --set run.max_steps=3 "${Q[@]}"
check "export the graph as ONNX" "$LOOM" export $GC --model-dir "$WORK/gc" --format onnx --output "$WORK/gc.onnx"
out=$("$CHK" onnx "$WORK/gc.onnx" 2>&1)
contains "gc.onnx: Add, Mul, Mean, Max, Sub, Concat; layouts matched by Transpose, ranks by Unsqueeze" \
    "ops Transpose,Conv,Relu,Conv,BatchNormalization,Add,Relu,Conv,Relu,Conv,Add,Transpose,LayerNormalization,Transpose,Mul,Mean,Max,Transpose,Sub,Concat,Concat,GlobalAveragePool,Flatten,Transpose,Unsqueeze,Add,Transpose,GlobalAveragePool,Flatten,Gemm,Softmax" "$out"
contains "gc.onnx: every parameter" "floats $("$LOOM" check $GC 2>&1 | sed -n 's/^Total params: \([0-9]*\).*/\1/p') " "$out"

check "export the MLP as npz" "$LOOM" export $MLP --model-dir "$WORK/mlp" --format npz --output "$WORK/mlp.npz"
out=$("$CHK" npz "$WORK/mlp.npz" 2>&1)
ckpt=$(ls "$WORK"/mlp/ckpt-*.loom | head -1)
want=$(params "$ckpt" | sed 's/$/.npy/')
got=$(echo "$out" | cut -d' ' -f1)
if [ -n "$want" ] && [ "$want" = "$got" ]; then pass "mlp.npz: every CRC-32 and .npy header checks, one array per variable named as loom inspect"
else fail "mlp.npz: arrays named as loom inspect" "want: $want" "got: $out"; fi
contains "mlp.npz: shapes" "dense_1/kernel.npy (784,64)" "$out"

# errors
expect_fail 1 "unwritable export path: clear error" "cannot write the export here" \
    "$LOOM" export $MLP --model-dir "$WORK/mlp" --format npz --output "$WORK/no/such/dir/m.npz"
mkdir -p "$WORK/ro" && chmod 555 "$WORK/ro"
if [ "$(id -u)" != 0 ]; then
    expect_fail 1 "read-only directory: clear error" "cannot write the export here" \
        "$LOOM" export $MLP --model-dir "$WORK/mlp" --format onnx --output "$WORK/ro/m.onnx"
fi
expect_fail 1 "a checkpoint of another model: names both shapes" \
    'tensor "dense_1/kernel" that this model does not have (shape (784, 64); the model'"'"'s tensor 0 is "conv2d_0/kernel" (5, 5, 1, 32))' \
    "$LOOM" export $CNN --checkpoint "$ckpt" --format onnx --output "$WORK/x.onnx"
expect_fail 1 "a checkpoint of the same layers, other sizes: names both shapes" \
    'tensor "dense_1/kernel" has shape (784, 64) in the checkpoint, the model expects (784, 32)' \
    "$LOOM" export $MLP --checkpoint "$ckpt" --set 'model.layers.[1].units=32' --format onnx --output "$WORK/x.onnx"
[ ! -e "$WORK/x.onnx" ] && pass "nothing written on failure" || fail "nothing written on failure"
expect_fail 1 "no checkpoint: says to train first" "no checkpoint in the model directory" \
    "$LOOM" export $MLP --model-dir "$WORK/empty" --format onnx --output "$WORK/x.onnx"
expect_fail 2 "unknown format" 'unknown --format "tflite" (expected one of: onnx, npz)' \
    "$LOOM" export $MLP --format tflite --output "$WORK/x"
expect_fail 2 "missing --output" "missing --output" "$LOOM" export $MLP --format onnx
sed 's/fn = "scale"; feature = "image"; scale = 0.00392156862745098; },$/fn = "per_image_standardization"; feature = "image"; },/' \
    $CNN >"$WORK/std.cfg"
expect_fail 2 "--include-preprocessing with a map with no ONNX form names it and its line" \
    "std.cfg:19: --include-preprocessing: the map \"per_image_standardization\"" \
    "$LOOM" export "$WORK/std.cfg" --checkpoint "$WORK/cnn/ckpt-3.loom" --format onnx --include-preprocessing \
    --output "$WORK/x.onnx"
finish
