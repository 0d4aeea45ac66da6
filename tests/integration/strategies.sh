#!/usr/bin/env bash
# strategies.sh - mirrored and central_storage through the loom binary, on
# real Fashion-MNIST (tests/configs/strategy_mlp.cfg, 64 steps per epoch):
# `loom check` prints the plan; two runs are bit-identical; a run stopped and
# resumed under mirrored ends bit-identical to an uninterrupted one;
# run.steps_per_execution changes nothing in the weights; evaluate and predict
# work and agree with one_device; a custom Lua step gives the built-in step's
# weights; bad devices and ops are clear errors.
source "$(dirname "$0")/lib.sh"
CFG=tests/configs/strategy_mlp.cfg
MIR=(--set strategy.type=mirrored --set 'strategy.devices=["cpu:0","cpu:1"]')
CEN=(--set strategy.type=central_storage --set strategy.replicas=2)
final() { ls "$1"/ckpt-*.loom | sed 's/.*ckpt-\([0-9]*\).loom/\1 &/' | sort -n | tail -1 | cut -d' ' -f2; }
acc_of() { sed 's/.*"eval_accuracy": \([0-9.]*\).*/\1/' <<<"$1"; }

# the plan
out=$("$LOOM" check $CFG "${MIR[@]}" 2>&1)
contains "check: mirrored on cpu:0 and cpu:1" "strategy: mirrored, 2 replicas on cpu:0, cpu:1" "$out"
contains "check: per-replica batch" "global batch 64, per-replica batch 32, 32" "$out"
contains "check: cross-device op and packing" "cross-device op: reduce_to_one_device; 1 pack (" "$out"
contains "check: bytes all-reduced per step (50,890 parameters)" "all-reduced per step: 198.8 KiB per replica" "$out"
out=$("$LOOM" check $CFG "${CEN[@]}" --set data.train.transforms.[2].size=63 2>&1)
contains "check: central_storage plan, uneven shares" "per-replica batch 32, 31" "$out"
contains "check: central_storage sums once" "are summed once" "$out"
out=$("$LOOM" check $CFG --set strategy.type=mirrored --set strategy.replicas=3 --set strategy.cross_device_ops=auto 2>&1)
contains "check: \"auto\" picks an op and says why" 'cross_device_ops = "auto": ' "$out"
# replica threads are pinned one per core when they fit (2 on this machine's 2 or more cores), not when they outnumber them
if [ "$(nproc)" -ge 2 ]; then
    contains "check: 2 replicas pinned to their cores" "1 compute thread each, pinned to its core" \
        "$("$LOOM" check $CFG "${MIR[@]}" 2>&1)"
fi
if [ "$(nproc)" -lt 3 ]; then
    if grep -q "pinned" <<<"$out"; then fail "check: 3 replicas on $(nproc) cores: not pinned" "$out"
    else pass "check: 3 replicas on $(nproc) cores: not pinned"; fi
fi

# bit-identical runs, and the one_device reference
check "one_device run" "$LOOM" train $CFG --model-dir "$WORK/one"
check "mirrored run A" "$LOOM" train $CFG --model-dir "$WORK/ma" "${MIR[@]}"
check "mirrored run B" "$LOOM" train $CFG --model-dir "$WORK/mb" "${MIR[@]}"
same_weights "mirrored: two runs with one seed give bit-identical weights" "$(final "$WORK/ma")" "$(final "$WORK/mb")"
check "central_storage run A" "$LOOM" train $CFG --model-dir "$WORK/ca" "${CEN[@]}"
check "central_storage run B" "$LOOM" train $CFG --model-dir "$WORK/cb" "${CEN[@]}"
same_weights "central_storage: two runs with one seed give bit-identical weights" "$(final "$WORK/ca")" "$(final "$WORK/cb")"
# with the same op and 2 replicas both strategies sum a + b: the same bits
same_weights "mirrored(2) and central_storage(2) train the same weights" "$(final "$WORK/ma")" "$(final "$WORK/ca")"

# packing: one pack per parameter tensor, reduced last layers first; with
# reduce_to_one_device the sums (and so the weights) are the same
out=$("$LOOM" check $CFG "${MIR[@]}" --set strategy.num_packs=0 2>&1)
contains "check: packs listed in reduction order, last layer first" \
    "4 packs (40 bytes, 2.5 KiB, 256 bytes, 196.0 KiB) in reduction order; bytes_per_pack 0, num_packs 0" "$out"
check "mirrored, num_packs = 0" "$LOOM" train $CFG --model-dir "$WORK/mp" "${MIR[@]}" --set strategy.num_packs=0
same_weights "gradients all-reduced per tensor give the same weights as in one pack" "$(final "$WORK/ma")" "$(final "$WORK/mp")"

