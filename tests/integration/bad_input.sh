#!/usr/bin/env bash
# bad_input.sh - bad configs, data and checkpoints get a clear error naming
# the file (and line), the right exit status, and nothing is written.
source "$(dirname "$0")/lib.sh"
CFG=tests/configs/small_mlp.cfg
D="$WORK/cfg"; mkdir -p "$D"

mk() { # mk NAME: writes $D/NAME.cfg from stdin
    cat > "$D/$1.cfg"
}
nothing_written() { if [ ! -e "$1" ]; then pass "$2: nothing written"; else fail "$2: nothing written" "$(ls -la "$1")"; fi; }

# --- configs -------------------------------------------------------------
printf 'version = 1;\nrun: { epochs = 3 }\n' > "$D/syntax.cfg"   # missing semicolon inside a group is fine; a missing brace is not
printf 'version = 1;\nrun: { epochs = 3;\n' > "$D/syntax.cfg"
expect_fail 2 "syntax error names file:line" "syntax.cfg:3" "$LOOM" train "$D/syntax.cfg" --model-dir "$WORK/m1"
nothing_written "$WORK/m1" "syntax error"

sed 's/epochs = 3;/epocs = 3;/' $CFG > "$D/unknown.cfg"
expect_fail 2 "unknown key suggests the nearest" "epochs" "$LOOM" train "$D/unknown.cfg" --model-dir "$WORK/m2"
out=$("$LOOM" check "$D/unknown.cfg" 2>&1); contains "unknown key names the line" "unknown.cfg:36" "$out"
nothing_written "$WORK/m2" "unknown key"

sed 's/epochs = 3;/epochs = "three";/' $CFG > "$D/type.cfg"
expect_fail 2 "wrong type" "run.epochs" "$LOOM" train "$D/type.cfg" --model-dir "$WORK/m3"
nothing_written "$WORK/m3" "wrong type"

sed 's/size = 64;/size = -64;/' $CFG > "$D/negbatch.cfg"
expect_fail 2 "negative batch size" "size" "$LOOM" train "$D/negbatch.cfg" --model-dir "$WORK/m4"
out=$("$LOOM" check "$D/negbatch.cfg" 2>&1); contains "negative batch size names the line" "negbatch.cfg:12" "$out"

expect_fail 2 "shuffle buffer over the RAM budget names its line and the bytes" \
    "small_mlp.cfg:11: data.train: data.train.transforms.[3]: shuffle: a buffer of 1000 elements needs 3137000 bytes" \
    "$LOOM" train $CFG --set 'data.options.autotune.ram_budget="1MB"' --model-dir "$WORK/m4b"
nothing_written "$WORK/m4b" "shuffle over the RAM budget"
nothing_written "$WORK/m4" "negative batch"

# list_files + interleave + zip: a feature on both sides of a zip is refused at open, naming the zip's line
O="$PWD/tests/fixtures/tf/order"
mk zipclash <<EOF
version = 1;
data: { train: {
  source: { type = "list_files"; files = ["$O/part-*.tfrecord"]; };
  transforms = ( { op = "interleave"; cycle_length = 2; source: { type = "tfrecord"; features: { id = { dtype = "int64"; shape = []; }; }; }; },
                 { op = "zip"; dataset: { source: { type = "tfrecord"; files = ["$O/ids.tfrecord"];
                                                    features: { id = { dtype = "int64"; shape = []; }; }; }; }; },
                 { op = "batch"; size = 2; } ); }; };
model: { input = "id"; label = "id"; layers = ( { type = "dense"; units = 10; } ); };
optimizer: { type = "sgd"; learning_rate = 0.1; };
run: { model_dir = "$WORK/m4z"; };
EOF
expect_fail 2 "zip name clash names the zip" 'zipclash.cfg:5: data.train: data.train.transforms.[1]: feature "id" is in both' \
    "$LOOM" train "$D/zipclash.cfg"
nothing_written "$WORK/m4z" "zip name clash"
sed 's#part-\*#nothing-*#' "$D/zipclash.cfg" > "$D/noglob.cfg"
expect_fail 2 "list_files glob matching nothing" 'noglob.cfg:3: data.train.source.files.[0]: no files match' "$LOOM" check "$D/noglob.cfg"

# --- data ----------------------------------------------------------------
I="$WORK/idx"; mkdir -p "$I"
python3 - "$I" <<'PY'
import sys, struct, gzip
d = sys.argv[1]
def idx(path, dims, payload, magic=None, gz=False):
    head = (magic if magic is not None else bytes([0, 0, 8, len(dims)])) + b''.join(struct.pack('>I', x) for x in dims)
    data = head + payload
    (gzip.open if gz else open)(path, 'wb').write(data)
