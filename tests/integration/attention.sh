#!/usr/bin/env bash
# attention.sh - issue 24's attention layers end to end on Debian's fortunes
# (loom.sh installs the package): a transformer_block's parts in `loom check`
# and in --print (which loads back to the same config), every layer of the
# text classifier through --gradcheck, the file_feature labels, and an exact
# resume through dropout on the attention weights (bit-identical weights).
source "$(dirname "$0")/lib.sh"
if ! ls /usr/share/games/fortunes/*.u8 >/dev/null 2>&1; then
    echo "1..0 # SKIP the fortunes package is not installed (apt-get install fortunes; loom.sh installs it)"
    exit 77
fi
TR=configs/fortunes_char_transformer.cfg
CLS=configs/fortunes_topic_classifier.cfg
RUN=(--set run.progress='"none"' --set run.status_port=0 --set run.eval_each_epoch=false --set run.eval_steps=1)

out=$("$LOOM" check $TR 2>&1); status=$?
if [ $status -eq 0 ]; then pass "check $TR"; else fail "check $TR" "$(echo "$out" | tail -5)"; fi
contains "check: the block's attention, named after it" "block1/attn (multi_head_attention)" "$out"
contains "check: the pre-norm block's residual add takes the block input" "block1/add1 (add)" "$out"
if grep -qE '^block2/norm1 \(layer_normalization\) .* block1$' <<<"$out"; then pass "check: the next block reads the layer named as the block"
else fail "check: the next block reads the layer named as the block" "$(grep block2/norm1 <<<"$out")"; fi
contains "check: the feed-forward on each step" "block2/ff1 (dense)                       (None, 64, 256)" "$out"
contains "check: 117092 parameters" "Total params: 117092" "$out"

"$LOOM" check $TR --print >"$WORK/p1.cfg" 2>/dev/null
"$LOOM" check "$WORK/p1.cfg" --print >"$WORK/p2.cfg" 2>/dev/null
if [ -s "$WORK/p1.cfg" ] && diff <(tail -n +2 "$WORK/p1.cfg") <(tail -n +2 "$WORK/p2.cfg") >/dev/null; then
    pass "--print of the expanded blocks loads back to the same config"
else fail "--print of the expanded blocks loads back to the same config" "$(diff "$WORK/p1.cfg" "$WORK/p2.cfg" | head -5)"; fi

out=$("$LOOM" check $CLS --gradcheck 2>&1); status=$?
if [ $status -eq 0 ]; then pass "gradcheck of the classifier's layers"; else fail "gradcheck of the classifier's layers" "$(echo "$out" | tail -8)"; fi
if grep -qE '^multi_head_attention_2 \(multi_head_attention\) +[0-9]+ .* pass' <<<"$out"; then pass "gradcheck: multi_head_attention passes"
else fail "gradcheck: multi_head_attention passes" "$(grep multi_head_attention <<<"$out")"; fi
contains "gradcheck: every layer passes" "gradcheck: every layer passes" "$out"
contains "the topic label from file_feature" "topic: int64 (32,)" "$out"

# exact resume: dropout on the attention weights keyed by the step
check "uninterrupted to step 20" "$LOOM" train $CLS --model-dir "$WORK/r1" --set run.max_steps=20 --set run.checkpoint_steps=0 "${RUN[@]}"
check "stop at step 9" "$LOOM" train $CLS --model-dir "$WORK/r2" --set run.max_steps=9 --set run.checkpoint_steps=0 "${RUN[@]}"
check "resume to step 20" "$LOOM" train $CLS --model-dir "$WORK/r2" --set run.max_steps=20 --set run.checkpoint_steps=0 "${RUN[@]}"
same_weights "resumed = uninterrupted (bit-identical weights)" "$WORK/r1/ckpt-20.loom" "$WORK/r2/ckpt-20.loom"
finish