# strategy.collective_timeout: checked at load, and a generous one changes nothing
expect_fail 2 "collective_timeout = -1 is an error at its setting" \
    "strategy.collective_timeout: expected a number >= 0.0, got -1" "$LOOM" check $CFG "${MIR[@]}" \
    --set strategy.collective_timeout=-1
check "check accepts collective_timeout = 30" "$LOOM" check $CFG "${MIR[@]}" --set strategy.collective_timeout=30
check "mirrored, collective_timeout = 30" "$LOOM" train $CFG --model-dir "$WORK/mt" "${MIR[@]}" \
    --set strategy.collective_timeout=30
same_weights "a collective timeout gives the same weights" "$(final "$WORK/ma")" "$(final "$WORK/mt")"

# stop mid-epoch (step 45 of 128) and resume
check "mirrored: run to step 45" "$LOOM" train $CFG --model-dir "$WORK/mr" "${MIR[@]}" --set run.max_steps=45
check "mirrored: resume to the end" "$LOOM" train $CFG --model-dir "$WORK/mr" "${MIR[@]}"
same_weights "mirrored: resumed = uninterrupted (bit-identical weights and slots)" "$(final "$WORK/ma")" "$(final "$WORK/mr")"

# steps_per_execution: the same steps, host work only at boundaries
check "mirrored, steps_per_execution = 7" "$LOOM" train $CFG --model-dir "$WORK/k7" "${MIR[@]}" --set run.steps_per_execution=7
same_weights "steps_per_execution = 7 gives the weights of 1" "$(final "$WORK/ma")" "$(final "$WORK/k7")"
ckpts=$(ls "$WORK/k7" | grep -c '^ckpt-' || true)
if [ -f "$WORK/k7/ckpt-20.loom" ] && [ -f "$WORK/k7/ckpt-40.loom" ] && [ ! -f "$WORK/k7/ckpt-21.loom" ]; then
    pass "checkpoints fall on the multiples of checkpoint_steps (20, 40; an execution ends there)"
else fail "checkpoints on the multiples of checkpoint_steps" "$(ls "$WORK/k7")"; fi
check "one_device, steps_per_execution = 5" "$LOOM" train $CFG --model-dir "$WORK/k5" --set run.steps_per_execution=5
same_weights "one_device: steps_per_execution = 5 gives the weights of 1" "$(final "$WORK/one")" "$(final "$WORK/k5")"
check "steps_per_execution = 4, resumed mid-run" "$LOOM" train $CFG --model-dir "$WORK/k4" "${MIR[@]}" --set run.steps_per_execution=4 --set run.max_steps=50
check "  ... to the end" "$LOOM" train $CFG --model-dir "$WORK/k4" "${MIR[@]}" --set run.steps_per_execution=4
same_weights "steps_per_execution = 4, stopped and resumed = uninterrupted" "$(final "$WORK/ma")" "$(final "$WORK/k4")"

# evaluate and predict under both strategies agree with one_device
one=$("$LOOM" evaluate $CFG --model-dir "$WORK/one" 2>/dev/null)
mir=$("$LOOM" evaluate $CFG --model-dir "$WORK/ma" "${MIR[@]}" 2>/dev/null)
cen=$("$LOOM" evaluate $CFG --model-dir "$WORK/ca" "${CEN[@]}" 2>/dev/null)
contains "evaluate under mirrored" '"examples": 1000' "$mir"
contains "evaluate under central_storage" '"examples": 1000' "$cen"
a1=$(acc_of "$one"); am=$(acc_of "$mir"); ac=$(acc_of "$cen")
if awk "BEGIN{d=$am-$a1; if (d<0) d=-d; e=$ac-$a1; if (e<0) e=-e; exit !(d <= 0.003 && e <= 0.003 && $a1 > 0.7)}"; then
    pass "eval accuracy: one_device $a1, mirrored $am, central_storage $ac (within 0.3%)"
else fail "eval accuracy within 0.3%" "one_device $a1, mirrored $am, central_storage $ac"; fi
check "predict under mirrored" "$LOOM" predict $CFG --model-dir "$WORK/ma" "${MIR[@]}" --output "$WORK/pm.csv"
check "predict under one_device, same checkpoint" "$LOOM" predict $CFG --model-dir "$WORK/ma" --output "$WORK/po.csv"
check "predict under central_storage" "$LOOM" predict $CFG --model-dir "$WORK/ma" "${CEN[@]}" --output "$WORK/pc.csv"
if [ "$(wc -l <"$WORK/pm.csv")" -eq 1001 ] && [ "$(cut -d, -f2 "$WORK/pm.csv")" = "$(cut -d, -f2 "$WORK/po.csv")" ] &&
    [ "$(cut -d, -f2 "$WORK/pc.csv")" = "$(cut -d, -f2 "$WORK/po.csv")" ]; then
    pass "predicted classes are the same under every strategy"
