#!/usr/bin/env bash
# flood.sh - a connection flood against a running job (issue 22): two
# multi_worker_mirrored workers under `ulimit -n 256`, and a client that
# holds 300 idle connections to the chief's cluster port and 300 to its
# status endpoint (opening again each one the server closes) until the job
# ends. The job checkpoints and exits 0 all the same (the bounds on pending
# handshakes and status connections leave the descriptors to checkpoints),
# and every warning the flood causes is rate limited: at most about one a
# second per kind (5 at once for the per-address lines). HEAD on the status
# endpoint sends headers only and keeps the connection usable. Every wait is
# bounded; every process this script starts is killed on exit.
source "$(dirname "$0")/lib.sh"
CFG=tests/configs/mwm_mlp.cfg
command -v python3 >/dev/null || { echo "1..0 # SKIP python3 not installed"; exit 0; }  # TAP skip
command -v curl >/dev/null || { echo "1..0 # SKIP curl not installed (loom.sh installs it)"; exit 0; }  # TAP skip
kill_jobs_at_exit

base=$(free_ports 3)
WS="cluster.worker=[\"127.0.0.1:$base\",\"127.0.0.1:$((base + 1))\"]"
SPORT=$((base + 2))
# steps of 30 ms of CPU: 100 steps outlast the flood's start on a loaded machine
SLOW='hooks.callbacks=({ fn = "../lua/mwm_slow.lua:slow"; args = { seconds = 0.03; }; })'
for i in 0 1; do
    (ulimit -n 256; timeout 90 "$LOOM" train $CFG --task worker:$i --model-dir "$WORK/job" --set "$WS" \
        --set run.max_steps=100 --set run.checkpoint_steps=10 --set run.eval_steps=1 --set run.status_port=$SPORT \
        --set "$SLOW" >"$WORK/w$i.log" 2>&1; echo $? >"$WORK/w$i.rc") &
    PIDS+=($!)
done
up=0
for _ in $(seq 1 300); do # 30 s at most
    [ "$(curl -s -m 2 -o /dev/null -w '%{http_code}' http://127.0.0.1:$SPORT/healthz)" = 200 ] && { up=1; break; }
    [ -e "$WORK/w0.rc" ] && break
    sleep 0.1
done
[ $up = 1 ] && pass "the chief trains and serves /healthz under ulimit -n 256" ||
    fail "the chief trains under ulimit -n 256" "$(tail -3 "$WORK/w0.log")"

