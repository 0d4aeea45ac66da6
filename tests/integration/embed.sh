#!/usr/bin/env bash
# embed.sh - embeddings and the CTR data through the loom binary
# (tests/configs/ctr_small.cfg: 8 columns of 2 ids into a 16384 x 8 table,
# lazy Adam): `loom records convert --config` writes the synthetic ctr data
# to TFRecord, reproducibly, and training on those files gives the very
# weights of training on the source; mirrored, central_storage and
# multi_worker_mirrored (densified gradients) train the weights of
# one_device within float rounding; a run stopped and resumed ends
# bit-identical (table and Adam/Adagrad slots); bad ids, inputs and ctr
# settings are clear errors.
source "$(dirname "$0")/lib.sh"
DIFF="${LOOM_CKPT_DIFF:-$(dirname "$LOOM")/tests/ckpt_diff}"
CFG=tests/configs/ctr_small.cfg
kill_jobs_at_exit
# close NAME TOL A B: ||a - b|| / ||a|| <= TOL
close() {
    local d
    if d=$("$DIFF" $CFG "$3" "$4" 2>&1) && awk -v d="$d" -v t="$2" 'BEGIN { exit !(d <= t) }'; then
        pass "$1 (${d} apart)"
    else
        fail "$1" "ckpt_diff: $d"
    fi
}

# ---- records: the synthetic ctr data as TFRecord, by seed --------------------------
check "records convert --config writes the ctr data" \
    "$LOOM" records convert --config $CFG --count 6400 --shards 2 --output "$WORK/rec/a"
check "a second conversion" "$LOOM" records convert --config $CFG --count 6400 --shards 2 --output "$WORK/rec/b"
if cmp -s "$WORK/rec/a-00000-of-00002.tfrecord" "$WORK/rec/b-00000-of-00002.tfrecord" &&
    cmp -s "$WORK/rec/a-00001-of-00002.tfrecord" "$WORK/rec/b-00001-of-00002.tfrecord"; then
    pass "the same seed writes the same bytes"
else
    fail "the same seed writes the same bytes"
fi
out=$("$LOOM" records count "$WORK"/rec/a-*.tfrecord 2>&1)
contains "6400 records in all" "6400" "$out"
out=$("$LOOM" records head "$WORK/rec/a-00000-of-00002.tfrecord" -n 1 2>&1)
contains "head: ids are 16 int64s" "ids    int64_list  length 16" "$out"
contains "head: label is one float" "label  float_list  length 1" "$out"
contains "head: the true probability rides along" "prob   float_list  length 1" "$out"
expect_fail 2 "an infinite source needs --count" "ctr_small.cfg:8: the source of data.train is infinite" \
    "$LOOM" records convert --config $CFG --output "$WORK/rec/inf"
expect_fail 2 "--count without --config" "--count applies to --config only" \
    "$LOOM" records convert --csv x.csv --count 5 --output "$WORK/rec/x"

# training on the files = training on the source, bit for bit
sed -e '/^  train: {/,/^  };/{s|source: { type = "synthetic"; count = -1;|source: { type = "tfrecord"; files = ["'"$WORK"'/rec/a-*.tfrecord"]; features: { ids = { dtype = "int64"; shape = [8, 2]; }; label = { dtype = "float32"; shape = []; }; }; }; #|; s|^              ctr = .*$||}' \
    $CFG >"$WORK/ctr_tfrecord.cfg"
check "one_device run" "$LOOM" train $CFG --model-dir "$WORK/one"
check "one_device, 5 steps" "$LOOM" train $CFG --model-dir "$WORK/five" --set run.max_steps=5
# the model learns: the eval loss after 100 steps well below that after 5
l5=$(grep '"event": "end"' "$WORK/five/metrics.jsonl" | sed 's/.*"eval_loss": \([0-9.]*\).*/\1/')
l100=$(grep '"event": "end"' "$WORK/one/metrics.jsonl" | sed 's/.*"eval_loss": \([0-9.]*\).*/\1/')
if awk -v a="$l5" -v b="$l100" 'BEGIN { exit !(b < a - 0.05) }'; then pass "the model learns (eval loss $l5 -> $l100)"
else fail "the model learns" "eval loss $l5 -> $l100"; fi
check "the same model from the TFRecord files" "$LOOM" train "$WORK/ctr_tfrecord.cfg" --model-dir "$WORK/tfr"
same_weights "TFRecord files train the weights of the synthetic source" "$WORK/one/ckpt-100.loom" "$WORK/tfr/ckpt-100.loom"

