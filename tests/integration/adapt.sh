#!/usr/bin/env bash
# adapt.sh - what maps with adapt = true compute and where it is kept (issue
# 16): normalize mode "min_max" and "mean_std" and string_lookup vocabularies
# from data.train (checked against Python on the same CSV), data.eval using
# the training numbers, the numbers inside every checkpoint so that predict,
# evaluate, export and the sidecar evaluator give the same outputs without
# adapt.txt or from a copied checkpoint, the checkpoint winning over a
# different adapt.txt (said once), exact resume, and the bad input.
source "$(dirname "$0")/lib.sh"
CSV="$ROOT/tests/fixtures/csv/produce.csv"
cp "$CSV" "$WORK/produce.csv"

# cfg NAME [EXTRA-TRAIN-TRANSFORMS] [EVAL-FILE]: strings and numbers of produce.csv into x
cfg() {
    local cols='id = { dtype = "int64"; }; weight = { dtype = "float32"; }; sugar = { dtype = "float32"; };
                colour = { dtype = "string"; max_length = 16; }; label = { dtype = "int64"; };'
    local maps='{ op = "map"; fn = "string_lookup"; feature = "colour"; adapt = true; max_tokens = 4; },
      { op = "map"; fn = "one_hot"; feature = "colour"; depth = 4; },
      { op = "map"; fn = "normalize"; feature = "weight"; adapt = true; mode = "min_max"; },
      { op = "map"; fn = "normalize"; feature = "sugar"; adapt = true; },
      { op = "concat"; features = ["weight", "sugar", "colour"]; output = "x"; }'
    cat > "$WORK/$1.cfg" <<CFG
version = 1;
data: {
  train: { source: { type = "csv"; files = ["produce.csv"]; columns: { $cols }; };
           transforms = ( ${2:-} $maps, { op = "shuffle"; buffer = 64; }, { op = "batch"; size = 32; } ); };
  eval:  { source: { type = "csv"; files = ["${3:-produce.csv}"]; columns: { $cols }; };
           transforms = ( $maps, { op = "batch"; size = 100; } ); };
};
model: { input = "x"; label = "label"; layers = ( { type = "dense"; units = 8; activation = "relu"; },
                                                  { type = "dense"; units = 3; } ); };
optimizer: { type = "adam"; learning_rate = 0.01; };
run: { model_dir = "run_$1"; epochs = 4; seed = 3; progress = "none"; };
CFG
}

cfg a
check "a config with string_lookup and min_max trains" bash -c "cd '$WORK' && timeout 120 '$LOOM' train a.cfg"
AD="$WORK/run_a/adapt.txt"

# 1. the numbers and the vocabulary are Python's on the same rows
python3 - "$CSV" "$AD" > "$WORK/py.out" 2>&1 <<'PY'
import collections, csv, math, struct, sys, urllib.parse
f32 = lambda v: struct.unpack("f", struct.pack("f", v))[0]
rows = list(csv.DictReader(open(sys.argv[1], newline="")))
w = [f32(float(r["weight"])) for r in rows]
s = [f32(float(r["sugar"])) for r in rows]
cnt = collections.Counter(r["colour"].encode() for r in rows)
vocab = sorted(cnt.items(), key=lambda kv: (-kv[1], kv[0]))[:3]   # max_tokens 4 = 1 oov id + 3
mean = sum(s) / len(s)
std = math.sqrt(sum((x - mean) ** 2 for x in s) / len(s))
want = {"min": min(w), "range": max(w) - min(w), "mean": mean, "std": std}
got, toks = {}, []
lines = open(sys.argv[2]).read().split("\n")
for i, l in enumerate(lines):
    p = l.split()
    if p and p[0] in want: got[p[0]] = float(p[1])
    if p and p[0] == "vocab":  # "=TOKEN COUNT" lines, bytes outside '!'..'~' and '%' as %XX
        toks = [(urllib.parse.unquote_to_bytes(t[1:]), int(c)) for t, c in (x.split() for x in lines[i + 1:i + 1 + int(p[3])])]
