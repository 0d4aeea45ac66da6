#!/usr/bin/env bash
# parameter_server_faults.sh - parameter-server training (issue 14) through
# `loom launch --local` on 127.0.0.1 (a coordinator, 2 workers, 2 ps): a worker
# killed in the middle of a step function (the job completes every step
# without it, and again when it rejoins); a synchronous job left short of
# workers for good (it stops, saying why). parameter_server_restarts.sh has
# the lost ps and coordinator. Every launch runs
# under `timeout`; launch kills its tasks when it exits.
source "$(dirname "$0")/lib.sh"
CFG=tests/configs/ps_mlp.cfg
L() { timeout 120 "$LOOM" launch --local $CFG --workers 2 --ps 2 "$@"; }

# --- a worker lost -------------------------------------------------------------------
out=$(LOOM_TEST_PS_DIE=worker:1@3 L --model-dir "$WORK/wkill" 2>&1); st=$?
[ $st -eq 0 ] && pass "worker killed: the job completes" || fail "worker killed: the job completes" "status $st" "$(tail -8 <<<"$out")"
contains "worker killed: launch lets the job go on" "worker:1 exited with status 137: parameter_server goes on without it" "$out"
contains "worker killed: its step function is put back in the queue" "put back in the queue for another worker" "$out"
contains "worker killed: every step applied" "done: step 100" "$out"
# (each step 15 ms longer, so the job outlasts the restart of the worker: 300 steps)
out=$(LOOM_TEST_PS_STEP_MS=15 LOOM_TEST_PS_DIE=worker:1@3 LOOM_TEST_PS_DIE_MARK="$WORK/wmark" L --model-dir "$WORK/wback" \
      --restarts 1 --set run.epochs=3 2>&1); st=$?
[ $st -eq 0 ] && pass "worker killed and restarted: the job completes" || fail "worker killed and restarted: the job completes" "status $st" "$(tail -8 <<<"$out")"
contains "worker restarted alone" "starting it again alone (1 of 1), it rejoins" "$out"
contains "worker rejoins and takes step functions" "worker:1 rejoined" "$out"
contains "worker restarted: every step applied" "done: step 300" "$out"

# synchronous, 2 of 2, a worker lost for good: no step can complete; the coordinator says so and stops
out=$(LOOM_TEST_PS_DIE=worker:1@3 L --model-dir "$WORK/wsync" --set 'strategy.sync={replicas_to_aggregate=2;}' \
      --set cluster.connect_timeout=10 2>&1); st=$?
[ $st -ne 0 ] && pass "sync, a worker short for good: the job stops" || fail "sync, a worker short for good: the job stops" "status 0"
contains "sync, a worker short for good: says why" "only 1 worker left, fewer than replicas_to_aggregate = 2" "$out"

finish
