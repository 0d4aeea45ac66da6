#!/usr/bin/env bash
# tasks.sh - binary and regression tasks and model.metrics through the loom
# binary (issue 16, section 3): BCE from logits with AUC as Keras computes it
# (checked against tf.keras.metrics.AUC where TensorFlow is installed), the
# metrics in the log, metrics.jsonl, `loom evaluate` and a callback's
# ctx.logs; a regression without accuracy; the bad inputs.
source "$(dirname "$0")/lib.sh"
BIN=configs/fashion_mnist_binary.cfg
run() { timeout 120 "$LOOM" "$@" --set run.progress='"none"' --set run.status_port=0 2>&1; }

# a short binary run: 40 steps, then the whole eval split of the two classes
out=$(run train "$BIN" --model-dir "$WORK/bin" --set run.max_steps=40); rc=$?
[ $rc -eq 0 ] && pass "binary config trains" || fail "binary config trains" "exit $rc" "$(echo "$out" | tail -3)"
contains "the log has the metrics" "accuracy" "$(grep -E 'epoch|done' <<<"$out")"
line=$(grep '"event": "end"' "$WORK/bin/metrics.jsonl")
for k in eval_accuracy eval_auc eval_precision eval_recall; do
    contains "metrics.jsonl's end line has $k" "\"$k\": 0." "$line"
done
ev=$(timeout 120 "$LOOM" evaluate "$BIN" --model-dir "$WORK/bin" 2>/dev/null)
contains "loom evaluate prints eval_auc" '"eval_auc": 0.' "$ev"
auc=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["eval_auc"])' "$ev")
python3 -c 'import sys; a = float(sys.argv[1]); sys.exit(0 if 0.8 < a < 1 else 1)' "$auc" \
    && pass "eval AUC after 40 steps is between 0.8 and 1 ($auc)" || fail "eval AUC after 40 steps" "$auc"

# the same AUC from TensorFlow on loom's predicted probabilities
check "loom predict writes the eval split's probabilities" timeout 120 "$LOOM" predict "$BIN" --model-dir "$WORK/bin" \
    --input eval --output "$WORK/pred.csv"
if python3 -c 'import tensorflow' >/dev/null 2>&1; then
    want=$(TF_CPP_MIN_LOG_LEVEL=3 timeout 120 python3 - "$WORK/pred.csv" "${LOOM_DATASETS_DIR:-/usr/share/datasets}" <<'PY' 2>/dev/null
import csv, gzip, os, sys
import numpy as np
import tensorflow as tf
root = sys.argv[2] + "/fashion-mnist/t10k-labels-idx1-ubyte"
raw = gzip.open(root + ".gz").read() if os.path.exists(root + ".gz") else open(root, "rb").read()
labels = np.frombuffer(raw[8:], np.uint8)
y = (labels[(labels == 0) | (labels == 6)] == 6).astype(np.float32)
p = np.array([float(r["probability"]) for r in csv.DictReader(open(sys.argv[1]))], np.float32)
assert len(p) == len(y), (len(p), len(y))
m = tf.keras.metrics.AUC(num_thresholds=200)
m.update_state(y, p)
print("%.6f" % float(m.result()))
PY
)
    python3 -c 'import sys; a, b = map(float, sys.argv[1:]); sys.exit(0 if abs(a - b) < 5e-4 else 1)' "$auc" "${want:-9}" \
        && pass "eval AUC equals tf.keras.metrics.AUC on the same predictions ($auc vs $want)" \
        || fail "eval AUC equals tf.keras.metrics.AUC" "loom $auc, keras ${want:-(failed)}"
else
    T=$((T + 1)); echo "ok $T - eval AUC equals tf.keras.metrics.AUC # SKIP TensorFlow is not installed"
fi
n1=$(awk -F, 'NR > 1 && $2 == 1' "$WORK/pred.csv" | wc -l)
[ "$n1" -gt 100 ] && pass "predict's class of a one-output model is p > 0.5 ($n1 ones)" || fail "predict's class for BCE" "$n1 ones"

