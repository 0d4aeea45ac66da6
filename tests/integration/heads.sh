#!/usr/bin/env bash
# heads.sh - several output heads (model.outputs, issue 23) on Fashion-MNIST
# (configs/fashion_mnist_two_heads.cfg: the 10 classes, and "footwear", a
# binary label a Lua map derives from the class). A brief run logs each
# head's loss and accuracy in metrics.jsonl, the total being the weighted
# sum (so do the summaries, in TensorBoard too); the footwear head learns; intra-op threads give the same bits;
# mirrored(2), central_storage(2), multi_worker_mirrored (2 workers) match
# one_device; parameter_server (2 workers, 1 ps) evaluates each head;
# evaluate reports every head; predict writes every head's columns; the
# config errors name file:line (unknown layer, duplicate head, first head
# not last, model.loss beside outputs, a label that is not a feature). Each run under `timeout`.
source "$(dirname "$0")/lib.sh"
CFG=configs/fashion_mnist_two_heads.cfg
S=(--set run.eval_steps=4 --set run.epochs=1)  # one pass: 469 steps

check "check: the two-head config" timeout 60 "$LOOM" check $CFG
run() { # NAME ARGS...: trains into $WORK/NAME, status checked
    local name=$1 out; shift
    if out=$(timeout 180 "$LOOM" train $CFG --model-dir "$WORK/$name" "$@" 2>&1); then
        pass "$name: training ends with status 0"
    else
        fail "$name: training ends with status 0" "$(echo "$out" | tail -4)"
    fi
    LOG=$out
}
run one "${S[@]}" --set run.summary_steps=100
contains "the log line names each head's loss" "logits_loss" "$LOG"
contains "the log line has the footwear head's accuracy" "footwear_accuracy" "$LOG"
# metrics.jsonl: the last line with train_ and eval_ values of each head; total = logits + 0.5 footwear
out=$(python3 - "$WORK/one/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
ep = [r for r in rows if r.get("event") == "epoch"][-1]
keys = ["train_logits_loss", "train_footwear_loss", "train_footwear_accuracy", "eval_logits_loss",
        "eval_footwear_loss", "eval_footwear_accuracy", "eval_loss"]
miss = [k for k in keys if ep.get(k) is None]
if miss: print("missing", miss); sys.exit(1)
tot = ep["eval_logits_loss"] + 0.5 * ep["eval_footwear_loss"]
print("weighted %.6f eval_loss %.6f footwear_acc %.4f" % (tot, ep["eval_loss"], ep["eval_footwear_accuracy"]))
ok = abs(tot - ep["eval_loss"]) <= 1e-5 * max(1, ep["eval_loss"]) and ep["eval_footwear_accuracy"] > 0.9
sys.exit(0 if ok else 1)
PY
) && pass "metrics.jsonl: per-head losses and accuracy, eval_loss = logits + 0.5 footwear, footwear learnt ($out)" ||
    fail "metrics.jsonl: per-head values" "$out" "$(tail -2 "$WORK/one/metrics.jsonl")"

n=$(cat "$WORK"/one/eval/events.out.tfevents.* 2>/dev/null | grep -c -a -e footwear_accuracy -e logits_loss)
[ "${n:-0}" -ge 1 ] && pass "TensorBoard: the eval scalars name the heads" || fail "TensorBoard: eval scalars of the heads" "$n"
# the training summaries (every 100 steps): each head's loss and accuracy over the window, in TensorBoard too
out=$(python3 - "$WORK/one/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
sm = [r for r in rows if r.get("event") == "summary"]
bad = [r["step"] for r in sm if abs(r["logits_loss"] + 0.5 * r["footwear_loss"] - r["loss"]) > 1e-4 * r["loss"]
       or not 0 <= r["footwear_accuracy"] <= 1]
print("%d summaries, %s bad" % (len(sm), bad or "none"))
sys.exit(0 if len(sm) >= 4 and not bad else 1)
PY
) && pass "metrics.jsonl: each summary's head losses sum to its loss ($out)" || fail "summaries: per-head values" "$out"
n=$(cat "$WORK"/one/events.out.tfevents.* 2>/dev/null | grep -c -a -e footwear_accuracy)
[ "${n:-0}" -ge 1 ] && pass "TensorBoard: the training scalars name the heads" || fail "TensorBoard: training scalars of the heads" "$n"
run t1 "${S[@]}" --set run.threads=1
run t2 "${S[@]}" --set run.threads=2
same_weights "run.threads 1 and 2: the same bits" "$WORK/t1/ckpt-469.loom" "$WORK/t2/ckpt-469.loom"
# 20 steps: mirrored(2) evaluates as one_device (float rounding apart)
Q=(--set run.max_steps=20 --set run.eval_steps=1 --set run.checkpoint_steps=20)
run o20 "${Q[@]}"
run m2 "${Q[@]}" --set strategy.type=mirrored --set strategy.replicas=2
run cs2 "${Q[@]}" --set strategy.type=central_storage --set strategy.replicas=2
# multi_worker_mirrored and parameter_server: 2 workers (and 1 ps) on 127.0.0.1 through launch --local
launch() { # NAME ARGS...: like run, through loom launch --local
    local name=$1 out; shift
    if out=$(timeout 180 "$LOOM" launch --local $CFG --model-dir "$WORK/$name" "${Q[@]}" --set run.threads=1 "$@" 2>&1)
    then pass "$name: launch --local ends with status 0"
    else fail "$name: launch --local ends with status 0" "$(echo "$out" | tail -4)"; fi
}
launch mw2 --workers 2 --set strategy.type=multi_worker_mirrored
launch ps2 --workers 2 --ps 1 --set strategy.type=parameter_server
for s in m2 cs2 mw2; do
    for k in eval_logits_loss eval_footwear_loss; do
        a=$(grep '"event": "end"' "$WORK/o20/metrics.jsonl" | grep -o "\"$k\": [0-9.e-]*")
        b=$(grep '"event": "end"' "$WORK/$s/metrics.jsonl" | grep -o "\"$k\": [0-9.e-]*")
        if [ -n "$a" ] && [ -n "$b" ] &&
                awk -v a="${a##* }" -v b="${b##* }" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d <= 1e-5 * a) }'; then
            pass "$s: $k within 1e-5 of one_device's (${a##* }, ${b##* })"
        else
            fail "$s: $k within 1e-5 of one_device's" "$a" "$b"
        fi
    done
