#!/usr/bin/env bash
# elastic_join.sh - multi_worker_mirrored with strategy.elastic (issue 25): a
# new or restarted worker enters the running job at a step boundary (the chief
# admits it, the ring re-forms, it receives the variables, the optimizer slots
# and the trainer's state: step, epoch, data.train's position); a scripted
# timeline (LOOM_TEST_MEMBERSHIP="leave worker:2 at 40; join worker:2 at 70")
# is bit-reproducible and visits each example of the epoch once; a joiner with
# another config is refused by the handshake, one beyond max_workers by the
# chief, and the job goes on. Real processes on 127.0.0.1.
#   tests/integration/elastic_join.sh build/loom
source "$(dirname "$0")/lib.sh"
kill_jobs_at_exit
CFG=tests/configs/mwm_mlp.cfg
# (a checkpoint every 10 steps: the join at 70 comes after a checkpoint, a collective the joiner is not part of)
OPTS=(--set run.epochs=1 --set run.checkpoint_steps=10 --set run.progress='"none"' --set cluster.heartbeat_timeout=2
      --set strategy.elastic.min_workers=2)

# start NAME I ARGS...: worker:I of job NAME (ports $BASE...) into $WORK/NAME (log $WORK/NAME.I[.k]); its pid in PID
start() {
    local name=$1 i=$2 log="$WORK/$1.$2"
    shift 2
    while [ -e "$log" ]; do log+=".b"; done
    "$LOOM" train $CFG --task worker:$i --model-dir "$WORK/$name" --set "cluster.worker=[$ADDRS]" "${OPTS[@]}" "$@" \
        >"$log" 2>&1 &
    PID=$!
    PIDS+=($!)
}
# job NAME ARGS...: 3 workers; their pids in JOB[]
job() {
    local name=$1 i
    shift
    BASE=$(free_ports 3)
    ADDRS="\"127.0.0.1:$BASE\",\"127.0.0.1:$((BASE + 1))\",\"127.0.0.1:$((BASE + 2))\""
    for i in 0 1 2; do start "$name" $i "$@"; JOB[$i]=$PID; done
}

# ---- an uninterrupted run: the epoch's examples ---------------------------------------------
export LOOM_TEST_EXAMPLE_IDS="$WORK/ids_ref"
job ref
status "${JOB[0]}"; s0=$ST; status "${JOB[1]}"; s1=$ST; status "${JOB[2]}"; s2=$ST
[ "$s0$s1$s2" = 000 ] || fail "the uninterrupted run ends" "status $s0 / $s1 / $s2" "$(tail -3 "$WORK/ref.0")"

# ---- the scripted timeline: worker:2 leaves before step 41 and joins before step 71 -----------
export LOOM_TEST_MEMBERSHIP="leave worker:2 at 40; join worker:2 at 70"
for k in 1 2; do
    export LOOM_TEST_EXAMPLE_IDS="$WORK/ids_det$k"
    job det$k
    status "${JOB[2]}" 60; s2=$ST
    start det$k 2 # the same command again: it asks to join; the chief holds step 71 for it
    status "${JOB[0]}"; s0=$ST; status "${JOB[1]}"; s1=$ST; status "$PID"; s3=$ST
    log=$(cat "$WORK/det$k.0")
    if [ "$s2" = 137 ] && [ "$s0$s1$s3" = 000 ] && [ "$(newest "$WORK/det$k")" = 100 ]; then
        pass "timeline run $k: worker:2 leaves at step 40 (SIGKILL), started again it joins, all three end at step 100"
    else fail "timeline run $k: worker:2 leaves, joins again, all end at step 100" "status $s2, then $s0 / $s1 / $s3" \
        "$(tail -3 <<<"$log")" "$(tail -3 "$WORK/det$k.2.b")"; fi
    contains "timeline run $k: the chief logs the join" "worker:2 joined at step 70; continuing with 3 workers" "$log"
    contains "timeline run $k: the joiner says where it entered" "worker:2: admitted into the running job at step 70, with 3 workers" "$(cat "$WORK/det$k.2.b")"