# a callback monitors eval_auc (early_stopping picks mode max for it)
cat > "$WORK/cb.lua" <<'LUA'
return { seen = function(args)
  return { on_epoch_end = function(ctx)
    assert(ctx.logs.eval_auc and ctx.logs.auc and ctx.logs.eval_precision, "no auc in ctx.logs")
    assert(ctx.logs.accuracy, "no accuracy in ctx.logs")
    ctx:log_scalar("seen_eval_auc", ctx.logs.eval_auc)
  end }
end }
LUA
out=$(run train "$BIN" --model-dir "$WORK/cb" --set run.epochs=1 --set 'data.train.transforms.[0].in=[0, 6]' \
      --set "hooks={ callbacks = ( { fn = \"$WORK/cb.lua:seen\"; }, { fn = \"$ROOT/lua/early_stopping.lua:early_stopping\"; args = { monitor = \"eval_auc\"; }; } ); }"); rc=$?
[ $rc -eq 0 ] && pass "callbacks read ctx.logs.eval_auc" || fail "callbacks read ctx.logs.eval_auc" "$(echo "$out" | tail -3)"
contains "the callback's scalar is in metrics.jsonl" '"name": "seen_eval_auc", "value": 0.' "$(cat "$WORK/cb/metrics.jsonl" 2>/dev/null)"

# a regression on a scalar target: no accuracy anywhere, mae and rmse when asked
python3 - "$WORK" <<'PY'
import random, sys
random.seed(3)
with open(sys.argv[1] + "/reg.csv", "w") as f:
    f.write("x,y\n")
    for i in range(400):
        x = random.uniform(-2, 2)
        f.write("%.5f,%.5f\n" % (x, 3 * x - 1 + random.gauss(0, 0.1)))
PY
reg() { # reg NAME LOSS METRICS_LINE
    cat > "$WORK/$1.cfg" <<CFG
version = 1;
data: {
  train: { source: { type = "csv"; files = ["reg.csv"]; columns: { x = { dtype = "float32"; }; y = { dtype = "float32"; }; }; };
           transforms = ( { op = "take"; count = 320; }, { op = "batch"; size = 32; } ); };
  eval:  { source: { type = "csv"; files = ["reg.csv"]; columns: { x = { dtype = "float32"; }; y = { dtype = "float32"; }; }; };
           transforms = ( { op = "skip"; count = 320; }, { op = "batch"; size = 40; } ); };
};
model: { input = "x"; label = "y"; loss = "$2"; $3
         layers = ( { type = "flatten"; }, { type = "dense"; units = 1; } ); };
optimizer: { type = "sgd"; learning_rate = 0.05; };
run: { model_dir = "run_$1"; epochs = 20; seed = 1; progress = "none"; };
CFG
}
reg mse mean_squared_error ""
out=$(cd "$WORK" && timeout 120 "$LOOM" train mse.cfg 2>&1); rc=$?
[ $rc -eq 0 ] && pass "a scalar regression target trains (no one_hot)" || fail "a scalar regression trains" "$(echo "$out" | tail -3)"
! grep -q "accuracy" <<<"$out" && pass "no accuracy in a regression's log" || fail "no accuracy in a regression's log" "$(grep accuracy <<<"$out" | head -2)"
! grep -q "accuracy" "$WORK/run_mse/metrics.jsonl" && pass "no accuracy in a regression's metrics.jsonl" \
    || fail "no accuracy in a regression's metrics.jsonl" "$(grep -m1 accuracy "$WORK/run_mse/metrics.jsonl")"
loss=$(grep -o '"eval_loss": [0-9.e-]*' "$WORK/run_mse/metrics.jsonl" | tail -1 | cut -d' ' -f2)
python3 -c 'import sys; sys.exit(0 if float(sys.argv[1]) < 0.05 else 1)' "$loss" \
    && pass "the regression fits y = 3x - 1 (eval mse $loss)" || fail "the regression fits" "eval mse $loss"