done
# parameter_server (asynchronous: no bits to compare): each head evaluated, the total their weighted sum, learnt
out=$(python3 - "$WORK/ps2/metrics.jsonl" <<'PY'
import json, sys
end = [json.loads(l) for l in open(sys.argv[1]) if '"end"' in l][-1]
tot = end["eval_logits_loss"] + 0.5 * end["eval_footwear_loss"]
print("eval_loss %.6f weighted %.6f footwear_acc %.4f" % (end["eval_loss"], tot, end["eval_footwear_accuracy"]))
sys.exit(0 if abs(tot - end["eval_loss"]) <= 1e-5 * end["eval_loss"] and end["eval_footwear_accuracy"] > 0.85 else 1)
PY
) && pass "parameter_server: each head's eval loss, eval_loss their weighted sum ($out)" ||
    fail "parameter_server: each head's eval values" "$out" "$(tail -1 "$WORK/ps2/metrics.jsonl")"
out=$(timeout 120 "$LOOM" evaluate $CFG --model-dir "$WORK/one" --set run.eval_steps=4 2>&1)
contains "evaluate: each head's values in its JSON" '"eval_footwear_accuracy": ' "$out"
contains "evaluate: the first head's loss" '"eval_logits_loss": ' "$out"

check "predict with two heads" timeout 120 "$LOOM" predict $CFG --model-dir "$WORK/one" --set run.eval_steps=1 \
    --output "$WORK/pred.csv"
contains "predict: head 0's columns, then the footwear head's probability" "index,class,p0,p1,p2,p3,p4,p5,p6,p7,p8,p9,footwear_0" \
    "$(head -1 "$WORK/pred.csv")"
out=$(awk -F, 'NR > 1 { s = 0; for (i = 3; i <= 12; i++) s += $i; if (s < 0.999 || s > 1.001 || $13 < 0 || $13 > 1 || NF != 13) bad++ }
               END { print NR - 1, bad + 0 }' "$WORK/pred.csv")
[ "${out#* }" = 0 ] && [ "${out% *}" -gt 0 ] && pass "predict: each row's classes sum to 1, the footwear probability in [0, 1] ($out)" ||
    fail "predict: rows" "$out"

# config errors at file:line
sed 's/layer = "footwear"; label/layer = "nope"; label/' $CFG > configs/.heads_bad_$$.cfg
trap 'rm -rf "$WORK" configs/.heads_bad_$$.cfg' EXIT
expect_fail 2 "an unknown head layer: file:line" ".heads_bad_$$.cfg:34" timeout 60 "$LOOM" check configs/.heads_bad_$$.cfg
expect_fail 2 "an unknown head layer: named" 'head 1: "nope" is not a layer of model.layers' timeout 60 "$LOOM" check \
    configs/.heads_bad_$$.cfg
sed 's/layer = "footwear"; label/layer = "logits"; label/' $CFG > configs/.heads_bad_$$.cfg
expect_fail 2 "the same layer twice" 'layer "logits" is already head 0' timeout 60 "$LOOM" check configs/.heads_bad_$$.cfg
sed 's/layer = "logits"; label = "label"/layer = "trunk"; label = "label"/' $CFG > configs/.heads_bad_$$.cfg
expect_fail 2 "the first head is the last layer" "the first head's layer \"trunk\" is not the last layer (\"logits\")" \
    timeout 60 "$LOOM" check configs/.heads_bad_$$.cfg
sed 's/input = "image";/input = "image"; loss = "mean_squared_error";/' $CFG > configs/.heads_bad_$$.cfg
expect_fail 2 "model.loss beside model.outputs" "give model.loss or model.outputs, not both" \
    timeout 60 "$LOOM" check configs/.heads_bad_$$.cfg
sed 's/label = "footwear"/label = "shoes"/' $CFG > configs/.heads_bad_$$.cfg
expect_fail 2 "a label that is not a feature" "head \"footwear\"'s label \"shoes\" is not a feature of the train pipeline" \
    timeout 60 "$LOOM" train configs/.heads_bad_$$.cfg --model-dir "$WORK/bad" "${S[@]}"
finish
