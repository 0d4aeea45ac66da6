#!/usr/bin/env bash
# elastic.sh - multi_worker_mirrored with strategy.elastic (issue 25): a worker
# of a 3-worker job killed -9, or stopped past cluster.heartbeat_timeout, is
# dropped at the next step boundary and the others go on to the end without a
# restart or a rollback (the chief logs it, metrics.jsonl records it); below
# min_workers the job stops with a checkpoint. Real processes on 127.0.0.1.
#   tests/integration/elastic.sh build/loom
source "$(dirname "$0")/lib.sh"
kill_jobs_at_exit
CFG=tests/configs/mwm_mlp.cfg
# 2 epochs of 100 steps, each about 15 ms of CPU (the slow callback), a checkpoint every 50
OPTS=(--set run.epochs=2 --set run.checkpoint_steps=50 --set run.progress='"none"' --set cluster.heartbeat_timeout=2
      --set 'hooks.callbacks=["../lua/mwm_slow.lua:slow"]')

# job NAME N ARGS...: N workers training into $WORK/NAME (logs $WORK/NAME.I); their pids in JOB[]
job() {
    local name=$1 n=$2 i base addrs=""
    shift 2
    base=$(free_ports "$n")
    for ((i = 0; i < n; i++)); do addrs+="${addrs:+,}\"127.0.0.1:$((base + i))\""; done
    for ((i = 0; i < n; i++)); do
        "$LOOM" train $CFG --task worker:$i --model-dir "$WORK/$name" --set "cluster.worker=[$addrs]" "${OPTS[@]}" "$@" \
            >"$WORK/$name.$i" 2>&1 &
        JOB[$i]=$!
        PIDS+=($!)
    done
}
accuracy() { sed -n 's/.*done: step [0-9]*, eval accuracy \([0-9.]*\).*/\1/p' "$1"; }

# ---- kill -9 of the last worker: the other two go on to the end ---------------------------
job kill 3 --set strategy.elastic.min_workers=2
wait_file "$WORK/kill/ckpt-50.loom"
kill -9 "${JOB[2]}"
wait "${JOB[2]}" 2>/dev/null # (no "Killed" notice)
status "${JOB[0]}"; s0=$ST; status "${JOB[1]}"; s1=$ST
log=$(cat "$WORK/kill.0")
if [ "$s0" = 0 ] && [ "$s1" = 0 ] && [ "$(newest "$WORK/kill")" = 200 ]; then
    pass "kill -9 worker:2: worker:0 and worker:1 train on to step 200 and exit 0"
else fail "kill -9 worker:2: worker:0 and worker:1 train on to step 200 and exit 0" "status $s0 / $s1, newest $(newest "$WORK/kill")" "$(tail -4 <<<"$log")"; fi
if grep -qE "worker:2 left at step [0-9]+; continuing with 2 workers" <<<"$log"; then pass "kill -9: the chief logs who left, when, and how many go on"
else fail "kill -9: the chief logs who left, when, and how many go on" "$(tail -4 <<<"$log")"; fi
at=$(sed -n 's/.*worker:2 left at step \([0-9]*\);.*/\1/p' <<<"$log")
if [ -n "$at" ] && [ "$at" -ge 50 ] && [ "$at" -lt 200 ]; then pass "kill -9: dropped at step $at, after the checkpoint it was killed at"
else fail "kill -9: dropped after the checkpoint it was killed at" "step '$at'"; fi
rec=$(grep '"membership"' "$WORK/kill/metrics.jsonl")
contains "kill -9: metrics.jsonl records the change and the members" \
    "\"left\": \"worker:2\", \"workers\": 2, \"members\": [\"worker:0\", \"worker:1\"]" "$rec"
if ! grep -qiE "restor|resum|restart" "$WORK/kill.0" "$WORK/kill.1"; then pass "kill -9: no rollback to a checkpoint, no restart"
else fail "kill -9: no rollback to a checkpoint, no restart" "$(grep -hiE "restor|resum|restart" "$WORK/kill.0" "$WORK/kill.1" | head -3)"; fi
acc=$(accuracy "$WORK/kill.0")
if awk -v a="$acc" 'BEGIN { exit !(a >= 0.75) }'; then pass "kill -9: the survivors still learn (eval accuracy $acc)"
else fail "kill -9: the survivors still learn" "eval accuracy '$acc'"; fi

# ---- worker:1 (the ring's middle) stopped past heartbeat_timeout: 0 and 2 close the ring ---
job stop 3 --set strategy.elastic.min_workers=2
wait_file "$WORK/stop/ckpt-50.loom"
kill -STOP "${JOB[1]}"
status "${JOB[0]}"; s0=$ST; status "${JOB[2]}"; s2=$ST
log=$(cat "$WORK/stop.0")
if [ "$s0" = 0 ] && [ "$s2" = 0 ] && [ "$(newest "$WORK/stop")" = 200 ]; then
    pass "SIGSTOP worker:1: worker:0 and worker:2 re-form the ring and train on to step 200"
