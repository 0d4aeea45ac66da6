#!/usr/bin/env bash
# parameter_server_ckpt.sh - sharded checkpoints of parameter-server training
# (issue 14) through `loom launch --local` on 127.0.0.1 (a coordinator, 2
# workers, 2 ps): every task killed (kill -9: _exit 137) at a moment of the
# write of the step-100 checkpoint -- a ps before writing its shard file, a
# ps after writing it (before answering), the coordinator with every shard
# written but the index not committed -- leaves the step-50 index valid, and
# the restart (launch --restarts 1) resumes from it exactly: the step
# counter continues from 50 and the ps tasks hold the shards' bytes; the
# final set is complete (inspect checks every shard against its index) and
# the files no index names are gone. Every launch runs under `timeout`;
# launch kills its tasks when it exits.
source "$(dirname "$0")/lib.sh"
CFG=tests/configs/ps_mlp.cfg
L() { timeout 120 "$LOOM" launch --local $CFG --workers 2 --ps 2 "$@"; }

for who in "ps:1@before" "ps:0@after" "chief:0@index"; do
    d="$WORK/${who//[:@]/_}"
    out=$(LOOM_TEST_PS_SAVE_DIE="$who@100" LOOM_TEST_PS_DIE_MARK="$d.mark" L --model-dir "$d" --restarts 1 2>&1); st=$?
    [ $st -eq 0 ] && pass "$who: killed in the checkpoint of step 100, the job restarts and completes" || \
        fail "$who: killed in the checkpoint of step 100, the job restarts and completes" "status $st" "$(tail -8 <<<"$out")"
    contains "$who: it died where asked" "LOOM_TEST_PS_SAVE_DIE: dying now ($who@100)" "$out"
    contains "$who: the step-50 index was the newest valid one: resumed from it" \
        "resuming from $d/ckpt-50.loom (step 50" "$out"
    contains "$who: the ps tasks hold the checkpoint's shards bit for bit" \
        "the 2 ps tasks hold the checkpoint's 50890 variables and 1 slot exactly, at step 50" "$out"
    contains "$who: the step counter continues to the end" "done: step 100" "$out"
    n_done=$(grep -c "done: step" <<<"$out")
    [ "$n_done" -eq 1 ] && pass "$who: no step counted twice (one end)" || fail "$who: no step counted twice" "$n_done ends"
    ins=$("$LOOM" inspect "$d/ckpt-100.loom" 2>&1); ist=$?
    [ $ist -eq 0 ] && pass "$who: the final index and both its shards check out" || fail "$who: the final index checks out" "$ins"
    contains "$who: inspect shows the shard set" "step 100, 2 shard files of 2 ps tasks" "$ins"
    shards=$(ls "$d" | grep -c '\.data-'); idx=$(ls "$d" | grep -c '^ckpt-[0-9]*\.loom$')
    [ "$shards" -eq $((2 * idx)) ] && pass "$who: every shard file belongs to an index ($shards files, $idx indexes)" || \
        fail "$who: every shard file belongs to an index" "$(ls "$d")"
    tmp=$(ls "$d" | grep -c '\.tmp\.')
    [ "$tmp" -eq 0 ] && pass "$who: no temporary file left" || fail "$who: no temporary file left" "$(ls "$d")"
done

# checkpoints land on the multiples of checkpoint_steps, also once an epoch's end (step 100, not a
# multiple of steps_per_execution = 7) shifted the executions (issue 22: they landed at 35, 63, 91, 121, ...)
d="$WORK/multiples"
out=$(L --model-dir "$d" --set run.epochs=2 --set run.steps_per_execution=7 --set run.checkpoint_steps=30 2>&1); st=$?
[ $st -eq 0 ] && pass "checkpoint_steps 30, K 7: the job completes" || fail "checkpoint_steps 30, K 7: the job completes" "status $st" "$(tail -5 <<<"$out")"
got=$(ls "$d" | grep -o '^ckpt-[0-9]*\.loom$' | sed 's/ckpt-\([0-9]*\).loom/\1/' | sort -n | tr '\n' ' ')
[ "$got" = "30 60 90 100 120 150 180 200 " ] && pass "checkpoints at the multiples of 30 (and the epochs' ends): $got" \
    || fail "checkpoints at the multiples of 30 (and the epochs' ends)" "got: $got"
# a ps task says what it is (it logged "training rank -1 of 3")
contains "a ps task logs what it is" "[ps:1] loom: cluster task ps:1 (--task ps:1), parameter server 1 of 2: holds its shards of the variables for the 2 workers" "$out"

finish
