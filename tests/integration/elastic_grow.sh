#!/usr/bin/env bash
# elastic_grow.sh - strategy.elastic past the cluster's list (issue 25): a
# job listed with 2 workers and max_workers = 3 grows to 3: worker:2, in no
# list, starts with the same config (--task worker:2), listens on an
# ephemeral port it tells the chief in its request to join, and enters the
# running job at a step boundary; a scripted timeline is bit-reproducible (run
# 2's worker:2 from TF_CONFIG, its own address appended, gives run 1's bits) and
# the epoch visits each example once (metrics.jsonl records the join); one
# with another optimizer is refused, naming the line. Started with a longer
# list (its own address in it) it joins too: the list is not compared. Killed (-9), the
# two listed go on; a worker beyond max_workers is refused (status 2) and the
# job goes on. loom launch --local --elastic --workers 2 with --discover
# grows the job to 4 (worker:3 dials worker:2, both unlisted, where the chief
# says; the chief's /status lists both). Real processes on 127.0.0.1, bounded, killed at exit.
#   tests/integration/elastic_grow.sh build/loom
source "$(dirname "$0")/lib.sh"
kill_jobs_at_exit
CFG=tests/configs/mwm_mlp.cfg
OPTS=(--set run.epochs=1 --set run.checkpoint_steps=50 --set run.progress='"none"' --set cluster.heartbeat_timeout=2
      --set strategy.elastic.min_workers=2 --set strategy.elastic.max_workers=3)

# start NAME I ARGS...: worker:I of job NAME (the 2 addresses $ADDRS) into $WORK/NAME (log $WORK/NAME.I[.b...]); pid in PID
start() {
    local name=$1 i=$2 log="$WORK/$1.$2"
    shift 2
    while [ -e "$log" ]; do log+=".b"; done
    "$LOOM" train $CFG --task worker:$i --model-dir "$WORK/$name" --set "cluster.worker=[$ADDRS]" "${OPTS[@]}" "$@" \
        >"$log" 2>&1 &
    PID=$!
    PIDS+=($!)
}
# start_tf NAME I: as start, the cluster from TF_CONFIG: the listed workers and this one's own address appended
# (as a TFJob or StatefulSet scaled past the list gives it), the config's list dropped
start_tf() {
    local tfc="{\"cluster\": {\"worker\": [$ADDRS, \"127.0.0.1:$(free_ports 1)\"]}, \"task\": {\"type\": \"worker\", \"index\": $2}}"
    TF_CONFIG="$tfc" "$LOOM" train $CFG --model-dir "$WORK/$1" --set 'cluster.worker=[]' "${OPTS[@]}" >"$WORK/$1.$2" 2>&1 &
    PID=$!
    PIDS+=($!)
}
addrs() { local base; base=$(free_ports 2); ADDRS="\"127.0.0.1:$base\",\"127.0.0.1:$((base + 1))\""; }
# refuse_adam: (the job held at step 30 for worker:2) an unlisted worker:2 with another optimizer (adam): the
# worker list is left out of the compared config, the optimizer is not: the handshake refuses it, naming the
# first differing line, and the job goes on (run 1 then ends with run 2's bits)
refuse_adam() {
    sed 's/^optimizer: .*/optimizer: { type = "adam"; learning_rate = 0.001; };/' $CFG >"$WORK/adam.cfg"
    env -u LOOM_TEST_EXAMPLE_IDS -u LOOM_TEST_MEMBERSHIP "$LOOM" train "$WORK/adam.cfg" --task worker:2 \
        --model-dir "$WORK/adam" --set "cluster.worker=[$ADDRS]" "${OPTS[@]}" >"$WORK/adam.2" 2>&1 &
    PIDS+=($!)
    status "$!" 60
    if [ "$ST" != hung ] && [ "$ST" != 0 ] && grep -q "worker:0 was started with a different config: first difference at line [0-9]* of the resolved config: \`type = \"adam\";\` here, \`type = \"momentum\";\` there" "$WORK/adam.2"; then
        pass "an unlisted worker:2 with another optimizer is refused (status $ST), naming the optimizer's line"
    else fail "an unlisted worker:2 with another optimizer is refused, naming the optimizer's line" "status $ST" \
        "$(tail -3 "$WORK/adam.2")"; fi
}
wait_line() { local i; for ((i = 0; i < ${3:-60} * 20; i++)); do grep -qF -- "$2" "$1" 2>/dev/null && return 0; sleep 0.05; done; return 1; }

# ---- loom check names the unlisted slots and this task among them ---------------------------------------
addrs
out=$("$LOOM" check $CFG --task worker:2 --set "cluster.worker=[$ADDRS]" "${OPTS[@]}" 2>&1)
contains "loom check: the unlisted worker up to max_workers" \
    "worker:2: unlisted (strategy.elastic.max_workers = 3): joins from an ephemeral port  <- this task" "$out"
contains "loom check: the unlisted task's rank" "task: worker:2 from --task (--task worker:2), training rank 2, past the 2 listed" "$out"

