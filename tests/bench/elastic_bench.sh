#!/usr/bin/env bash
# elastic_bench.sh - recovery from a lost worker (issue 25): the seconds from
# one of 3 workers killed (SIGKILL, at step 60) to the job's first completed
# step after it, Loom's strategy.elastic beside torch's elastic agent
# restarting DDP (gloo) on the same kill, in one run; prints both and the ratio.
#   tests/bench/elastic_bench.sh [build/loom]      (ELASTIC_BENCH_NO_TORCH=1: Loom's side only)
# Loom: tests/configs/mwm_mlp.cfg on 3 workers over 127.0.0.1, each step padded
# to about 15 ms (tests/lua/mwm_slow.lua), strategy.elastic.min_workers = 2,
# cluster.heartbeat_timeout = 5 (a kill closes the connections: it is seen at
# once; the target is <= heartbeat_timeout + 1 s). Its progress: the steps in
# worker:0's LOOM_TEST_EXAMPLE_IDS file.
# torch: tests/bench/elastic_torch_ref.py (/usr/bin/python3): the same MLP and
# step padding, elastic_launch with min 1 / max 3 nodes, nproc 3, monitor
# interval 5 s (torchrun's default), a checkpoint every 50 steps; the agent
# restarting every worker, which reload it.
# Then the join: worker:2 started again with the same command; the seconds
# from its start (the process, its connection, its request) to its first
# step trained in the running job (its LOOM_TEST_EXAMPLE_IDS file), with 3.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
LOOM=$(realpath "${1:-$ROOT/build/loom}")
W=$(mktemp -d)
PIDS=()
trap 'for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null; done; rm -rf "$W"' EXIT
cd "$ROOT" || exit 1

base=$(python3 -c 'import random; print(random.randint(30000, 55000))')
addrs="\"127.0.0.1:$base\",\"127.0.0.1:$((base + 1))\",\"127.0.0.1:$((base + 2))\""
export LOOM_TEST_EXAMPLE_IDS="$W/ids"
TASK_ARGS=(--model-dir "$W/loom" --set "cluster.worker=[$addrs]" --set run.epochs=3 --set run.checkpoint_steps=100
           --set run.progress='"none"' --set cluster.heartbeat_timeout=5 --set strategy.elastic.min_workers=2
           --set 'hooks.callbacks=["../lua/mwm_slow.lua:slow"]')
for i in 0 1 2; do
    "$LOOM" train tests/configs/mwm_mlp.cfg --task worker:$i "${TASK_ARGS[@]}" >"$W/loom.$i" 2>&1 &
    PIDS+=($!)
done
loom_s=$(python3 - "$W/ids.worker:0" "${PIDS[2]}" <<'EOF'
import os, signal, sys, time
path, victim = sys.argv[1], int(sys.argv[2])
def last():
    try:
        with open(path) as f:
            lines = [l for l in f.read().split("\n") if l]
        return int(lines[-1].split()[0]) if lines else 0
    except OSError:
        return 0
t_end = time.time() + 200
while last() < 60 and time.time() < t_end:
    time.sleep(0.005)
at = last()
t_kill = time.time()
os.kill(victim, signal.SIGKILL)
while last() <= at + 1 and time.time() < t_end:
    time.sleep(0.002)
print("%.3f" % (time.time() - t_kill) if last() > at + 1 else "none")
EOF
)
wait "${PIDS[2]}" 2>/dev/null # (the killed one: no "Killed" notice)
# the join: worker:2 again, from its start to its first step trained in the job
join_s=$(python3 - "$W/ids.worker:2" "$LOOM" tests/configs/mwm_mlp.cfg --task worker:2 "${TASK_ARGS[@]}" <<'EOF'
import subprocess, sys, threading, time
path, cmd = sys.argv[1], sys.argv[2:]
t_req = []
def watch(p):  # its request to join: just after its transport connected to the chief (-v: "connected to worker:0")
    with open(path + ".log", "w") as log:
        for line in p.stdout:
            if not t_req and "connected to worker:0" in line:
                t_req.append(time.time())
            log.write(line)
def steps():
    try:
        with open(path) as f:
            return [int(l.split()[0]) for l in f.read().split("\n") if l]
    except OSError:
        return []
before = max(steps() or [0])
t0 = time.time()
p = subprocess.Popen([cmd[0], "train"] + cmd[1:] + ["-v"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
threading.Thread(target=watch, args=(p,), daemon=True).start()
while max(steps() or [0]) <= before and time.time() < t0 + 60 and p.poll() is None:
    time.sleep(0.002)
t1 = time.time()
if max(steps() or [0]) > before and t_req:
    print("%.3f s from its request (%.3f s from the process's start, its data loaded first)" % (t1 - t_req[0], t1 - t0))
else:
    print("none")
p.wait()
EOF
)
unset LOOM_TEST_EXAMPLE_IDS
for i in 0 1; do timeout 200 tail --pid="${PIDS[$i]}" -f /dev/null; done
grep -h "left at step\|joined at step" "$W"/loom.0 | sed 's/^/# loom: /'

torch_json=none
[ -n "${ELASTIC_BENCH_NO_TORCH:-}" ] || torch_json=$(timeout 300 /usr/bin/python3 "$HERE/elastic_torch_ref.py" --port $((29600 + RANDOM % 300)) --monitor 5 \
    --kill-at 60 2>"$W/torch.err" | tail -1)
torch_s=$(python3 -c 'import json,sys; print("%.3f" % json.loads(sys.argv[1])["recovery_s"])' "$torch_json" 2>/dev/null || echo none)
[ "$torch_s" = none ] && [ -e "$W/torch.err" ] && tail -5 "$W/torch.err" | sed 's/^/# torch: /'

echo "recovery from a killed worker (3 workers, kill -9 at step 60, to the next completed step):"
echo "  loom strategy.elastic (heartbeat_timeout 5 s):       ${loom_s} s"
echo "  torch elastic agent + DDP gloo (monitor_interval 5 s): ${torch_s} s"
echo "  loom: worker:2 started again, to its first step in the job (3 workers):  ${join_s}"
if [ "$loom_s" != none ] && [ "$torch_s" != none ]; then
    python3 -c 'import sys; l, t = float(sys.argv[1]), float(sys.argv[2]); print("  ratio torch / loom: %.1fx (target >= 10x); loom <= heartbeat_timeout + 1 s: %s" % (t / l, "yes" if l <= 6 else "no"))' "$loom_s" "$torch_s"
fi