else fail "predicted classes under every strategy" "$(diff "$WORK/pm.csv" "$WORK/po.csv" | head -3)"; fi

# dropout under mirrored (tests/configs/small_mlp.cfg): reproducible
check "mirrored with dropout, run A" "$LOOM" train tests/configs/small_mlp.cfg --model-dir "$WORK/da" "${MIR[@]}" --set run.progress='"none"'
check "mirrored with dropout, run B" "$LOOM" train tests/configs/small_mlp.cfg --model-dir "$WORK/db" "${MIR[@]}" --set run.progress='"none"'
same_weights "mirrored with dropout: bit-identical runs" "$(final "$WORK/da")" "$(final "$WORK/db")"

# a custom Lua step (lua/clipped_step.lua, no clipping) runs the strategies' step parts
check "mirrored built-in step, small_mlp" "$LOOM" train tests/configs/small_mlp.cfg --model-dir "$WORK/hb" "${MIR[@]}" --set run.progress='"none"'
check "mirrored Lua step, small_step" "$LOOM" train tests/configs/small_step.cfg --model-dir "$WORK/hs" "${MIR[@]}" --set run.progress='"none"'
same_weights "mirrored: the Lua step's weights are the built-in step's" "$WORK/hb/ckpt-96.loom" "$WORK/hs/ckpt-96.loom"
C3=(--set strategy.type=central_storage --set strategy.replicas=3)
check "central_storage(3) built-in step" "$LOOM" train tests/configs/small_mlp.cfg --model-dir "$WORK/hcb" "${C3[@]}" --set run.progress='"none"'
check "central_storage(3) Lua step" "$LOOM" train tests/configs/small_step.cfg --model-dir "$WORK/hcs" "${C3[@]}" --set run.progress='"none"'
same_weights "central_storage: the Lua step's weights are the built-in step's" "$WORK/hcb/ckpt-96.loom" "$WORK/hcs/ckpt-96.loom"

# bad input: each a clear message naming the setting, exit status 2
expect_fail 2 "a device that does not exist" 'device "cpu:4095" does not exist: this machine has cpu:0 to cpu:' \
    "$LOOM" check $CFG --set strategy.type=mirrored --set 'strategy.devices=["cpu:0","cpu:4095"]'
# (the cuda plugin may be built here, but there is no driver or GPU: the message says which)
expect_fail 2 "gpu without a usable CUDA backend" 'strategy.devices: device "gpu:*" is not usable: ' \
    "$LOOM" train $CFG --model-dir "$WORK/bad" --set strategy.type=mirrored --set 'strategy.devices=["gpu:*"]'
expect_fail 2 "an unknown cross-device op lists the known ones" \
    '--set strategy.cross_device_ops: unknown cross-device op "ringg" (available: reduce_to_one_device, ' \
    "$LOOM" check $CFG --set strategy.type=mirrored --set strategy.replicas=2 --set strategy.cross_device_ops=ringg
expect_fail 2 "... and suggests the closest" 'hint: did you mean "ring"?' \
    "$LOOM" check $CFG --set strategy.type=mirrored --set strategy.replicas=2 --set strategy.cross_device_ops=ringg
sed 's/^strategy: { type = "one_device"; };/strategy: { type = "mirrored";\n  devices = ["cpu:0", "cpu:4095"]; };/' $CFG >"$WORK/bad_dev.cfg"
expect_fail 2 "a bad device in a file names its file:line" "bad_dev.cfg:36: strategy.devices: device \"cpu:4095\" does not exist" \
    "$LOOM" check "$WORK/bad_dev.cfg"
expect_fail 2 "replicas < 1" "strategy.replicas: expected an integer in [1, 64], got 0" \
    "$LOOM" check $CFG --set strategy.type=mirrored --set strategy.replicas=0
expect_fail 2 "more replicas than the global batch" "8 replicas but the global batch (data.train, line 13) is 4" \
    "$LOOM" check $CFG --set strategy.type=central_storage --set strategy.replicas=8 --set data.train.transforms.[2].size=4
expect_fail 2 "steps_per_execution < 1" "run.steps_per_execution: expected an integer in [1, 1048576], got 0" \
    "$LOOM" check $CFG --set run.steps_per_execution=0
finish