done
unset LOOM_TEST_MEMBERSHIP LOOM_TEST_EXAMPLE_IDS
rec=$(grep '"membership"' "$WORK/det1/metrics.jsonl")
contains "timeline: metrics.jsonl records the leave" \
    '{"membership": "left", "step": 40, "left": "worker:2", "workers": 2, "members": ["worker:0", "worker:1"]}' "$rec"
contains "timeline: metrics.jsonl records the join" \
    '{"membership": "joined", "step": 70, "joined": "worker:2", "workers": 3, "members": ["worker:0", "worker:1", "worker:2"]}' "$rec"
same_weights "timeline: two runs of the same leave-and-join timeline end with the same bits" \
    "$WORK/det1/ckpt-100.loom" "$WORK/det2/ckpt-100.loom"
exactly_once "exactly once: with worker:2 gone for steps 41-70, the epoch trained on its 9600 examples, each once" "$WORK/ids_ref" "$WORK/ids_det1" 9600
absent_then "exactly once: worker:2 trained on none of steps 41-70 and its third of each batch after" "$WORK/ids_det1.worker:2" 40 70 $((30 * 32))

# ---- kill -9 and start again (no script): a joiner with another config is refused, the same config joins
OPTS=(--set run.epochs=1 --set run.checkpoint_steps=50 --set run.progress='"none"' --set cluster.heartbeat_timeout=2
      --set strategy.elastic.min_workers=2 --set 'hooks.callbacks=["../lua/mwm_slow.lua:slow"]')
job restart
wait_file "$WORK/restart/ckpt-50.loom"
kill -9 "${JOB[2]}"
wait "${JOB[2]}" 2>/dev/null
start restart 2 --set optimizer.learning_rate=0.5
status "$PID" 60; sx=$ST
if [ "$sx" != hung ] && [ "$sx" != 0 ] && grep -q "worker:0 was started with a different config" "$WORK/restart.2.b"; then
    pass "another config: the joiner stops with the handshake's message (status $sx)"
else fail "another config: the joiner stops with the handshake's message" "status $sx" "$(tail -3 "$WORK/restart.2.b")"; fi
start restart 2
J=$PID
status "${JOB[0]}"; s0=$ST; status "${JOB[1]}"; s1=$ST; status "$J"; s3=$ST
log=$(cat "$WORK/restart.0")
contains "another config: the chief names it and goes on" "(claims to be worker:2): worker:2 was started with a different config" "$log"
at=$(sed -n 's/.*worker:2 joined at step \([0-9]*\); continuing with 3 workers.*/\1/p' <<<"$log")
if [ "$s0$s1$s3" = 000 ] && [ -n "$at" ] && [ "$at" -gt 50 ] && [ "$(newest "$WORK/restart")" = 100 ]; then
    pass "kill -9 worker:2, started again: it joins at step $at, the three end at step 100"
else fail "kill -9 worker:2, started again: it joins, the three end at step 100" "status $s0 / $s1 / $s3, joined at '$at'" \
    "$(tail -3 <<<"$log")" "$(tail -3 "$WORK/restart.2.b.b")"; fi

# ---- below min_workers the job waits (strategy.elastic.wait_timeout) and goes on once a worker joins --
OPTS=(--set run.epochs=1 --set run.checkpoint_steps=50 --set run.progress='"none"' --set cluster.heartbeat_timeout=2
      --set strategy.elastic.min_workers=3 --set strategy.elastic.wait_timeout=60
      --set 'hooks.callbacks=["../lua/mwm_slow.lua:slow"]')
job wait
wait_file "$WORK/wait/ckpt-50.loom"
kill -9 "${JOB[2]}"
wait "${JOB[2]}" 2>/dev/null
for ((i = 0; i < 200; i++)); do grep -q "waiting up to 60 s" "$WORK/wait.0" && break; sleep 0.05; done
start wait 2
J=$PID
status "${JOB[0]}"; s0=$ST; status "${JOB[1]}"; s1=$ST; status "$J"; s3=$ST
log=$(cat "$WORK/wait.0")
at=$(sed -n 's/.*worker:2 left at step \([0-9]*\);.*/\1/p' <<<"$log" | head -1)
contains "below min_workers: the chief waits for workers" \
    "worker:2 left at step $at; 2 workers are left, fewer than strategy.elastic.min_workers = 3: waiting up to 60 s (strategy.elastic.wait_timeout) for workers to join" "$log"
