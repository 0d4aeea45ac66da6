#!/usr/bin/env python3
"""tfdata_ref.py - the Fashion-MNIST input pipeline of pipeline_bench.sh in
tf.data, AUTOTUNE everywhere: read sharded TFRecords, parse Examples
{image: bytes (784), label: int64}, normalize, random flip, shuffle 10,000,
batch 128, prefetch. Runs `--epochs` passes and prints one JSON line:
samples/s over the timed passes (pipeline built before the clock starts; the
shuffle buffer's fill is inside the time, as it is for Loom).
    python3 tfdata_ref.py --files 'DIR/train-*.tfrecord' [--compression GZIP|''] [--epochs 1]
TensorFlow cannot read zstd TFRecords: give it uncompressed or GZIP shards."""
import argparse
import glob
import json
import os
import resource
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

MEAN, STD = 72.94, 90.02  # Fashion-MNIST pixel mean and std (0.2860, 0.3530 of 255)


def build(files, compression, seed):
    ds = tf.data.TFRecordDataset(files, compression_type=compression, num_parallel_reads=tf.data.AUTOTUNE)
    spec = {"image": tf.io.FixedLenFeature([], tf.string), "label": tf.io.FixedLenFeature([], tf.int64)}

    def parse(rec):
        ex = tf.io.parse_single_example(rec, spec)
        return tf.reshape(tf.io.decode_raw(ex["image"], tf.uint8), [28, 28, 1]), ex["label"]

    def normalize(img, label):
        return (tf.cast(img, tf.float32) - MEAN) / STD, label

    def flip(img, label):
        return tf.image.random_flip_left_right(img), label

    ds = ds.map(parse, num_parallel_calls=tf.data.AUTOTUNE)
    ds = ds.map(normalize, num_parallel_calls=tf.data.AUTOTUNE)
    ds = ds.map(flip, num_parallel_calls=tf.data.AUTOTUNE)
    ds = ds.shuffle(10000, seed=seed)
    ds = ds.batch(128)
    return ds.prefetch(tf.data.AUTOTUNE)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", required=True)
    ap.add_argument("--compression", default="")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--seed", type=int, default=42)
    a = ap.parse_args()
    files = sorted(glob.glob(a.files))
    if not files:
        raise SystemExit(f"tfdata_ref.py: no files match {a.files}")
    tf.random.set_seed(a.seed)
    ds = build(files, a.compression, a.seed)
    samples, checksum = 0, 0.0
    t0 = time.perf_counter()
    for _ in range(a.epochs):
        for img, label in ds:
            samples += int(label.shape[0])
        checksum += float(tf.reduce_sum(img))  # the last batch: the values were really computed
    dt = time.perf_counter() - t0
    print(json.dumps({"impl": "tf.data", "tf": tf.__version__, "files": len(files), "compression": a.compression or "none",
                      "samples": samples, "seconds": round(dt, 3), "samples_per_sec": round(samples / dt, 1),
                      "maxrss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                      "checksum": round(checksum, 2)}))


if __name__ == "__main__":
    main()