idx(f'{d}/img.idx', [100, 28, 28], bytes(100 * 784))
idx(f'{d}/lbl.idx.gz', [100], bytes(i % 10 for i in range(100)), gz=True)
idx(f'{d}/lbl90.idx', [90], bytes(90))
idx(f'{d}/trunc.idx', [100, 28, 28], bytes(50 * 784))
idx(f'{d}/magic.idx', [100, 28, 28], bytes(100 * 784), magic=b'\x12\x34\x08\x03')
PY
FLATTEN='{ type = "flatten"; },'
idxcfg() { # idxcfg NAME IMAGES LABELS [first layers]
local first="${4-$FLATTEN}"
cat > "$D/$1.cfg" <<CFG
version = 1;
data: { train: {
  source: { type = "idx"; features: { image = "$2"; label = "$3"; }; };
  transforms = ( { op = "map"; fn = "scale"; feature = "image"; scale = 0.0039; }, { op = "batch"; size = 10; } );
}; };
model: { layers = ( $first { type = "dense"; units = 10; } ); };
optimizer: { type = "sgd"; learning_rate = 0.1; };
run: { model_dir = "$WORK/idxrun_$1"; epochs = 1; progress = "none"; };
CFG
}
idxcfg ok "$I/img.idx" "$I/lbl.idx.gz"
check "a good IDX config trains (plain and gzip files)" "$LOOM" train "$D/ok.cfg"
idxcfg missing "$I/nope.idx" "$I/lbl.idx.gz"
expect_fail 2 "missing IDX file names it" "nope.idx" "$LOOM" train "$D/missing.cfg"
nothing_written "$WORK/idxrun_missing" "missing IDX"
idxcfg trunc "$I/trunc.idx" "$I/lbl.idx.gz"
expect_fail 2 "truncated IDX file names it" "trunc.idx" "$LOOM" train "$D/trunc.cfg"
nothing_written "$WORK/idxrun_trunc" "truncated IDX"
idxcfg magic "$I/magic.idx" "$I/lbl.idx.gz"
expect_fail 2 "wrong IDX magic names it" "magic.idx" "$LOOM" train "$D/magic.cfg"
idxcfg mismatch "$I/img.idx" "$I/lbl90.idx"
expect_fail 2 "images and labels of different lengths" "lbl90.idx" "$LOOM" train "$D/mismatch.cfg"
nothing_written "$WORK/idxrun_mismatch" "length mismatch"
idxcfg noflatten "$I/img.idx" "$I/lbl.idx.gz" " "
expect_fail 2 "model input shape mismatch suggests flatten" "flatten" "$LOOM" check "$D/noflatten.cfg"
out=$("$LOOM" check "$D/noflatten.cfg" 2>&1); contains "shape mismatch names the layer's line" "noflatten.cfg:6" "$out"

# --- model_dir -----------------------------------------------------------
touch "$WORK/afile"
expect_fail 1 "unwritable model_dir" "afile" "$LOOM" train $CFG --model-dir "$WORK/afile/sub" --set run.max_steps=2