jat=$(sed -n 's/.*worker:2 joined at step \([0-9]*\); continuing with 3 workers.*/\1/p' <<<"$log")
if [ "$s0$s1$s3" = 000 ] && [ -n "$jat" ] && [ -n "$at" ] && [ "$jat" -gt "$at" ] &&
   [ "$(newest "$WORK/wait")" = 100 ]; then
    pass "below min_workers: worker:2 started again joins at step $jat, the job trains to step 100"
else fail "below min_workers: worker:2 started again joins, the job trains to the end" "status $s0 / $s1 / $s3" \
    "$(tail -4 <<<"$log")"; fi

# ---- SIGTERM to a worker: it leaves at the next step boundary (exit 0), the others re-form at once ------
# (heartbeat_timeout = 60: only the leaver's closed connections can tell the chief within the 10 s allowed)
OPTS=(--set run.epochs=1 --set run.checkpoint_steps=50 --set run.progress='"none"' --set cluster.heartbeat_timeout=60
      --set strategy.elastic.min_workers=2 --set 'hooks.callbacks=["../lua/mwm_slow.lua:slow"]')
job leave
wait_file "$WORK/leave/ckpt-50.loom"
t0=$(date +%s.%N)
kill -TERM "${JOB[2]}"
status "${JOB[2]}" 30; s2=$ST
for ((i = 0; i < 200; i++)); do grep -q "worker:2 left at step" "$WORK/leave.0" && break; sleep 0.05; done
dt=$(printf %.2f "$(echo "$(date +%s.%N) - $t0" | bc)")
status "${JOB[0]}"; s0=$ST; status "${JOB[1]}"; s1=$ST
log=$(cat "$WORK/leave.0")
at=$(sed -n 's/.*worker:2 left at step \([0-9]*\); continuing with 2 workers.*/\1/p' <<<"$log")
if [ "$s2" = 0 ] && [ -n "$at" ] && [ "$(echo "$dt < 10" | bc)" = 1 ]; then
    pass "SIGTERM: worker:2 leaves at step $at (exit 0), the chief says so $dt s after the signal"
else fail "SIGTERM: worker:2 leaves (exit 0), the chief says so within 10 s" "status $s2, left at '$at', ${dt} s" \
    "$(tail -3 <<<"$log")" "$(tail -3 "$WORK/leave.2")"; fi
contains "SIGTERM: the leaver says why it goes" "worker:2: SIGTERM: leaving the job before step $((at + 1)) (strategy.elastic)" \
    "$(cat "$WORK/leave.2")"
if [ "$s0$s1" = 00 ] && [ "$(newest "$WORK/leave")" = 100 ]; then pass "SIGTERM: worker:0 and worker:1 train on to step 100"
else fail "SIGTERM: worker:0 and worker:1 train on to step 100" "status $s0 / $s1" "$(tail -3 <<<"$log")"; fi

# ---- max_workers: a task beyond it is refused politely, the job goes on ----------------------------
OPTS=(--set run.epochs=1 --set run.checkpoint_steps=100 --set run.progress='"none"' --set cluster.heartbeat_timeout=2
      --set strategy.elastic.min_workers=1 --set strategy.elastic.max_workers=2)
job max
status "${JOB[0]}"; s0=$ST; status "${JOB[1]}"; s1=$ST; status "${JOB[2]}" 30; s2=$ST
if [ "$s0$s1" = 00 ] && [ "$s2" = 2 ] && [ "$(newest "$WORK/max")" = 100 ]; then
    pass "max_workers = 2: worker:2 is refused (status 2), worker:0 and worker:1 train to the end"
