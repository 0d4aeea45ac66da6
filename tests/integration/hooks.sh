#!/usr/bin/env bash
# hooks.sh - Lua callbacks and custom training steps on real Fashion-MNIST
# (tests/configs/small_mlp.cfg: 3 epochs of 32 steps, dropout): a Lua step
# gives the built-in step's weights bit for bit; set_learning_rate, early
# stopping, log_scalar, save_checkpoint and the callbacks' saved state work;
# a failing hook exits 1 with file:line and leaves a checkpoint to resume from.
source "$(dirname "$0")/lib.sh"
CFG=tests/configs/small_mlp.cfg
Q=(--set run.progress='"none"')
callbacks() { echo "hooks.callbacks=( $* )"; }
SCRIPTED='{ fn = "../lua/scripted_hooks.lua:scripted"; args = { values = "0.5,0.4,0.45,0.41,0.42,0.3"; }; }'
EARLY='{ fn = "../../lua/early_stopping.lua:early_stopping"; args = { monitor = "scripted"; patience = 2; }; }'

check "built-in step" "$LOOM" train $CFG --model-dir "$WORK/builtin" "${Q[@]}"

# 1. lua/clipped_step.lua without clipping = the built-in step, bit for bit
check "custom Lua step (lua/clipped_step.lua, no clipping)" "$LOOM" train tests/configs/small_step.cfg --model-dir "$WORK/step" "${Q[@]}"
same_weights "the Lua step's weights are bit-identical to the built-in step's after 96 steps" \
    "$WORK/builtin/ckpt-96.loom" "$WORK/step/ckpt-96.loom"
if [ "$(grep '"event": "epoch"' "$WORK/builtin/metrics.jsonl" | grep -o '"train_loss": [^,]*')" = \
     "$(grep '"event": "epoch"' "$WORK/step/metrics.jsonl" | grep -o '"train_loss": [^,]*')" ]; then
    pass "the Lua step's ctx:loss() feeds the same train_loss to the logs"
else fail "the Lua step's ctx:loss() feeds the same train_loss to the logs"; fi
for st in mirrored central_storage; do
    check "$st, 2 replicas: built-in step" "$LOOM" train $CFG --model-dir "$WORK/$st" "${Q[@]}" --set strategy.type=$st --set strategy.replicas=2
    check "$st, 2 replicas: Lua step" "$LOOM" train tests/configs/small_step.cfg --model-dir "$WORK/${st}_step" "${Q[@]}" \
        --set strategy.type=$st --set strategy.replicas=2
    same_weights "$st: the Lua step (ctx:all_reduce_gradients over 2 replicas) gives the built-in step's weights bit for bit" \
        "$WORK/$st/ckpt-96.loom" "$WORK/${st}_step/ckpt-96.loom"
done
check "clipped Lua step" "$LOOM" train $CFG --model-dir "$WORK/clip" "${Q[@]}" \
    --set 'hooks.train_step={ fn = "../../lua/clipped_step.lua:train_step"; args = { clip_norm = 0.5; log_every = 8; }; }'
if [ "$(tensors "$WORK/clip/ckpt-96.loom")" != "$(tensors "$WORK/builtin/ckpt-96.loom")" ]; then
    pass "clipping changes the weights"; else fail "clipping changes the weights"; fi
n=$(grep -c '"name": "grad_norm"' "$WORK/clip/metrics.jsonl")
if [ "$n" -eq 12 ]; then pass "clipped_step logs grad_norm every 8 steps (12 lines)"; else fail "grad_norm lines" "$n"; fi

# 2. ctx:set_learning_rate takes effect: warmup_cosine with no warm-up is the built-in cosine schedule
check "built-in cosine schedule" "$LOOM" train $CFG --model-dir "$WORK/cos" "${Q[@]}" \
    --set 'optimizer.schedule={ type = "cosine"; decay_steps = 80; alpha = 0.1; }'
check "the same schedule from lua/warmup_cosine.lua" "$LOOM" train $CFG --model-dir "$WORK/luacos" "${Q[@]}" \
    --set "$(callbacks '{ fn = "../../lua/warmup_cosine.lua:warmup_cosine"; args = { peak = 0.05; warmup_steps = 0; total_steps = 80; alpha = 0.1; }; }')"
same_weights "set_learning_rate from Lua gives the built-in schedule's weights bit for bit" \
    "$WORK/cos/ckpt-96.loom" "$WORK/luacos/ckpt-96.loom"
# with a warm-up: the rate in an epoch line of metrics.jsonl is the formula's lr(step), set after the epoch's last step
check "warm-up and cosine" "$LOOM" train $CFG --model-dir "$WORK/warm" "${Q[@]}" \
    --set "$(callbacks '{ fn = "../../lua/warmup_cosine.lua:warmup_cosine"; args = { peak = 0.05; warmup_steps = 20; total_steps = 96; }; }')"
python3 - "$WORK/warm/metrics.jsonl" <<'PY' && pass "warm-up + cosine rates in metrics.jsonl match the formula" || fail "warm-up + cosine rates"
import json, math, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if '"event": "epoch"' in l]
def lr(s):
    return 0.05 * (s + 1) / 20 if s < 20 else 0.05 * (0.5 * (1 + math.cos(math.pi * min(s - 20, 76) / 76)))
