#!/usr/bin/env bash
# status_peers.sh - the status endpoint in a job across processes (issue 15):
# `loom launch --local --workers 2` with run.status_port set; only the chief
# (worker:0) serves it (the other task would otherwise fail on the port in
# use), and its /metrics and /status list worker:1 as a live peer with the
# time the chief's collectives waited on it. Every wait is bounded; every
# process this script starts is killed on exit.
source "$(dirname "$0")/lib.sh"
CFG=tests/configs/mwm_mlp.cfg
command -v curl >/dev/null || { echo "1..0 # SKIP curl not installed (loom.sh installs it)"; exit 0; }  # TAP skip
free_port() {
    local p
    for _ in $(seq 1 50); do
        p=$((20000 + RANDOM % 12000))
        (exec 3<>/dev/tcp/127.0.0.1/$p) 2>/dev/null || { echo $p; return; }
    done
    echo 0
}
PORT=$(free_port)
URL=http://127.0.0.1:$PORT
get() { curl -s -m 3 "$@"; }

timeout 60 "$LOOM" launch --local $CFG --workers 2 --model-dir "$WORK/job" --set run.status_port=$PORT \
    --set run.max_steps=2000 --set run.checkpoint_steps=0 --set 'hooks.callbacks=["../lua/mwm_slow.lua:slow"]' \
    >"$WORK/launch.out" 2>&1 &
lp=$!
trap 'kill_tree $lp; wait $lp 2>/dev/null; rm -rf "$WORK"' EXIT
m=""
for _ in $(seq 1 150); do # 15 s at most
    m=$(get $URL/metrics)
    grep -q '^loom_cluster_peer_up{task="worker:1"} 1$' <<<"$m" && break
    kill -0 $lp 2>/dev/null || break
    sleep 0.1
done
contains "the chief's /metrics: worker:1 is up" 'loom_cluster_peer_up{task="worker:1"} 1' "$m"
seen=$(sed -n 's/^loom_cluster_peer_last_seen_seconds{task="worker:1"} \(.*\)$/\1/p' <<<"$m")
if [ -n "$seen" ] && awk -v s="$seen" 'BEGIN { exit !(s >= 0 && s < 30) }'; then
    pass "worker:1 was heard within the heartbeat timeout ($seen s ago)"
else
    fail "worker:1 was heard within the heartbeat timeout" "last_seen '$seen'" "$(grep peer <<<"$m")"
fi
wait_s=$(sed -n 's/^loom_cluster_collective_wait_seconds_total{task="worker:1"} \(.*\)$/\1/p' <<<"$m")
if [ -n "$wait_s" ] && awk -v s="$wait_s" 'BEGIN { exit !(s >= 0) }'; then
    pass "the chief's collective wait on worker:1 is reported ($wait_s s)"
else
    fail "the chief's collective wait on worker:1 is reported" "'$wait_s'" "$(grep peer <<<"$m")"
fi
# a second look, a few steps later: the chief has waited on worker:1 at some step (each step ends in an all-reduce)
w2=""
for _ in $(seq 1 30); do # 3 s at most
    sleep 0.1
    w2=$(get $URL/metrics | sed -n 's/^loom_cluster_collective_wait_seconds_total{task="worker:1"} \(.*\)$/\1/p')
    [ -n "$w2" ] && awk -v s="$w2" 'BEGIN { exit !(s > 0) }' && break
done
if [ -n "$w2" ] && awk -v s="$w2" 'BEGIN { exit !(s > 0) }'; then
    pass "the chief's wait on worker:1 grows as the collectives run ($w2 s)"
else
    fail "the chief's wait on worker:1 grows as the collectives run" "'$w2'" "$(tail -3 "$WORK/launch.out")"
fi
bad=$(grep 'task="worker:0"' <<<"$m" | head -1)
[ -z "$bad" ] && pass "the chief does not list itself as a peer" || fail "the chief does not list itself" "$bad"
contains "/status lists the peer as alive" '"task": "worker:1", "alive": true' "$(get $URL/status)"
kill -0 $lp 2>/dev/null && pass "both tasks train with the same run.status_port (only the chief binds it)" ||
    fail "both tasks train with the same run.status_port" "$(tail -5 "$WORK/launch.out")"
n=$(grep -c "status endpoint: http" "$WORK/launch.out")
[ "$n" = 1 ] && pass "one status endpoint in the job" || fail "one status endpoint in the job" "$n lines" "$(grep status "$WORK/launch.out")"
finish
