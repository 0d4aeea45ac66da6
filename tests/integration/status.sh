#!/usr/bin/env bash
# status.sh - the status endpoint (run.status_port / --status-port) scraped
# during a real training run: /metrics in Prometheus' text format with the
# step rising between scrapes, /healthz, /status as JSON, malformed requests
# that never disturb training, a port in use refused before training, a bad
# run.status_bind refused at load. Every wait is bounded.
source "$(dirname "$0")/lib.sh"
CFG=configs/fashion_mnist_mlp.cfg
command -v curl >/dev/null || { echo "1..0 # SKIP curl not installed (loom.sh installs it)"; exit 0; }  # TAP skip
# a port nobody listens on (connect refused), from a range the kernel does not hand out by default
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
get() { curl -s -m 5 "$@"; }
raw() { # raw BYTES: sends them on a fresh connection, reads what comes back for at most 2 s
    timeout 3 bash -c 'exec 3<>/dev/tcp/127.0.0.1/'$PORT'; printf "%b" "$1" >&3; timeout 2 cat <&3' _ "$1" 2>/dev/null
}

"$LOOM" train $CFG --model-dir "$WORK/run" --status-port $PORT --set run.epochs=1000 --set run.progress='"none"' \
    >"$WORK/train.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null; rm -rf "$WORK"' EXIT
up=0
for _ in $(seq 1 200); do # 20 s at most
    [ "$(get -o /dev/null -w '%{http_code}' $URL/healthz)" = 200 ] && { up=1; break; }
    kill -0 $pid 2>/dev/null || break
    sleep 0.1
done
[ $up = 1 ] && pass "/healthz answers 200 while training" || fail "/healthz answers 200 while training" "$(tail -3 "$WORK/train.log")"
contains "the log names the endpoint" "status endpoint: http://127.0.0.1:$PORT/metrics" "$(cat "$WORK/train.log")"
contains "/healthz says ok" "ok" "$(get $URL/healthz)"

m1=$(get $URL/metrics)
s1=$(sed -n 's/^loom_step \([0-9]*\)$/\1/p' <<<"$m1")
contains "/metrics: typed families" "# TYPE loom_step counter" "$m1"
contains "/metrics: loss" "loom_train_loss " "$m1"
contains "/metrics: samples/s" "loom_samples_per_second " "$m1"
contains "/metrics: input wait" "loom_input_wait_fraction " "$m1"
contains "/metrics: per-stage pipeline figures" 'loom_pipeline_stage_elements_total{index="0",stage="catalog(fashion_mnist)"}' "$m1"
# with a core per step thread, the MLP's batches are gathered on them inside loom_iter_next (the prefetch inline)
pf="prefetch(auto)"; [ "$(nproc)" -ge 2 ] && pf="prefetch(inline)"
contains "/metrics: the prefetch stage's buffer" "loom_pipeline_stage_buffered{index=\"4\",stage=\"$pf\"}" "$m1"
contains "/metrics: the cluster peers' family (empty in one process)" "# TYPE loom_cluster_peer_up gauge" "$m1"
bad=$(grep -v '^#' <<<"$m1" | grep -Ev '^[a-z_]+(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? (-?[0-9.e+-]+|NaN)$' | head -3)
[ -z "$bad" ] && pass "/metrics: every sample line is Prometheus text format" || fail "/metrics: sample lines" "$bad"
ctype=$(get -o /dev/null -w '%{content_type}' $URL/metrics)
contains "/metrics: Prometheus' content type" "text/plain; version=0.0.4" "$ctype"

# HEAD: the headers GET would send (Content-Length included), no body; curl reuses the connection
h=$(curl -s -m 5 -I $URL/status -I $URL/healthz -w 'conns=%{num_connects}\n')
contains "HEAD /status: JSON's headers" "Content-Type: application/json" "$h"
[ "$(grep -c '^Content-Length: [1-9]' <<<"$h")" = 2 ] && pass "HEAD /status, /healthz: Content-Length of the GET" ||
    fail "HEAD: Content-Length" "$h"