ok = len(lines) == 3 and all(abs(l["learning_rate"] - lr(l["step"])) < 1e-8 * lr(l["step"]) for l in lines[:2])
sys.exit(0 if ok else 1)
PY

# 3. early stopping on a scripted metric: 0.5 0.4 | 0.45 0.41 -> 2 epochs without improvement: stop after epoch 4
out=$("$LOOM" train $CFG --model-dir "$WORK/early" "${Q[@]}" --set run.epochs=6 --set "$(callbacks "$SCRIPTED, $EARLY")" 2>&1)
contains "early_stopping says why it stops" "has not improved on 0.4 (epoch 2) for 2 epochs; stopping after epoch 4" "$out"
n=$(grep -c '"event": "epoch"' "$WORK/early/metrics.jsonl")
if [ "$n" -eq 4 ] && [ -f "$WORK/early/ckpt-128.loom" ] && ! ls "$WORK/early"/ckpt-1[3-9]*.loom >/dev/null 2>&1; then
    pass "early stopping stops after epoch 4 of 6 (step 128)"; else fail "early stopping stops after epoch 4" "$n epochs"; fi
out=$("$LOOM" train $CFG --model-dir "$WORK/early" "${Q[@]}" --set run.epochs=6 --set "$(callbacks "$SCRIPTED, $EARLY")" 2>&1)
contains "a stopped run started again stays stopped (its state is in the checkpoint)" "stopped by a hook" "$out"
[ "$(grep -c '"event": "epoch"' "$WORK/early/metrics.jsonl")" -eq 4 ] && pass "... and trains no further" || fail "trains no further"
# the state survives a resume in the middle: 3 epochs (one without improvement), then resume to 6
check "early stopping: first 3 epochs" "$LOOM" train $CFG --model-dir "$WORK/early2" "${Q[@]}" --set run.epochs=3 \
    --set "$(callbacks "$SCRIPTED, $EARLY")"
check "early stopping: resumed to 6" "$LOOM" train $CFG --model-dir "$WORK/early2" "${Q[@]}" --set run.epochs=6 \
    --set "$(callbacks "$SCRIPTED, $EARLY")"
n=$(grep -c '"event": "epoch"' "$WORK/early2/metrics.jsonl")
if [ "$n" -eq 4 ]; then pass "a resumed run keeps early_stopping's count (stops after epoch 4)"; else fail "resumed early stopping" "$n epochs"; fi

# 3b. a run a callback stopped (with no state of its own) is finished: a rerun
# has nothing to do (final.json says "stopped"), as after max_steps; another
# run.epochs trains on; --fresh starts over (issue 22, item 5)
STOP="$(callbacks '{ fn = "../lua/scripted_hooks.lua:stop_after"; args = { epoch = 2; }; }')"
check "a callback stops the run after epoch 2 of 6" "$LOOM" train $CFG --model-dir "$WORK/stop" "${Q[@]}" --set run.epochs=6 --set "$STOP"
contains "final.json records the stop" '"step": 64, "checkpoint": "ckpt-64.loom", "reason": "stopped", "epochs": 6' \
    "$(cat "$WORK/stop/final.json" 2>&1)"
out=$("$LOOM" train $CFG --model-dir "$WORK/stop" "${Q[@]}" --set run.epochs=6 --set "$STOP" 2>&1)
contains "a rerun of the stopped run has nothing to do" "nothing to do: the run in $WORK/stop was stopped by a hook (ctx:stop()) at step 64 (epoch 2 of 6)" "$out"
out=$("$LOOM" train $CFG --model-dir "$WORK/stop" "${Q[@]}" --set run.epochs=6 --set "$STOP" 2>&1)
contains "... and so has the next one" "nothing to do" "$out"
if [ "$(grep -c '"event": "epoch"' "$WORK/stop/metrics.jsonl")" -eq 2 ] && ! ls "$WORK/stop"/ckpt-[7-9]?.loom >/dev/null 2>&1; then
    pass "... neither trains another epoch (2 epoch lines, no checkpoint past step 64)"
else fail "reruns of a stopped run train no further" "$(grep -c '"event": "epoch"' "$WORK/stop/metrics.jsonl") epoch lines"; fi
check "another run.epochs trains on from the stop" "$LOOM" train $CFG --model-dir "$WORK/stop" "${Q[@]}" --set run.epochs=5 --set "$STOP"
if [ -f "$WORK/stop/ckpt-96.loom" ] && [ "$(grep -c '"event": "epoch"' "$WORK/stop/metrics.jsonl")" -eq 3 ]; then
    pass "... one more epoch (the callback stops it again, at step 96)"; else fail "another run.epochs trains on"; fi
