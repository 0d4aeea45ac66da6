#!/usr/bin/env python3
"""png_ref.py - the PNG-decoding input pipeline of png_bench.sh in tf.data:
read the TFRecord shards (num_parallel_reads AUTOTUNE), parse
{image: bytes (PNG), label: int64}, tf.io.decode_png(channels=1) and convert_image_dtype
to float32 in a map with num_parallel_calls=AUTOTUNE, batch 128, prefetch AUTOTUNE; one pass
timed after the pipeline is built. Prints one JSON line with samples/s.
    python3 png_ref.py --files 'DIR/train-*.tfrecord' [--epochs 1]"""
import argparse
import glob
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402


def build(files):
    ds = tf.data.TFRecordDataset(files, num_parallel_reads=tf.data.AUTOTUNE)
    spec = {"image": tf.io.FixedLenFeature([], tf.string), "label": tf.io.FixedLenFeature([], tf.int64)}

    def parse_decode(rec):
        ex = tf.io.parse_single_example(rec, spec)
        img = tf.image.convert_image_dtype(tf.io.decode_png(ex["image"], channels=1), tf.float32)
        return tf.ensure_shape(img, [28, 28, 1]), ex["label"]

    ds = ds.map(parse_decode, num_parallel_calls=tf.data.AUTOTUNE)
    return ds.batch(128).prefetch(tf.data.AUTOTUNE)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", required=True)
    ap.add_argument("--epochs", type=int, default=1)
    a = ap.parse_args()
    files = sorted(glob.glob(a.files))
    ds = build(files)
    n = 0
    t0 = time.perf_counter()
    for _ in range(a.epochs):
        for img, _ in ds:
            n += int(img.shape[0])
    dt = time.perf_counter() - t0
    print(json.dumps({"samples": n, "seconds": round(dt, 3), "samples_per_sec": round(n / dt, 1)}))


if __name__ == "__main__":
    main()