grep -q '^ok$\|"state"' <<<"$h" && fail "HEAD sends no body" "$h" || pass "HEAD sends no body"
contains "HEAD twice on one keep-alive connection" "conns=0" "$h"

# malformed and hostile requests, while training runs
raw 'GARBAGE\r\n\r\n' >/dev/null
raw '\x00\xff\xfe\x01binary\r\n\r\n' >/dev/null
raw "GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: $(head -c 20000 /dev/zero | tr '\0' a)\r\n\r\n" >/dev/null
raw 'GET /%00%ff%2e%2e/../healthz HTTP/1.1\r\nHost: x\r\n\r\n' >/dev/null
raw 'GET /metrics HTTP/1.1\r\nContent-Length: -5\r\n\r\n' >/dev/null
raw 'GET /metri' >/dev/null  # cut short, then closed
raw 'GET /metrics HTTP/9.9\r\n\r\n' >/dev/null
out=$(raw 'POST /metrics HTTP/1.1\r\nHost: x\r\n\r\n')
raw 'POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\nabcd' >/dev/null  # a body: 413
contains "POST is refused (evhttp: 501 Not Implemented)" "HTTP/1.1 501" "$out"
out=$(raw 'GET /nope HTTP/1.0\r\n\r\n')
contains "an unknown path is 404" "404" "$out"
for _ in $(seq 1 20); do get -o /dev/null $URL/status & done; wait_ok=0
sleep 1
kill -0 $pid 2>/dev/null && pass "training survives malformed requests and 20 concurrent scrapes" ||
    fail "training survives malformed requests" "$(tail -5 "$WORK/train.log")"

j=$(get $URL/status)
contains "/status: JSON with the state" '{"state": "training"' "$j"
contains "/status: the pipeline's stages" '"pipeline": [{"stage": "catalog(fashion_mnist)"' "$j"
if command -v python3 >/dev/null; then
    python3 -c 'import json,sys; d=json.loads(sys.argv[1]); assert d["step"] > 0 and d["state"] == "training"' "$j" &&
        pass "/status parses as JSON" || fail "/status parses as JSON" "$j"
fi
m2=$(get $URL/metrics)
s2=$(sed -n 's/^loom_step \([0-9]*\)$/\1/p' <<<"$m2")
[ -n "$s1" ] && [ -n "$s2" ] && [ "$s2" -gt "$s1" ] && pass "the step rises between scrapes ($s1 -> $s2)" ||
    fail "the step rises between scrapes" "$s1 -> $s2"

# a port in use: refused before training, nothing written
expect_fail 1 "a port in use: a clear error before training" "bind(127.0.0.1:$PORT) failed: Address already in use" \
    "$LOOM" train $CFG --model-dir "$WORK/second" --set run.status_port=$PORT --set run.max_steps=5
[ ! -e "$WORK/second" ] && pass "a port in use: the model directory is not created" || fail "a port in use: nothing written"

kill -TERM $pid
st=0
for _ in $(seq 1 100); do kill -0 $pid 2>/dev/null || break; sleep 0.1; done
wait $pid; st=$?
contains "SIGTERM still saves a checkpoint and stops" "interrupted by signal 15" "$(cat "$WORK/train.log")"
[ $st -eq 143 ] && pass "SIGTERM: exit status 143 (128 + 15)" || fail "SIGTERM: exit status 143 (128 + 15)" "status $st"
code=$(get -o /dev/null -w '%{http_code}' $URL/healthz)
[ "$code" = 000 ] && pass "the endpoint closes with the run" || fail "the endpoint closes with the run" "HTTP $code"

expect_fail 2 "run.status_bind must be an address literal, with file:line" \
    'run.status_bind: "localhost" is not an IPv4 or IPv6 address' \
    "$LOOM" check $CFG --set run.status_bind='"localhost"'
expect_fail 2 "--status-port out of range" "--status-port expects a port in [1, 65535]" \
    "$LOOM" train $CFG --status-port 70000
expect_fail 2 "--status-port is a train option" "does not apply" "$LOOM" evaluate $CFG --status-port 1234
finish
