#!/usr/bin/env bash
# seq.sh - sequence models from a config (issue 24): a character model over
# padded lines (tokenize with output_sequence_length, embedding mask_zero)
# with lstm, gru and bidirectional layers and a per-token loss (lm_pairs);
# `loom check --gradcheck` passes on every layer; training reports token
# accuracy and perplexity = exp(loss); a run stopped and resumed ends with
# the bits of an uninterrupted one; mirrored(2) trains it; bad shapes are
# errors naming the layer's line.
source "$(dirname "$0")/lib.sh"
Q=(--set run.progress='"none"')
for i in $(seq 1 60); do
    echo "line $i: $(printf 'the quick brown fox %.0s' $(seq 1 $((i % 4 + 1))))" | cut -c1-$((5 + i % 29))
done > "$WORK/lines.txt"
pipeline() {
    cat <<CFG
    source: { type = "text"; files = ["$WORK/lines.txt"]; max_length = 256; };
    transforms = (
      { op = "map"; fn = "tokenize"; feature = "line"; mode = "utf8_chars"; adapt = true; max_tokens = 40; output_sequence_length = 25; },
      { op = "lm_pairs"; feature = "line"; input = "context"; target = "next"; },
      { op = "batch"; size = 8; drop_remainder = true; }
    );
CFG
}
cat > "$WORK/seq.cfg" <<CFG
version = 1;
data: {
  train: {
$(pipeline)
  };
  eval: {
$(pipeline)
  };
};
model: {
  input = "context"; label = "next";
  metrics = ["accuracy", "perplexity"];
  layers = (
    { type = "embedding"; input_dim = 40; output_dim = 8; mask_zero = true; },
    { type = "lstm"; units = 12; return_sequences = true; },
    { type = "bidirectional"; layer = "gru"; units = 6; return_sequences = true; },
    { type = "gru"; units = 10; return_sequences = true; },
    { type = "dense"; units = 40; }
  );
};
optimizer: { type = "adam"; learning_rate = 0.01; };
run: { model_dir = "$WORK/m"; max_steps = 24; eval_each_epoch = false; };
CFG

out=$("$LOOM" check "$WORK/seq.cfg" --gradcheck 2>&1)
contains "gradcheck: lstm passes" "lstm_1 (lstm)" "$(grep pass <<<"$out")"
contains "gradcheck: bidirectional gru passes" "bidirectional_2 (bidirectional)" "$(grep pass <<<"$out")"
contains "gradcheck: gru passes" "gru_3 (gru)" "$(grep pass <<<"$out")"
contains "gradcheck: every layer passes" "gradcheck: every layer passes" "$out"
contains "check: a per-step output (None, 24, 40)" "(None, 24, 40)" "$out"

# a graph: lstm and gru side by side on the embedding, concatenated (each layer alone names no input)
out=$("$LOOM" check "$WORK/seq.cfg" --gradcheck --set 'model.layers=({ type = "embedding"; input_dim = 40; output_dim = 8; mask_zero = true; name = "emb"; }, { type = "lstm"; units = 5; return_sequences = true; name = "a"; inputs = ["emb"]; }, { type = "gru"; units = 4; return_sequences = true; name = "b"; inputs = ["emb"]; }, { type = "concatenate"; inputs = ["a", "b"]; }, { type = "dense"; units = 40; })' 2>&1)
contains "gradcheck of a graph: the recurrent layers that name their inputs pass, the merge is skipped" \
    "gradcheck: every layer passes" "$out"
contains "gradcheck of a graph: the merge row says why it is skipped" "skipped (a merge of several inputs)" "$out"

check "train 24 steps" "$LOOM" train "$WORK/seq.cfg" "${Q[@]}"
end=$(grep '"event": "end"' "$WORK/m/metrics.jsonl")
loss=$(sed 's/.*"eval_loss": \([0-9.e+-]*\).*/\1/' <<<"$end")
ppl=$(sed 's/.*"eval_perplexity": \([0-9.e+-]*\).*/\1/' <<<"$end")
acc=$(sed 's/.*"eval_accuracy": \([0-9.e+-]*\).*/\1/' <<<"$end")
# (perplexity is exp of the mean over tokens, the loss a mean over sequences: they differ with padding)
awk -v l="$loss" -v p="$ppl" 'BEGIN { exit !(l > 0 && l < log(40) && p > 1 && p < 40) }' &&
    pass "eval loss $loss and perplexity $ppl below the uniform 40's" || fail "perplexity" "$end"