else fail "max_workers = 2: worker:2 refused, the others train to the end" "status $s0 / $s1 / $s2" "$(tail -2 "$WORK/max.2")"; fi
contains "max_workers = 2: the refused worker says why" \
    "the chief refused this task's request to join the running job: the job starts with strategy.elastic.max_workers = 2 workers" \
    "$(cat "$WORK/max.2")"

# ---- loom launch --local --elastic --discover: a killed worker is started again and joins; discovery
# ends a worker and starts it again -------------------------------------------------------------------
# wait_line FILE TEXT [SECONDS]: until FILE holds TEXT (default 60 s)
wait_line() { local i; for ((i = 0; i < ${3:-60} * 20; i++)); do grep -qF -- "$2" "$1" 2>/dev/null && return 0; sleep 0.05; done; return 1; }
printf 'localhost:2\nlocalhost\n' >"$WORK/hosts"
OPTS=(--set run.epochs=2 --set run.checkpoint_steps=50 --set run.progress='"none"' --set cluster.heartbeat_timeout=2
      --set strategy.elastic.min_workers=1 --set 'hooks.callbacks=["../lua/mwm_slow.lua:slow"]')
(timeout 300 "$LOOM" launch --local $CFG --workers 3 --grace 3 --elastic --restarts 2 --discover "cat $WORK/hosts" \
    --discover-interval 0.5 "${OPTS[@]}" --model-dir "$WORK/launch" >"$WORK/launch.out" 2>&1; echo $? >"$WORK/launch.rc") &
PIDS+=($!)
L=$!
wait_file "$WORK/launch/ckpt-50.loom"
w=$(pgrep -f -- "--task worker:1 .*--model-dir $WORK/launch\$" | head -1)
[ -n "$w" ] && kill -9 "$w"
ok1=$(wait_line "$WORK/launch.out" "worker:1 joined at step" && echo y)
printf 'localhost:2\n' >"$WORK/hosts"
ok2=$(wait_line "$WORK/launch.out" "worker:2 left at step" && echo y)
printf 'localhost\nlocalhost\nlocalhost\n' >"$WORK/hosts"
ok3=$(wait_line "$WORK/launch.out" "worker:2 joined at step" && echo y)
status "$L" 240
out=$(cat "$WORK/launch.out")
contains "launch --elastic: a killed worker is started again alone" \
    "[launch] worker:1 was killed by signal 9: multi_worker_mirrored goes on without it; starting it again alone (1 of 2), it joins" "$out"
if [ "$ok1" = y ]; then pass "launch --elastic: worker:1 joins the running job"
else fail "launch --elastic: worker:1 joins the running job" "$(tail -4 <<<"$out")"; fi
contains "launch --discover: 2 workers wanted: launch ends worker:2 with SIGTERM" \
    "[launch] --discover: ending worker:2 (SIGTERM, SIGKILL after 3 s); it leaves the running job" "$out"
contains "launch --discover: worker:2 leaves gracefully (exit 0)" "[launch] worker:2 left the running job (exit 0)" "$out"
if [ "$ok2" = y ] && [ "$ok3" = y ]; then pass "launch --discover: worker:2 leaves, then (3 wanted) is started again and joins"
else fail "launch --discover: worker:2 leaves, then is started again and joins" "left '$ok2', joined '$ok3'" "$(tail -4 <<<"$out")"; fi
if [ "$(cat "$WORK/launch.rc" 2>/dev/null)" = 0 ] && [ "$(newest "$WORK/launch")" = 200 ]; then
    pass "launch --elastic --discover: the job trains to step 200 and launch exits 0"
else fail "launch --elastic --discover: the job trains to step 200 and launch exits 0" "status $(cat "$WORK/launch.rc" 2>/dev/null)" "$(tail -4 <<<"$out")"; fi
out=$("$LOOM" launch --local $CFG --workers 2 --elastic 2>&1); rc=$?
if [ $rc = 2 ] && grep -q "launch --elastic needs strategy.elastic" <<<"$out"; then pass "launch --elastic without strategy.elastic: refused (status 2)"
else fail "launch --elastic without strategy.elastic: refused (status 2)" "status $rc" "$(tail -2 <<<"$out")"; fi

finish