# --- checkpoints ---------------------------------------------------------
check "train 20 steps" "$LOOM" train $CFG --model-dir "$WORK/ck" --set run.max_steps=20 --set run.progress='"none"'
cp "$WORK/ck/ckpt-20.loom" "$WORK/good20"
head -c 1000 "$WORK/good20" > "$WORK/ck/ckpt-20.loom"
expect_fail 1 "truncated checkpoint is refused with its name" "ckpt-20.loom" "$LOOM" train $CFG --model-dir "$WORK/ck" --set run.max_steps=30
out=$("$LOOM" train $CFG --model-dir "$WORK/ck" --set run.max_steps=30 2>&1); contains "truncated checkpoint says truncated" "truncated" "$out"
if [ ! -e "$WORK/ck/ckpt-30.loom" ]; then pass "no silent restart from scratch"; else fail "no silent restart from scratch"; fi
python3 -c "
import sys; b = bytearray(open('$WORK/good20','rb').read()); b[len(b)//2] ^= 0xff; open('$WORK/ck/ckpt-20.loom','wb').write(b)"
expect_fail 1 "corrupt checkpoint is refused" "corrupt" "$LOOM" train $CFG --model-dir "$WORK/ck" --set run.max_steps=30
check "--fresh starts over" "$LOOM" train $CFG --model-dir "$WORK/ck" --set run.max_steps=30 --fresh --set run.progress='"none"'
# a checkpoint of another model
check "train a different model" "$LOOM" train $CFG --model-dir "$WORK/other" --set run.max_steps=10 --set run.progress='"none"'
expect_fail 1 "checkpoint of a different model is refused" "different model" "$LOOM" train $CFG --model-dir "$WORK/other" --set 'model.layers.[1].units=32'

# --- non-finite loss -----------------------------------------------------
expect_fail 1 "a diverging loss stops with the step" "not finite at step" "$LOOM" train $CFG --model-dir "$WORK/nan" --set optimizer.learning_rate=1e30 --set optimizer.momentum=0.99 --set run.checkpoint_steps=1
# --- sizes, integers and --set (issue 11) --------------------------------
# integers past 32 bits: libconfig 1.5 reads 4294967297 as 1; loom keeps what was written
out=$("$LOOM" check --print $CFG --set run.max_steps=4294967297 2>&1)
contains "--set max_steps past 32 bits keeps its value" "max_steps = 4294967297L;" "$out"
expect_fail 2 "--set beyond 64 bits names the range" "--set run.max_steps: expected an integer >= 0, got 99999999999999999999" \
    "$LOOM" check $CFG --set run.max_steps=99999999999999999999
expect_fail 2 "one assignment per --set" "--set run.epochs: one assignment per --set" \
    "$LOOM" train $CFG --set 'run.epochs=3; version=2' --model-dir "$WORK/m5"
nothing_written "$WORK/m5" "two assignments in one --set"
expect_fail 2 "batch 10^9 is refused with its line" "--set data.train.transforms.[4].size: expected an integer in [1, 16777216], got 1000000000" \
    "$LOOM" check $CFG --set 'data.train.transforms.[4].size=1000000000'
expect_fail 2 "units = 2^31 - 1 is refused with its line" "model.layers.[1].units: expected an integer in [1, 16777216], got 2147483647" \
    "$LOOM" check $CFG --set 'model.layers.[1].units=2147483647'
expect_fail 2 "a layer past 2^31 parameters names its line" 'small_mlp.cfg:28: layer "dense_1" (dense) takes the model past 2147483647 parameters' \
    "$LOOM" check $CFG --set 'model.layers.[1].units=16777216'
mk hugebatch <<EOF
version = 1;
data: { train: { source: { type = "synthetic"; count = 100;
                           features: { x = { dtype = "float32"; shape = [32768, 32768]; }; y = { dtype = "int32"; shape = []; max = 10; }; }; };
                 transforms = ( { op = "batch"; size = 16777216; } ); }; };
model: { input = "x"; label = "y"; layers = ( { type = "flatten"; }, { type = "dense"; units = 10; } ); };
optimizer: { type = "sgd"; learning_rate = 0.1; };
run: { model_dir = "$WORK/m6"; };
EOF
expect_fail 2 "a batch larger than memory is found by check at its line" \
    'hugebatch.cfg:4: data.train: data.train.transforms.[0]: batch: a batch of 16777216 elements of feature "x"' \
    "$LOOM" check "$D/hugebatch.cfg"
expect_fail 2 "an empty training set is found by check at its line" "small_mlp.cfg:5: data.train yields no batch" \
    "$LOOM" check $CFG --set 'data.train.transforms.[0].count=0'
sed 's/{ op = "take"; count = 2048; },/{ op = "filter"; feature = "label"; in = [99]; },/' $CFG > "$D/emptyfilter.cfg"
expect_fail 2 "an empty training set of unknown size is found by check" "emptyfilter.cfg:5: data.train yields no batch" \
    "$LOOM" check "$D/emptyfilter.cfg"
# --- a run without data.eval: the log and metrics.jsonl never hold NaN ----
sed '/^  eval: {/,/^  };/d' $CFG > "$D/noeval.cfg"
out=$("$LOOM" train "$D/noeval.cfg" --model-dir "$WORK/noeval" --set run.max_steps=40 --set run.progress='"none"' 2>&1)
contains "no eval data is said in the epoch line" "accuracy 0." "$out"
contains "no eval data is said" "; no eval data," "$out"
contains "the end line says no eval data" "done: step 40, no eval data" "$out"
if grep -qi nan <<<"$out"; then fail "no NaN in the log" "$(grep -i nan <<<"$out")"; else pass "no NaN in the log"; fi
if grep -qiE 'nan|infinity' "$WORK/noeval/metrics.jsonl"; then fail "no NaN in metrics.jsonl" "$(cat "$WORK/noeval/metrics.jsonl")"
else pass "no NaN in metrics.jsonl"; fi
python3 -c "import json,sys; [json.loads(l, parse_constant=lambda c: int('strict JSON has no ' + c)) for l in open(sys.argv[1])]" "$WORK/noeval/metrics.jsonl" \
    && pass "metrics.jsonl is strict JSON" || fail "metrics.jsonl is strict JSON"
finish
