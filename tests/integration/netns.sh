#!/usr/bin/env bash
# netns.sh - the cluster across emulated hosts (netns_lib.sh: one network
# namespace per host, 10.213.0.1..3 on a bridge, real interfaces, no
# loopback): multi_worker_mirrored on 3 hosts (refused without the secret,
# trains with it, the weights of mirrored(3)); cluster.tls; compression;
# a link cut (ip link set down) in the middle of training, which stops the
# job naming the lost worker, within a bound; a Slurm node list resolving
# to the hosts; parameter_server (chief, 2 workers, ps) over 3 hosts;
# strategy.elastic: host 3's loom killed -9 and started again joins the job;
# a job of 2 listed grows to 3 with an unlisted worker on host 3.
# Every loom runs under `timeout` in its host through `ip netns exec`; the
# EXIT trap kills them and deletes the namespaces. A TAP skip when not root
# or where namespaces cannot be made.
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/netns_lib.sh"
DIFF="${LOOM_CKPT_DIFF:-$(dirname "$LOOM")/tests/ckpt_diff}"
CFG=tests/configs/mwm_mlp.cfg
netns_require
kill_jobs_at_exit
netns_up 3 || { echo "Bail out! cannot set up the emulated hosts"; exit 1; }
for v in $(env | grep -oE '^(SLURM|OMPI|PMIX|PMI)_[A-Z_]*|^TF_CONFIG|^LOOM_CLUSTER_SECRET' || true); do unset "$v"; done
SECRET=$(openssl rand -hex 32)
PORT=29500
S40=(--set run.max_steps=40 --set run.eval_steps=1)

# workers_on N: the --set placing worker:i on host i+1
workers_on() {
    local n=$1 list="" i
    for ((i = 1; i <= n; i++)); do list+="${list:+,}\"$(netns_addr "$i"):$PORT\""; done
    echo "cluster.worker=[$list]"
}
# job NAME N DIR [ARGS...]: worker:i of $CFG on host i+1 (env from $JOB_ENV), each under timeout; waits for all.
JOB_ENV=()
job() {
    local name=$1 n=$2 dir=$3 i pids=(); shift 3
    for ((i = 0; i < n; i++)); do
        (netns_exec $((i + 1)) env "${JOB_ENV[@]}" timeout -k 5 90 "$LOOM" train $CFG --task worker:$i --model-dir "$dir" \
            --set "$(workers_on "$n")" "$@" >"$WORK/$name.$i" 2>&1; echo $? >"$WORK/$name.$i.rc") &
        pids+=($!); PIDS+=($!)
    done
    for p in "${pids[@]}"; do wait "$p"; done
}
rc_of() { cat "$WORK/$1.rc" 2>/dev/null || echo none; }
all_ok() { # NAME N: every worker exited 0
    local i bad=""
    for ((i = 0; i < $2; i++)); do [ "$(rc_of "$1.$i")" = 0 ] || bad+=" worker:$i=$(rc_of "$1.$i")"; done
    if [ -z "$bad" ]; then pass "$1: every worker exits 0"; else fail "$1: every worker exits 0" "$bad" "$(tail -3 "$WORK/$1.0")" "$(tail -3 "$WORK/$1.1")"; fi
}
wait_for() { # FILE: up to 60 s
    local i
    for ((i = 0; i < 1200; i++)); do [ -e "$1" ] && return; sleep 0.05; done
}

# ---- non-loopback addresses: the secret is required -----------------------------------
expect_fail 2 "3 hosts without a secret: refused before any socket opens" "secret" \
    netns_exec 1 timeout 30 "$LOOM" train $CFG --task worker:0 --model-dir "$WORK/nosecret" --set "$(workers_on 3)" "${S40[@]}"
[ -e "$WORK/nosecret/ckpt-40.loom" ] && fail "without a secret nothing is trained" || pass "without a secret nothing is trained"

# ---- 3 hosts with the secret: trains, the weights of mirrored(3) -----------------------
JOB_ENV=(LOOM_CLUSTER_SECRET="$SECRET")
job three 3 "$WORK/three" "${S40[@]}"
all_ok three 3
out=$(netns_exec 1 env "${JOB_ENV[@]}" "$LOOM" check $CFG --task worker:0 --set "$(workers_on 3)" 2>&1)
contains "3 hosts: check lists worker:2 at host 3's address" "worker:2     $(netns_addr 3):$PORT" "$out"
contains "3 hosts: check says the secret is used" "security: a shared secret from LOOM_CLUSTER_SECRET" "$out"
"$LOOM" train $CFG --model-dir "$WORK/mir3" "${S40[@]}" --set strategy.type=mirrored --set strategy.replicas=3 \
    --set cluster.worker=[] >/dev/null 2>&1