awk -v a="$acc" 'BEGIN { exit !(a > 0.1 && a <= 1) }' && pass "token accuracy $acc learnt (chance 0.025)" || fail "token accuracy" "$end"

check "run to step 10" "$LOOM" train "$WORK/seq.cfg" --model-dir "$WORK/r" --set run.max_steps=10 "${Q[@]}"
check "resume to step 24" "$LOOM" train "$WORK/seq.cfg" --model-dir "$WORK/r" "${Q[@]}"
same_weights "resumed = uninterrupted (lstm, gru, bidirectional, Adam slots)" "$WORK/m/ckpt-24.loom" "$WORK/r/ckpt-24.loom"

check "mirrored(2) trains it" "$LOOM" train "$WORK/seq.cfg" --model-dir "$WORK/mir" --set strategy.type='"mirrored"' \
    --set strategy.replicas=2 "${Q[@]}"
# the strategies across processes and central_storage (issue 24: "with any strategy")
check "central_storage(2) trains it" "$LOOM" train "$WORK/seq.cfg" --model-dir "$WORK/cs" \
    --set strategy.type='"central_storage"' --set strategy.replicas=2 "${Q[@]}"
check "launch: 2 multi_worker_mirrored workers train it" timeout 120 "$LOOM" launch --local "$WORK/seq.cfg" --workers 2 \
    --set strategy.type='"multi_worker_mirrored"' --set "run.model_dir=\"$WORK/mw\"" "${Q[@]}"
[ -e "$WORK/mw/ckpt-24.loom" ] && pass "launch: the workers' job checkpointed step 24" || fail "mwm checkpoint" "$(ls "$WORK/mw")"
check "launch: parameter_server (2 workers, 1 ps) trains it" timeout 120 "$LOOM" launch --local "$WORK/seq.cfg" --workers 2 \
    --ps 1 --set strategy.type='"parameter_server"' --set "run.model_dir=\"$WORK/ps\"" "${Q[@]}"
[ -e "$WORK/ps/final.json" ] && pass "launch: the parameter-server job finished" || fail "ps final.json" "$(ls "$WORK/ps")"
check "evaluate the checkpoint" "$LOOM" evaluate "$WORK/seq.cfg"
check "predict it" "$LOOM" predict "$WORK/seq.cfg" --output "$WORK/p.csv"
hdr=$(head -1 "$WORK/p.csv")
contains "predict: a class per step, then each step's probabilities" "index,class_0,class_1," "$hdr"
contains "predict: the last step's last probability column" ",class_23,p0_0," "$hdr"
awk -F, 'NR > 1 { s = 0; for (c = 26; c <= 65; c++) s += $c; if (s < 0.999 || s > 1.001) bad++ } END { exit bad > 0 }' "$WORK/p.csv" &&
    pass "predict: each step's 40 probabilities sum to 1" || fail "predict: per-step softmax" "$(sed -n 2p "$WORK/p.csv" | cut -c1-200)"
check "export it as ONNX (the model input made by lm_pairs)" "$LOOM" export "$WORK/seq.cfg" --format onnx --output "$WORK/seq.onnx"

expect_fail 2 "an lstm after a flatten names its line and the input it needs" \
    "layer \"lstm_2\" (lstm) needs a sequence input (steps, features), got (192,)" \
    "$LOOM" check "$WORK/seq.cfg" --set 'model.layers=({ type = "embedding"; input_dim = 40; output_dim = 8; }, { type = "flatten"; }, { type = "lstm"; units = 4; return_sequences = true; }, { type = "dense"; units = 40; })'
expect_fail 2 "per-token labels need a per-step output" "the labels (24,) are per token but the model output (40,) has no time axis" \
    "$LOOM" check "$WORK/seq.cfg" --set 'model.layers=({ type = "embedding"; input_dim = 40; output_dim = 8; mask_zero = true; }, { type = "lstm"; units = 4; }, { type = "dense"; units = 40; })'
expect_fail 2 "auc on a per-token loss is a config error" '"auc" does not fit this model' \
    "$LOOM" check "$WORK/seq.cfg" --set 'model.metrics=["auc"]'
finish
