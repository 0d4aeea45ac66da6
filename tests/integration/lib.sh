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
# (every line of the details is a TAP comment, also the lines inside one argument)
fail() { T=$((T + 1)); FAILED=$((FAILED + 1)); echo "not ok $T - $1"; shift; printf '%s\n' "$@" | sed 's/^/#   /'; }

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

finish() {
    echo "1..$T"
    [ "$FAILED" -eq 0 ]
}
