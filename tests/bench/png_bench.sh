#!/bin/bash
# png_bench.sh - decoding PNG-encoded images in the input pipeline, side by
# side in one run: Loom's map fn = "decode_image" vs tf.data's
# tf.io.decode_png in a map with num_parallel_calls = AUTOTUNE, on the same files.
#
#   tests/bench/png_bench.sh [--runs N] [--images N] [--build DIR] [--keep]
#
#   --runs N    repetitions (default 3); medians are reported; the two alternate
#               within each run, so load from other processes falls on both alike
#   --images N  Fashion-MNIST training images encoded (default 20000, in 4 shards)
#   --build     meson build dir with `loom` (default BUILD or ./build)
#   --keep      keep the scratch directory
#
# The files: TFRecord shards of tf.train.Example {image: bytes (PNG, 28x28 grey),
# label: int64} written by TensorFlow itself (tests/fixtures/make_png_fixtures.py
# --full: tf.io.encode_png + tf.io.TFRecordWriter). The pipeline, the same in
# both: read the shards, parse, decode to (28, 28, 1) float32 in [0, 1]
# (tf.image.convert_image_dtype after decode_png), batch 128,
# prefetch; one pass each, timed after the pipeline is built (Loom: `loom
# profile`, which runs data.train alone). Needs TensorFlow (TF_PYTHON, default
# python3). Prints a table and a "json: " line with the medians and the ratio
# (the issue's target: Loom >= 2x tf.data).
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
RUNS=3
IMAGES=20000
KEEP=0
TF_PY=${TF_PYTHON:-python3}

usage() { sed -n '2,22p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }
while [ $# -gt 0 ]; do
    case "$1" in
    --runs) RUNS=$2; shift ;;
    --images) IMAGES=$2; shift ;;
    --build) BUILD=$2; shift ;;
    --keep) KEEP=1 ;;
    -h | --help) usage 0 ;;
    *) echo "png_bench.sh: unknown argument '$1'" >&2; usage ;;
    esac
    shift
done
bench_loom png_bench.sh
"$TF_PY" -c 'import tensorflow' 2>/dev/null || { echo "png_bench.sh: $TF_PY cannot import tensorflow (pip install tensorflow-cpu, or set TF_PYTHON)" >&2; exit 1; }

W=$(mktemp -d /tmp/loom_png_bench_XXXXXX)
[ "$KEEP" = 1 ] && echo "scratch: $W" || trap 'rm -rf "$W"' EXIT

echo "making $IMAGES PNG records with TensorFlow ..." >&2
TF_CPP_MIN_LOG_LEVEL=2 "$TF_PY" "$ROOT/tests/fixtures/make_png_fixtures.py" --full "$W/png" "$IMAGES" 2>"$W/make.err" ||
    { cat "$W/make.err" >&2; exit 1; }

cat >"$W/loom.cfg" <<CFG
version = 1;
data: {
  train: {
    source: {
      type = "tfrecord";
      files = ["$W/png/train-*.tfrecord"];
      features: {
        image = { dtype = "uint8"; shape = [1024]; var_len = true; };
        label = { dtype = "int64"; shape = []; };
      };
    };
    transforms = (
      { op = "map"; fn = "decode_image"; feature = "image"; channels = 1; size = [28, 28]; dtype = "float32";
        parallel = "auto"; },
      { op = "batch"; size = 128; },
      { op = "prefetch"; buffer = -1; }
    );
  };
};
model: { layers = ({ type = "flatten"; }, { type = "dense"; units = 10; }); };
optimizer: { type = "sgd"; learning_rate = 0.1; };
run: { model_dir = "$W/model"; seed = 42; };
CFG
"$LOOM" check "$W/loom.cfg" >/dev/null
steps=$(( (IMAGES + 127) / 128 ))

for r in $(seq 1 "$RUNS"); do
    out=$("$LOOM" profile "$W/loom.cfg" --steps "$steps" 2>&1) || { echo "$out" >&2; exit 1; }
    grep -o '[0-9]* samples/s' <<<"$out" | head -1 | cut -d' ' -f1 >>"$W/loom.txt"
    out=$("$TF_PY" "$HERE/png_ref.py" --files "$W/png/train-*.tfrecord" 2>"$W/tf.err") || { cat "$W/tf.err" >&2; exit 1; }
    python3 -c 'import json,sys; print(json.loads(sys.argv[1])["samples_per_sec"])' "$(tail -1 <<<"$out")" >>"$W/tf.txt"
    echo "run $r: loom $(tail -1 "$W/loom.txt") samples/s, tf.data $(tail -1 "$W/tf.txt") samples/s" >&2
done

python3 - "$W/loom.txt" "$W/tf.txt" "$IMAGES" "$RUNS" <<'PY'
import json, statistics, sys
loom = [float(x) for x in open(sys.argv[1]).read().split()]
tf = [float(x) for x in open(sys.argv[2]).read().split()]
ml, mt = statistics.median(loom), statistics.median(tf)
print(f"PNG decode pipeline, {sys.argv[3]} Fashion-MNIST images, median of {sys.argv[4]} runs")
print(f"| pipeline | samples/s (median) | runs |")
print(f"| --- | ---: | --- |")
print(f"| Loom decode_image (parallel auto) | {ml:,.0f} | {', '.join(f'{x:.0f}' for x in loom)} |")
print(f"| tf.data decode_png (AUTOTUNE) | {mt:,.0f} | {', '.join(f'{x:.0f}' for x in tf)} |")
print(f"Loom / tf.data: {ml / mt:.2f}x (target 2x)")
print("json: " + json.dumps({"loom_samples_per_sec": ml, "tfdata_samples_per_sec": mt, "ratio": round(ml / mt, 2)}))
PY