else fail "SIGSTOP worker:1: worker:0 and worker:2 re-form the ring and train on to step 200" "status $s0 / $s2" "$(tail -4 <<<"$log")" "$(tail -3 "$WORK/stop.2")"; fi
contains "SIGSTOP worker:1: the chief drops it" "worker:1 left at step" "$log"
# woken after the job ended, the dropped worker stops with an error instead of waiting forever
kill -CONT "${JOB[1]}"
status "${JOB[1]}" 30; s1=$ST
if [ "$s1" != hung ] && [ "$s1" != 0 ]; then pass "SIGSTOP worker:1: woken after the end, it stops with an error (status $s1)"
else fail "SIGSTOP worker:1: woken after the end, it stops with an error" "status $s1" "$(tail -3 "$WORK/stop.1")"; fi

# ---- below min_workers: the job stops with a checkpoint -----------------------------------
job min 3 --set strategy.elastic.min_workers=3 --set strategy.elastic.wait_timeout=0
wait_file "$WORK/min/ckpt-50.loom"
kill -9 "${JOB[2]}"
wait "${JOB[2]}" 2>/dev/null # (no "Killed" notice)
status "${JOB[0]}"; s0=$ST; status "${JOB[1]}"; s1=$ST
log=$(cat "$WORK/min.0")
at=$(sed -n 's/.*worker:2 left at step \([0-9]*\);.*/\1/p' <<<"$log")
contains "below min_workers: the chief says it stops" "worker:2 left at step $at; 2 workers are left, fewer than strategy.elastic.min_workers = 3: the job stops with a checkpoint" "$log"
last=$(newest "$WORK/min")
if [ "$s0" != hung ] && [ "$s1" != hung ] && [ -n "$at" ] && [ -n "$last" ] && [ "$last" -gt 50 ] && [ "$last" -le $((at + 1)) ]; then
    pass "below min_workers: both stop at once with a checkpoint of step $last (status $s0 / $s1)"
else fail "below min_workers: both stop at once with a checkpoint" "status $s0 / $s1, left at '$at', newest $last" "$(tail -3 <<<"$log")"; fi

# ---- the chief lost: the others stop at once, saying the job needs its chief -------------------
job chief 3 --set strategy.elastic.min_workers=2
wait_file "$WORK/chief/ckpt-50.loom"
kill -9 "${JOB[0]}"
wait "${JOB[0]}" 2>/dev/null
status "${JOB[1]}" 60; s1=$ST; status "${JOB[2]}" 60; s2=$ST
out=$(cat "$WORK/chief.1" "$WORK/chief.2")
n=$(grep -c "the chief (worker:0) was lost while the job re-formed after a lost worker" <<<"$out")
if [ "$s1" = 1 ] && [ "$s2" = 1 ] && [ "$n" = 2 ]; then pass "chief killed: worker:1 and worker:2 stop at once naming the lost chief"
else fail "chief killed: worker:1 and worker:2 stop at once naming the lost chief" "status $s1 / $s2" "$(tail -2 <<<"$out")"; fi

# ---- a scripted timeline (LOOM_TEST_MEMBERSHIP) gives the same bits every time ---------------
SLOW=("${OPTS[@]}")
OPTS=(--set run.epochs=3 --set run.checkpoint_steps=100 --set run.progress='"none"' --set cluster.heartbeat_timeout=2
      --set strategy.elastic.min_workers=2)
export LOOM_TEST_MEMBERSHIP="leave worker:2 at 150"
for k in 1 2; do
    job det$k 3
    status "${JOB[0]}"; s0=$ST; status "${JOB[1]}"; s1=$ST; status "${JOB[2]}" 30; s2=$ST
    if [ "$s0" = 0 ] && [ "$s1" = 0 ] && [ "$s2" = 137 ] && grep -q "worker:2 left at step 150; continuing with 2 workers" "$WORK/det$k.0"; then
        pass "timeline run $k: worker:2 leaves before step 151 (SIGKILL), the others finish"
    else fail "timeline run $k: worker:2 leaves before step 151, the others finish" "status $s0 / $s1 / $s2" "$(tail -3 "$WORK/det$k.0")"; fi
done
unset LOOM_TEST_MEMBERSHIP
same_weights "timeline: two runs of the same membership timeline end with the same bits" "$WORK/det1/ckpt-300.loom" "$WORK/det2/ckpt-300.loom"
OPTS=("${SLOW[@]}")

