#!/usr/bin/env bash
# ps_sparse.sh - parameter_server with sparse updates of an embedding table
# (issue 14, item 4) through `loom launch --local` on 127.0.0.1, on
# tests/configs/ps_ctr.cfg (the small CTR model, its 16384 x 8 table split
# over 2 ps tasks, lazy Adam): a worker pulls only the table rows its batch
# looks up and pushes only their gradients. Checked: 1 worker + 2 ps ends
# with the weights and slots of one_device bit for bit (Adam, Adagrad), and of the same job
# with the table moved whole (LOOM_TEST_PS_DENSE_TABLES=1); a synchronous
# job of 2 differently shuffling workers (rows summed by id, then averaged)
# ends as the same job with the table moved whole; optimizer.clip_norm
# clips on the worker as one_device clips; the bytes moved per step are
# those of the rows touched, not of the table; a worker killed mid-run
# still leaves every step applied; an id outside the table is named. Then
# configs/ctr_parameter_server.cfg (2 workers + 2 ps, the 2^20-row table)
# trains briefly end to end. Every launch runs under `timeout`; launch kills
# its tasks when it exits.
source "$(dirname "$0")/lib.sh"
CFG=tests/configs/ps_ctr.cfg
L() { timeout 120 "$LOOM" launch --local "$@"; }
tensors() { "$LOOM" inspect "$1" | grep '^tensor'; }
DIFF="${LOOM_CKPT_DIFF:-$(dirname "$LOOM")/tests/ckpt_diff}"
# same_weights WHAT A B [--set K=V ...]: parameters and optimizer slots bit for
# bit (ckpt_diff --exact reads one-file checkpoints and sharded ones alike)
same_weights() {
    local what=$1 a=$2 b=$3 out; shift 3
    out=$("$DIFF" --exact tests/configs/ctr_small.cfg "$a" "$b" "$@" 2>&1)
    if [ "$out" = identical ]; then pass "$what"; else fail "$what" "$a vs $b" "$out"; fi
}
# field NAME TEXT: the number after NAME= in the coordinator's traffic line
field() { grep -o "$1=[0-9.]*" <<<"$2" | head -1 | cut -d= -f2; }
ok_run() { # NAME STATUS OUTPUT
    [ "$2" -eq 0 ] && pass "$1" || fail "$1" "status $2" "$(tail -6 <<<"$3")"
}

out=$("$LOOM" check $CFG --task chief:0 2>&1)
contains "check: the plan says the table moves by rows" \
    "the embedding table embedding_0/embeddings: workers pull only the rows a batch looks up" "$out"
contains "check: the table split over both ps" "embedding_0/embeddings (16384, 8) shard 2/2: rows 8192..16383" "$out"

# ---- sparse = one_device = dense, bit for bit ------------------------------------------
# (tests/configs/ctr_small.cfg: the same model, data, seed and optimizer under one_device)
check "one_device run" "$LOOM" train tests/configs/ctr_small.cfg --model-dir "$WORK/one"
out=$(L $CFG --workers 1 --ps 2 --model-dir "$WORK/sp" 2>&1); st=$?
ok_run "sparse, 1 worker + 2 ps: completes" $st "$out"
contains "sparse: every step applied" "done: step 100" "$out"
sparse_line=$(grep "the workers' pulls and pushes moved" <<<"$out")
out=$(LOOM_TEST_PS_DENSE_TABLES=1 L $CFG --workers 1 --ps 2 --model-dir "$WORK/de" 2>&1); st=$?
ok_run "table moved whole, 1 worker + 2 ps: completes" $st "$out"
dense_line=$(grep "the workers' pulls and pushes moved" <<<"$out")
same_weights "sparse pull/push = one_device (table, dense layers, Adam m and v), bit for bit" \
    "$WORK/one/ckpt-100.loom" "$WORK/sp/ckpt-100.loom"
same_weights "sparse pull/push = the table moved whole, bit for bit" "$WORK/de/ckpt-100.loom" "$WORK/sp/ckpt-100.loom"

# Adagrad (the CTR config's optimizer): the sparse update's bits are the dense update's
AG=(--set optimizer.type=adagrad --set optimizer.learning_rate=0.1)
check "one_device run, adagrad" "$LOOM" train tests/configs/ctr_small.cfg --model-dir "$WORK/oneag" "${AG[@]}"
out=$(L $CFG --workers 1 --ps 2 --model-dir "$WORK/spag" "${AG[@]}" 2>&1); st=$?
ok_run "sparse, adagrad: completes" $st "$out"
same_weights "sparse, adagrad = one_device (table and accumulator), bit for bit" \
    "$WORK/oneag/ckpt-100.loom" "$WORK/spag/ckpt-100.loom" "${AG[@]}"

# optimizer.clip_norm: the worker clips by the global norm of its gradients before pushing
CLIP=optimizer.clip_norm=0.05
check "one_device run, clip_norm 0.05" "$LOOM" train tests/configs/ctr_small.cfg --model-dir "$WORK/onec" --set $CLIP
out=$(L $CFG --workers 1 --ps 2 --model-dir "$WORK/spc" --set $CLIP 2>&1); st=$?
ok_run "sparse, clip_norm 0.05: completes" $st "$out"
same_weights "sparse, clip_norm: the worker's global-norm clipping = one_device's, bit for bit" \
    "$WORK/onec/ckpt-100.loom" "$WORK/spc/ckpt-100.loom" --set $CLIP
if [ "$(tensors "$WORK/onec/ckpt-100.loom")" != "$(tensors "$WORK/one/ckpt-100.loom")" ]; then
    pass "clip_norm 0.05 did clip (other weights than without)"
else
    fail "clip_norm 0.05 did clip"
fi

