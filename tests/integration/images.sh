#!/usr/bin/env bash
# images.sh - PNG-encoded TFRecords written by TensorFlow (tests/fixtures/img,
# make_png_fixtures.py) through the loom binary: decode_image with random
# brightness and contrast trains, resumes bit-identically mid-epoch, evaluates
# and predicts; a corrupt PNG stops the run naming the file:line of the map
# and the record; PNG bytes declared as raw pixels get the decode_image hint.
source "$(dirname "$0")/lib.sh"
FIX="$ROOT/tests/fixtures/img/fmnist_png.tfrecord"

# config FILE TRAIN_RECORDS IMAGE_DECL: a small MLP over 256 TF-written PNG records (8 steps an epoch)
config() {
    cat >"$1" <<CFG
version = 1;
data: {
  train: {
    source: { type = "tfrecord"; files = ["$2"];
              features: { image = $3; label = { dtype = "int64"; shape = []; }; }; };
    transforms = (
      { op = "shuffle"; buffer = 256; },
      { op = "map"; fn = "decode_image"; feature = "image"; channels = 1; dtype = "float32"; max_size = [32, 32];
        parallel = 2; },
      { op = "map"; fn = "resize"; feature = "image"; size = [28, 28]; },
      { op = "map"; fn = "random_brightness"; feature = "image"; max_delta = 0.1; parallel = 2; },
      { op = "map"; fn = "random_contrast"; feature = "image"; lower = 0.8; upper = 1.2; },
      { op = "batch"; size = 32; },
      { op = "prefetch"; buffer = 2; }
    );
  };
  eval: {
    source: { type = "tfrecord"; files = ["$2"];
              features: { image = $3; label = { dtype = "int64"; shape = []; }; }; };
    transforms = (
      { op = "map"; fn = "decode_image"; feature = "image"; channels = 1; dtype = "float32"; size = [28, 28]; },
      { op = "batch"; size = 64; }
    );
  };
};
model: { layers = ( { type = "flatten"; }, { type = "dense"; units = 32; activation = "relu"; },
                    { type = "dense"; units = 10; } ); };
optimizer: { type = "momentum"; learning_rate = 0.05; momentum = 0.9; };
run: { model_dir = "$WORK/unused"; epochs = 3; seed = 7; checkpoint_steps = 4; progress = "none"; status_port = 0; };
CFG
}
PNG='{ dtype = "uint8"; shape = [1024]; var_len = true; }'
config "$WORK/png.cfg" "$FIX" "$PNG"
check "check the PNG config" "$LOOM" check "$WORK/png.cfg"
check "train 3 epochs from PNG records" "$LOOM" train "$WORK/png.cfg" --model-dir "$WORK/a"
check "train to step 10 (mid-epoch 1)" "$LOOM" train "$WORK/png.cfg" --model-dir "$WORK/b" --set run.max_steps=10
check "resume to the end" "$LOOM" train "$WORK/png.cfg" --model-dir "$WORK/b"
ta=$("$LOOM" inspect "$WORK/a/ckpt-24.loom" | grep '^tensor'); tb=$("$LOOM" inspect "$WORK/b/ckpt-24.loom" | grep '^tensor')
if [ -n "$ta" ] && [ "$ta" = "$tb" ]; then pass "random brightness/contrast resumed mid-epoch = uninterrupted (bit-identical)"
else fail "random brightness/contrast resumed mid-epoch = uninterrupted" "$(diff <(echo "$ta") <(echo "$tb") | head -4)"; fi
out=$("$LOOM" evaluate "$WORK/png.cfg" --model-dir "$WORK/a" 2>/dev/null)
contains "evaluate on the PNG records" '"examples": 256' "$out"
check "predict on the PNG records (random maps left out)" "$LOOM" predict "$WORK/png.cfg" --model-dir "$WORK/a" \
    --input eval --output "$WORK/pred.csv"
n=$(($(wc -l <"$WORK/pred.csv") - 1))
[ "$n" -eq 256 ] && pass "predict wrote 256 rows" || fail "predict wrote 256 rows" "$n rows"

# record 5's PNG damaged inside its IDAT, the TFRecord CRCs made valid again, so the PNG decoder finds it
python3 - "$FIX" "$WORK/bad.tfrecord" <<'PY'
import struct, sys
def crc32c(b, t=[]):
    if not t:
        for i in range(256):
            c = i
            for _ in range(8):
                c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
            t.append(c)
    c = 0xFFFFFFFF
    for x in b:
        c = t[(c ^ x) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF
def masked(b):
    c = crc32c(b)
    return ((((c >> 15) | (c << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF
d = open(sys.argv[1], "rb").read()
out, i, k = bytearray(), 0, 0
while i < len(d):
    n = struct.unpack("<Q", d[i:i + 8])[0]
    rec = bytearray(d[i + 12:i + 12 + n])
    if k == 5:
        at = rec.find(b"IDAT") + 20
        rec[at] ^= 0x5A
    hdr = struct.pack("<Q", n)
    out += hdr + struct.pack("<I", masked(hdr)) + rec + struct.pack("<I", masked(bytes(rec)))
    i += 16 + n
    k += 1
open(sys.argv[2], "wb").write(out)
PY
config "$WORK/bad.cfg" "$WORK/bad.tfrecord" "$PNG"
expect_fail 1 "a corrupt PNG stops evaluate, naming the map's line and the record" \
    "bad.cfg:21: data.eval.transforms.[0]: map(decode_image) on \"image\": record 5 of this epoch's reading order (from 0): corrupt PNG" \
    "$LOOM" evaluate "$WORK/bad.cfg" --model-dir "$WORK/a"
# the same bytes declared as raw 28x28 pixels: the hint names decode_image
cat >"$WORK/raw.cfg" <<CFG
version = 1;
data: { train: { source: { type = "tfrecord"; files = ["$FIX"];
  features: { image = { dtype = "uint8"; shape = [28, 28]; }; label = { dtype = "int64"; shape = []; }; }; };
  transforms = ( { op = "map"; fn = "scale"; feature = "image"; scale = 0.00392156862745098; }, { op = "batch"; size = 32; } ); }; };
model: { layers = ( { type = "flatten"; }, { type = "dense"; units = 10; } ); };
optimizer: { type = "sgd"; learning_rate = 0.1; };
run: { model_dir = "$WORK/raw"; };
CFG
expect_fail 2 "PNG bytes declared raw: the hint names decode_image" 'and decode it with map fn = "decode_image"' \
    "$LOOM" check "$WORK/raw.cfg"
finish