if d=$("$DIFF" $CFG "$WORK/mir3/ckpt-40.loom" "$WORK/three/ckpt-40.loom" 2>&1) && awk -v d="$d" 'BEGIN { exit !(d <= 1e-6) }'; then
    pass "3 hosts = mirrored(3) within 1e-6 ($d apart)"
else
    fail "3 hosts = mirrored(3) within 1e-6" "ckpt_diff: $d"
fi

# ---- a wrong secret on one host: refused, nothing trained ------------------------------
(netns_exec 3 env LOOM_CLUSTER_SECRET=wrong timeout -k 5 30 "$LOOM" train $CFG --task worker:2 --model-dir "$WORK/wrong" \
    --set "$(workers_on 3)" "${S40[@]}" --set cluster.connect_timeout=5 >"$WORK/wrong.2" 2>&1) &
PIDS+=($!)
JOB_ENV=(LOOM_CLUSTER_SECRET="$SECRET")
for i in 0 1; do
    (netns_exec $((i + 1)) env "${JOB_ENV[@]}" timeout -k 5 30 "$LOOM" train $CFG --task worker:$i --model-dir "$WORK/wrong" \
        --set "$(workers_on 3)" "${S40[@]}" --set cluster.connect_timeout=5 >"$WORK/wrong.$i" 2>&1; echo $? >"$WORK/wrong.$i.rc") &
    PIDS+=($!)
done
wait
if [ "$(rc_of wrong.0)" != 0 ] && grep -qi "secret" "$WORK/wrong.0" "$WORK/wrong.1" "$WORK/wrong.2" && ! [ -e "$WORK/wrong/ckpt-40.loom" ]; then
    pass "a wrong secret on host 3: refused, nothing trained"
else
    fail "a wrong secret on host 3: refused, nothing trained" "rc $(rc_of wrong.0)" "$(tail -2 "$WORK/wrong.0")" "$(tail -2 "$WORK/wrong.2")"
fi

# ---- TLS on every connection between the hosts ------------------------------------------
TLSD=$ROOT/tests/fixtures/tls
TLS=(--set cluster.tls=true --set "cluster.tls_cert=\"$TLSD/task.pem\"" --set "cluster.tls_key=\"$TLSD/task.key\""
     --set "cluster.tls_ca=\"$TLSD/ca.pem\"")
job tls 3 "$WORK/tls" "${S40[@]}" "${TLS[@]}"
all_ok tls 3
same_weights "TLS: the same weights as clear TCP" "$WORK/three/ckpt-40.loom" "$WORK/tls/ckpt-40.loom"

# ---- compression across the hosts -------------------------------------------------------
job bf16 3 "$WORK/bf16" "${S40[@]}" --set strategy.compression=bf16 --set strategy.compression_error_feedback=true
all_ok bf16 3
out=$(netns_exec 1 env "${JOB_ENV[@]}" "$LOOM" check $CFG --task worker:0 --set "$(workers_on 3)" \
    --set strategy.compression=bf16 --set strategy.compression_error_feedback=true 2>&1)
contains "compression: check's plan says so" 'compression = "bf16": the gradients cross as 16 bits' "$out"
if [ "$(tensors "$WORK/bf16/ckpt-40.loom")" != "$(tensors "$WORK/three/ckpt-40.loom")" ] &&
   d=$("$DIFF" $CFG "$WORK/three/ckpt-40.loom" "$WORK/bf16/ckpt-40.loom" 2>&1) && awk -v d="$d" 'BEGIN { exit !(d <= 0.05) }'; then
    pass "compression: other bits than float32 (bf16 crossed), close to them ($d apart)"
else
    fail "compression: other bits than float32 (bf16 crossed), close to them" "ckpt_diff: $d"
fi

# ---- a cut link in the middle of training: the job stops, naming the lost worker --------
# Steps of 40 ms (tests/lua/mwm_slow.lua); heartbeat_timeout 3 s. Host 3's link goes down
# after checkpoint 20: worker:0 and worker:1 stop naming worker:2, and worker:2, which
# hears no one, stops too; each within heartbeat_timeout + 10 s (loaded machines).
SLOW=(--set run.max_steps=400 --set run.checkpoint_steps=10 --set run.eval_steps=1
      --set 'hooks.callbacks=({ fn = "../lua/mwm_slow.lua:slow"; args = { seconds = 0.04; }; })')
