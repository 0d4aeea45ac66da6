#!/usr/bin/env bash
# resume.sh - same seed, same weights; a run stopped (cleanly or by SIGKILL)
# and restarted ends bit-identical to an uninterrupted one.
source "$(dirname "$0")/lib.sh"
CFG=tests/configs/small_mlp.cfg
final() { ls "$1"/ckpt-*.loom | sed 's/.*ckpt-\([0-9]*\).loom/\1 &/' | sort -n | tail -1 | cut -d' ' -f2; }
# same_weights NAME A B: the checkpoints' tensors (parameters and optimizer
# slots) are bit-identical. The iterator blob may legitimately differ in form
# (how far a prefetch thread had run ahead) while meaning the same position.

check "uninterrupted run A" "$LOOM" train $CFG --model-dir "$WORK/a" --set run.progress='"none"'
check "uninterrupted run B" "$LOOM" train $CFG --model-dir "$WORK/b" --set run.progress='"none"'
fa=$(final "$WORK/a"); fb=$(final "$WORK/b")
same_weights "two runs with one seed give bit-identical weights" "$fa" "$fb"

# stop mid-epoch (step 45 of 96; 32 steps per epoch) and resume
check "run to step 45" "$LOOM" train $CFG --model-dir "$WORK/c" --set run.max_steps=45 --set run.progress='"none"'
check "resume to the end" "$LOOM" train $CFG --model-dir "$WORK/c" --set run.progress='"none"'
fc=$(final "$WORK/c")
same_weights "resumed mid-epoch = uninterrupted (bit-identical weights and slots)" "$fa" "$fc"

# the same through list_files (shuffled) + parallel interleave + shuffle + prefetch over TFRecord shards
TCFG=configs/fashion_mnist_tfrecord.cfg
[ -f runs/fashion_mnist_records/train-00003-of-00004.tfrecord.zst ] ||
    check "make runs/fashion_mnist_records" "${LOOM_MAKE_FMNIST_RECORDS:-$(dirname "$LOOM")/tests/make_fmnist_records}" \
        runs/fashion_mnist_records
check "tfrecord interleave: run to step 150" "$LOOM" train $TCFG --model-dir "$WORK/t1" --set run.max_steps=150 --set run.progress='"none"'
check "tfrecord interleave: run to step 70 (mid-epoch)" "$LOOM" train $TCFG --model-dir "$WORK/t2" --set run.max_steps=70 --set run.progress='"none"'
check "tfrecord interleave: resume to step 150" "$LOOM" train $TCFG --model-dir "$WORK/t2" --set run.max_steps=150 --set run.progress='"none"'
same_weights "interleaved input resumed mid-epoch = uninterrupted" "$WORK/t1/ckpt-150.loom" "$WORK/t2/ckpt-150.loom"

# the same through fashion_mnist_mlp.cfg's shuffle(indices) over the whole catalog (a buffer of
# 60000 positions): stopped mid-epoch 1, resumed across the epoch boundary
MCFG=configs/fashion_mnist_mlp.cfg
MOPT=(--set run.checkpoint_steps=0 --set run.eval_each_epoch=false --set run.progress='"none"')
check "mlp shuffle(indices): run to step 600" "$LOOM" train $MCFG --model-dir "$WORK/m1" --set run.max_steps=600 "${MOPT[@]}"
check "mlp shuffle(indices): run to step 300 (mid-epoch)" "$LOOM" train $MCFG --model-dir "$WORK/m2" --set run.max_steps=300 "${MOPT[@]}"
out=$("$LOOM" train $MCFG --model-dir "$WORK/m2" --set run.max_steps=600 "${MOPT[@]}" 2>&1)
contains "mlp shuffle(indices): resumed from step 300" "resuming from $WORK/m2/ckpt-300.loom (step 300" "$out"
same_weights "shuffle(indices) resumed mid-epoch = uninterrupted" "$WORK/m1/ckpt-600.loom" "$WORK/m2/ckpt-600.loom"

# SIGKILL at an arbitrary moment, then resume from whatever checkpoint survived
"$LOOM" train $CFG --model-dir "$WORK/d" --set run.progress='"none"' --set run.epochs=40 >/dev/null 2>&1 &
pid=$!
for _ in $(seq 1 200); do
    n=$(ls "$WORK/d"/ckpt-*.loom 2>/dev/null | wc -l)
    [ "$n" -ge 3 ] && break
    sleep 0.05
done
kill -9 $pid 2>/dev/null; wait $pid 2>/dev/null
left=$(ls "$WORK/d" | grep -c '\.tmp\.' || true)
check "resume after SIGKILL" "$LOOM" train $CFG --model-dir "$WORK/d" --set run.progress='"none"'
# the killed run trained further than 3 epochs perhaps; compare with an uninterrupted 40-epoch run only at the end
check "uninterrupted 40-epoch run" "$LOOM" train $CFG --model-dir "$WORK/e" --set run.progress='"none"' --set run.epochs=40
check "finish the killed run to 40 epochs" "$LOOM" train $CFG --model-dir "$WORK/d" --set run.progress='"none"' --set run.epochs=40
fd=$(final "$WORK/d"); fe=$(final "$WORK/e")
same_weights "killed and resumed = uninterrupted (bit-identical weights and slots)" "$fd" "$fe"
# and the check itself can fail: an epoch earlier is different
same_weights_neg() { ! [ "$("$LOOM" inspect "$1" | grep '^tensor')" = "$("$LOOM" inspect "$2" | grep '^tensor')" ]; }
if same_weights_neg "$WORK/a/ckpt-64.loom" "$fa"; then pass "inspect tells different weights apart"; else fail "inspect tells different weights apart"; fi

