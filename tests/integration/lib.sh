# lib.sh - TAP helpers for the integration tests. Source it, then:
#   ok COND_CMD... "name"    via `check "name" cmd args...`
#   expect_fail STATUS "name" "substring" cmd args...
# The loom binary is $LOOM (the first argument of the test script).
LOOM="${1:?usage: $0 path/to/loom}"
LOOM="$(cd "$(dirname "$LOOM")" && pwd)/$(basename "$LOOM")"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
T=0
FAILED=0
WORK="$(mktemp -d /tmp/loom_it_XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
export LOOM_TEST=1

pass() { T=$((T + 1)); echo "ok $T - $1"; }
# (every line of the details is a TAP comment, also the lines inside one argument; the same on stderr, which
# meson's --print-errorlogs shows in a CI log, where the TAP stdout is not)
fail() {
    T=$((T + 1)); FAILED=$((FAILED + 1)); echo "not ok $T - $1"
    local name=$1
    shift
    printf '%s\n' "$@" | sed 's/^/#   /'
    { echo "not ok $T - $name"; printf '%s\n' "$@" | sed 's/^/#   /'; } >&2
}

# check NAME CMD...: passes when CMD exits 0.
check() {
    local name="$1"; shift
    local out
    if out=$("$@" 2>&1); then pass "$name"; else fail "$name" "command: $*" "$(echo "$out" | tail -5)"; fi
}

# expect_fail STATUS NAME SUBSTRING CMD...: passes when CMD exits with STATUS
# and its stderr+stdout contain SUBSTRING.
expect_fail() {
    local want="$1" name="$2" sub="$3"; shift 3
    local out status
    out=$("$@" 2>&1); status=$?
    if [ "$status" -ne "$want" ]; then
        fail "$name" "exit status $status, expected $want" "$(echo "$out" | tail -5)"
    elif ! grep -qF -- "$sub" <<<"$out"; then
        fail "$name" "output lacks: $sub" "$(echo "$out" | tail -5)"
    else
        pass "$name"
    fi
}

# contains NAME SUBSTRING TEXT
contains() {
    if grep -qF -- "$2" <<<"$3"; then pass "$1"; else fail "$1" "lacks: $2" "$(echo "$3" | tail -5)"; fi
}

# wait_file FILE: up to 60 s for FILE to exist (1 if it never does)
wait_file() { local i; for ((i = 0; i < 1200; i++)); do [ -e "$1" ] && return 0; sleep 0.05; done; return 1; }
# newest DIR: the step of DIR's newest checkpoint (ckpt-N.loom), empty without one
newest() { ls "$1" 2>/dev/null | sed -n 's/^ckpt-\([0-9]*\)\.loom$/\1/p' | sort -n | tail -1; }
# status PID [SECONDS]: ST = the background process's exit status once it ends (up to SECONDS,
# default 150), else "hung"
status() {
    local i
    for ((i = 0; i < ${2:-150} * 20; i++)); do
        if ! kill -0 "$1" 2>/dev/null; then wait "$1" 2>/dev/null; ST=$?; return; fi
        sleep 0.05
    done
    ST=hung
}

# ---- jobs of several processes (multi_worker.sh, mpi.sh, mwm_*.sh, status_peers.sh) ----
# kill_tree PID: PID and its descendants, SIGKILL (only processes the test started).
kill_tree() {
    local c
    for c in $(pgrep -P "$1"); do kill_tree "$c"; done
    kill -9 "$1" 2>/dev/null
}
# PIDS holds what the test starts in the background; kill_jobs_at_exit makes
# the EXIT trap kill each (and its children) before removing $WORK.
PIDS=()
kill_jobs_at_exit() {
    trap 'for p in "${PIDS[@]}"; do kill_tree "$p"; done; rm -rf "$WORK"' EXIT
}
# free_ports N: a base port with N free ports after it (another test may hold some).
free_ports() {
    python3 - "$1" <<'EOF'
import random, socket, sys
n = int(sys.argv[1])
for _ in range(100):
    base = random.randint(20000, 60000)
    socks = []
    try:
        for i in range(n):
            s = socket.socket(); s.bind(("127.0.0.1", base + i)); socks.append(s)
        print(base); break
    except OSError:
        pass
    finally:
        for s in socks: s.close()
EOF
}
# tensors CKPT: its tensor lines (names, shapes, CRCs); same_weights NAME A B
# passes when two checkpoints hold the same bits; close6 NAME A B when
# $DIFF (ckpt_diff) finds them within 1e-6 under config $CFG.
tensors() { "$LOOM" inspect "$1" | grep '^tensor'; }
same_weights() {
    local ta tb
    ta=$(tensors "$2") && tb=$(tensors "$3")
    if [ -n "$ta" ] && [ "$ta" = "$tb" ]; then pass "$1"; else fail "$1" "$2 vs $3" "$(diff <(echo "$ta") <(echo "$tb") | head -4)"; fi
}
close6() {
    local d
    if d=$("$DIFF" $CFG "$2" "$3" 2>&1) && awk -v d="$d" 'BEGIN { exit !(d <= 1e-6) }'; then
        pass "$1 (${d} apart)"
    else
        fail "$1" "ckpt_diff: $d"
    fi
}

# The example ids each worker trained on (LOOM_TEST_EXAMPLE_IDS=PREFIX writes
# PREFIX.worker:N, lines "STEP CRC"). exactly_once NAME REF RUN N: RUN's
# multiset of examples is REF's, N in all; absent_then NAME FILE LO HI ROWS:
# FILE has no example of steps LO+1 to HI and ROWS examples after HI.
exactly_once() {
    local ref got n
    ref=$(cat "$2".worker:* | awk '{print $2}' | sort) got=$(cat "$3".worker:* | awk '{print $2}' | sort)
    n=$(grep -c . <<<"$got")
    if [ "$n" = "$4" ] && [ "$ref" = "$got" ]; then pass "$1"
    else fail "$1" "$n examples" "$(diff <(echo "$ref") <(echo "$got") | head -3)"; fi
}
absent_then() {
    local gone after
    gone=$(awk -v lo="$3" -v hi="$4" '$1 > lo && $1 <= hi' "$2" | wc -l) after=$(awk -v hi="$4" '$1 > hi' "$2" | wc -l)
    if [ "$gone" = 0 ] && [ "$after" = "$5" ]; then pass "$1"
    else fail "$1" "$gone examples in steps $(($3 + 1))-$4, $after after"; fi
}

finish() {
    echo "1..$T"
    [ "$FAILED" -eq 0 ]
}
