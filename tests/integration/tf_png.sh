#!/usr/bin/env bash
# tf_png.sh - PNG- and JPEG-encoded TFRecords as TensorFlow writes them
# (issue 16), made here by TensorFlow itself (tests/fixtures/make_png_fixtures.py:
# tf.io.encode_png + tf.train.Example + tf.io.TFRecordWriter): loom trains
# on them with configs/fashion_mnist_png.cfg's pipeline, and decode_image
# gives the pixels of tf.io.decode_png and tf.io.decode_jpeg, byte for byte.
# TensorFlow is $TF_PYTHON's (default python3); without it the test is skipped.
source "$(dirname "$0")/lib.sh"
TF_PY=${TF_PYTHON:-python3}
export TF_CPP_MIN_LOG_LEVEL=2
if ! "$TF_PY" -c "import tensorflow" >/dev/null 2>&1; then
    echo "1..0 # SKIP TensorFlow is not installed for $TF_PY (set TF_PYTHON to a python with tensorflow-cpu)"
    exit 0
fi
if [ ! -f /usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz ]; then
    echo "1..0 # SKIP Debian's dataset-fashion-mnist is not installed"
    exit 0
fi
DUMP="${LOOM_DECODE_DUMP:-$(dirname "$LOOM")/tests/decode_dump}"

# 1. the records, by TensorFlow: 2048 training images in 4 shards, 500 test images
check "TensorFlow writes PNG-encoded Fashion-MNIST records" \
    timeout 300 "$TF_PY" tests/fixtures/make_png_fixtures.py --full "$WORK/png" 2048 500
ls "$WORK"/png/train-0000[0-3]-of-00004.tfrecord "$WORK/png/test-00000-of-00001.tfrecord" >/dev/null 2>&1 &&
    pass "4 training shards and a test file" || fail "the record files" "$(ls "$WORK/png")"