bad = [k for k in want if k not in got or abs(got[k] - want[k]) > 1e-5 * max(1, abs(want[k]))]
print("numbers", "ok" if not bad else "differ: %s loom %s python %s" % (bad, got, want))
print("vocab", "ok" if toks == vocab else "differ: loom %s python %s" % (toks, vocab))
PY
contains "min_max: min and range are Python's (float32 values)" "numbers ok" "$(cat "$WORK/py.out")"
contains "string_lookup: the vocabulary is Python's Counter, most frequent first, max_tokens - 1 strings" "vocab ok" "$(cat "$WORK/py.out")"
contains "adapt.txt names each kind" "minmax 2 weight 1" "$(cat "$AD")"
p1=$(cd "$WORK" && "$LOOM" check --print a.cfg 2>/dev/null); echo "$p1" > "$WORK/printed.cfg"
p2=$(cd "$WORK" && "$LOOM" check --print printed.cfg 2>/dev/null)
contains "check --print shows string_lookup's settings" "num_oov_indices = 1;" "$p1"
contains "check --print shows the csv string column" 'dtype = "string"; max_length = 16' "$p1"
[ -n "$p1" ] && [ "$(echo "$p1" | tail -n +2)" = "$(echo "$p2" | tail -n +2)" ] && pass "the printed config loads back to the same" || fail "print round trip" "$(diff <(echo "$p1") <(echo "$p2") | head -5)"

# 2. the checkpoint holds them
LAST=$(ls -v "$WORK"/run_a/ckpt-*.loom | tail -1)
out=$(timeout 30 "$LOOM" inspect "$LAST" 2>&1)
contains "every checkpoint has an \"adapt\" record" "blob   adapt" "$out"

# 3. predict / evaluate / export: the same outputs without adapt.txt, from a copied checkpoint
pred() { (cd "$WORK" && timeout 60 "$LOOM" predict a.cfg --id id,label --output - "$@" 2>"$WORK/pred.err"); }
evaljs() { (cd "$WORK" && timeout 60 "$LOOM" evaluate a.cfg "$@" 2>"$WORK/eval.err"); }
p1=$(pred); e1=$(evaljs)
[ "$(echo "$p1" | wc -l)" -eq 601 ] && pass "predict writes 600 rows" || fail "predict writes 600 rows" "$(echo "$p1" | head -3)"
mv "$AD" "$WORK/adapt.saved"
p2=$(pred); e2=$(evaljs)
[ -n "$p1" ] && [ "$p1" = "$p2" ] && pass "predict without adapt.txt: the same outputs (the checkpoint's numbers)" \
    || fail "predict without adapt.txt: the same outputs" "$(cat "$WORK/pred.err" | tail -3)"
[ -n "$e1" ] && [ "$e1" = "$e2" ] && pass "evaluate without adapt.txt: the same result" || fail "evaluate without adapt.txt" "$e1 / $e2" "$(tail -3 "$WORK/eval.err")"
contains "it says the numbers come from the checkpoint, by absolute path" "from the checkpoint $WORK/run_a/ckpt-" "$(cat "$WORK/eval.err")"
# export --include-preprocessing folds the numbers in: a model of the numbers alone (min_max on a vector)
cat > "$WORK/n.cfg" <<CFG
version = 1;
data: { train: { source: { type = "csv"; files = ["produce.csv"]; columns: { x = { dtype = "float32"; index = "1-2"; };
                                                                          label = { dtype = "int64"; }; }; };
                 transforms = ( { op = "map"; fn = "normalize"; feature = "x"; adapt = true; mode = "min_max"; },
                                { op = "batch"; size = 32; } ); }; };
model: { input = "x"; label = "label"; layers = ( { type = "dense"; units = 3; } ); };
optimizer: { type = "sgd"; learning_rate = 0.1; };
run: { model_dir = "run_n"; epochs = 1; progress = "none"; };
CFG
ex() { (cd "$WORK" && timeout 60 "$LOOM" export n.cfg --format onnx --include-preprocessing --output "$1" 2>&1); }
(cd "$WORK" && timeout 60 "$LOOM" train n.cfg >/dev/null 2>&1)
ex "$WORK/n1.onnx" >/dev/null
rm -f "$WORK/run_n/adapt.txt"
out=$(ex "$WORK/n2.onnx")
[ -s "$WORK/n1.onnx" ] && cmp -s "$WORK/n1.onnx" "$WORK/n2.onnx" && pass "export --include-preprocessing without adapt.txt: the same ONNX bytes" \
    || fail "export --include-preprocessing without adapt.txt: the same ONNX bytes" "$out"
mkdir -p "$WORK/elsewhere" "$WORK/empty"
cp "$LAST" "$WORK/elsewhere/copied.loom"
p3=$(pred --model-dir "$WORK/empty" --checkpoint "$WORK/elsewhere/copied.loom")
[ "$p1" = "$p3" ] && pass "a checkpoint copied elsewhere predicts the same" || fail "a copied checkpoint predicts the same" "$(tail -3 "$WORK/pred.err")"
[ ! -e "$WORK/empty/adapt.txt" ] && pass "predict writes nothing into the model_dir" || fail "predict wrote adapt.txt"

