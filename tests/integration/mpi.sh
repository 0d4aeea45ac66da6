#!/usr/bin/env bash
# mpi.sh - strategy.communication = "mpi" (the mpi plugin) in jobs started by
# mpirun (Open MPI over TCP, --mca btl tcp,self): 2 ranks end with the same
# bits as `launch --local --workers 2` on the ring (a sum of two floats has
# one order), 3 ranks within 1e-6 of 3 workers on the ring; only the chief
# writes; `loom check` names the op; and the refusals: not under mpirun, the
# plugin absent, the op as a cross_device_ops of one process.
# Skips (77) only when mpirun is not installed. Every mpirun and loom runs
# under `timeout`, and whatever is left is killed on exit.
source "$(dirname "$0")/lib.sh"
DIFF="${LOOM_CKPT_DIFF:-$(dirname "$LOOM")/tests/ckpt_diff}"
CFG=tests/configs/mwm_mlp.cfg
if ! command -v mpirun >/dev/null; then
    echo "1..0 # SKIP mpirun not installed (Debian: openmpi-bin libopenmpi-dev)"
    exit 77
fi
kill_jobs_at_exit
# Open MPI's own allocations at MPI_Init are never freed (known, outside Loom):
# under LeakSanitizer (the ASan suite) they are suppressed, nothing else is.
# Full stacks, so that Open MPI's frames are there to match.
export LSAN_OPTIONS="${LSAN_OPTIONS:+$LSAN_OPTIONS:}suppressions=$ROOT/tests/integration/mpi.lsan:print_suppressions=0"
export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}fast_unwind_on_malloc=0"
MPIRUN=(mpirun --allow-run-as-root --oversubscribe --mca btl tcp,self --mca btl_tcp_if_include lo)

# run_bg NAME CMD...: CMD in the background (its pid kept for cleanup), waited for; its output in
# $WORK/NAME.out, its status in $WORK/NAME.out.rc.
run_bg() {
    local out="$WORK/$1.out"; shift
    ("$@" >"$out" 2>&1; echo $? >"$out.rc") &
    PIDS+=($!)
    wait $!
}
# mpi_job NAME N DIR [ARGS...]: N ranks of `loom train` under mpirun, communication = "mpi".
mpi_job() {
    local name=$1 n=$2 dir=$3 base; shift 3
    base=$(free_ports "$n")
    run_bg "$name" timeout -k 5 90 "${MPIRUN[@]}" -np "$n" "$LOOM" train $CFG --model-dir "$dir" \
        --set 'cluster.worker=[]' --set cluster.port_base="$base" --set strategy.communication=mpi "$@"
}
rc_is() { # NAME WANT TEXT
    local rc
    rc=$(cat "$WORK/$1.out.rc" 2>/dev/null || echo none)
    if [ "$rc" = "$2" ]; then pass "$3"; else fail "$3" "exit status $rc, expected $2" "$(tail -8 "$WORK/$1.out")"; fi
}
S40=(--set run.max_steps=40 --set run.eval_steps=1)

# ---- 2 ranks under mpirun = launch --local --workers 2 on the ring, bit for bit --------
mpi_job two 2 "$WORK/mpi2" "${S40[@]}"
rc_is two 0 "mpirun -np 2: the job exits 0"
contains "each rank all-reduces through MPI" "worker:1 is MPI rank 1 of 2; gradients all-reduce with MPI_Allreduce" \
    "$(cat "$WORK/two.out")"
contains "the chief ends the job" "done: step 40" "$(cat "$WORK/two.out")"
n=$(ls "$WORK/mpi2" 2>/dev/null | grep -c '^events.out.tfevents')
[ "$n" = 1 ] && pass "only the chief writes (one event file)" || fail "only the chief writes (one event file)" "$(ls "$WORK/mpi2")"
run_bg ring2 timeout -k 5 90 "$LOOM" launch --local $CFG --workers 2 --model-dir "$WORK/ring2" "${S40[@]}"
rc_is ring2 0 "launch --local --workers 2 (the ring) exits 0"
same_weights "mpi(2) = ring(2): the same bits" "$WORK/mpi2/ckpt-40.loom" "$WORK/ring2/ckpt-40.loom"

# ---- 3 ranks: another order of the sums, within 1e-6 ---------------------------------
mpi_job three 3 "$WORK/mpi3" "${S40[@]}"
rc_is three 0 "mpirun -np 3: the job exits 0"
run_bg ring3 timeout -k 5 90 "$LOOM" launch --local $CFG --workers 3 --model-dir "$WORK/ring3" "${S40[@]}"
rc_is ring3 0 "launch --local --workers 3 (the ring) exits 0"
close6 "mpi(3) = ring(3) within 1e-6" "$WORK/mpi3/ckpt-40.loom" "$WORK/ring3/ckpt-40.loom"

# ---- the plan names the op -------------------------------------------------------------
out=$("$LOOM" check $CFG --task worker:0 --set strategy.communication=mpi 2>&1)
contains "loom check: the plan names the mpi op" "the mpi plugin's all-reduce across processes (communication = \"mpi\")" "$out"
contains "loom plugins: the mpi op reduces across processes only" 'provides cross-device ops "mpi" (host memory) (across processes only' \
    "$("$LOOM" plugins 2>&1)"
contains "loom devices: the mpi op is for strategy.communication, not the replicas" \
    "  mpi                    across processes: communication" "$("$LOOM" devices 2>&1)"

# ---- refusals ---------------------------------------------------------------------------
# not started by mpirun: both tasks refuse, the job stops, nothing is trained
run_bg nompi timeout -k 5 60 "$LOOM" launch --local $CFG --workers 2 --model-dir "$WORK/nompi" "${S40[@]}" \
    --set strategy.communication=mpi
rc_is nompi 2 "communication = mpi outside mpirun: the job fails"
contains "... saying the task was not started by mpirun" 'was not started by mpirun (none of OMPI_COMM_WORLD_SIZE' \
    "$(cat "$WORK/nompi.out")"
contains "... naming the setting" "--set strategy.communication" "$(cat "$WORK/nompi.out")"
[ ! -e "$WORK/nompi/ckpt-40.loom" ] && pass "... and trains nothing" || fail "... and trains nothing" "$(ls "$WORK/nompi")"
# the plugin absent: a loom binary with no plugins/ beside it
mkdir -p "$WORK/bare"
cp "$LOOM" "$WORK/bare/loom"
expect_fail 2 "the mpi plugin absent: refused at the setting" \
    'strategy.communication: "mpi": no cross-device op "mpi" is loaded' \
    env -u LOOM_PLUGIN_PATH "$WORK/bare/loom" check $CFG --task worker:0 --set strategy.communication=mpi
# mpi is no op among the replicas of one process
expect_fail 2 "cross_device_ops = mpi in one process: refused, pointing at communication" \
    'reduces across the processes of a job only' \
    "$LOOM" train $CFG --model-dir "$WORK/mir" "${S40[@]}" --set strategy.type=mirrored --set strategy.replicas=2 \
    --set 'cluster.worker=[]' --set strategy.cross_device_ops=mpi
finish
