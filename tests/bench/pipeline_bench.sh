#!/bin/bash
# pipeline_bench.sh - the Fashion-MNIST input pipeline, side by side in one run:
# Loom vs tf.data (AUTOTUNE everywhere) vs a torch DataLoader.
#
#   tests/bench/pipeline_bench.sh [--quick] [--runs N] [--build DIR] [--before DIR] [--tf-compression none|gzip]
#                                 [--no-tf] [--no-torch] [--keep]
#
#   --quick   3 runs (unless --runs), torch timed over 20,000 samples, 1 s num_workers sweep
#   --runs N  repetitions (default BENCH_RUNS or 5); medians are reported. The
#             implementations alternate within each run, so load from other
#             processes falls on all alike.
#   --build   meson build dir with `loom` and tests/bench/membw (default BUILD or ./build)
#   --before  a build dir (or a directory holding a `loom` binary) of an earlier
#             commit: its zstd figure is measured in the same runs, alternating,
#             and printed as "before" beside the current one
#   --tf-compression  the shards tf.data reads (and Loom reads too, for a like-for-like
#             figure): none (default) or gzip. TensorFlow cannot read zstd TFRecords.
#   --keep    keep the scratch directory (shards, configs, raw outputs)
#
# The pipeline: read 4 TFRecord shards of the 60,000 training Examples
# {image: bytes (784), label: int64} (made by `loom records convert`), parse,
# normalize ((x - 72.94) / 90.02 as float32), random left-right flip, shuffle
# 10,000, batch 128, prefetch; one pass. Torch reads the decoded IDX arrays
# (it has no TFRecord reader) with the same per-sample transform.
# Prints a table (with the 1-minute load average seen over the runs: the
# figures mean little on a loaded machine), then the medians as one JSON line
# (prefix "json: ").
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
RUNS=${BENCH_RUNS:-}
QUICK=0
TFC=none
DO_TF=1
DO_TORCH=1
KEEP=0
BEFORE=
TF_PY=${TF_PYTHON:-python3}          # the pyenv python3 has TensorFlow
TORCH_PY=${TORCH_PYTHON:-/usr/bin/python3} # Debian's python3-torch
FM=${LOOM_DATASETS_DIR:-/usr/share/datasets}/fashion-mnist

usage() { sed -n '2,22p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }
while [ $# -gt 0 ]; do
    case "$1" in
    --quick) QUICK=1 ;;
    --runs) RUNS=$2; shift ;;
    --build) BUILD=$2; shift ;;
    --before) BEFORE=$2; shift ;;
    --tf-compression) TFC=$2; shift ;;
    --no-tf) DO_TF=0 ;;
    --no-torch) DO_TORCH=0 ;;
    --keep) KEEP=1 ;;
    -h | --help) usage 0 ;;
    *) echo "pipeline_bench.sh: unknown argument '$1'" >&2; usage ;;
    esac
    shift