for l in mean_absolute_error huber; do
    reg "$l" "$l" 'metrics = ["mae", "rmse"];'
    out=$(cd "$WORK" && timeout 120 "$LOOM" train "$l.cfg" 2>&1)
    contains "$l trains and logs mae and rmse" ", mae 0." "$(grep 'epoch 20/20' <<<"$out")"
done

# exact resume with the new optimizers and layers: 45 steps straight = 20, then resumed to 45
final() { ls "$1"/ckpt-*.loom | sed 's/.*ckpt-\([0-9]*\).loom/\1 &/' | sort -n | tail -1 | cut -d' ' -f2; }
LAYERS='model.layers=( { type = "flatten"; }, { type = "dense"; units = 32; use_bias = false; }, { type = "batch_normalization"; }, { type = "activation"; activation = "leaky_relu"; }, { type = "dense"; units = 16; }, { type = "layer_normalization"; }, { type = "activation"; activation = "gelu"; }, { type = "dense"; units = 10; } )'
for opt in 'optimizer={ type = "adamw"; learning_rate = 0.01; weight_decay = 0.01; clip_norm = 1.0; }' \
           'optimizer={ type = "rmsprop"; learning_rate = 0.003; clip_norm = 0.5; }'; do
    name=$(sed 's/.*type = "\([a-z]*\)".*/\1/' <<<"$opt")
    common=(--set run.progress='"none"' --set "$opt" --set "$LAYERS" --set model.l2=0.0001 --set run.epochs=2)
    timeout 120 "$LOOM" train tests/configs/small_mlp.cfg --model-dir "$WORK/r_$name" "${common[@]}" --set run.max_steps=45 >/dev/null 2>&1
    timeout 120 "$LOOM" train tests/configs/small_mlp.cfg --model-dir "$WORK/s_$name" "${common[@]}" --set run.max_steps=20 >/dev/null 2>&1
    timeout 120 "$LOOM" train tests/configs/small_mlp.cfg --model-dir "$WORK/s_$name" "${common[@]}" --set run.max_steps=45 >/dev/null 2>&1
    a=$("$LOOM" inspect "$(final "$WORK/r_$name")" 2>/dev/null | grep '^tensor'); b=$("$LOOM" inspect "$(final "$WORK/s_$name")" 2>/dev/null | grep '^tensor')
    if [ -n "$a" ] && [ "$a" = "$b" ]; then pass "$name, clip_norm, l2, batch/layer norm: resumed = uninterrupted, bit for bit"
    else fail "$name: resumed = uninterrupted" "$(diff <(echo "$a") <(echo "$b") | head -4)"; fi
    contains "$name's slots and the moving statistics are in the checkpoint" "moving_variance" "$a"
done

# mirrored: clip_norm all-reduces whole, and batch normalization per replica; the run trains
out=$(timeout 120 "$LOOM" train tests/configs/small_mlp.cfg --model-dir "$WORK/mir" --set run.progress='"none"' \
      --set 'optimizer={ type = "adamw"; learning_rate = 0.01; clip_norm = 1.0; }' --set "$LAYERS" \
      --set 'strategy={ type = "mirrored"; replicas = 2; }' --set run.epochs=1 2>&1); rc=$?
[ $rc -eq 0 ] && grep -q "eval loss" <<<"$out" && pass "mirrored, 2 replicas: clip_norm and batch normalization train" \
    || fail "mirrored with clip_norm and batch normalization" "$(echo "$out" | tail -3)"

# model.sample_weight: weight 0 on corrupted rows leaves the fit as if they were not there
python3 - "$WORK" <<'PY'
import random, sys
random.seed(4)
with open(sys.argv[1] + "/wreg.csv", "w") as f:
    f.write("x,y,w\n")
    for i in range(400):
        x = random.uniform(-2, 2)
        bad = i < 320 and i % 5 == 0
        f.write("%.5f,%.5f,%d\n" % (x, 3 * x - 1 + (40 if bad else random.gauss(0, 0.1)), 0 if bad else 1))