t_cut=""
job cut 3 "$WORK/cut" "${SLOW[@]}" &
jpid=$!
wait_for "$WORK/cut/ckpt-20.loom"
netns_link 3 down
t_cut=$(date +%s.%N)
wait $jpid
t_end=$(date +%s.%N)
secs=$(awk -v a="$t_cut" -v b="$t_end" 'BEGIN { printf "%.1f", b - a }')
if [ "$(rc_of cut.0)" != 0 ] && [ "$(rc_of cut.0)" != 124 ] && grep -q "worker:2" "$WORK/cut.0"; then
    pass "cut link: the chief stops naming worker:2 (every task gone ${secs} s after the cut)"
else
    fail "cut link: the chief stops naming worker:2" "rc $(rc_of cut.0)" "$(tail -3 "$WORK/cut.0")"
fi
if [ "$(rc_of cut.2)" != 0 ] && [ "$(rc_of cut.2)" != 124 ] && [ "$(rc_of cut.1)" != 124 ]; then
    pass "cut link: the cut-off worker:2 and worker:1 stop on their own (no timeout kill)"
else
    fail "cut link: the cut-off worker:2 and worker:1 stop on their own" "rc $(rc_of cut.1) $(rc_of cut.2)" "$(tail -3 "$WORK/cut.2")"
fi
awk -v s="$secs" 'BEGIN { exit !(s <= 3 + 10) }' && pass "cut link: bounded (${secs} s <= heartbeat_timeout + 10 s)" \
    || fail "cut link: bounded (heartbeat_timeout + 10 s)" "${secs} s"
[ -e "$WORK/cut/ckpt-400.loom" ] && fail "cut link: the job did not finish" || pass "cut link: the job did not finish"
netns_link 3 up

# ---- Slurm: the step's node list resolves to the hosts ----------------------------------
netns_hosts node 3
for i in 0 1 2; do
    (netns_exec $((i + 1)) env LOOM_CLUSTER_SECRET="$SECRET" SLURM_PROCID=$i SLURM_NTASKS=3 SLURM_STEP_NODELIST='node[1-3]' \
        SLURM_STEP_TASKS_PER_NODE='1(x3)' SLURM_NODEID=$i SLURM_LOCALID=0 timeout -k 5 90 "$LOOM" train $CFG \
        --model-dir "$WORK/slurm" --set 'cluster.worker=[]' --set cluster.port_base=$PORT "${S40[@]}" \
        >"$WORK/slurm.$i" 2>&1; echo $? >"$WORK/slurm.$i.rc") &
    PIDS+=($!)
done
wait
all_ok slurm 3
out=$(netns_exec 1 env LOOM_CLUSTER_SECRET="$SECRET" SLURM_PROCID=0 SLURM_NTASKS=3 SLURM_STEP_NODELIST='node[1-3]' \
    SLURM_STEP_TASKS_PER_NODE='1(x3)' SLURM_NODEID=0 SLURM_LOCALID=0 "$LOOM" check $CFG --set 'cluster.worker=[]' \
    --set cluster.port_base=$PORT 2>&1)
contains "Slurm: the node list expanded" "worker:2     node3:$PORT" "$out"
contains "Slurm: the tasks trained over the hosts' names" "cluster task worker:0 (SLURM_PROCID=0 of SLURM_NTASKS=3)" "$(cat "$WORK/slurm.0")"
same_weights "Slurm: the weights of the same job from the config's addresses" "$WORK/three/ckpt-40.loom" "$WORK/slurm/ckpt-40.loom"

# ---- parameter_server across the hosts: chief + ps:0 on host 1, workers on hosts 2, 3 ---
PCFG=tests/configs/ps_mlp.cfg
PS=(--set "cluster.chief=[\"$(netns_addr 1):$PORT\"]" --set "cluster.ps=[\"$(netns_addr 1):$((PORT + 1))\"]"
    --set "cluster.worker=[\"$(netns_addr 2):$PORT\", \"$(netns_addr 3):$PORT\"]")
ps_task() { # HOST TASK
    (netns_exec "$1" env LOOM_CLUSTER_SECRET="$SECRET" timeout -k 5 120 "$LOOM" train $PCFG --task "$2" \
        --model-dir "$WORK/ps" "${PS[@]}" >"$WORK/ps.$2" 2>&1; echo $? >"$WORK/ps.$2.rc") &
    PIDS+=($!)
}
ps_task 1 chief:0; ps_task 1 ps:0; ps_task 2 worker:0; ps_task 3 worker:1
wait
[ "$(rc_of ps.chief:0)" = 0 ] && pass "parameter_server over 3 hosts: the chief completes" \
    || fail "parameter_server over 3 hosts: the chief completes" "rc $(rc_of ps.chief:0)" "$(tail -3 "$WORK/ps.chief:0")"