# 4. a different adapt.txt: the checkpoint wins, said once
sed 's/^mean .*/mean 99.5/' "$WORK/adapt.saved" > "$AD"
p4=$(pred)
[ "$p1" = "$p4" ] && pass "a different adapt.txt: the checkpoint's numbers win" || fail "the checkpoint wins" "$(tail -3 "$WORK/pred.err")"
n=$(grep -c "differ from $WORK/run_a/adapt.txt; using the checkpoint's" "$WORK/pred.err")
[ "$n" = 1 ] && pass "...and it says so once" || fail "it says so once" "said $n times" "$(cat "$WORK/pred.err" | tail -3)"
contains "...naming the checkpoint's absolute path" "$WORK/run_a/ckpt-" "$(grep differ "$WORK/pred.err")"

# 5. the sidecar evaluator takes the checkpoint's numbers too (a late watcher, no adapt.txt)
mkdir -p "$WORK/late"
cp "$WORK/run_a/"ckpt-*.loom "$WORK/run_a/checkpoint" "$WORK/run_a/final.json" "$WORK/late/"
w=$(cd "$WORK" && timeout 60 "$LOOM" evaluate a.cfg --watch --model-dir "$WORK/late" 2>"$WORK/watch.err")
contains "evaluate --watch uses the checkpoint's numbers" "from the checkpoint $WORK/late/ckpt-" "$(cat "$WORK/watch.err")"
l1=$(echo "$e1" | sed 's/.*"eval_loss": \([^,}]*\).*/\1/'); l2=$(echo "$w" | grep '"eval_loss"' | sed 's/.*"eval_loss": \([^,}]*\).*/\1/')
[ -n "$l1" ] && [ "$l1" = "$l2" ] && pass "...and reports evaluate's loss ($l1)" || fail "the watcher's loss is evaluate's" "$l1 vs $l2" "$(tail -3 "$WORK/watch.err")"

# 6. exact resume: 2 epochs, adapt.txt deleted, 2 more = 4 epochs at once
cfg r
sed -i 's/epochs = 4/epochs = 2/' "$WORK/r.cfg"
(cd "$WORK" && timeout 60 "$LOOM" train r.cfg >/dev/null 2>&1)
rm -f "$WORK/run_r/adapt.txt"
sed -i 's/epochs = 2/epochs = 4/' "$WORK/r.cfg"
out=$(cd "$WORK" && timeout 60 "$LOOM" train r.cfg 2>&1)
contains "a resume takes the checkpoint's numbers" "from the checkpoint $WORK/run_r/ckpt-" "$out"
[ -f "$WORK/run_r/adapt.txt" ] && cmp -s "$WORK/run_r/adapt.txt" "$WORK/adapt.saved" && pass "...and writes adapt.txt back as it was" \
    || fail "the resume writes adapt.txt back"
ta=$(timeout 30 "$LOOM" inspect "$LAST" | grep '^tensor'); tr=$(timeout 30 "$LOOM" inspect "$(ls -v "$WORK"/run_r/ckpt-*.loom | tail -1)" | grep '^tensor')
[ -n "$ta" ] && [ "$ta" = "$tr" ] && pass "the resumed run's weights are the uninterrupted run's, bit for bit (every tensor's CRC)" \
    || fail "exact resume: the weights differ" "$(diff <(echo "$ta") <(echo "$tr") | head -4)"

# 6b. string_lookup's ids go straight into an embedding first layer (input_dim = max_tokens)
cat > "$WORK/emb.cfg" <<CFG
version = 1;
data: { train: { source: { type = "csv"; files = ["produce.csv"];
                           columns: { colour = { dtype = "string"; max_length = 16; }; label = { dtype = "int64"; }; }; };
                 transforms = ( { op = "map"; fn = "string_lookup"; feature = "colour"; adapt = true; max_tokens = 8; },
                                { op = "batch"; size = 32; } ); }; };
model: { input = "colour"; label = "label";
         layers = ( { type = "embedding"; input_dim = 8; output_dim = 4; }, { type = "flatten"; },
                    { type = "dense"; units = 3; } ); };
optimizer: { type = "adam"; learning_rate = 0.05; };
run: { model_dir = "run_emb"; epochs = 3; progress = "none"; };
CFG
out=$(cd "$WORK" && timeout 60 "$LOOM" train emb.cfg 2>&1)
acc=$(grep -o "done: step [0-9]*, train accuracy [0-9.]*\|accuracy [0-9.]*" <<<"$out" | tail -1 | awk '{print $NF}')
awk -v a="${acc:-0}" 'BEGIN { exit !(a > 0.6) }' && pass "string_lookup ids feed an embedding: it learns the label from the colour (accuracy $acc)" \
    || fail "string_lookup into an embedding" "$(echo "$out" | tail -3)"