# SIGINT and SIGTERM: a checkpoint of the step reached, then exit 128 +
# the signal (130, 143), as a shell reports a process the signal killed
# (issue 22: SIGINT exited 1); the rerun resumes from that checkpoint
for sig in INT TERM; do
    want=$([ $sig = INT ] && echo 130 || echo 143)
    "$LOOM" train $CFG --model-dir "$WORK/sig$sig" --set run.progress='"none"' --set run.epochs=400 >"$WORK/sig$sig.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 200); do [ -e "$WORK/sig$sig/ckpt-64.loom" ] && break; sleep 0.05; done
    kill -$sig $pid; wait $pid; st=$?
    [ $st -eq $want ] && pass "SIG$sig: exit status $want" || fail "SIG$sig: exit status $want" "status $st" "$(tail -3 "$WORK/sig$sig.log")"
    step=$(sed -n "s/.*interrupted by signal [0-9]* at step \([0-9]*\); saved .*/\1/p" "$WORK/sig$sig.log")
    [ -n "$step" ] && [ -f "$WORK/sig$sig/ckpt-$step.loom" ] && pass "SIG$sig: the checkpoint of step $step is saved" ||
        fail "SIG$sig: a checkpoint is saved" "step '$step'" "$(tail -3 "$WORK/sig$sig.log")"
done

# the sidecar evaluator too: SIGINT between evaluations exits 130
"$LOOM" evaluate $CFG --model-dir "$WORK/sigINT" --watch --idle-timeout 60 >"$WORK/watch.log" 2>&1 &
pid=$!
for _ in $(seq 1 100); do grep -q "eval loss" "$WORK/watch.log" && break; sleep 0.1; done
kill -INT $pid; wait $pid; st=$?
[ $st -eq 130 ] && pass "evaluate --watch: SIGINT exits 130" || fail "evaluate --watch: SIGINT exits 130" "status $st" "$(tail -3 "$WORK/watch.log")"
contains "evaluate --watch: says it was stopped by the signal" "stopped by signal 2 after 1 evaluation" "$(cat "$WORK/watch.log")"

# evaluate and predict use the latest checkpoint
out=$("$LOOM" evaluate $CFG --model-dir "$WORK/a" 2>/dev/null)
contains "evaluate prints accuracy as JSON" '"eval_accuracy"' "$out"
acc=$(echo "$out" | sed 's/.*"eval_accuracy": \([0-9.]*\).*/\1/')
if awk "BEGIN{exit !($acc > 0.6)}"; then pass "small model learned something (eval accuracy $acc > 0.6)"; else fail "small model learned (eval accuracy $acc)"; fi
check "predict on eval" "$LOOM" predict $CFG --model-dir "$WORK/a" --output "$WORK/pred.csv"
lines=$(wc -l < "$WORK/pred.csv")
if [ "$lines" -eq 1001 ]; then pass "predict writes one row per example plus a header"; else fail "predict rows" "$lines lines"; fi
head -1 "$WORK/pred.csv" | grep -q '^index,class,p0,p1,p2,p3,p4,p5,p6,p7,p8,p9$' && pass "predict CSV header" || fail "predict CSV header" "$(head -1 "$WORK/pred.csv")"
# predict's classes agree with evaluate's accuracy
labels=$(mktemp)
python3 - "$WORK/pred.csv" "$acc" <<'PY' && pass "predicted classes reproduce the evaluated accuracy" || fail "predicted classes reproduce the evaluated accuracy"
import sys, gzip, struct
rows = [l.split(',') for l in open(sys.argv[1]).read().split('\n')[1:] if l]
with gzip.open('/usr/share/datasets/fashion-mnist/t10k-labels-idx1-ubyte.gz') as f:
    data = f.read()[8:8 + len(rows)]
acc = sum(int(r[1]) == data[i] for i, r in enumerate(rows)) / len(rows)
probs_ok = all(abs(sum(float(x) for x in r[2:]) - 1) < 1e-3 for r in rows)
sys.exit(0 if abs(acc - float(sys.argv[2])) < 1e-6 and probs_ok else 1)
PY
rm -f "$labels"
# predict from an IDX file of images
check "predict on an IDX file" "$LOOM" predict $CFG --model-dir "$WORK/a" --input /usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz --output "$WORK/pred2.csv"
lines=$(wc -l < "$WORK/pred2.csv")
if [ "$lines" -eq 10001 ]; then pass "IDX predict covers all 10000 images"; else fail "IDX predict rows" "$lines"; fi
if [ "$(sed -n 2,1001p "$WORK/pred2.csv" | cut -d, -f2)" = "$(sed -n 2,1001p "$WORK/pred.csv" | cut -d, -f2)" ]; then
    pass "IDX predict agrees with dataset predict"; else fail "IDX predict agrees with dataset predict"; fi
# metrics.jsonl: one line per epoch with the promised keys, then an end line
m="$WORK/a/metrics.jsonl"
n=$(grep -c '"event": "epoch"' "$m")
if [ "$n" -eq 3 ]; then pass "metrics.jsonl has one line per epoch"; else fail "metrics.jsonl epochs" "$n"; fi
for k in epoch step train_loss eval_loss eval_accuracy samples_per_sec wall_time; do
    grep '"event": "epoch"' "$m" | head -1 | grep -q "\"$k\"" || { fail "metrics key $k"; continue; }
done
pass "metrics.jsonl epoch lines have the documented keys"
finish
