#!/usr/bin/env bash
# parameter_server_shards.sh - what reads a sharded checkpoint of
# parameter-server training (issue 14), and what a ps holds, through `loom
# launch --local` on 127.0.0.1: a synchronous job of one worker writes the
# same shard bytes twice and, killed and restarted, resumes from them
# exactly; loom evaluate, predict, export and inspect read the index and
# its shards (variables cut into 3 parts by a partitioner) and find the
# coordinator's model; restoring onto another partitioning is refused
# naming both. (Separate disks and a ps's memory: parameter_server_ps_tasks.sh.)
# Every launch runs under `timeout`; launch kills its tasks when it exits.
source "$(dirname "$0")/lib.sh"
CFG=tests/configs/ps_mlp.cfg
SYNC=(--set 'strategy.sync={replicas_to_aggregate=1;total_replicas=1;}'
      --set 'strategy.variable_partitioner={type="fixed";num_shards=3;}')
L1() { timeout 120 "$LOOM" launch --local $CFG --workers 1 --ps 2 "${SYNC[@]}" "$@"; }

# --- synchronous, one worker: the same shards twice; a restart resumes from them exactly ----------
out=$(L1 --model-dir "$WORK/a" 2>&1); st=$?
[ $st -eq 0 ] && pass "sync, 1 worker, 3 shards per variable: completes" || fail "sync, 1 worker: completes" "status $st" "$(tail -5 <<<"$out")"
final=$(grep -o 'eval loss [0-9.]*, accuracy [0-9.]*' <<<"$out" | tail -1)
L1 --model-dir "$WORK/b" >/dev/null 2>&1
same=1
for f in "$WORK"/a/ckpt-*.data-*; do cmp -s "$f" "$WORK/b/$(basename "$f")" || same=0; done
[ $same -eq 1 ] && [ "$(ls "$WORK/a" | grep -c '\.data-')" -eq 4 ] && pass "sync, 1 worker: two runs write the same shard bytes" || \
    fail "sync, 1 worker: two runs write the same shard bytes" "$(ls -l "$WORK/a" "$WORK/b")"
out=$(LOOM_TEST_PS_DIE=chief:0@73 LOOM_TEST_PS_DIE_MARK="$WORK/cmark" L1 --model-dir "$WORK/c" --restarts 1 2>&1); st=$?
[ $st -eq 0 ] && pass "sync, 1 worker, coordinator killed at step 73: completes" || fail "sync, coordinator killed: completes" "status $st" "$(tail -5 <<<"$out")"
contains "sync, coordinator killed: resumed from step 50" "resuming from $WORK/c/ckpt-50.loom (step 50" "$out"
contains "sync, coordinator killed: the ps tasks hold the step-50 shards exactly" \
    "the 2 ps tasks hold the checkpoint's 50890 variables and 1 slot exactly, at step 50" "$out"
contains "sync, coordinator killed: the step counter ends where it should" "done: step 100" "$out"
same=1
for f in "$WORK"/a/ckpt-50.data-*; do cmp -s "$f" "$WORK/c/$(basename "$f")" || same=0; done
[ $same -eq 1 ] && pass "sync, coordinator killed: its step-50 shards are the uninterrupted run's, byte for byte" || \
    fail "sync, coordinator killed: its step-50 shards are the uninterrupted run's" "$(ls -l "$WORK/c")"
# (steps 51..100 of the restarted run differ from the uninterrupted one's: the worker rebuilds its
# input pipeline from the start, as TF's workers do; README "Parameter-server training")

# --- every reader of checkpoints reads the index and its shards -------------------------------------
ev=$("$LOOM" evaluate $CFG --model-dir "$WORK/a" 2>&1)
contains "evaluate: reads the sharded checkpoint" '"step": 100' "$ev"
contains "evaluate: the coordinator's own final evaluation, to the digit ($final)" "$final" "$ev"
check "predict: reads it" "$LOOM" predict $CFG --model-dir "$WORK/a" --output "$WORK/p.csv"
[ "$(wc -l <"$WORK/p.csv")" -eq 1001 ] && pass "predict: 1000 predictions" || fail "predict: 1000 predictions" "$(wc -l <"$WORK/p.csv")"
check "export npz: reads it" "$LOOM" export $CFG --model-dir "$WORK/a" --format npz --output "$WORK/m.npz"
ins=$("$LOOM" inspect "$WORK/a/ckpt-100.loom" 2>&1); st=$?
[ $st -eq 0 ] && pass "inspect: checks the index and every shard" || fail "inspect: checks the index and every shard" "$ins"
contains "inspect: a variable's 3 parts" "dense_1/kernel/part_2                    rows 523..783 of dense_1/kernel" "$ins"
contains "inspect: each shard against the index" "(ps:1; matches the index)" "$ins"
rm "$WORK/a/ckpt-100.data-00001-of-00002"
expect_fail 1 "a shard missing: evaluate names it" "the checkpoint's shard of ps:1, $WORK/a/ckpt-100.data-00001-of-00002, cannot be read" \
    "$LOOM" evaluate $CFG --model-dir "$WORK/a"

# --- another partitioning: refused, naming both ---------------------------------------------------
out=$(timeout 120 "$LOOM" launch --local $CFG --workers 1 --ps 2 --model-dir "$WORK/c" --set run.epochs=2 \
      --set 'strategy.variable_partitioner={type="fixed";num_shards=2;}' 2>&1); st=$?
[ $st -ne 0 ] && pass "another partitioning: refused" || fail "another partitioning: refused" "status 0" "$(tail -5 <<<"$out")"
contains "another partitioning: says which and what to do" \
    "the checkpoint's variables were cut into 12 shards over 2 ps tasks by another partitioning" "$out"
contains "another partitioning: this job's" "this job cuts them into 8 over 2" "$out"

finish
