#!/usr/bin/env bash
# config_load.sh - config errors that the config alone decides are found when
# the config loads, before any pipeline, plugin or task starts (issue 12):
# data.train / data.eval without a batch transform (train, evaluate, check,
# launch), a cache after repeat(-1), class weights a loss cannot take. A
# pipeline run alone (loom profile) still takes a config without batches.
source "$(dirname "$0")/lib.sh"
NB=tests/configs/train_no_batch.cfg

for cmd in train evaluate check; do
    expect_fail 2 "loom $cmd: no batch transform, found at load" \
        "train_no_batch.cfg:6: data.train.transforms: no batch transform" \
        timeout 60 "$LOOM" "$cmd" $NB --set "run.model_dir=\"$WORK/$cmd\""
done
out=$(timeout 60 "$LOOM" check $NB 2>&1)
contains "both datasets are named, with the hint" 'add { op = "batch"; size = 256; } to data.eval.transforms' "$out"
[ ! -e "$WORK/train" ] && pass "train wrote nothing (no model_dir)" || fail "train wrote nothing (no model_dir)" "$(ls -la "$WORK/train")"

# launch validates the config before it starts a task: no task output at all
out=$(timeout 60 "$LOOM" launch --local $NB --workers 2 --set strategy.type=multi_worker_mirrored --set "run.model_dir=\"$WORK/job\"" 2>&1); st=$?
[ "$st" -eq 2 ] && pass "launch: exit 2" || fail "launch: exit 2" "exit $st" "$(echo "$out" | tail -5)"
contains "launch: the error names the file and line" "train_no_batch.cfg:6: data.train.transforms: no batch transform" "$out"
grep -q '^\[worker:' <<<"$out" && fail "launch started no task" "$(echo "$out" | tail -5)" || pass "launch started no task"

# a pipeline alone needs no batch
check "profile runs data.train without a batch" timeout 120 "$LOOM" profile $NB --steps 5

# load-time siblings: loom check reports them at the config's lines, with the others
expect_fail 2 "cache after repeat(-1): at the cache's line" \
    "bad_load_time.cfg:11: data.eval: cache: the repeat before it (transforms.[0]) has count = -1" \
    timeout 60 "$LOOM" check tests/configs/bad_load_time.cfg
expect_fail 2 "class_weight with a loss without classes: at its line" \
    "bad_load_time.cfg:16: model.class_weight: needs classes; the loss mean_squared_error has none" \
    timeout 60 "$LOOM" check tests/configs/bad_load_time.cfg
expect_fail 2 "binary cross-entropy takes two class weights" \
    "bad_load_time2.cfg:16: model.class_weight: binary_cross_entropy takes [negative, positive], got 3 weights" \
    timeout 60 "$LOOM" check tests/configs/bad_load_time2.cfg
finish