# ---- bytes per step: the rows touched, not the table -----------------------------------
# per step, for R rows (a mean): the dense variables (1057 floats) and the rows (8 floats) pulled
# and pushed, the rows' 4-byte ids in the PULL, its VALUES and the PUSH, the 32-byte header of
# each of 4 messages to and from each of 2 ps, and the 8-byte head of each of the 6 shards in 3
bps=$(field bytes_per_step "$sparse_line")
whole=$(field whole_bytes_per_step "$sparse_line")
rows=$(field rows_per_step "$sparse_line")
dbps=$(field bytes_per_step "$dense_line")
if [ -n "$bps" ] && [ -n "$rows" ] && awk -v b="$bps" -v r="$rows" 'BEGIN {
        want = 2 * (1057 * 4 + r * 8 * 4) + 3 * 4 * r + 4 * 2 * 32 + 3 * 6 * 8;
        exit !(b >= want - 16 && b <= want + 16) }'; then
    pass "sparse: $bps bytes a step = the dense variables and $rows table rows both ways, their ids and headers"
else
    fail "sparse: bytes a step are those of the rows touched" "$sparse_line"
fi
if [ -n "$bps" ] && [ -n "$whole" ] && awk -v b="$bps" -v w="$whole" 'BEGIN { exit !(b * 10 < w) }'; then
    pass "sparse: more than 10x fewer bytes than the whole variables ($bps vs $whole a step)"
else
    fail "sparse: more than 10x fewer bytes than the whole variables" "$sparse_line"
fi
if [ -n "$dbps" ] && awk -v b="$dbps" -v w="$whole" 'BEGIN { exit !(b >= w && b < w * 1.01) }'; then
    pass "table moved whole: the whole variables both ways ($dbps a step)"
else
    fail "table moved whole: the whole variables both ways" "$dense_line"
fi

# ---- synchronous, 2 of 2, workers that shuffle differently: rows summed by id ------------------
sed -e 's|{ op = "take"; count = 6400; },|{ op = "take"; count = 6400; }, { op = "shuffle"; buffer = 640; },|' $CFG >"$WORK/shuf.cfg"
SYNC='strategy.sync={replicas_to_aggregate=2;total_replicas=2;}'
out=$(L "$WORK/shuf.cfg" --workers 2 --ps 2 --model-dir "$WORK/ss" --set "$SYNC" 2>&1); st=$?
ok_run "sync 2 of 2, sparse: completes" $st "$out"
contains "sync, sparse: none stale, every step" "parameter_server: 0 stale gradients dropped" "$out"
out=$(LOOM_TEST_PS_DENSE_TABLES=1 L "$WORK/shuf.cfg" --workers 2 --ps 2 --model-dir "$WORK/sd" --set "$SYNC" 2>&1); st=$?
ok_run "sync 2 of 2, table moved whole: completes" $st "$out"
same_weights "sync: the mean of 2 workers' rows summed by id = of their whole tables, bit for bit" \
    "$WORK/sd/ckpt-100.loom" "$WORK/ss/ckpt-100.loom"
if [ "$("$DIFF" --exact tests/configs/ctr_small.cfg "$WORK/ss/ckpt-100.loom" "$WORK/one/ckpt-100.loom" 2>&1)" != identical ]; then
    pass "sync: the workers did see other batches (not one_device's weights)"
else
    fail "sync: the workers did see other batches"
fi

# ---- a worker killed mid-run; an id outside the table ---------------------------------------
out=$(LOOM_TEST_PS_DIE=worker:1@3 L $CFG --workers 2 --ps 2 --model-dir "$WORK/wkill" 2>&1); st=$?
ok_run "sparse, a worker killed: the job completes" $st "$out"
contains "sparse, a worker killed: its step function is put back" "put back in the queue for another worker" "$out"
contains "sparse, a worker killed: every step applied" "done: step 100" "$out"
out=$(L $CFG --workers 2 --ps 2 --model-dir "$WORK/badid" --set 'model.layers.[0].input_dim=1000' \
      --set cluster.connect_timeout=5 2>&1); st=$?
[ $st -ne 0 ] && pass "an id outside the table: the job stops" || fail "an id outside the table: the job stops" "status 0"
contains "an id outside the table: named by the worker" \
    'layer "embedding_0" (embedding): example 0 of the batch, column 0: id 15611 is outside [0, 1000) (input_dim)' "$out"

# ---- configs/ctr_parameter_server.cfg: 2 workers + 2 ps, briefly ----------------------------
out=$(timeout 240 "$LOOM" launch --local configs/ctr_parameter_server.cfg --workers 2 --ps 2 --model-dir "$WORK/ctr" \
      --set run.max_steps=10 --set data.eval.source.count=1000 --set run.threads=1 2>&1); st=$?
ok_run "ctr_parameter_server.cfg: 2 workers + 2 ps train" $st "$out"
contains "ctr_parameter_server.cfg: every step applied" "done: step 10" "$out"
line=$(grep "the workers' pulls and pushes moved" <<<"$out")
x=$(grep -o '[0-9.]*x)' <<<"$line" | tr -d 'x)')
if [ -n "$x" ] && awk -v x="$x" 'BEGIN { exit !(x >= 20) }'; then
    pass "ctr_parameter_server.cfg: ${x}x fewer bytes a step than moving the 2^20-row table"
else
    fail "ctr_parameter_server.cfg: far fewer bytes a step than moving the table" "$line"
fi
ev=$("$LOOM" evaluate configs/ctr_parameter_server.cfg --model-dir "$WORK/ctr" --set data.eval.source.count=1000 2>/dev/null)
contains "ctr_parameter_server.cfg: its checkpoint evaluates" '"step": 10' "$ev"

finish
