# netns_lib.sh - emulated hosts for the cluster tests and benchmarks: N
# network namespaces ("hosts") joined by a bridge in a hub namespace, host i
# at 10.213.0.i/24 on its interface eth0 (addresses of the project's own,
# only inside the namespaces; the root namespace is never touched), with an
# optional token-bucket rate (tc tbf; this kernel has no netem) on both
# directions of every host's link, as a 1 or 10 Gbit/s NIC.
#
#   source tests/integration/netns_lib.sh
#   netns_require            # not root, or namespaces cannot be made: a TAP skip (exit 0)
#   netns_up 3 1gbit         # hosts 1..3 (rate optional: 1gbit, 10gbit, ...); the EXIT trap removes them
#   netns_exec 2 CMD...      # CMD in host 2 (ip netns exec)
#   netns_link 3 down        # cut (or restore) host 3's link
#   netns_hosts "node" 3     # host i answers to the name nodeI inside every host (/etc/netns/NS/hosts)
#   netns_down               # (the trap's) kill what runs in them, delete them
#
# Names are loomnt-<pid of this shell>-hI and -hub, so parallel runs never
# collide; netns_up first deletes namespaces of that prefix whose shell is
# gone (a run killed with SIGKILL cannot run its trap). Standalone (the
# benchmarks) or after lib.sh (the tests): netns_up chains onto lib.sh's
# EXIT trap (its PIDS and $WORK) when there is one.
NETNS_PREFIX=loomnt
NETNS_ID="$NETNS_PREFIX-$$"
NETNS_N=0
NETNS_NET=10.213.0

netns_name() { if [ "$1" = hub ]; then echo "$NETNS_ID-hub"; else echo "$NETNS_ID-h$1"; fi; }
netns_addr() { echo "$NETNS_NET.$1"; }

# netns_require: skip (TAP, exit 0) unless root with ip, tc and working namespaces.
netns_require() {
    local why=""
    if [ "$(id -u)" != 0 ]; then why="not root (network namespaces need CAP_NET_ADMIN)"
    elif ! command -v ip >/dev/null || ! command -v tc >/dev/null; then why="ip or tc (iproute2) not installed"
    elif ! ip netns add "$NETNS_ID-probe" 2>/dev/null; then why="cannot create a network namespace here"
    else
        if ! ip -n "$NETNS_ID-probe" link add br0 type bridge 2>/dev/null; then
            why="cannot create a bridge in a network namespace"
        elif ! ip -n "$NETNS_ID-probe" link add v0 type veth peer name v1 2>/dev/null; then
            why="cannot create a veth pair in a network namespace"
        fi
        ip netns del "$NETNS_ID-probe" 2>/dev/null
    fi
    if [ -n "$why" ]; then
        echo "1..0 # SKIP $why"
        exit 0 # a TAP skip (meson counts 77 under tap as an error)
    fi
}

# Deletes namespaces of our prefix whose owning shell no longer runs.
netns_sweep() {
    local ns pid
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^$NETNS_PREFIX-[0-9]*-"); do
        pid=${ns#"$NETNS_PREFIX"-}; pid=${pid%%-*}
        if ! kill -0 "$pid" 2>/dev/null; then
            netns_kill_in "$ns"
            ip netns del "$ns" 2>/dev/null
            rm -rf "/etc/netns/$ns"
        fi
    done
}

# Kills (SIGKILL) every process inside namespace $1.
netns_kill_in() {
    local p
    for p in $(ip netns pids "$1" 2>/dev/null); do kill -9 "$p" 2>/dev/null; done
}

netns_down() {
    local i ns
    for i in hub $(seq 1 "$NETNS_N"); do
        ns=$(netns_name "$i")
        netns_kill_in "$ns"
        ip netns del "$ns" 2>/dev/null
        rm -rf "/etc/netns/$ns"
    done
    NETNS_N=0
}

# netns_rate DEV NS RATE: tbf on DEV's egress in NS (burst: 10 ms at RATE, at least 256 KiB, for the GSO segments).
netns_rate() {
    local dev=$1 ns=$2 rate=$3 bits burst
    bits=$(awk -v r="$rate" 'BEGIN { m = 1; if (r ~ /gbit$/) m = 1e9; else if (r ~ /mbit$/) m = 1e6; sub(/[a-z]+$/, "", r); print r * m }')
    burst=$(awk -v b="$bits" 'BEGIN { x = b / 8 / 100; if (x < 262144) x = 262144; printf "%d", x }')
    ip netns exec "$ns" tc qdisc replace dev "$dev" root tbf rate "$rate" burst "$burst" latency 100ms
}

# netns_up N [RATE]: N hosts on one bridge, each link at RATE when given.
netns_up() {
    local n=$1 rate=${2:-} i ns hub out
    netns_sweep
    if declare -F kill_tree >/dev/null; then # lib.sh: its processes, then the hosts, then $WORK
        trap 'for p in "${PIDS[@]}"; do kill_tree "$p"; done; netns_down; rm -rf "$WORK"' EXIT
    else
        trap 'netns_down' EXIT
    fi
    trap 'exit 130' INT TERM
    hub=$(netns_name hub)
    ip netns add "$hub" || return 1
    NETNS_N=$n
    ip -n "$hub" link set lo up
    ip -n "$hub" link add br0 type bridge || return 1
    ip -n "$hub" link set br0 up
    for ((i = 1; i <= n; i++)); do
        ns=$(netns_name "$i")
        ip netns add "$ns" || return 1
        ip -n "$ns" link set lo up
        # the pair is made inside the two namespaces: no name in the root namespace
        ip -n "$hub" link add "h$i" type veth peer name eth0 netns "$ns" || return 1
        ip -n "$hub" link set "h$i" master br0
        ip -n "$hub" link set "h$i" up
        ip -n "$ns" addr add "$(netns_addr "$i")/24" dev eth0
        ip -n "$ns" link set eth0 up
        if [ -n "$rate" ]; then
            netns_rate eth0 "$ns" "$rate" || return 1   # what host i sends
            netns_rate "h$i" "$hub" "$rate" || return 1 # what it receives
        fi
    done
    # host 1 reaches host n (a refused TCP connection proves it; no ping needed)
    for ((i = 0; i < 50; i++)); do
        out=$(ip netns exec "$(netns_name 1)" timeout 2 bash -c "exec 3<>/dev/tcp/$(netns_addr "$n")/9" 2>&1)
        grep -q refused <<<"$out" && return 0
        sleep 0.1
    done
    echo "netns_up: host 1 cannot reach host $n" >&2
    return 1
}

netns_exec() {
    local i=$1; shift
    ip netns exec "$(netns_name "$i")" "$@"
}

# netns_link I up|down: host I's link (its eth0).
netns_link() { ip -n "$(netns_name "$1")" link set eth0 "$2"; }

# netns_hosts PREFIX N: in every host, PREFIX1..PREFIXN resolve to hosts 1..N
# (ip netns exec bind-mounts /etc/netns/NS/hosts over /etc/hosts).
netns_hosts() {
    local prefix=$1 n=$2 i j ns
    for ((i = 1; i <= NETNS_N; i++)); do
        ns=$(netns_name "$i")
        mkdir -p "/etc/netns/$ns"
        { echo "127.0.0.1 localhost"; for ((j = 1; j <= n; j++)); do echo "$(netns_addr "$j") $prefix$j"; done; } >"/etc/netns/$ns/hosts"
    done
}