contains "parameter_server over 3 hosts: every step applied" "done: step 100" "$(cat "$WORK/ps.chief:0")"

# ---- elastic across the hosts: host 3's loom killed -9 and started again joins the running job ---
EL=(--set run.max_steps=80 --set run.checkpoint_steps=10 --set run.eval_steps=1 --set cluster.heartbeat_timeout=3
    --set strategy.elastic.min_workers=2 --set 'hooks.callbacks=({ fn = "../lua/mwm_slow.lua:slow"; args = { seconds = 0.04; }; })')
el_task() { # I [LOG SUFFIX]: worker:I on host I+1
    (netns_exec $(($1 + 1)) env "${JOB_ENV[@]}" timeout -k 5 150 "$LOOM" train $CFG --task worker:$1 --model-dir "$WORK/el" \
        --set "$(workers_on 3)" "${EL[@]}" >"$WORK/el.$1$2" 2>&1; echo $? >"$WORK/el.$1$2.rc") &
    PIDS+=($!)
}
el_task 0; el_task 1; el_task 2
wait_for "$WORK/el/ckpt-20.loom"
w=$(pgrep -f -- "^$LOOM train .*--task worker:2 --model-dir $WORK/el " | head -1) # (loom, not its timeout)
[ -n "$w" ] && kill -9 "$w"
for ((i = 0; i < 600; i++)); do [ -e "$WORK/el.2.rc" ] && break; sleep 0.05; done
el_task 2 .b
wait
log=$(cat "$WORK/el.0")
if [ -n "$w" ] && [ "$(rc_of el.0)$(rc_of el.1)$(rc_of el.2.b)" = 000 ] && grep -q "worker:2 left at step" <<<"$log" &&
   grep -q "worker:2 joined at step [0-9]*; continuing with 3 workers" <<<"$log" && [ -e "$WORK/el/ckpt-80.loom" ]; then
    pass "elastic over 3 hosts: worker:2 killed -9 on host 3 and started again joins; the job trains to step 80"
else
    fail "elastic over 3 hosts: worker:2 killed -9 and started again joins" "pid '$w', rc $(rc_of el.0) $(rc_of el.1) $(rc_of el.2.b)" \
        "$(grep -E "left|joined" <<<"$log")" "$(tail -3 "$WORK/el.2.b")"
fi

# ---- elastic past the list across the hosts: 2 listed (hosts 1 and 2), max_workers = 3: worker:2 on host 3,
# in no list, listens on an ephemeral port of every interface; the chief records the address its connection
# comes from and tells worker:1, whose ring successor it becomes ---------------------------------------------
GR=(--set run.max_steps=60 --set run.checkpoint_steps=10 --set run.eval_steps=1 --set cluster.heartbeat_timeout=3
    --set strategy.elastic.min_workers=2 --set strategy.elastic.max_workers=3
    --set 'hooks.callbacks=({ fn = "../lua/mwm_slow.lua:slow"; args = { seconds = 0.04; }; })')
gr_task() { # I: worker:I on host I+1, the list naming 2
    (netns_exec $(($1 + 1)) env "${JOB_ENV[@]}" timeout -k 5 150 "$LOOM" train $CFG --task worker:$1 --model-dir "$WORK/gr" \
        --set "$(workers_on 2)" "${GR[@]}" >"$WORK/gr.$1" 2>&1; echo $? >"$WORK/gr.$1.rc") &
    PIDS+=($!)
}
gr_task 0; gr_task 1
wait_for "$WORK/gr/ckpt-10.loom"
gr_task 2
wait
log=$(cat "$WORK/gr.0")
if [ "$(rc_of gr.0)$(rc_of gr.1)$(rc_of gr.2)" = 000 ] && [ -e "$WORK/gr/ckpt-60.loom" ] &&
   grep -q "worker:2 joined at step [0-9]*; continuing with 3 workers" <<<"$log"; then
    pass "elastic past the list over 3 hosts: worker:2 (unlisted) on host 3 joins; the job trains to step 60"
else
    fail "elastic past the list over 3 hosts: worker:2 (unlisted) on host 3 joins" \
        "rc $(rc_of gr.0) $(rc_of gr.1) $(rc_of gr.2)" "$(tail -3 <<<"$log")" "$(tail -3 "$WORK/gr.2")"
fi
contains "elastic past the list: the chief records host 3's address for worker:2" \
    "worker:2 (not in the cluster's list) asks to join; it listens on $(netns_addr 3):" "$log"
finish
