#!/usr/bin/env bash
# generate.sh - `loom generate` on configs/fortunes_char_embed.cfg trained
# briefly here: the same seed gives the same text (another seed another);
# greedy decoding is the argmax chain (each greedy token is what a greedy
# run of one token gives from the prompt plus the tokens before it); top-k 1
# is greedy at any temperature; tokens reach stdout while the process still
# runs; prompt characters outside the vocabulary are counted on stderr; a
# word-level model writes words with a space before each; an LSTM model's
# incremental path gives the generic path's tokens, as a small transformer's
# KV cache does; a
# model that is not a language model is refused at its model block; no
# checkpoint, no adapted vocabulary and bad options are clear errors.
source "$(dirname "$0")/lib.sh"
kill_jobs_at_exit
if ! ls /usr/share/games/fortunes/*.u8 >/dev/null 2>&1; then
    echo "1..0 # SKIP the fortunes package is not installed (apt-get install fortunes; loom.sh installs it)"
    exit 77
fi
CFG=configs/fortunes_char_embed.cfg
M="$WORK/m"
RUN=(--set run.progress='"none"' --set run.status_port=0)
GEN=("$LOOM" generate $CFG --model-dir "$M" --quiet)

check "train $CFG 300 steps" "$LOOM" train $CFG --model-dir "$M" --set run.max_steps=300 --set run.eval_steps=5 "${RUN[@]}"

# determinism: a seed gives one text, another seed another
a=$("${GEN[@]}" --prompt "The " --max-tokens 120 --seed 7 2>/dev/null)
b=$("${GEN[@]}" --prompt "The " --max-tokens 120 --seed 7 2>/dev/null)
c=$("${GEN[@]}" --prompt "The " --max-tokens 120 --seed 8 2>/dev/null)
if [ -n "$a" ] && [ "$a" = "$b" ]; then pass "seed 7 twice: the same text"; else fail "seed 7 twice: the same text" "$a" "$b"; fi
if [ "$a" != "$c" ]; then pass "seeds 7 and 8: different texts"; else fail "seeds 7 and 8: different texts" "$a"; fi
"${GEN[@]}" --prompt "The " --max-tokens 120 --seed 7 > "$WORK/a.txt" 2>/dev/null
n=$(python3 -c 'import sys; print(len(open(sys.argv[1], "rb").read().decode()) - 1)' "$WORK/a.txt")
if [ "$n" -eq 120 ]; then pass "120 tokens: 120 characters and a newline"; else fail "120 tokens: 120 characters" "got $n: $a"; fi

# greedy = the argmax chain: token k of a greedy run is the greedy token after prompt + tokens 0..k-1
P="What is the "
g=$("${GEN[@]}" --prompt "$P" --max-tokens 24 --temperature 0 2>/dev/null)
chain=""
for k in $(seq 0 23); do
    prefix=$(python3 -c 'import sys; print(sys.argv[1][:int(sys.argv[2])], end="")' "$g" "$k")
    t=$("${GEN[@]}" --prompt "$P$prefix" --max-tokens 1 --temperature 0 2>/dev/null)
    chain="$chain$t"
done
if [ -n "$g" ] && [ "$g" = "$chain" ]; then pass "greedy = the argmax chain (24 tokens)"
else fail "greedy = the argmax chain (24 tokens)" "greedy: [$g]" "chain:  [$chain]"; fi
g2=$("${GEN[@]}" --prompt "$P" --max-tokens 24 --temperature 0 --seed 99 2>/dev/null)
if [ "$g" = "$g2" ]; then pass "greedy ignores the seed"; else fail "greedy ignores the seed" "$g" "$g2"; fi

# top-k 1 is greedy whatever the temperature and seed
k1=$("${GEN[@]}" --prompt "$P" --max-tokens 24 --temperature 1.7 --top-k 1 --seed 3 2>/dev/null)
if [ "$k1" = "$g" ]; then pass "top-k 1 = greedy"; else fail "top-k 1 = greedy" "top-k 1: [$k1]" "greedy:  [$g]"; fi
k5=$("${GEN[@]}" --prompt "$P" --max-tokens 200 --top-k 5 --seed 3 2>/dev/null)
if [ "$k5" != "$g" ] && [ -n "$k5" ]; then pass "top-k 5 samples"; else fail "top-k 5 samples" "$k5"; fi

# --samples N: N continuations one after the other, the draws going on: the first is the one-sample text
"${GEN[@]}" --prompt "The " --max-tokens 30 --seed 9 >"$WORK/s1.txt" 2>/dev/null
"${GEN[@]}" --prompt "The " --max-tokens 30 --seed 9 --samples 3 >"$WORK/s3.txt" 2>/dev/null
if python3 -c 'import sys; a = open(sys.argv[1], "rb").read().decode(); b = open(sys.argv[2], "rb").read().decode()
sys.exit(0 if b.startswith(a) and len(b) == 3 * 31 and b[31:62] != b[:31] else 1)' "$WORK/s1.txt" "$WORK/s3.txt"
then pass "--samples 3: three 30-token samples, the first the one-sample text"
else fail "--samples 3: three 30-token samples, the first the one-sample text" "$(cat -A "$WORK/s3.txt")"; fi

# streaming: the first tokens are on stdout while the process is still drawing (10^8 tokens)
"${GEN[@]}" --prompt "The " --max-tokens 100000000 --seed 1 > "$WORK/stream.txt" 2>/dev/null &
gp=$!
PIDS+=($gp)
for _ in $(seq 1 100); do [ -s "$WORK/stream.txt" ] && break; sleep 0.1; done
if [ -s "$WORK/stream.txt" ] && kill -0 $gp 2>/dev/null; then pass "streaming: text on stdout before the end"
else fail "streaming: text on stdout before the end" "size $(stat -c %s "$WORK/stream.txt"), running: $(kill -0 $gp 2>/dev/null && echo yes || echo no)"; fi
kill $gp 2>/dev/null; wait $gp 2>/dev/null

# a prompt with characters outside the vocabulary: mapped to OOV, counted on stderr
out=$("${GEN[@]}" --prompt "Caf☃ ü☂" --max-tokens 5 --seed 1 2>&1 >/dev/null); status=$?
if [ $status -eq 0 ]; then pass "OOV prompt: generates"; else fail "OOV prompt: generates" "$out"; fi
contains "OOV prompt: 3 of 7 reported" "--prompt: 3 of its 7 tokens are not in the vocabulary" "$out"

# words (a vocabulary tokenizer): each word written with a space before it; an unknown word is OOV
cat > "$WORK/words.cfg" <<CFG
version = 1;
data: { train: {
  source: { type = "text"; files = ["/usr/share/games/fortunes/*.u8"]; record_separator = "%"; max_length = 4096;
            truncate = true; };
  transforms = (
    { op = "map"; fn = "tokenize"; feature = "line"; mode = "vocabulary"; adapt = true; max_tokens = 2000; },
    { op = "select"; features = ["line"]; },
    { op = "unbatch"; },
    { op = "window"; size = 9; shift = 1; drop_remainder = true; },
    { op = "lm_pairs"; feature = "line"; input = "context"; target = "next"; target_last = true; },
    { op = "shuffle"; buffer = 1024; },
    { op = "batch"; size = 64; drop_remainder = true; }
  ); }; };
model: { input = "context"; label = "next"; layers = (
  { type = "embedding"; input_dim = 2000; output_dim = 16; }, { type = "flatten"; },
  { type = "dense"; units = 64; activation = "relu"; }, { type = "dense"; units = 2000; } ); };
optimizer: { type = "adam"; learning_rate = 0.005; };
run: { model_dir = "$WORK/w"; max_steps = 150; };
CFG
check "train a word-level model 150 steps" "$LOOM" train "$WORK/words.cfg" "${RUN[@]}"
"$LOOM" generate "$WORK/words.cfg" --prompt "The man zzqxj who" --max-tokens 12 --seed 2 >"$WORK/w.txt" 2>"$WORK/w.err"
if [ "$(wc -w <"$WORK/w.txt")" -eq 12 ] && head -c 1 "$WORK/w.txt" | grep -q ' ' && ! grep -q UNK "$WORK/w.txt"; then
    pass "words: 12 words, a space before each, no [UNK]"
else fail "words: 12 words, a space before each, no [UNK]" "$(cat -A "$WORK/w.txt")"; fi
contains "words: the unknown word reported" "--prompt: 1 of its 4 tokens is not in the vocabulary" "$(cat "$WORK/w.err")"

# an LSTM language model (per-token targets): the incremental path (the state carried token to token)
# gives the generic path's tokens while the sequence fits the window (4 + 12 = 16 = T), and says so
cat > "$WORK/lstm.cfg" <<CFG
version = 1;
data: { train: {
  source: { type = "text"; files = ["/usr/share/games/fortunes/*.u8"]; record_separator = "%"; max_length = 4096;
            truncate = true; };
  transforms = (
    { op = "map"; fn = "tokenize"; feature = "line"; mode = "utf8_chars"; adapt = true; max_tokens = 100; },
    { op = "select"; features = ["line"]; },
    { op = "unbatch"; },
    { op = "window"; size = 17; shift = 16; drop_remainder = true; },
    { op = "lm_pairs"; feature = "line"; input = "context"; target = "next"; },
    { op = "shuffle"; buffer = 1024; },
    { op = "batch"; size = 32; drop_remainder = true; }
  ); }; };
model: { input = "context"; label = "next"; layers = (
  { type = "embedding"; input_dim = 100; output_dim = 16; },
  { type = "lstm"; units = 32; return_sequences = true; },
  { type = "dense"; units = 100; } ); };
optimizer: { type = "adam"; learning_rate = 0.01; };
run: { model_dir = "$WORK/l"; max_steps = 40; };
CFG
check "train a small LSTM language model 40 steps" "$LOOM" train "$WORK/lstm.cfg" "${RUN[@]}"
for seed in 5 6 7; do
    li=$("$LOOM" generate "$WORK/lstm.cfg" --prompt "The " --max-tokens 12 --seed $seed 2>"$WORK/i.err")
    lg=$("$LOOM" generate "$WORK/lstm.cfg" --prompt "The " --max-tokens 12 --seed $seed --generic 2>"$WORK/g.err")
    if [ -n "$li" ] && [ "$li" = "$lg" ]; then pass "lstm, seed $seed: incremental = generic"
    else fail "lstm, seed $seed: incremental = generic" "incremental: [$li]" "generic:     [$lg]"; fi
done
contains "lstm: the incremental path" "incremental path" "$(cat "$WORK/i.err")"
contains "lstm --generic: the generic path" "generic path" "$(cat "$WORK/g.err")"
li=$("$LOOM" generate "$WORK/lstm.cfg" --prompt "The " --max-tokens 100 --seed 5 2>/dev/null)
lj=$("$LOOM" generate "$WORK/lstm.cfg" --prompt "The " --max-tokens 100 --seed 5 2>/dev/null)
if [ "$li" = "$lj" ] && [ "${#li}" -ge 90 ]; then pass "lstm past the window: the same text for a seed"
else fail "lstm past the window: the same text for a seed" "$li" "$lj"; fi

# a small causal transformer (positional_embedding, transformer_block): the KV cache's tokens are the generic
# path's within the window, and past it (where the generic path takes over, sliding the window)
sed -e 's|{ type = "lstm"; units = 32; return_sequences = true; },|{ type = "positional_embedding"; max_length = 16; }, { type = "transformer_block"; num_heads = 2; key_dim = 8; ff_dim = 32; causal = true; },|' \
    -e "s|$WORK/l\"|$WORK/t\"|" "$WORK/lstm.cfg" >"$WORK/tf.cfg"
check "train a small transformer language model 40 steps" "$LOOM" train "$WORK/tf.cfg" "${RUN[@]}"
for seed in 5 6; do
    li=$("$LOOM" generate "$WORK/tf.cfg" --prompt "The " --max-tokens 40 --seed $seed 2>"$WORK/i.err")
    lg=$("$LOOM" generate "$WORK/tf.cfg" --prompt "The " --max-tokens 40 --seed $seed --generic 2>/dev/null)
    if [ -n "$li" ] && [ "$li" = "$lg" ]; then pass "transformer, seed $seed: KV cache = generic (40 tokens)"
    else fail "transformer, seed $seed: KV cache = generic (40 tokens)" "incremental: [$li]" "generic:     [$lg]"; fi
done
contains "transformer: the incremental path" "incremental path" "$(cat "$WORK/i.err")"

# a model that is not a language model (one-hot float windows): refused at the model block
line=$(grep -n '^model:' configs/fortunes_char_mlp.cfg | cut -d: -f1)
expect_fail 2 "not a language model: refused" "fortunes_char_mlp.cfg:$line: model: not a language model" \
    "$LOOM" generate configs/fortunes_char_mlp.cfg --model-dir "$M" --prompt "The "
expect_fail 2 "not a language model: says what generate needs" "generate needs one input of token ids (T,)" \
    "$LOOM" generate configs/fortunes_char_mlp.cfg --model-dir "$M" --prompt "The "

# no checkpoint (the adapted vocabulary there): no checkpoint in the model directory
mkdir -p "$WORK/empty" && cp "$M/adapt.txt" "$WORK/empty/"
expect_fail 1 "no checkpoint: an error naming the directory" "$WORK/empty: no checkpoint in the model directory" \
    "$LOOM" generate $CFG --model-dir "$WORK/empty" --prompt "The "
expect_fail 1 "a model directory never trained: train first" "run loom train first" \
    "$LOOM" generate $CFG --model-dir "$WORK/none" --prompt "The "
expect_fail 1 "--checkpoint that does not exist" "$WORK/nope.loom" \
    "$LOOM" generate $CFG --model-dir "$M" --checkpoint "$WORK/nope.loom" --prompt "The "
ck=$(ls "$M"/ckpt-*.loom | sort -V | tail -1)
x=$("${GEN[@]}" --checkpoint "$ck" --prompt "$P" --max-tokens 24 --temperature 0 2>/dev/null)
if [ "$x" = "$g" ]; then pass "--checkpoint FILE: the same model"; else fail "--checkpoint FILE: the same model" "$x"; fi

# options
expect_fail 2 "missing --prompt" "missing --prompt" "$LOOM" generate $CFG
expect_fail 2 "--top-k -1" "--top-k expects an integer" "$LOOM" generate $CFG --prompt a --top-k -1
expect_fail 2 "--temperature nan" "--temperature expects a number" "$LOOM" generate $CFG --prompt a --temperature nan
expect_fail 2 "an empty prompt" "has no token" "$LOOM" generate $CFG --model-dir "$M" --prompt ""
finish
