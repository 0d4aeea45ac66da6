#!/usr/bin/env python3
"""text_ref.py - text_bench.sh's pipeline in tf.data, AUTOTUNE everywhere:
the fortunes as lines (TextLineDataset), TextVectorization(split="character",
standardize=None, max_tokens=100, ragged) adapted before the clock starts and
mapped over batches of 1024 lines, unbatched twice into a stream of ids,
window(65, shift=64, drop_remainder=True).flat_map(batch(65)), split into
(input, target) = (w[:-1], w[1:]), batch 64 (drop_remainder), prefetch.
Prints one JSON line: windows (samples) per second over `--epochs` timed passes.
    python3 text_ref.py --files '/usr/share/games/fortunes/*.u8' [--epochs 1]"""
import argparse
import glob
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

AUTO = tf.data.AUTOTUNE


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", required=True)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--size", type=int, default=65)
    a = ap.parse_args()
    files = sorted(glob.glob(a.files))
    lines = tf.data.TextLineDataset(files)
    vec = tf.keras.layers.TextVectorization(max_tokens=100, standardize=None, split="character",
                                            output_mode="int", ragged=True)
    vec.adapt(lines.batch(1024))
    T = a.size

    def split(w):
        return w[:-1], w[1:]

    ds = (lines.batch(1024).map(vec, num_parallel_calls=AUTO).unbatch().unbatch()
          .window(T, shift=T - 1, drop_remainder=True).flat_map(lambda w: w.batch(T, drop_remainder=True))
          .map(split, num_parallel_calls=AUTO).batch(64, drop_remainder=True).prefetch(AUTO))
    n = 0
    t0 = time.perf_counter()
    for _ in range(a.epochs):
        for x, _y in ds:
            n += int(x.shape[0])
    dt = time.perf_counter() - t0
    print(json.dumps({"impl": "tf.data", "samples": n, "seconds": round(dt, 4), "samples_per_sec": round(n / dt, 1),
                      "tokens_per_sec": round(n * (T - 1) / dt, 1), "tf": tf.__version__}))


if __name__ == "__main__":
    main()