out=$("$LOOM" train $CFG --model-dir "$WORK/stop" "${Q[@]}" --set run.epochs=5 --set "$STOP" --fresh 2>&1)
contains "--fresh starts the stopped run over" "moved the earlier checkpoints" "$out"
contains "... and trains from step 0 to the callback's stop" '"step": 64, "checkpoint": "ckpt-64.loom", "reason": "stopped"' \
    "$(cat "$WORK/stop/final.json" 2>&1)"
check "a run that reaches run.epochs records it as finished" grep -q '"reason": "finished"' "$WORK/builtin/final.json"

# 4. log_scalar lands in metrics.jsonl; ctx:param reads a parameter
check "logger" "$LOOM" train $CFG --model-dir "$WORK/log" "${Q[@]}" \
    --set "$(callbacks '{ fn = "../../lua/logger.lua:logger"; args = { every = 16; param = "dense_1/kernel"; }; }')"
python3 - "$WORK/log/metrics.jsonl" <<'PY' && pass "log_scalar lines in metrics.jsonl: train/loss every 16 steps, a weight norm per epoch" || fail "log_scalar lines"
import json, sys
s = [json.loads(l) for l in open(sys.argv[1]) if '"event": "scalar"' in l]
loss = [x["step"] for x in s if x["name"] == "train/loss"]
norm = [x for x in s if x["name"] == "param_norm/dense_1/kernel"]
sys.exit(0 if loss == [16, 32, 48, 64, 80, 96] and len(norm) == 3 and all(x["value"] > 1 for x in norm) else 1)
PY

# 5. ctx:save_checkpoint writes one (step 7 is not a multiple of checkpoint_steps = 10)
out=$("$LOOM" train $CFG --model-dir "$WORK/save" "${Q[@]}" --set run.max_steps=12 \
    --set "$(callbacks '{ fn = "../lua/scripted_hooks.lua:saver"; args = { at = 7; }; }')" 2>&1)
contains "save_checkpoint returns the path" "ckpt-7.loom" "$out"
check "the checkpoint a hook saved verifies" "$LOOM" inspect "$WORK/save/ckpt-7.loom"

# 6. a failing callback: exit 1, file:line and traceback, a checkpoint to resume from
expect_fail 1 "a callback error exits 1 naming the Lua file and line" "scripted_hooks.lua:22: on_step_end" \
    "$LOOM" train $CFG --model-dir "$WORK/fail" "${Q[@]}" --set "$(callbacks '{ fn = "../lua/scripted_hooks.lua:fail_at"; args = { at = 45; }; }')"
out=$("$LOOM" train $CFG --model-dir "$WORK/fail2" "${Q[@]}" --set "$(callbacks '{ fn = "../lua/scripted_hooks.lua:fail_at"; args = { at = 45; }; }')" 2>&1)
contains "... with a traceback" "stack traceback:" "$out"
contains "... and the checkpoint it saved" "saved $WORK/fail2/ckpt-45.loom" "$out"
check "that checkpoint verifies" "$LOOM" inspect "$WORK/fail/ckpt-45.loom"
check "resume without the failing hook" "$LOOM" train $CFG --model-dir "$WORK/fail" "${Q[@]}"
same_weights "a run resumed after a hook error ends bit-identical to one never interrupted" \
    "$WORK/builtin/ckpt-96.loom" "$WORK/fail/ckpt-96.loom"
# a failing train_step, after its update: the update is counted in the checkpoint
expect_fail 1 "a train_step error exits 1 naming the Lua file and line" "scripted_hooks.lua:29: train_step" \
    "$LOOM" train $CFG --model-dir "$WORK/sfail" "${Q[@]}" --set 'hooks.train_step={ fn = "../lua/scripted_hooks.lua:failing_step"; args = { at = 45; }; }'
check "resume after the failing step" "$LOOM" train $CFG --model-dir "$WORK/sfail" "${Q[@]}"
same_weights "... ends bit-identical too" "$WORK/builtin/ckpt-96.loom" "$WORK/sfail/ckpt-96.loom"

# a callback that allocates without bound is stopped by hooks.memory_limit, and leaves a checkpoint
expect_fail 1 "a callback allocating without bound: hooks.memory_limit, at its line" "scripted_hooks.lua:36: on_step_end" \
    "$LOOM" train $CFG --model-dir "$WORK/hog" "${Q[@]}" --set hooks.memory_limit=16000000 \
    --set "$(callbacks '{ fn = "../lua/scripted_hooks.lua:hog"; args = { at = 5; }; }')"
check "... and its checkpoint verifies" "$LOOM" inspect "$WORK/hog/ckpt-5.loom"

# 7. loom check finds a function the config names that the file lacks
expect_fail 2 "loom check: a missing callback function" 'no function "loger"' \
    "$LOOM" check $CFG --set 'hooks.callbacks=["../../lua/logger.lua:loger"]'
expect_fail 2 "loom check: a missing train_step" 'no function "train_stp"' \
    "$LOOM" check tests/configs/small_step.cfg --set 'hooks.train_step="../../lua/clipped_step.lua:train_stp"'
expect_fail 2 "loom check: a misspelt callback in the returned table" "did you mean" \
    "$LOOM" check $CFG --set 'hooks.callbacks=["../lua/test_callbacks.lua:misspelt"]'
finish
