#!/usr/bin/env bash
# seq_states.sh - return_state on lstm and gru (issue 24): a config reads an
# lstm's final h and c and a gru's final h as "<name>/h", "<name>/c"
# (tests/configs/seq_states.cfg); `loom check --gradcheck` passes with the
# states' gradients checked with their layer; it trains, a resumed run ends
# with the bits of an uninterrupted one, --print gives a config that reads
# back; refusals: bidirectional, states that feed nothing, an ONNX export.
# (The values against the last real step's h and c under masks, and the
# gradients under masks: tests/unit/test_seq.c rnn_states*.)
source "$(dirname "$0")/lib.sh"
CFG=tests/configs/seq_states.cfg
Q=(--set run.progress='"none"')

out=$("$LOOM" check "$CFG" --gradcheck 2>&1)
contains "gradcheck: the lstm with its h and c passes" "enc (lstm)" "$(grep pass <<<"$out")"
contains "gradcheck: the gru with its h passes" "g (gru)" "$(grep pass <<<"$out")"
contains "gradcheck: the state layers are checked with theirs" 'checked with "enc" (its state)' "$out"
contains "gradcheck: every layer passes" "gradcheck: every layer passes" "$out"
contains "summary: enc/c is (None, 6)" "$(printf '%-40s %-22s' 'enc/c (lstm)' '(None, 6)')" "$out"

check "train 16 steps" "$LOOM" train "$CFG" --model-dir "$WORK/m" "${Q[@]}"
# 64 examples of random labels: memorised through the states (chance: ln 4 = 1.386)
check "train 160 steps" "$LOOM" train "$CFG" --model-dir "$WORK/long" --set run.max_steps=160 "${Q[@]}"
loss=$(grep '"event": "epoch"' "$WORK/long/metrics.jsonl" | tail -1 | sed 's/.*"train_loss": \([0-9.e+-]*\).*/\1/')
awk -v l="$loss" 'BEGIN { exit !(l > 0 && l < 1.0) }' && pass "it learns: train loss $loss after 20 epochs" ||
    fail "learning" "$(tail -2 "$WORK/long/metrics.jsonl")"
check "run to step 6" "$LOOM" train "$CFG" --model-dir "$WORK/r" --set run.max_steps=6 "${Q[@]}"
check "resume to step 16" "$LOOM" train "$CFG" --model-dir "$WORK/r" "${Q[@]}"
same_weights "resumed = uninterrupted through the states" "$WORK/m/ckpt-16.loom" "$WORK/r/ckpt-16.loom"
check "mirrored(2) trains it" "$LOOM" train "$CFG" --model-dir "$WORK/mir" --set strategy.type='"mirrored"' \
    --set strategy.replicas=2 "${Q[@]}"

"$LOOM" check "$CFG" --print > "$WORK/p.cfg" 2>&1
contains "--print: return_state, not the made state layers" "return_state = true;" "$(cat "$WORK/p.cfg")"
check "--print reads back" "$LOOM" check "$WORK/p.cfg"

expect_fail 2 "bidirectional with return_state is refused" 'return_state applies only to type = "lstm" or "gru"' \
    "$LOOM" check "$CFG" --set 'model.layers=({ type = "bidirectional"; layer = "lstm"; units = 3; return_state = true; }, { type = "dense"; units = 4; })'
expect_fail 2 "return_state on the last layer names it" 'layer "lstm_0" has return_state = true but is the model' \
    "$LOOM" check "$CFG" --set 'model.layers=({ type = "lstm"; units = 3; return_state = true; })'
expect_fail 2 "a state of a layer without return_state is not a layer" 'input "l/h" is neither a layer nor a model input' \
    "$LOOM" check "$CFG" --set 'model.layers=({ type = "lstm"; name = "l"; units = 3; }, { type = "dense"; units = 4; inputs = ["l/h"]; })'
expect_fail 2 "no ONNX export: the error names the layer" 'layer "enc": return_state (its final states as layers) does not export to ONNX' \
    "$LOOM" export "$CFG" --model-dir "$WORK/m" --format onnx --output "$WORK/s.onnx"
check "the npz export writes its weights" "$LOOM" export "$CFG" --model-dir "$WORK/m" --format npz --output "$WORK/s.npz"
finish