# ---- an uninterrupted run of 3 listed workers: the epoch's examples ------------------------------
export LOOM_TEST_EXAMPLE_IDS="$WORK/ids_ref"
base=$(free_ports 3)
ADDRS="\"127.0.0.1:$base\",\"127.0.0.1:$((base + 1))\",\"127.0.0.1:$((base + 2))\""
for i in 0 1 2; do start ref $i; J[$i]=$PID; done
status "${J[0]}"; s0=$ST; status "${J[1]}"; s1=$ST; status "${J[2]}"; s2=$ST
[ "$s0$s1$s2" = 000 ] || fail "the uninterrupted run ends" "status $s0 / $s1 / $s2" "$(tail -3 "$WORK/ref.0")"

# ---- 2 listed; worker:2, unlisted, joins at step 30 (LOOM_TEST_MEMBERSHIP holds the job for it): twice ------
for k in 1 2; do
    export LOOM_TEST_EXAMPLE_IDS="$WORK/ids_grow$k" LOOM_TEST_MEMBERSHIP="join worker:2 at 30"
    addrs
    for i in 0 1; do start grow$k $i; J[$i]=$PID; done
    wait_line "$WORK/grow$k.0" "holding step 30 until worker:2 asks" 60
    if [ $k = 1 ]; then refuse_adam; start grow$k 2
    else start_tf grow$k 2; fi
    J[2]=$PID
    status "${J[0]}"; s0=$ST; status "${J[1]}"; s1=$ST; status "${J[2]}"; s2=$ST
    unset LOOM_TEST_MEMBERSHIP LOOM_TEST_EXAMPLE_IDS
    log=$(cat "$WORK/grow$k.0")
    if [ "$s0$s1$s2" = 000 ] && [ "$(newest "$WORK/grow$k")" = 100 ]; then
        pass "run $k: 2 listed; worker:2, unlisted, joins the running job; all three end at step 100"
    else fail "run $k: 2 listed, unlisted worker:2 joins; all end at step 100" "status $s0 / $s1 / $s2" \
        "$(tail -3 <<<"$log")" "$(tail -3 "$WORK/grow$k.2")"; fi
    contains "run $k: the chief records where the unlisted worker listens" \
        "worker:2 (not in the cluster's list) asks to join; it listens on 127.0.0.1:" "$log"
    contains "run $k: the chief logs the join" "worker:2 joined at step 30; continuing with 3 workers" "$log"
    [ $k = 1 ] && contains "run 1: the chief names the refused worker (another optimizer) and goes on" \
        "(claims to be worker:2): worker:2 was started with a different config: first difference at line" "$log"
    contains "run $k: the joiner says where it entered" "worker:2: admitted into the running job at step 30, with 3 workers" \
        "$(cat "$WORK/grow$k.2")"
done
contains "metrics.jsonl records the unlisted worker's join and the members" \
    '{"membership": "joined", "step": 30, "joined": "worker:2", "workers": 3, "members": ["worker:0", "worker:1", "worker:2"]}' \
    "$(grep '"membership"' "$WORK/grow1/metrics.jsonl")"
contains "run 2: worker:2 takes its task and the 3 workers from TF_CONFIG" "cluster task worker:2 (TF_CONFIG task), training rank 2 of 3" \
    "$(cat "$WORK/grow2.2")"
same_weights "two runs of the same growth (worker:2 joins at step 30: unlisted by --task, then by TF_CONFIG) end with the same bits" \
    "$WORK/grow1/ckpt-100.loom" "$WORK/grow2/ckpt-100.loom"
exactly_once "exactly once: growing from 2 to 3 at step 30, the epoch trained on its 9600 examples, each once" "$WORK/ids_ref" "$WORK/ids_grow1" 9600
absent_then "worker:2 trained on none of steps 1-30 and its third of each batch after" "$WORK/ids_grow1.worker:2" 0 30 $((70 * 32))

# ---- worker:2 started with a longer list (its own address in it, as a scaled set's TF_CONFIG gives it):
# the list is not compared under strategy.elastic, it joins; killed (-9), the two listed go on; one beyond
# max_workers is refused ------------------------------------------------------------------------------
OPTS+=(--set 'hooks.callbacks=["../lua/mwm_slow.lua:slow"]')
addrs
for i in 0 1; do start kill $i; J[$i]=$PID; done
wait_file "$WORK/kill/ckpt-50.loom"
start kill 2 --set "cluster.worker=[$ADDRS,\"127.0.0.1:$(free_ports 1)\"]"
J[2]=$PID
wait_line "$WORK/kill.0" "worker:2 joined at step" 60
start kill 3
status "$PID" 30; s3=$ST
kill -9 "${J[2]}"
wait "${J[2]}" 2>/dev/null
status "${J[0]}"; s0=$ST; status "${J[1]}"; s1=$ST
log=$(cat "$WORK/kill.0")
jat=$(sed -n 's/.*worker:2 joined at step \([0-9]*\); continuing with 3 workers.*/\1/p' <<<"$log")
lat=$(sed -n 's/.*worker:2 left at step \([0-9]*\); continuing with 2 workers.*/\1/p' <<<"$log")
if [ "$s0$s1" = 00 ] && [ -n "$jat" ] && [ -n "$lat" ] && [ "$lat" -ge "$jat" ] && [ "$(newest "$WORK/kill")" = 100 ]; then
    pass "kill -9 the unlisted worker:2 (joined at step $jat, lost at $lat): worker:0 and worker:1 train to step 100"