# 2. configs/fashion_mnist_png.cfg's pipeline (decode_image, resize, brightness, contrast) trains on them
sed "s#\.\./runs/fashion_mnist_png/#$WORK/png/#" configs/fashion_mnist_png.cfg > "$WORK/png.cfg"
out=$(timeout 300 "$LOOM" train "$WORK/png.cfg" --model-dir "$WORK/run" --set run.epochs=3 --set run.progress=\"none\" 2>&1)
st=$?
[ $st -eq 0 ] && pass "fashion_mnist_png.cfg trains on TensorFlow's records" || fail "training on TF's records" "$(echo "$out" | tail -5)"
js=$(timeout 120 "$LOOM" evaluate "$WORK/png.cfg" --model-dir "$WORK/run" 2>/dev/null)
acc=$(echo "$js" | sed -n 's/.*"eval_accuracy": \([0-9.]*\).*/\1/p')
awk -v a="${acc:-0}" 'BEGIN { exit !(a >= 0.6) }' && pass "evaluate on 500 TF-written test images: accuracy $acc (>= 0.6 after 3 epochs of 2048)" \
    || fail "accuracy on TF's test records >= 0.6" "$js"
contains "all 500 test images are read" '"examples": 500' "$js"

# 3. decode_image's pixels = tf.io.decode_png's; then JPEG (grey and colour) = tf.io.decode_jpeg's
# dump_cfg FILE FEATURE BYTES CHANNELS: an eval pipeline that only decodes, for decode_dump
dump_cfg() {
    cat > "$WORK/dump.cfg" <<CFG
version = 1;
data: {
  train: { source: { type = "tfrecord"; files = ["$1"];
                     features: { $2 = { dtype = "uint8"; shape = [$3]; var_len = true; }; }; };
           transforms = ( { op = "batch"; size = 1; } ); };
  eval:  { source: { type = "tfrecord"; files = ["$1"];
                     features: { $2 = { dtype = "uint8"; shape = [$3]; var_len = true; }; }; };
           transforms = ( { op = "map"; fn = "decode_image"; feature = "$2"; channels = $4; size = [28, 28]; } ); };
};
model: { input = "$2"; layers = ( { type = "flatten"; }, { type = "dense"; units = 2; } ); };
optimizer: { type = "sgd"; learning_rate = 0.1; };
run: { model_dir = "unused"; };
CFG
}
# compare FILE FEATURE CHANNELS LOOM_RAW: TF's decode of every record's FEATURE against loom's bytes
compare() {
    "$TF_PY" - "$@" <<'PY'
import sys
import numpy as np
import tensorflow as tf
path, feat, ch, raw = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
ours = np.fromfile(raw, np.uint8)
tfs = []
for r in tf.data.TFRecordDataset(path):
    ex = tf.train.Example.FromString(r.numpy())
    data = ex.features.feature[feat].bytes_list.value[0]
    dec = tf.io.decode_png(data, channels=ch) if data[:4] == b"\x89PNG" else tf.io.decode_jpeg(data, channels=ch)
    tfs.append(dec.numpy().ravel())
theirs = np.concatenate(tfs)
if ours.shape != theirs.shape:
    print("sizes differ: loom %d bytes, tf %d" % (ours.size, theirs.size))
else:
    d = np.abs(ours.astype(int) - theirs.astype(int))
    print("images %d bytes %d differing %d max %d" % (len(tfs), ours.size, int((d > 0).sum()), int(d.max())))
PY
}
dump_cfg "$WORK/png/test-00000-of-00001.tfrecord" image 1024 1
o=$(timeout 60 "$DUMP" "$WORK/dump.cfg" image "$WORK/png.raw" 2>&1)
contains "decode_dump decodes the 500 PNGs" "500 uint8 (28, 28, 1)" "$o"
r=$(compare "$WORK/png/test-00000-of-00001.tfrecord" image 1 "$WORK/png.raw" 2>&1)
contains "decode_image = tf.io.decode_png on TF's PNG records, every byte" "images 500 bytes 392000 differing 0 max 0" "$r"

"$TF_PY" - "$WORK/jpeg.tfrecord" <<'PY' 2>"$WORK/jpeg.err"
import gzip, sys
import numpy as np
import tensorflow as tf
with gzip.open("/usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz") as f:
    imgs = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 28, 28)[:200]
b = lambda v: tf.train.Feature(bytes_list=tf.train.BytesList(value=[v]))
with tf.io.TFRecordWriter(sys.argv[1]) as w:
    for i, g in enumerate(imgs):
        rgb = np.stack([g, 255 - g, (g // 2 + 37 * (i % 5)).astype(np.uint8)], -1)
        feat = {"grey": b(tf.io.encode_jpeg(g[:, :, None], quality=85).numpy()),
                "rgb": b(tf.io.encode_jpeg(rgb, quality=90).numpy())}
        w.write(tf.train.Example(features=tf.train.Features(feature=feat)).SerializeToString())
PY
[ -s "$WORK/jpeg.tfrecord" ] && pass "TensorFlow writes 200 JPEG records (grey and colour)" || fail "TF JPEG records" "$(tail -3 "$WORK/jpeg.err")"
for v in "grey 1" "rgb 3"; do
    set -- $v
    dump_cfg "$WORK/jpeg.tfrecord" "$1" 8192 "$2"
    o=$(timeout 60 "$DUMP" "$WORK/dump.cfg" "$1" "$WORK/$1.raw" 2>&1)
    contains "decode_dump decodes the 200 $1 JPEGs" "200 uint8 (28, 28, $2)" "$o"
    r=$(compare "$WORK/jpeg.tfrecord" "$1" "$2" "$WORK/$1.raw" 2>&1)
    contains "decode_image = tf.io.decode_jpeg on TF's $1 JPEGs, every byte" "images 200 bytes $((200 * 784 * $2)) differing 0 max 0" "$r"
done
finish
