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

finish