done
case "$BUILD" in /*) ;; *) BUILD=$ROOT/$BUILD ;; esac
if [ -n "$BEFORE" ]; then
    case "$BEFORE" in /*) ;; *) BEFORE=$ROOT/$BEFORE ;; esac
    [ -x "$BEFORE/loom" ] || { echo "pipeline_bench.sh: --before $BEFORE has no loom binary" >&2; exit 2; }
fi
case "$TFC" in none | gzip) ;; *) echo "pipeline_bench.sh: --tf-compression is none or gzip, not '$TFC'" >&2; exit 2 ;; esac
[ -n "$RUNS" ] || RUNS=$([ "$QUICK" = 1 ] && echo 3 || echo 5)
TORCH_SAMPLES=$([ "$QUICK" = 1 ] && echo 20000 || echo 60000)
SWEEP_SAMPLES=$([ "$QUICK" = 1 ] && echo 5000 || echo 15000)

bench_loom pipeline_bench.sh tests/bench/membw
MEMBW=$BUILD/tests/bench/membw
[ -r "$FM/train-images-idx3-ubyte.gz" ] || { echo "pipeline_bench.sh: $FM missing (apt install dataset-fashion-mnist)" >&2; exit 1; }
if [ "$DO_TF" = 1 ] && ! "$TF_PY" -c 'import tensorflow' 2>/dev/null; then
    echo "pipeline_bench.sh: $TF_PY cannot import tensorflow; skipping tf.data (or set TF_PYTHON)" >&2; DO_TF=0
fi
if [ "$DO_TORCH" = 1 ] && ! "$TORCH_PY" -c 'import torch' 2>/dev/null; then
    echo "pipeline_bench.sh: $TORCH_PY cannot import torch; skipping the DataLoader (or set TORCH_PYTHON)" >&2; DO_TORCH=0
fi

W=$(mktemp -d /tmp/loom_pipeline_bench_XXXXXX)
[ "$KEEP" = 1 ] && echo "scratch: $W" || trap 'rm -rf "$W"' EXIT

# --- the shards: zstd for Loom, and the format tf.data reads ------------------
ext=$([ "$TFC" = gzip ] && echo .gz || echo "")
"$LOOM" records convert --images "$FM/train-images-idx3-ubyte.gz" --labels "$FM/train-labels-idx1-ubyte.gz" \
    --output "$W/zst/train" --shards 4 --compression zstd >/dev/null
"$LOOM" records convert --images "$FM/train-images-idx3-ubyte.gz" --labels "$FM/train-labels-idx1-ubyte.gz" \
    --output "$W/tf/train" --shards 4 --compression "$TFC" >/dev/null
"$LOOM" records convert --images "$FM/train-images-idx3-ubyte.gz" --labels "$FM/train-labels-idx1-ubyte.gz" \
    --output "$W/raw/train" --shards 4 >/dev/null

loom_config() { # pattern -> config on stdout
    cat <<EOF
version = 1;
data: {
  train: {
    source: {
      type = "tfrecord";
      files = ["$1"];
      features: {
        image = { dtype = "uint8"; shape = [28, 28]; };
        label = { dtype = "int64"; shape = []; };
      };
    };
    transforms = (
      # inline maps (fused into one stage, run on the prefetch thread): on 3 KB
      # elements a hand-off to a pool worker costs more than the op, and
      # parallel = "auto" measured ~30% slower here
      { op = "map"; fn = "normalize"; feature = "image"; mean = 72.94; std = 90.02; },
      { op = "map"; fn = "random_flip_left_right"; feature = "image"; },
      { op = "shuffle"; buffer = 10000; },
      { op = "batch"; size = 128; },
      { op = "prefetch"; buffer = -1; }
    );
  };
};
model: { layers = ({ type = "flatten"; }, { type = "dense"; units = 10; }); };
optimizer: { type = "sgd"; learning_rate = 0.1; };
run: { model_dir = "$W/model"; seed = 42; };
EOF
}
loom_config "$W/zst/train-*.tfrecord.zst" >"$W/loom_zst.cfg"
loom_config "$W/tf/train-*.tfrecord$ext" >"$W/loom_tf.cfg"
"$LOOM" check "$W/loom_zst.cfg" >/dev/null

# --- runs ----------------------------------------------------------------------------
# run NAME CMD...: appends the command's JSON result (+ peak RSS) to $W/NAME.jsonl.
run() {
    local name=$1; shift
    local out
    if ! out=$("$HERE/peak_rss.py" "$@" 2>"$W/$name.err"); then
        echo "pipeline_bench.sh: $name failed:" >&2; tail -20 "$W/$name.err" >&2; echo "$out" >&2; exit 1
    fi
    echo "$out" >>"$W/$name.out"
    python3 - "$name" "$out" >>"$W/$name.jsonl" <<'PY'
import json, re, sys
name, out = sys.argv[1], sys.argv[2]
rss = json.loads(re.search(r"^peak_rss: (.*)$", out, re.M).group(1))
m = re.search(r"profile .*?: (\d+) elements \((\d+) samples\) in ([\d.]+) s: [\d.]+ elements/s, (\d+) samples/s", out)
if m:
    r = {"samples": int(m.group(2)), "seconds": float(m.group(3)), "samples_per_sec": float(m.group(4))}
    b = re.search(r"^bottleneck: (.*)$", out, re.M)
    r["bottleneck"] = b.group(1) if b else ""
else:
    r = json.loads([l for l in out.splitlines() if l.startswith("{")][-1])
r["peak_rss_mb"] = max(rss["tree_mb"], rss["maxrss_mb"])
print(json.dumps(r))
PY
}

LOOM_PROFILE=("$LOOM" profile --steps 469)
TORCH_ARGS=(--images "$FM/train-images-idx3-ubyte.gz" --labels "$FM/train-labels-idx1-ubyte.gz")
TORCH_WORKERS=0
if [ "$DO_TORCH" = 1 ]; then # the best num_workers for this machine, measured
    best=0
    for w in 0 1 2 3 4; do
        s=$("$TORCH_PY" "$HERE/torch_loader_ref.py" "${TORCH_ARGS[@]}" --workers $w --samples "$SWEEP_SAMPLES" |
            python3 -c 'import json,sys; print(int(json.loads(sys.stdin.read())["samples_per_sec"]))')
        echo "torch num_workers=$w: $s samples/s (sweep)" >>"$W/sweep.txt"
        if [ "$s" -gt "$best" ]; then best=$s; TORCH_WORKERS=$w; fi
    done
fi

for r in $(seq 1 "$RUNS"); do
    cut -d' ' -f1 /proc/loadavg >>"$W/load.txt"
    "$MEMBW" -t 2 -r 7 | sed -n 's/^json: //p' >>"$W/membw.jsonl" # under the same load as the runs
    [ -n "$BEFORE" ] && run loom_zst_before "$BEFORE/loom" profile --steps 469 "$W/loom_zst.cfg"
    run loom_zst "${LOOM_PROFILE[@]}" "$W/loom_zst.cfg"
    run loom_tf "${LOOM_PROFILE[@]}" "$W/loom_tf.cfg"
    [ "$DO_TF" = 1 ] && run tfdata "$TF_PY" "$HERE/tfdata_ref.py" --files "$W/tf/train-*.tfrecord$ext" \
        --compression "$([ "$TFC" = gzip ] && echo GZIP || echo "")"
    [ "$DO_TORCH" = 1 ] && run torch "$TORCH_PY" "$HERE/torch_loader_ref.py" "${TORCH_ARGS[@]}" \
        --workers "$TORCH_WORKERS" --samples "$TORCH_SAMPLES"
    echo "run $r/$RUNS done" >&2
done
cut -d' ' -f1 /proc/loadavg >>"$W/load.txt"

# --- the table ------------------------------------------------------------------------
python3 - "$W" "$RUNS" "$TFC" "$TORCH_WORKERS" "$QUICK" <<'PY'
import glob, json, os, statistics, sys
w, runs, tfc, workers, quick = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5] == "1"

def load(name):
    p = f"{w}/{name}.jsonl"
    return [json.loads(l) for l in open(p)] if os.path.exists(p) else []

def med(rows, key):
    return statistics.median(r[key] for r in rows) if rows else None

def per_sample(pattern):
    return sum(os.path.getsize(f) for f in glob.glob(pattern)) / 60000

# Bytes touched per sample if every stage reads its input once and writes its
# output once: the file's bytes, the decoded records written then parsed (r
# each), the parsed uint8 image + int64 label (792), normalize (read 784,
# write 3136), flip (read + write 3136), the shuffle buffer (write + read
# 3144) and the batch (write 3144).
r = per_sample(f"{w}/raw/train-*")
def touched(file_bytes):
    return file_bytes + 2 * r + 792 + (784 + 3136) + 2 * 3136 + 2 * 3144 + 3144
bw = load("membw")
bps, bps1 = med(bw, "touched_bytes_per_sec"), med(bw, "touched_bytes_per_sec_1")
ext = ".gz" if tfc == "gzip" else ""
impls = [("loom (zstd) before", "loom_zst_before", touched(per_sample(f"{w}/zst/train-*"))),
         ("loom (zstd)", "loom_zst", touched(per_sample(f"{w}/zst/train-*"))),
         (f"loom ({tfc})", "loom_tf", touched(per_sample(f"{w}/tf/train-*"))),
         (f"tf.data ({tfc})", "tfdata", touched(per_sample(f"{w}/tf/train-*"))),
         (f"torch DataLoader (workers={workers})", "torch", None)]
res = {}
print(f"Fashion-MNIST input pipeline, medians of {runs} run(s){' (--quick)' if quick else ''}; "
      f"memcpy bandwidth {bps / 1e9:.1f} GB/s touched (2 threads), {bps1 / 1e9:.1f} (1 thread)")
loads = [float(x) for x in open(f"{w}/load.txt").read().split()] if os.path.exists(f"{w}/load.txt") else []
if loads:
    print(f"load average (1 min) over the runs: {min(loads):.1f} to {max(loads):.1f} on {os.cpu_count()} cores")
print(f"{'implementation':36s} {'samples/s':>10s} {'runs':>22s} {'peak RSS':>9s} {'bytes/sample':>12s} {'of mem bound':>12s}")
for label, key, tb in impls:
    rows = load(key)
    if not rows:
        continue
    sps, rss = med(rows, "samples_per_sec"), med(rows, "peak_rss_mb")
    allr = ",".join(f"{x['samples_per_sec'] / 1000:.0f}k" for x in rows)
    frac, tbs = (f"{sps * tb / bps * 100:.1f}%", f"{tb:.0f}") if tb else ("-", "-")
    print(f"{label:36s} {sps:10.0f} {allr:>22s} {rss:7.0f}MB {tbs:>12s} {frac:>12s}")
    res[key] = {"samples_per_sec": sps, "peak_rss_mb": rss, "bytes_per_sample": tb,
                "bound_fraction": sps * tb / bps if tb else None}
def ratio(a, b):
    return res[a]["samples_per_sec"] / res[b]["samples_per_sec"] if a in res and b in res else None
out = {"runs": runs, "tf_compression": tfc, "torch_workers": workers, "membw_touched_bytes_per_sec": bps, **res}
for a, b, target, name in [("loom_zst", "tfdata", 2, "loom(zstd)/tf.data"), ("loom_tf", "tfdata", 2, f"loom({tfc})/tf.data"),
                           ("loom_zst_before", "torch", 10, "loom(zstd) before/torch"),
                           ("loom_zst", "torch", 10, "loom(zstd)/torch"), ("loom_zst", "loom_zst_before", None, "loom(zstd) after/before")]:
    q = ratio(a, b)
    if q is not None:
        print(f"{name:24s} {q:6.2f}x" + (f"   (target >= {target}x: {'met' if q >= target else 'MISSED'})" if target else ""))
        out[name] = q
for key, name in [("loom_zst_before", "loom(zstd) before"), ("loom_zst", "loom(zstd)")]:
    if key in res:
        f = res[key]["bound_fraction"]
        print(f"{name + ' of mem bound':24s} {f * 100:5.1f}%   (target >= 40%: {'met' if f >= 0.4 else 'MISSED'})")
out["load_average"] = loads
if "loom_zst" in res and "tfdata" in res:
    q = res["loom_zst"]["peak_rss_mb"] / res["tfdata"]["peak_rss_mb"]
    print(f"{'RSS loom(zstd)/tf.data':24s} {q:6.2f}    (target <= 0.33: {'met' if q <= 1 / 3 else 'MISSED'})")
    out["rss_ratio_loom_tfdata"] = q
b = load("loom_zst")
if b:
    print(f"loom bottleneck (last run): {b[-1].get('bottleneck', '')}")
print("json: " + json.dumps(out))
PY
[ -f "$W/sweep.txt" ] && cat "$W/sweep.txt"
