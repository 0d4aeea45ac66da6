#!/usr/bin/env bash
# parameter_server_restarts.sh - parameter-server training (issue 14) through
# `loom launch --local` on 127.0.0.1 (a coordinator, 2 workers, 2 ps): a ps
# killed (the job restarts exactly from its checkpoint); the coordinator
# killed (the restart resumes); SIGTERM (a checkpoint, then a rerun
# resumes); a checkpoint of 2 ps restored onto 1 (refused); a push from a
# task that is not a worker (refused, logged). Every launch runs
# under `timeout`; launch kills its tasks when it exits.
source "$(dirname "$0")/lib.sh"
CFG=tests/configs/ps_mlp.cfg
L() { timeout 120 "$LOOM" launch --local $CFG --workers 2 --ps 2 "$@"; }

# --- a ps lost: the job restarts from its checkpoint -----------------------------------
out=$(LOOM_TEST_PS_DIE=ps:1@70 LOOM_TEST_PS_DIE_MARK="$WORK/pmark" L --model-dir "$WORK/pkill" --restarts 1 2>&1); st=$?
[ $st -eq 0 ] && pass "ps killed: the job restarts and completes" || fail "ps killed: the job restarts and completes" "status $st" "$(tail -8 <<<"$out")"
contains "ps killed: the coordinator reports it" "lost ps:1" "$out"
contains "ps killed: resumed from the checkpoint" "resuming from $WORK/pkill/ckpt-50.loom (step 50" "$out"
contains "ps killed: the ps tasks hold the checkpoint's variables bit for bit" \
    "the 2 ps tasks hold the checkpoint's 50890 variables and 1 slot exactly, at step 50" "$out"
contains "ps killed: every step applied" "done: step 100" "$out"

# --- the coordinator lost: the restart resumes ------------------------------------------
out=$(LOOM_TEST_PS_DIE=chief:0@73 LOOM_TEST_PS_DIE_MARK="$WORK/cmark" L --model-dir "$WORK/ckill" --restarts 1 2>&1); st=$?
[ $st -eq 0 ] && pass "coordinator killed: the job restarts and completes" || fail "coordinator killed: the job restarts and completes" "status $st" "$(tail -8 <<<"$out")"
contains "coordinator killed: resumed from the checkpoint" "resuming from $WORK/ckill/ckpt-50.loom (step 50" "$out"
contains "coordinator killed: every step applied" "done: step 100" "$out"

# --- SIGTERM (preemption): the coordinator saves the ps tasks' variables; a rerun resumes -----
LOOM_TEST_PS_STEP_MS=20 timeout 120 "$LOOM" launch --local $CFG --workers 2 --ps 2 --model-dir "$WORK/term" \
    --set run.epochs=3 >"$WORK/term.log" 2>&1 &
lp=$! # timeout's: it passes the SIGTERM on to launch
for i in $(seq 240); do grep -q "training 50890" "$WORK/term.log" && break; sleep 0.5; done
sleep 1
kill -TERM $lp
wait $lp; st=$?
out=$(cat "$WORK/term.log")
[ $st -eq 143 ] && pass "SIGTERM: launch stops with 128 + 15" || fail "SIGTERM: launch stops with 128 + 15" "status $st" "$(tail -5 <<<"$out")"
contains "SIGTERM: the coordinator saved a checkpoint" "interrupted by signal 15 at step" "$out"
saved=$(grep -o 'interrupted by signal 15 at step [0-9]*' <<<"$out" | grep -o '[0-9]*$')
out=$(L --model-dir "$WORK/term" --set run.epochs=3 2>&1); st=$?
[ $st -eq 0 ] && pass "SIGTERM: the rerun completes" || fail "SIGTERM: the rerun completes" "status $st" "$(tail -5 <<<"$out")"
contains "SIGTERM: the rerun resumes where it stopped" "resuming from $WORK/term/ckpt-$saved.loom (step $saved" "$out"
contains "SIGTERM: the rerun reads the variables back exactly" "the 2 ps tasks hold the checkpoint's 50890 variables and 1 slot exactly, at step $saved" "$out"
contains "SIGTERM: every step applied" "done: step 300" "$out"

# --- a ps count changed between checkpoint and restore -----------------------------------
out=$(timeout 120 "$LOOM" launch --local $CFG --workers 2 --ps 1 --model-dir "$WORK/pkill" --set run.epochs=2 2>&1); st=$?
[ $st -ne 0 ] && pass "another ps count: refused" || fail "another ps count: refused" "status 0" "$(tail -5 <<<"$out")"
contains "another ps count: says which and what to do" "written by a job of 2 ps tasks, this job has 1" "$out"

# --- a push from a task that is not a worker ----------------------------------------------
out=$(LOOM_TEST_PS_FORGE_PUSH=1 L --model-dir "$WORK/forge" 2>&1); st=$?
[ $st -eq 0 ] && pass "forged push: the job still completes" || fail "forged push: the job still completes" "status $st" "$(tail -5 <<<"$out")"
contains "forged push: refused and logged by the ps" "refused a message from chief:0: a gradient push from chief:0, which is not a worker of this job" "$out"
contains "forged push: the sender is told" "ps:0 refused a message of the coordinator" "$out"

finish
