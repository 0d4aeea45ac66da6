#!/usr/bin/env bash
# sync_bn.sh - synchronised batch normalization (a batch_normalization layer
# with sync = true, as TF's SyncBatchNormalization): the batch statistics
# are those of the global batch across replicas and workers, so training
# with mirrored(2), central_storage(3) and mirrored(4) (a last batch of one
# example: three replicas without examples) ends within 1e-6 of one_device
# on the same global batch, and without sync it does not (the replicas
# normalise over their own shares); 2 workers under multi_worker_mirrored
# (launch --local) end within 1e-6 of mirrored(2), 2 workers x 2 replicas of
# mirrored(4); under one_device sync changes nothing (the same bits).
# Config: tests/configs/sync_bn_mlp.cfg (784-64-BN-relu-10, global batch 96).
# Each job runs under `timeout`.
source "$(dirname "$0")/lib.sh"
DIFF="${LOOM_CKPT_DIFF:-$(dirname "$LOOM")/tests/ckpt_diff}"
CFG=tests/configs/sync_bn_mlp.cfg
S=(--set run.max_steps=40 --set run.eval_steps=1 --set run.checkpoint_steps=40)
# the epoch's last batch holds one example (4801 = 50 x 96 + 1): step 51
S51=(--set run.max_steps=51 --set run.eval_steps=1 --set run.checkpoint_steps=51 --set data.train.transforms.[0].count=4801)
NOSYNC=(--set 'model.layers.[2].sync=false')
run() { # NAME ARGS...: trains into $WORK/NAME, status checked
    local name=$1 out; shift
    if ! out=$(timeout 120 "$LOOM" train $CFG --model-dir "$WORK/$name" "$@" 2>&1); then
        fail "$name: training ends with status 0" "$(echo "$out" | tail -4)"
    fi
}
job() { # NAME WORKERS ARGS...: launch --local, status checked
    local name=$1 n=$2 out; shift 2
    if ! out=$(timeout 120 "$LOOM" launch --local --workers "$n" $CFG --model-dir "$WORK/$name" \
            --set strategy.type=multi_worker_mirrored "$@" 2>&1); then
        fail "$name: the job ends with status 0" "$(echo "$out" | tail -4)"
    fi
}
# near NAME A B LIMIT: ||a - b|| / ||a|| <= LIMIT; far: > LIMIT
cmp_ckpt() {
    local op=$1 name=$2 a=$3 b=$4 lim=$5 d
    if ! d=$("$DIFF" $CFG "$a" "$b" 2>&1); then fail "$name" "ckpt_diff: $d"; return; fi
    if awk -v d="$d" -v l="$lim" -v op="$op" 'BEGIN { exit !(op == "near" ? d <= l : d > l) }'; then
        pass "$name (${d} apart)"
    else
        fail "$name" "relative difference $d"
    fi
}
tensors() { "$LOOM" inspect "$1" | grep '^tensor'; }

run one "${S[@]}"
run m2 "${S[@]}" --set strategy.type=mirrored --set strategy.replicas=2
run m2_nosync "${S[@]}" --set strategy.type=mirrored --set strategy.replicas=2 "${NOSYNC[@]}"
run c3 "${S[@]}" --set strategy.type=central_storage --set strategy.replicas=3
cmp_ckpt near "mirrored(2), sync: the weights of one_device on the global batch within 1e-6" \
    "$WORK/one/ckpt-40.loom" "$WORK/m2/ckpt-40.loom" 1e-6
cmp_ckpt far "mirrored(2) without sync: more than 1e-3 from one_device (statistics of each replica's share)" \
    "$WORK/one/ckpt-40.loom" "$WORK/m2_nosync/ckpt-40.loom" 1e-3
cmp_ckpt near "central_storage(3), sync: one_device's weights within 1e-6" \
    "$WORK/one/ckpt-40.loom" "$WORK/c3/ckpt-40.loom" 1e-6

run one_nosync "${S[@]}" "${NOSYNC[@]}"
ta=$(tensors "$WORK/one/ckpt-40.loom"); tb=$(tensors "$WORK/one_nosync/ckpt-40.loom")
if [ -n "$ta" ] && [ "$ta" = "$tb" ]; then pass "one_device: sync is a no-op (the same bits)"
else fail "one_device: sync is a no-op (the same bits)"; fi

run one51 "${S51[@]}"
run m4_51 "${S51[@]}" --set strategy.type=mirrored --set strategy.replicas=4
cmp_ckpt near "mirrored(4), sync, a last batch of one example (3 replicas without examples): one_device within 1e-6" \
    "$WORK/one51/ckpt-51.loom" "$WORK/m4_51/ckpt-51.loom" 1e-6

# a custom (Lua) train_step runs forward, loss and backward as parts on every replica
LUA=(--set 'hooks.train_step="../../lua/clipped_step.lua:train_step"')
run m4_51_lua "${S51[@]}" --set strategy.type=mirrored --set strategy.replicas=4 "${LUA[@]}"
cmp_ckpt near "mirrored(4), sync, a Lua train_step (forward/loss/backward parts), replicas without examples: one_device within 1e-6" \
    "$WORK/one51/ckpt-51.loom" "$WORK/m4_51_lua/ckpt-51.loom" 1e-6

job w2 2 "${S[@]}"
cmp_ckpt near "2 workers (multi_worker_mirrored), sync: mirrored(2)'s weights within 1e-6" \
    "$WORK/m2/ckpt-40.loom" "$WORK/w2/ckpt-40.loom" 1e-6
run m4 "${S[@]}" --set strategy.type=mirrored --set strategy.replicas=4
job w22 2 "${S[@]}" --set strategy.replicas=2
cmp_ckpt near "2 workers x 2 replicas, sync: mirrored(4)'s weights within 1e-6" \
    "$WORK/m4/ckpt-40.loom" "$WORK/w22/ckpt-40.loom" 1e-6
job w2_51 2 "${S51[@]}"
run m2_51 "${S51[@]}" --set strategy.type=mirrored --set strategy.replicas=2
cmp_ckpt near "2 workers, sync, a last batch one worker has no share of: mirrored(2) within 1e-6" \
    "$WORK/m2_51/ckpt-51.loom" "$WORK/w2_51/ckpt-51.loom" 1e-6
job w2_nosync 2 "${S[@]}" "${NOSYNC[@]}"
cmp_ckpt far "2 workers without sync: more than 1e-3 from mirrored(2) with sync" \
    "$WORK/m2/ckpt-40.loom" "$WORK/w2_nosync/ckpt-40.loom" 1e-3

contains "loom check --print shows the layer's sync setting" "sync = true;" "$("$LOOM" check $CFG --print 2>&1)"
expect_fail 2 "sync on a layer other than batch_normalization: a config error naming the setting" \
    'model.layers.[1].sync: sync applies only to type = "batch_normalization" (type is "dense")' \
    "$LOOM" check $CFG --set 'model.layers.[1].sync=true'
finish