# 7. data.eval uses the training vocabulary: a string only eval has is out of vocabulary
grep -v ",purple," "$CSV" > "$WORK/nopurple.csv"
cfg v "" produce.csv
sed -i '0,/files = \["produce.csv"\]; columns/s//files = ["nopurple.csv"]; columns/; s/depth = 4/depth = 8/g' "$WORK/v.cfg"
sed -i 's/max_tokens = 4; }/max_tokens = 0; num_oov_indices = 0; }/g' "$WORK/v.cfg"
expect_fail 1 "eval's string_lookup uses train's vocabulary: a string train never saw, with no oov id, is an error" \
    '"purple" is not in the vocabulary' bash -c "cd '$WORK' && timeout 60 '$LOOM' train v.cfg"

# 8. bad input
cfg e '{ op = "filter"; feature = "weight"; min = 1e9; },'
expect_fail 1 "adapt on an empty split is an error naming the map" "data.train yields no elements before this map" \
    bash -c "cd '$WORK' && timeout 60 '$LOOM' train e.cfg"
contains "...at the map's file:line" "$WORK/e.cfg:" "$(cd "$WORK" && timeout 60 "$LOOM" train e.cfg 2>&1)"
cfg f
sed -i '0,/feature = "colour"; adapt = true/s//feature = "weight"; adapt = true/' "$WORK/f.cfg"
expect_fail 2 "string_lookup on a float feature is an error" 'a vocabulary is made of strings (uint8 bytes, the last axis one string), but "weight" is float32' \
    bash -c "cd '$WORK' && timeout 60 '$LOOM' train f.cfg"
cfg g
sed -i 's/adapt = true; mode = "min_max"; }/adapt = true; mode = "min_max"; }/; s/run_g/run_a/' "$WORK/g.cfg"
sed -i '0,/max_tokens = 4;/s//max_tokens = 5;/' "$WORK/g.cfg"
expect_fail 1 "a checkpoint adapted with other settings is refused, naming both" \
    "was adapted with num_oov_indices = 1, max_tokens = 4; the config says 1 and 5" \
    bash -c "cd '$WORK' && timeout 60 '$LOOM' predict g.cfg --output -"
# a damaged adapt.txt and no checkpoint to take the numbers from: an error naming the file and the map
mkdir -p "$WORK/damaged"
sed 's/^=green /=%ZZgreen /' "$WORK/adapt.saved" > "$WORK/damaged/adapt.txt"
expect_fail 1 "a damaged vocabulary in adapt.txt is an error naming the file" \
    "$WORK/damaged/adapt.txt: vocab 0 (\"colour\"): token lines are damaged" \
    bash -c "cd '$WORK' && timeout 60 '$LOOM' predict a.cfg --model-dir '$WORK/damaged' --output -"
# adapt.txt is a path loom writes in the user's model directory (issue 22):
# a FIFO there is refused, not renamed over; a link to a regular file is
# written through
mkdir -p "$WORK/run_fifo"; mkfifo "$WORK/run_fifo/adapt.txt"
expect_fail 1 "a FIFO as adapt.txt is refused, not replaced" "adapt.txt: is a FIFO (named pipe), not a regular file: refused" \
    bash -c "cd '$WORK' && timeout 120 '$LOOM' train a.cfg --fresh --model-dir run_fifo --set run.max_steps=2"
[ -p "$WORK/run_fifo/adapt.txt" ] && pass "adapt.txt: the FIFO is still a FIFO" || fail "adapt.txt: the FIFO is still a FIFO" "$(ls -la "$WORK/run_fifo")"
mkdir -p "$WORK/run_link"; : > "$WORK/kept_adapt.txt"; ln -s ../kept_adapt.txt "$WORK/run_link/adapt.txt"
check "adapt.txt as a link to a regular file: trains" \
    bash -c "cd '$WORK' && timeout 120 '$LOOM' train a.cfg --fresh --model-dir run_link --set run.max_steps=2"
[ -L "$WORK/run_link/adapt.txt" ] && grep -q "^vocab" "$WORK/kept_adapt.txt" && grep -q "^min" "$WORK/kept_adapt.txt" && pass "adapt.txt: written through the link, the link kept" ||
    fail "adapt.txt: written through the link, the link kept" "$(ls -la "$WORK/run_link")"

finish