else fail "kill -9 the unlisted worker:2: the listed two go on to step 100" "status $s0 / $s1, joined '$jat', left '$lat'" \
    "$(tail -3 <<<"$log")"; fi
contains "worker:2 lists 3 workers (itself among them)" "cluster task worker:2 (--task worker:2), training rank 2 of 3" \
    "$(cat "$WORK/kill.2")"
if [ "$s3" = 2 ]; then pass "worker:3, beyond max_workers = 3: refused (status 2)"
else fail "worker:3, beyond max_workers = 3: refused (status 2)" "status $s3" "$(tail -3 "$WORK/kill.3")"; fi
contains "worker:3 says why" "worker:3 is beyond strategy.elastic.max_workers = 3: the job may have worker:0 to worker:2" \
    "$(cat "$WORK/kill.3")"

# ---- loom launch --local --elastic --workers 2 with max_workers = 4: --discover printing 3 slots starts
# worker:2 (unlisted), then 4 slots worker:3, which enters the running job and dials worker:2 where the chief
# says it listens ------------------------------------------------------------------------------------------
printf 'localhost:3\n' >"$WORK/hosts"
export LOOM_TEST_EXAMPLE_IDS="$WORK/ids_launch"
SP=$(free_ports 1)
(timeout 240 "$LOOM" launch --local $CFG --workers 2 --grace 3 --elastic --discover "cat $WORK/hosts" \
    --discover-interval 0.5 "${OPTS[@]}" --set strategy.elastic.max_workers=4 --set run.status_port=$SP --model-dir "$WORK/launch" \
    >"$WORK/launch.out" 2>&1; echo $? >"$WORK/launch.rc") &
PIDS+=($!)
L=$!
wait_file "$WORK/launch/ckpt-50.loom"
printf 'localhost:4\n' >"$WORK/hosts"
# the chief's status endpoint lists the unlisted workers among the members once they join
if command -v curl >/dev/null; then
    st=""
    for ((i = 0; i < 600; i++)); do
        st=$(curl -s -m 2 "http://127.0.0.1:$SP/status" 2>/dev/null)
        grep -q '"task": "worker:3", "alive": true' <<<"$st" && break
        sleep 0.1
    done
    if grep -q '"task": "worker:2", "alive": true' <<<"$st" && grep -q '"task": "worker:3", "alive": true' <<<"$st"; then
        pass "launch --discover: the chief's /status lists the unlisted worker:2 and worker:3"
    else fail "launch --discover: the chief's /status lists the unlisted workers" "$(grep -o '"peers".*' <<<"$st" | head -c 300)"; fi
fi
status "$L" 240
unset LOOM_TEST_EXAMPLE_IDS
out=$(cat "$WORK/launch.out")
contains "launch --discover: starts worker:2 past --workers 2" \
    "[launch] --discover: starting worker:2, past the listed workers (strategy.elastic.max_workers = 4); it joins the running job" "$out"
contains "launch --discover: the chief records where the unlisted worker:2 listens" \
    "worker:2 (not in the cluster's list) asks to join; it listens on 127.0.0.1:" "$out"
jat=$(sed -n 's/.*worker:3 joined at step \([0-9]*\); continuing with 4 workers.*/\1/p' <<<"$out")
if [ -n "$jat" ] && [ "$jat" -ge 50 ] && grep -q "worker:3: worker:2 connected (127.0.0.1:" <<<"$out"; then
    pass "launch --discover: 4 slots later: worker:3 (unlisted) dials worker:2 (unlisted) and joins at step $jat"
else fail "launch --discover: worker:3 dials worker:2 and joins the running job" "joined at '$jat'" "$(tail -4 <<<"$out")"; fi
w2=$(cat "$WORK/ids_launch.worker:2" 2>/dev/null | wc -l) w3=$(cat "$WORK/ids_launch.worker:3" 2>/dev/null | wc -l)
if [ "$w2" -gt 0 ] && [ "$w3" -gt 0 ]; then pass "launch --discover: the unlisted workers trained ($w2 and $w3 examples)"
else fail "launch --discover: the unlisted workers train" "$w2 / $w3 examples" "$(tail -4 <<<"$out")"; fi
if [ "$(cat "$WORK/launch.rc" 2>/dev/null)" = 0 ] && [ "$(newest "$WORK/launch")" = 100 ]; then
    pass "launch --elastic --discover: the job trains to step 100 and launch exits 0"
else fail "launch --elastic --discover: the job trains to step 100 and launch exits 0" "status $(cat "$WORK/launch.rc" 2>/dev/null)" "$(tail -4 <<<"$out")"; fi

finish