# ---- strategies: densified gradients, lazy Adam, against one_device ------------------
check "mirrored(2) run" "$LOOM" train $CFG --model-dir "$WORK/mir" --set strategy.type=mirrored --set strategy.replicas=2
close "mirrored(2) = one_device within 1e-5 after 100 lazy Adam steps" 1e-5 "$WORK/one/ckpt-100.loom" "$WORK/mir/ckpt-100.loom"
check "central_storage(2) run" "$LOOM" train $CFG --model-dir "$WORK/cen" \
    --set strategy.type=central_storage --set strategy.replicas=2
close "central_storage(2) = one_device within 1e-5" 1e-5 "$WORK/one/ckpt-100.loom" "$WORK/cen/ckpt-100.loom"
out=$("$LOOM" check $CFG --set strategy.type=mirrored --set strategy.replicas=2 2>&1)
contains "check: the densified all-reduce carries the table" "all-reduced per step: 516.1 KiB per replica" "$out"

# multi_worker_mirrored: 2 processes on loopback
base=$(python3 -c 'import socket
s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close()
t = socket.socket(); t.bind(("127.0.0.1", 0)); q = t.getsockname()[1]; t.close(); print(p, q)')
read -r p0 p1 <<<"$base"
for i in 0 1; do
    (timeout 60 "$LOOM" train $CFG --task worker:$i --model-dir "$WORK/mw" --set strategy.type=multi_worker_mirrored \
        --set "cluster.worker=[\"127.0.0.1:$p0\",\"127.0.0.1:$p1\"]" >"$WORK/mw.$i" 2>&1; echo $? >"$WORK/mw.$i.rc") &
    PIDS+=($!)
done
for p in "${PIDS[@]}"; do wait "$p"; done
if [ "$(cat "$WORK/mw.0.rc")" = 0 ] && [ "$(cat "$WORK/mw.1.rc")" = 0 ]; then pass "2 workers: both exit 0"
else fail "2 workers: both exit 0" "$(tail -3 "$WORK/mw.0")" "$(tail -3 "$WORK/mw.1")"; fi
close "multi_worker_mirrored(2 workers) = mirrored(2) within 1e-6" 1e-6 "$WORK/mir/ckpt-100.loom" "$WORK/mw/ckpt-100.loom"

# ---- checkpoints hold the table and the slots: an exact resume -------------------------
check "run to step 45" "$LOOM" train $CFG --model-dir "$WORK/res" --set run.max_steps=45
check "resume to the end" "$LOOM" train $CFG --model-dir "$WORK/res"
same_weights "resumed = uninterrupted (table, Adam m and v)" "$WORK/one/ckpt-100.loom" "$WORK/res/ckpt-100.loom"
AG=(--set optimizer.type=adagrad --set optimizer.learning_rate=0.1)
check "adagrad run" "$LOOM" train $CFG --model-dir "$WORK/ag" "${AG[@]}"
check "adagrad: run to step 33" "$LOOM" train $CFG --model-dir "$WORK/agr" "${AG[@]}" --set run.max_steps=33
check "adagrad: resume" "$LOOM" train $CFG --model-dir "$WORK/agr" "${AG[@]}"
same_weights "adagrad: resumed = uninterrupted (table and accumulator)" "$WORK/ag/ckpt-100.loom" "$WORK/agr/ckpt-100.loom"
contains "the accumulator is checkpointed beside the table" "embedding_0/embeddings/accumulator" \
    "$("$LOOM" inspect "$WORK/ag/ckpt-100.loom")"

# ---- bad input ----------------------------------------------------------------------
expect_fail 1 "an id outside the table names the layer, example, column and id" \
    'layer "embedding_0" (embedding): example 0 of the batch, column 0: id 15611 is outside [0, 1000) (input_dim)' \
    "$LOOM" train $CFG --model-dir "$WORK/bad1" --set 'model.layers.[0].input_dim=1000'
expect_fail 2 "float input to an embedding" "an embedding layer needs int32 or int64 ids" \
    "$LOOM" check $CFG --set model.input=prob
expect_fail 2 "an embedding that is not the first layer" "so it must be the first layer" \
    "$LOOM" check $CFG --set 'model.layers.[1].type=embedding' --set 'model.layers.[1].input_dim=5' --set 'model.layers.[1].output_dim=2'
check "export: an embedding model as ONNX (Gather, masked -1 ids, ReduceSum; onnxruntime checks it in export_interop)" \
    "$LOOM" export $CFG --model-dir "$WORK/one" --format onnx --output "$WORK/m.onnx"
check "export npz" "$LOOM" export $CFG --model-dir "$WORK/one" --format npz --output "$WORK/m.npz"
expect_fail 2 "ctr.columns out of range" "data.train.source.ctr.columns: expected an integer in [1, 1024], got 0" \
    "$LOOM" check $CFG --set 'data.train.source.ctr.columns=0'
expect_fail 2 "embedding without output_dim" "missing required setting \`output_dim\`" \
    "$LOOM" check tests/configs/bad_embedding.cfg
finish