PY
wreg() { # wreg NAME EXTRA_MODEL_KEYS
    cat > "$WORK/$1.cfg" <<CFG
version = 1;
data: {
  train: { source: { type = "csv"; files = ["wreg.csv"]; columns: { x = { dtype = "float32"; }; y = { dtype = "float32"; }; w = { dtype = "float32"; }; }; };
           transforms = ( { op = "take"; count = 320; }, { op = "batch"; size = 32; } ); };
  eval:  { source: { type = "csv"; files = ["wreg.csv"]; columns: { x = { dtype = "float32"; }; y = { dtype = "float32"; }; w = { dtype = "float32"; }; }; };
           transforms = ( { op = "skip"; count = 320; }, { op = "batch"; size = 40; } ); };
};
model: { input = "x"; label = "y"; loss = "mean_squared_error"; $2
         layers = ( { type = "flatten"; }, { type = "dense"; units = 1; } ); };
optimizer: { type = "sgd"; learning_rate = 0.02; };
run: { model_dir = "run_$1"; epochs = 20; seed = 1; progress = "none"; };
CFG
}
wreg weighted 'sample_weight = "w";'
wreg unweighted ''
(cd "$WORK" && timeout 120 "$LOOM" train weighted.cfg >/dev/null 2>&1 && timeout 120 "$LOOM" train unweighted.cfg >/dev/null 2>&1)
lw=$(grep -o '"eval_loss": [0-9.e-]*' "$WORK/run_weighted/metrics.jsonl" | tail -1 | cut -d' ' -f2)
lu=$(grep -o '"eval_loss": [0-9.e-]*' "$WORK/run_unweighted/metrics.jsonl" | tail -1 | cut -d' ' -f2)
python3 -c 'import sys; w, u = map(float, sys.argv[1:]); sys.exit(0 if w < 0.05 and u > 1 else 1)' "${lw:-9}" "${lu:-0}" \
    && pass "sample_weight 0 on corrupted rows: eval mse $lw (unweighted $lu)" || fail "sample_weight" "weighted ${lw:-none}, unweighted ${lu:-none}"
expect_fail 2 "sample_weight naming a missing feature is an error" 'model.sample_weight: the train pipeline has no feature "wt"' \
    "$LOOM" check "$WORK/weighted.cfg" --set 'model.sample_weight="wt"'

# bad input: an unknown metric, AUC on ten classes, accuracy of a regression, BCE labels outside [0, 1]
expect_fail 2 "an unknown metric is a config error with the choices" \
    'model.metrics.[1]: unknown value "aucc" (expected one of: accuracy, auc, precision, recall, top_k_accuracy, mae, rmse, perplexity)' \
    "$LOOM" check "$BIN" --set 'model.metrics=["accuracy", "aucc"]'
expect_fail 2 "auc on ten classes without multi_label is a config error" \
    '"auc" does not fit this model: the model has 10 classes and AUC is a curve of two' \
    "$LOOM" check configs/fashion_mnist_mlp.cfg --set 'model.metrics=["auc"]'
expect_fail 2 "accuracy of a regression is a config error" '"accuracy" does not fit this model' \
    "$LOOM" check "$WORK/mse.cfg" --set 'model.metrics=["accuracy"]'
expect_fail 1 "a BCE label outside [0, 1] names the batch and the example" \
    'data.train batch 1 of epoch 1 (step 1): label of example ' \
    timeout 120 "$LOOM" train "$BIN" --model-dir "$WORK/badlab0" --set run.max_steps=3 \
    --set 'data.train.transforms.[4]={ op = "map"; fn = "cast"; feature = "label"; dtype = "float32"; }'
expect_fail 1 "... and its value" 'is 6, outside [0, 1] for binary_cross_entropy' \
    timeout 120 "$LOOM" train "$BIN" --model-dir "$WORK/badlab" --set run.max_steps=3 \
    --set 'data.train.transforms.[4]={ op = "map"; fn = "cast"; feature = "label"; dtype = "float32"; }'
finish
