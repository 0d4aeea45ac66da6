#!/usr/bin/env python3
"""tb_interop.py LOOM - TensorBoard's own reader (EventAccumulator) reads the
event files of a Loom run: the train scalars' steps and values equal
metrics.jsonl's "summary" lines, eval/'s equal the epoch lines' eval metrics,
a histogram per variable per epoch with as many values as the variable,
the resolved config as a text tensor, and after a resume one continuous
curve (no duplicate step), also when a killed run had written points past
its last checkpoint (SessionLog START). Exits 77 (skip) when tensorboard is not
installed (pip install tensorboard)."""
import json
import os
import subprocess
import sys
import tempfile
import time

try:
    from tensorboard.backend.event_processing import event_accumulator as ea
    from tensorboard.util import tensor_util
except ImportError:
    print("tensorboard is not installed: skipped (pip install tensorboard)")
    sys.exit(77)

loom = sys.argv[1]
cfg = "tests/configs/small_mlp.cfg"
failures = 0


def check(cond, what):
    global failures
    print(("ok" if cond else "FAIL") + " - " + what)
    failures += not cond


def train(model_dir, epochs):
    subprocess.run([loom, "train", cfg, "--model-dir", model_dir, "--set", 'run.progress="none"',
                    "--set", "run.summary_steps=10", "--set", "run.histogram_epochs=1",
                    "--set", "run.epochs=%d" % epochs], check=True, timeout=300)


def load(d):
    a = ea.EventAccumulator(d, size_guidance={ea.SCALARS: 0, ea.HISTOGRAMS: 0, ea.TENSORS: 0})
    a.Reload()
    return a


with tempfile.TemporaryDirectory() as tmp:
    md = os.path.join(tmp, "run")
    train(md, 2)
    time.sleep(1.1)  # the resumed run's file sorts after the first (names carry the start second)
    train(md, 3)
    # as if killed after writing step 96's eval scalars and histograms but before
    # committing ckpt-96: the rerun resumes at ckpt-90 (small_mlp checkpoints every
    # 10 steps), its START at 91 drops the stale points, and step 96 is written again
    os.remove(os.path.join(md, "ckpt-96.loom"))
    time.sleep(1.1)
    train(md, 3)
    lines = [json.loads(l) for l in open(os.path.join(md, "metrics.jsonl"))]
    acc = load(md)
    tags = acc.Tags()
    for tag in ["loss", "accuracy", "learning_rate", "samples_per_sec", "input_wait_fraction"]:
        want = [(l["step"], l[tag]) for l in lines if l["event"] == "summary" and l[tag] is not None]
        got = [(e.step, e.value) for e in acc.Scalars(tag)] if tag in tags["scalars"] else []
        ok = len(got) == len(want) and all(s == t and abs(v - w) <= 1e-6 * max(1, abs(w)) for (s, v), (t, w) in zip(got, want))
        check(ok, "train scalar %s: %d points, steps and values equal metrics.jsonl" % (tag, len(want)))
    steps = [e.step for e in acc.Scalars("loss")]
    check(steps == sorted(set(steps)) and steps[0] == 10 and steps[-1] == 90,
          "one continuous loss curve over three runs, no duplicate step (10..90)")
    ev = load(os.path.join(md, "eval"))
    for tag, key in [("loss", "eval_loss"), ("accuracy", "eval_accuracy")]:
        want = [(l["step"], l[key]) for l in lines if l["event"] == "epoch"]
        got = [(e.step, e.value) for e in ev.Scalars(tag)]
        check(len(got) == 3 and all(s == t and abs(v - w) <= 1e-6 for (s, v), (t, w) in zip(got, want)),
              "eval/%s at each epoch's step equals metrics.jsonl" % tag)
    sizes = {"dense_1/kernel": 784 * 64, "dense_1/bias": 64, "dense_3/kernel": 64 * 10, "dense_3/bias": 10}
    for name, n in sizes.items():
        h = acc.Histograms(name) if name in tags["histograms"] else []
        check(len(h) == 3 and all(x.histogram_value.num == n and sum(x.histogram_value.bucket) == n for x in h)
              and [x.step for x in h] == [32, 64, 96],
              "histogram %s: one per epoch, %d values each" % (name, n))
    check("config" in tags["tensors"], "the config is a text summary")
    if "config" in tags["tensors"]:
        t = acc.Tensors("config")
        text = tensor_util.make_ndarray(t[0].tensor_proto).item().decode()
        check(acc.SummaryMetadata("config").plugin_data.plugin_name == "text" and "summary_steps = 10;" in text
              and "histogram_epochs = 1;" in text, "config text: plugin \"text\", the resolved settings")

print("%d failure(s)" % failures)
sys.exit(1 if failures else 0)
