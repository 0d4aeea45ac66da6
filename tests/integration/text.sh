#!/usr/bin/env bash
# text.sh - issue 24's input pipeline on Debian's fortunes (loom.sh installs
# the package): `loom profile` of the character pipeline (records -> tokenize
# -> unbatch -> window -> lm_pairs) and of the word pipeline with
# bucket_by_sequence_length, each stage's figures printed; the adapted
# vocabulary in adapt.txt and in the checkpoints (evaluate without adapt.txt);
# an exact resume through the window's ring and the shuffle (bit-identical
# weights); and the bad inputs: invalid UTF-8 (replaced and counted, or an
# error naming file and byte offset), a vocabulary with a duplicate or an
# empty line (file:line), a window longer than the data (a warning, no
# windows), sequences longer than output_sequence_length (counted, reported).
source "$(dirname "$0")/lib.sh"
if ! ls /usr/share/games/fortunes/*.u8 >/dev/null 2>&1; then
    echo "1..0 # SKIP the fortunes package is not installed (apt-get install fortunes; loom.sh installs it)"
    exit 77
fi
CFG=configs/fortunes_char_mlp.cfg
RUN=(--set run.progress='"none"' --set run.status_port=0)

# profile: the pipeline alone, every stage with its figures
out=$("$LOOM" profile $CFG --steps 100 2>&1); status=$?
if [ $status -eq 0 ]; then pass "profile $CFG"; else fail "profile $CFG" "$(echo "$out" | tail -5)"; fi
contains "profile: the plan" "text -> split(train) -> map(tokenize) -> select -> unbatch -> window -> lm_pairs" "$out"
for st in "map(tokenize)" unbatch window lm_pairs; do
    if grep -qE "^[0-9]+ +$(sed 's/[()]/\\&/g' <<<"$st") +[0-9]+ +[0-9]+" <<<"$out"; then pass "profile: a row of figures for $st"
    else fail "profile: a row of figures for $st" "$(echo "$out" | tail -14)"; fi
done
contains "profile: 100 batches of 64" "100 elements (6400 samples)" "$out"
contains "profile: the vocabulary adapted from data.train" 'tokenize adapt: "line": 98 tokens' "$out"

out=$("$LOOM" profile tests/configs/fortunes_words.cfg --steps 50 2>&1); status=$?
if [ $status -eq 0 ]; then pass "profile the word pipeline"; else fail "profile the word pipeline" "$(echo "$out" | tail -5)"; fi
contains "profile: bucket_by_sequence_length's row" "bucket_by_sequence_length" "$out"
contains "profile: words adapted (Keras' ids: 0 padding, 1 [UNK])" '19998 tokens' "$out"

# the vocabulary in adapt.txt and the checkpoints; evaluate takes the checkpoint's
check "train 60 steps" "$LOOM" train $CFG --model-dir "$WORK/a" --set run.max_steps=60 --set run.eval_steps=5 "${RUN[@]}"
if grep -q '^vocab 1 line 98 1 100$' "$WORK/a/adapt.txt"; then pass "adapt.txt holds tokenize's vocabulary"
else fail "adapt.txt holds tokenize's vocabulary" "$(head -3 "$WORK/a/adapt.txt")"; fi
rm -f "$WORK/a/adapt.txt"
out=$("$LOOM" evaluate $CFG --model-dir "$WORK/a" --set run.eval_steps=5 2>&1); status=$?
if [ $status -eq 0 ]; then pass "evaluate without adapt.txt"; else fail "evaluate without adapt.txt" "$(echo "$out" | tail -5)"; fi
contains "evaluate: the vocabulary from the checkpoint" "adapt: the numbers of 1 map from the checkpoint" "$out"

# exact resume: stopped at step 70 (mid-pass, windows and shuffle buffered) = uninterrupted
check "uninterrupted to step 150" "$LOOM" train $CFG --model-dir "$WORK/r1" --set run.max_steps=150 --set run.checkpoint_steps=0 "${RUN[@]}"
check "stop at step 70" "$LOOM" train $CFG --model-dir "$WORK/r2" --set run.max_steps=70 --set run.checkpoint_steps=0 "${RUN[@]}"
check "resume to step 150" "$LOOM" train $CFG --model-dir "$WORK/r2" --set run.max_steps=150 --set run.checkpoint_steps=0 "${RUN[@]}"
same_weights "resumed mid-pass = uninterrupted (bit-identical weights)" "$WORK/r1/ckpt-150.loom" "$WORK/r2/ckpt-150.loom"

# the adapted vocabularies are Keras TextVectorization's, token for token and in its order
# (ties in reverse byte order), characters and words, when TF_PYTHON (or python3) has TensorFlow
TF_PY=${TF_PYTHON:-python3}
if "$TF_PY" -c "import tensorflow" 2>/dev/null; then
    for v in "utf8_chars none character 100" "whitespace lower_and_strip_punctuation whitespace 2000"; do
        read -r mode std split max <<<"$v"
        cat > "$WORK/v.cfg" <<CFG
version = 1;
data: { train: {
  source: { type = "text"; files = ["/usr/share/games/fortunes/*.u8"]; max_length = 4096; truncate = true; };
  transforms = (
    { op = "map"; fn = "tokenize"; feature = "line"; mode = "$mode"; standardize = "$std"; adapt = true; max_tokens = $max; },
    { op = "select"; features = ["line"]; },
    { op = "unbatch"; },
    { op = "window"; size = 9; drop_remainder = true; },
    { op = "lm_pairs"; feature = "line"; target_last = true; },
    { op = "batch"; size = 8; }
  ); }; };
model: { input = "input"; label = "target"; layers = ({ type = "flatten"; }, { type = "dense"; units = $max; }); };
optimizer: { type = "sgd"; learning_rate = 0.1; };
run: { model_dir = "v_$mode"; epochs = 1; max_steps = 1; progress = "none"; };
CFG
        "$LOOM" train "$WORK/v.cfg" >/dev/null 2>&1
        ours=$(grep '^=' "$WORK/v_$mode/adapt.txt" 2>/dev/null | sed 's/ [0-9]*$//')
        ref=$("$TF_PY" tests/fixtures/text_vocab_ref.py --files '/usr/share/games/fortunes/*.u8' --split "$split" \
            --standardize "$std" --max-tokens "$max" 2>/dev/null)
        if [ -n "$ours" ] && [ "$ours" = "$ref" ]; then pass "tokenize $mode adapt = Keras TextVectorization's vocabulary ($max ids)"
        else fail "tokenize $mode adapt = Keras TextVectorization's vocabulary ($max ids)" "$(diff <(echo "$ours") <(echo "$ref") | head -5)"; fi
    done
else
    T=$((T + 1)); echo "ok $T - vocabularies against Keras TextVectorization # SKIP $TF_PY has no TensorFlow (set TF_PYTHON)"
fi

# ---- bad input ----
mkdir -p "$WORK/bad"
printf 'good line\nbad \377 byte\n' > "$WORK/bad/bad.txt"
printf 'the\ncat\nthe\n' > "$WORK/bad/dup.txt"
printf 'the\n\ncat\n' > "$WORK/bad/empty.txt"
printf 'the cat\n' > "$WORK/bad/w.txt"
cat > "$WORK/bad/p.cfg" <<'CFG'
version = 1;
data: { train: {
  source: { type = "text"; files = ["bad.txt"]; max_length = 64; };
  transforms = (
    { op = "map"; fn = "tokenize"; feature = "line"; mode = "utf8_chars"; on_invalid = "error"; },
    { op = "padded_batch"; size = 2; mask = "line"; }
  ); }; };
model: { input = "line"; layers = ({ type = "flatten"; }, { type = "dense"; units = 2; }); };
optimizer: { type = "sgd"; learning_rate = 0.1; };
run: { model_dir = "m"; epochs = 1; };
CFG
expect_fail 1 "invalid UTF-8 with on_invalid = error names the file and byte offset" \
    "$WORK/bad/bad.txt: byte offset 14: tokenize: invalid UTF-8 (byte 0xFF)" "$LOOM" profile "$WORK/bad/p.cfg"
out=$("$LOOM" profile "$WORK/bad/p.cfg" --set 'data.train.transforms.[0].on_invalid="replace"' 2>&1)
contains "invalid UTF-8 replaced: counted and reported at the pass's end" \
    '1 invalid UTF-8 sequence replaced with U+FFFD in this pass of 2 strings' "$out"
out=$("$LOOM" profile "$WORK/bad/p.cfg" --set 'data.train.transforms.[0].on_invalid="replace"' \
    --set 'data.train.transforms.[0].output_sequence_length=4' 2>&1)
contains "sequences longer than output_sequence_length: truncated, counted, reported" \
    '2 of 2 sequences were longer than output_sequence_length = 4 and were truncated (the longest had 10 ids)' "$out"
VOC=(--set 'data.train.source.files=["w.txt"]' --set 'data.train.transforms.[0].mode="whitespace"'
     --set 'data.train.transforms.[0].on_invalid="replace"')
expect_fail 1 "a vocabulary with a duplicate token names file:line" \
    "$WORK/bad/dup.txt:3: tokenize: vocabulary token \"the\" appears twice (lines 1 and 3)" \
    "$LOOM" profile "$WORK/bad/p.cfg" "${VOC[@]}" --set 'data.train.transforms.[0].vocabulary_file="dup.txt"'
expect_fail 1 "a vocabulary with an empty line names file:line" \
    "$WORK/bad/empty.txt:2: tokenize: an empty line in the vocabulary" \
    "$LOOM" profile "$WORK/bad/p.cfg" "${VOC[@]}" --set 'data.train.transforms.[0].vocabulary_file="empty.txt"'
expect_fail 2 "words without a vocabulary are a config error" 'maps words through a vocabulary: it needs vocabulary_file or adapt = true' \
    "$LOOM" check "$WORK/bad/p.cfg" "${VOC[@]}"
cat > "$WORK/bad/w.cfg" <<'CFG'
version = 1;
data: { train: {
  source: { type = "text"; files = ["w.txt"]; max_length = 64; };
  transforms = (
    { op = "map"; fn = "tokenize"; feature = "line"; mode = "bytes"; },
    { op = "select"; features = ["line"]; },
    { op = "unbatch"; },
    { op = "window"; size = 65; drop_remainder = true; },
    { op = "batch"; size = 2; }
  ); }; };
model: { input = "line"; layers = ({ type = "flatten"; }, { type = "dense"; units = 2; }); };
optimizer: { type = "sgd"; learning_rate = 0.1; };
run: { model_dir = "m"; epochs = 1; };
CFG
expect_fail 2 "a window beyond the RAM budget is refused at open, naming the transform" \
    'transforms.[3]: window: a ring of 20000 elements and the window needs 320000 bytes, more than' \
    "$LOOM" profile "$WORK/bad/w.cfg" --set 'data.options.autotune.ram_budget="64KiB"' --set 'data.train.transforms.[3].size=20000'
out=$("$LOOM" profile "$WORK/bad/w.cfg" 2>&1)
contains "a window longer than the data: a warning, no windows (as tf.data)" \
    'window: the pass had 7 elements, fewer than one window spans (size 65, stride 1: 65 elements), so it yields no windows' "$out"
finish