# ---- exactly once: every worker reads the global batch and trains on its member's slice, so an
# epoch's examples are each used once whatever the membership (LOOM_TEST_EXAMPLE_IDS: each
# worker writes "step crc" per example it trained on)
OPTS=(--set run.epochs=1 --set run.checkpoint_steps=100 --set run.progress='"none"' --set cluster.heartbeat_timeout=2
      --set strategy.elastic.min_workers=2)
for k in ref left; do
    export LOOM_TEST_EXAMPLE_IDS="$WORK/ids_$k"
    [ $k = left ] && export LOOM_TEST_MEMBERSHIP="leave worker:2 at 40"
    job ids_$k 3
    status "${JOB[0]}"; s0=$ST; status "${JOB[1]}"; s1=$ST; status "${JOB[2]}" 30
    [ "$s0" = 0 ] && [ "$s1" = 0 ] || fail "exactly once ($k): the job ends" "status $s0 / $s1" "$(tail -3 "$WORK/ids_$k.0")"
done
unset LOOM_TEST_EXAMPLE_IDS LOOM_TEST_MEMBERSHIP
OPTS=("${SLOW[@]}")
ref=$(cat "$WORK"/ids_ref.worker:* | awk '{print $2}' | sort) left=$(cat "$WORK"/ids_left.worker:* | awk '{print $2}' | sort)
n=$(grep -c . <<<"$left")
if [ "$n" = 9600 ] && [ "$ref" = "$left" ]; then
    pass "exactly once: worker:2 left at step 40, the epoch still trained on its 9600 examples, each once (the multiset of an uninterrupted run)"
else fail "exactly once: the epoch's multiset with worker:2 leaving at step 40 = an uninterrupted run's" "$n examples" \
    "$(diff <(echo "$ref") <(echo "$left") | head -3)"; fi
after=$(awk '$1 > 40' "$WORK/ids_left.worker:0" "$WORK/ids_left.worker:1" | wc -l) late=$(awk '$1 > 40' "$WORK/ids_left.worker:2" | wc -l)
if [ "$after" = $((60 * 96)) ] && [ "$late" = 0 ]; then pass "exactly once: after it left, worker:0 and worker:1 share the whole global batch (96 a step)"
else fail "exactly once: after it left, worker:0 and worker:1 share the whole global batch" "$after examples after step 40 on 0 and 1, $late on worker:2"; fi

# ---- under loom launch --local: launch does not stop the job for a lost worker --------------
SP=$(free_ports 1)
(timeout 200 "$LOOM" launch --local $CFG --workers 3 --grace 3 "${OPTS[@]}" --set strategy.elastic.min_workers=2 \
    --set run.status_port=$SP --model-dir "$WORK/launch" >"$WORK/launch.out" 2>&1; echo $? >"$WORK/launch.rc") &
PIDS+=($!)
L=$!
wait_file "$WORK/launch/ckpt-50.loom"
w=$(pgrep -f -- "--task worker:2 .*--model-dir $WORK/launch\$" | head -1)
[ -n "$w" ] && kill -9 "$w"
# the chief's status endpoint lists the members: worker:2 leaves the list, worker:1 stays
st=""
for ((i = 0; i < 200; i++)); do
    st=$(curl -s -m 2 "http://127.0.0.1:$SP/status" 2>/dev/null)
    grep -q '"task": "worker:1"' <<<"$st" && ! grep -q '"task": "worker:2"' <<<"$st" && break
    sleep 0.1
done
if command -v curl >/dev/null; then
    if grep -q '"task": "worker:1", "alive": true' <<<"$st" && ! grep -q '"task": "worker:2"' <<<"$st"; then
        pass "launch --local: the chief's /status lists the members (worker:1; worker:2 gone)"
    else fail "launch --local: the chief's /status lists the members" "$(grep -o '"peers".*' <<<"$st" | head -c 300)"; fi
fi
status "$L" 200
out=$(cat "$WORK/launch.out")
if [ -n "$w" ] && [ "$(cat "$WORK/launch.rc" 2>/dev/null)" = 0 ] && [ "$(newest "$WORK/launch")" = 200 ]; then
    pass "launch --local: worker:2 killed, the job trains on to step 200 and launch exits 0"
else fail "launch --local: worker:2 killed, the job trains on to step 200 and launch exits 0" "pid '$w', status $(cat "$WORK/launch.rc" 2>/dev/null)" "$(tail -4 <<<"$out")"; fi
contains "launch --local: launch says the job goes on without it" \
    "[launch] worker:2 was killed by signal 9: multi_worker_mirrored goes on without it (strategy.elastic)" "$out"
contains "launch --local: the chief says who left" "worker:2 left at step" "$out"

finish