# ---- HEAD: headers only, the connection stays usable ---------------------------------
h=$(curl -s -m 5 -I http://127.0.0.1:$SPORT/metrics)
contains "curl -I /metrics: 200 with the content type" "text/plain; version=0.0.4" "$h"
len=$(tr -d '\r' <<<"$h" | sed -n 's/^Content-Length: //p')
[ -n "$len" ] && [ "$len" -gt 100 ] && pass "HEAD /metrics: the length GET would send ($len)" ||
    fail "HEAD /metrics: Content-Length" "$h"
ka=$(timeout 5 python3 - "$SPORT" <<'EOF'
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=4)
s.sendall(b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
data = b""
while b"\r\n\r\n" not in data:
    data += s.recv(4096)
head, rest = data.split(b"\r\n\r\n", 1)
# the HEAD answer ends with its headers; the next bytes are the GET's status line
s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
s.settimeout(2)
try:
    while rest.count(b"\r\n\r\n") < 1 or not rest.endswith(b"ok\n"):
        c = s.recv(4096)
        if not c: break
        rest += c
except socket.timeout:
    pass
print("HEAD:", head.split(b"\r\n")[0].decode(), "| after:", repr(rest[:40]))
EOF
)
contains "HEAD then GET on one keep-alive connection: HEAD answered" "HEAD: HTTP/1.1 200 OK" "$ka"
contains "... and the GET's answer starts right after the HEAD's headers" "after: b'HTTP/1.1 200 OK" "$ka"

# ---- the flood -----------------------------------------------------------------------
t0=$(date +%s)
timeout 60 python3 - "$base" "$SPORT" "$WORK/w0.rc" >"$WORK/flood.out" 2>&1 <<'EOF'
import os, resource, select, socket, sys, time
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
ports = [int(sys.argv[1]), int(sys.argv[2])]
rc_file = sys.argv[3]
N = 300
socks = {p: [] for p in ports}
opened = 0
garbage = b"\x00garbage, not a loom frame" * 2
def fill(p, most):
    global opened
    while len(socks[p]) < N and most > 0:
        s = socket.socket()
        s.setblocking(False)
        try:
            s.connect(("127.0.0.1", p))
        except BlockingIOError:
            pass
        except OSError:
            s.close(); break
        if p == ports[0] and opened % 10 == 0: # every 10th to the cluster port: a failed handshake
            try:
                select.select([], [s], [], 0.5)
                s.send(garbage)
            except OSError:
                pass
        socks[p].append(s); opened += 1; most -= 1
t0 = time.time()
while time.time() - t0 < 45 and not os.path.exists(rc_file):
    for p in ports:
        fill(p, N if time.time() - t0 < 1 else 40) # 300 at once, then 40 more a turn
        # the ones the server closed (readable with EOF or an error): open them again
        r, _, _ = select.select(socks[p], [], [], 0)
        for s in r:
            try:
                d = s.recv(1)
            except OSError:
                d = b""
            if not d:
                socks[p].remove(s); s.close()
    time.sleep(0.1)
print("opened", opened, "connections in", round(time.time() - t0, 1), "s")
EOF
t1=$(date +%s)
secs=$((t1 - t0 + 1))
for i in 0 1; do
    for _ in $(seq 1 300); do [ -e "$WORK/w$i.rc" ] && break; sleep 0.1; done
done
opened=$(sed -n 's/^opened \([0-9]*\).*/\1/p' "$WORK/flood.out")
[ -n "$opened" ] && [ "$opened" -ge 600 ] && pass "the flood opened 600 idle connections at once ($opened in all, $secs s)" ||
    fail "the flood ran" "$(cat "$WORK/flood.out")"
for i in 0 1; do
    [ "$(cat "$WORK/w$i.rc" 2>/dev/null)" = 0 ] && pass "worker:$i exits 0 through the flood" ||
        fail "worker:$i exits 0 through the flood" "rc $(cat "$WORK/w$i.rc" 2>/dev/null)" "$(tail -4 "$WORK/w$i.log")"
done
[ -e "$WORK/job/ckpt-100.loom" ] && pass "the chief wrote its checkpoints (ckpt-100)" ||
    fail "the chief wrote its checkpoints" "$(ls "$WORK/job")"
n=$(grep -c "Too many open files" "$WORK/w0.log")
[ "$n" = 0 ] && pass "no descriptor ran out" || fail "no descriptor ran out" "$(grep -m3 "Too many open files" "$WORK/w0.log")"
# the bounds were reached (the flood was real), and their lines are rate limited
count() { grep -c -- "$1" "$WORK/w0.log"; }
upto() { # NAME PATTERN MAX
    local k; k=$(count "$2")
    [ "$k" -le "$3" ] && pass "$1: $k lines in $secs s (at most $3)" || fail "$1: $k lines in $secs s, more than $3" \
        "$(grep -m3 -- "$2" "$WORK/w0.log")"
}
k=$(count "connections wait for a handshake, the bound")
[ "$k" -ge 1 ] && pass "the cluster port's bound on pending handshakes was reached" ||
    fail "the cluster port's bound was reached" "$(tail -5 "$WORK/w0.log")"
k=$(count "status endpoint: .* connections open, the bound")
[ "$k" -ge 1 ] && pass "the status endpoint's bound on connections was reached" ||
    fail "the status endpoint's bound was reached" "$(tail -5 "$WORK/w0.log")"
upto "evictions at the cluster port, one line a second" "connections wait for a handshake, the bound" $((secs + 2))
upto "evictions at the status endpoint, one line a second" "status endpoint: .* connections open, the bound" $((secs + 2))
upto "accept() failures, one line a second" "accept() on" $((2 * secs + 2))
upto "libevent's own lines, one a second" "libevent:" $((secs + 2))
upto "libevent's accept storm, handled (it logged 161,030 lines in 10 s)" "Error from accept() call" $((secs + 2))
upto "pre-handshake failures of one address: 5, then one a second" \
    "dropped the connection from\|closed before the handshake\|closed during the handshake" $((secs + 10))
contains "the lines held back are counted (per address)" "more such lines about this address not logged" "$(cat "$WORK/w0.log")"
contains "the lines held back are counted (evictions)" "more closed since the last line)" "$(cat "$WORK/w0.log")"
finish
