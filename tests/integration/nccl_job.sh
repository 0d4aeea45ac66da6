#!/usr/bin/env bash
# nccl_job.sh - strategy.communication = "nccl" across processes, the part
# that runs without a GPU: `launch --local --workers 2` with the nccl plugin;
# the chief creates the job's NCCL unique id and Loom's cluster transport
# carries it to the other task (both log the same fingerprint of it); then
# every task finds it has no GPU, and the job stops at once, both tasks
# naming every task without one, before ncclCommInitRank could wait for a
# rank that never comes; nothing is trained. It does NOT show that training
# on GPUs works: with a usable GPU it skips (77), as without the nccl plugin.
source "$(dirname "$0")/lib.sh"
CFG=tests/configs/mwm_mlp.cfg
PLUGIN="$(dirname "$LOOM")/plugins/nccl.so"
if [ ! -f "$PLUGIN" ]; then
    echo "1..0 # SKIP the nccl plugin is not built (it needs the CUDA toolkit and NCCL)"
    exit 0 # a TAP skip (meson counts 77 under tap as an error)
fi
if "$LOOM" devices 2>&1 | grep -qE '^ +gpu:[0-9]+ '; then
    echo "1..0 # SKIP a GPU is present: this test covers the path without one"
    exit 77
fi
PID=""
cleanup() {
    local c
    if [ -n "$PID" ]; then for c in $(pgrep -P "$PID"); do kill -9 "$c" 2>/dev/null; done; kill -9 "$PID" 2>/dev/null; fi
    rm -rf "$WORK"
}
trap cleanup EXIT

(timeout -k 5 60 "$LOOM" launch --local $CFG --workers 2 --model-dir "$WORK/job" --set run.max_steps=20 \
    --set strategy.communication=nccl >"$WORK/out" 2>&1; echo $? >"$WORK/rc") &
PID=$!
SECONDS=0
wait "$PID"
took=$SECONDS
out=$(cat "$WORK/out")
rc=$(cat "$WORK/rc")
[ "$rc" = 1 ] && pass "the job fails (exit 1)" || fail "the job fails (exit 1)" "exit status $rc" "$(tail -5 "$WORK/out")"
[ "$took" -lt 45 ] && pass "... at once (${took} s), not waiting inside NCCL" || fail "... at once" "${took} s"
sent=$(grep -o "worker:0 created the job's unique id (fingerprint [0-9a-f]*) and sent it to 1 task" <<<"$out" | grep -o '[0-9a-f]\{8\}')
got=$(grep -o "worker:1 received the job's unique id from the chief (fingerprint [0-9a-f]*)" <<<"$out" | grep -o '[0-9a-f]\{8\}')
if [ -n "$sent" ] && [ "$sent" = "$got" ]; then
    pass "the chief's unique id reaches worker:1 over the cluster transport (fingerprint $sent)"
else
    fail "the chief's unique id reaches worker:1 over the cluster transport" "sent '$sent', received '$got'" \
        "$(grep -i nccl <<<"$out" | head -4)"
fi
# The first task to report makes launch stop the other, which may be gone
# before it prints: at least one task reports, and every report names both.
reports=$(grep "^\[worker:[01]\] loom: --set strategy.communication: nccl: no usable GPU" <<<"$out")
[ -n "$reports" ] && pass "a task reports the tasks without a GPU ($(grep -c . <<<"$reports") of 2 reported before launch stopped the job)" ||
    fail "a task reports the tasks without a GPU" "$(tail -5 "$WORK/out")"
if [ -n "$reports" ] && ! grep -v "no usable GPU on worker:0 (no CUDA device.*; worker:1 (no CUDA device" <<<"$reports" | grep -q .; then
    pass "... and every report names both tasks"
else
    fail "... and every report names both tasks" "$reports"
fi
contains "... with what to do" 'use communication = "ring"' "$out"
if grep -q "NCCL rank" <<<"$out"; then fail "no task enters ncclCommInitRank" "$(grep "NCCL rank" <<<"$out")"; else pass "no task enters ncclCommInitRank"; fi
[ -z "$(ls "$WORK/job" 2>/dev/null | grep ckpt)" ] && pass "nothing is trained" || fail "nothing is trained" "$(ls "$WORK/job")"
finish
