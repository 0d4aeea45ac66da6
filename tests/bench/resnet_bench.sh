#!/bin/bash
# resnet_bench.sh - issue 23's residual models, Loom beside PyTorch, side by side in one run.
#
#   tests/bench/resnet_bench.sh [--quick | --full] [--models resnet20,resnet50] [--runs N]
#                               [--isa native|avx2] [--build DIR] [--no-loom] [--no-torch] [--keep]
#
#   resnet20  configs/fashion_mnist_resnet.cfg (ResNet-20 v1, Fashion-MNIST, batch 128) beside
#             resnet_torch_ref.py's same model and schedule.
#             --quick (default): BENCH_RESNET20_STEPS (300) steps, samples/s of all the training steps
#             (each side's first step included; evaluation and start-up not), the accuracy after them
#             printed, not judged; --full: the config's 15 epochs
#             (BENCH_RESNET20_EPOCHS), the accuracy target >= 0.935 and samples/s >= 1.5x.
#   resnet50  configs/resnet50.cfg (Keras' ResNet50, 224x224x3 synthetic, batch 32): training
#             steps after BENCH_RESNET50_WARMUP (2) untimed ones, median of BENCH_RESNET50_STEPS (5);
#             target >= 1.3x PyTorch's best (oneDNN, channels-last, best of 1 and 2 threads), peak
#             RSS <= PyTorch's; both as fractions of the FMA peak (gemm_peak's 1024^3 sgemm median,
#             2 threads; training FLOPs = 3 x forward, multiply-add = 2). Also `loom check` time
#             (target < 100 ms, median of 5). BENCH_PEAK_GFLOPS=G takes G as the peak instead.
#   --runs N  repetitions (default BENCH_RUNS or 3), Loom and PyTorch alternating; medians reported.
#   --build   meson build dir with `loom` and tests/bench/gemm_peak (default BUILD or ./build)
#   --keep    keep the scratch directory (model dirs, metrics.jsonl, raw JSON)
#   --isa avx2  both sides confined to AVX2 + FMA on an AVX-512 machine, as train_bench.sh's:
#             Loom with LOOM_TEST_CPU=avx2 (its kernels, its element-wise loops' clones, its
#             OpenBLAS core), PyTorch with ONEDNN_MAX_CPU_ISA=DNNL_MAX_CPU_ISA=AVX2,
#             ATEN_CPU_CAPABILITY=avx2, OPENBLAS_CORETYPE=Haswell; gemm_peak capped too, so the
#             peak fractions are of the AVX2 peak. (default: native, each at the machine's best)
#
# A loom that refuses a config (one built before issue 23's graph layers) is
# reported as such, its `loom check` errors shown, the PyTorch side still run,
# and the script exits 3. Prints a table, then the medians as one JSON line ("json: ").
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
PY=/usr/bin/python3
RUNS=${BENCH_RUNS:-3}
MODE=quick
MODELS=resnet20,resnet50
DO_LOOM=1
DO_TORCH=1
KEEP=0
R20_STEPS=${BENCH_RESNET20_STEPS:-300}
R20_EPOCHS=${BENCH_RESNET20_EPOCHS:-15}
R50_WARMUP=${BENCH_RESNET50_WARMUP:-2}
R50_STEPS=${BENCH_RESNET50_STEPS:-5}
TORCH_RESNET20_THREADS=${TORCH_RESNET20_THREADS:-2}
TORCH_RESNET50_THREADS=${TORCH_RESNET50_THREADS:-1,2}
ISA=native

usage() { sed -n '2,30p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }
while [ $# -gt 0 ]; do
    case "$1" in
    --quick) MODE=quick ;;
    --full) MODE=full ;;
    --models) MODELS=$2; shift ;;
    --runs) RUNS=$2; shift ;;
    --build) BUILD=$2; shift ;;
    --no-loom) DO_LOOM=0 ;;
    --no-torch) DO_TORCH=0 ;;
    --keep) KEEP=1 ;;
    --isa) ISA=$2; shift ;;
    -h | --help) usage 0 ;;
    *) echo "resnet_bench.sh: unknown argument '$1'" >&2; usage ;;
    esac
    shift
done
# Loom's environment, PyTorch's (OpenBLAS threads, and the ISA cap under --isa avx2)
LOOM_ENV=(env -u OPENBLAS_CORETYPE -u LOOM_TEST_CPU)
TORCH_ENV=(env -u OPENBLAS_CORETYPE OPENBLAS_NUM_THREADS=2)
case "$ISA" in
native) ;;
avx2)
    LOOM_ENV+=(LOOM_TEST_CPU=avx2)
    TORCH_ENV+=(ONEDNN_MAX_CPU_ISA=AVX2 DNNL_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 OPENBLAS_CORETYPE=Haswell)
    ;;
*) echo "resnet_bench.sh: unknown --isa '$ISA' (native, avx2)" >&2; usage ;;
esac
IFS=, read -r -a MODEL_LIST <<<"$MODELS"
for m in "${MODEL_LIST[@]}"; do
    case "$m" in resnet20 | resnet50) ;; *) echo "resnet_bench.sh: unknown model '$m' (resnet20, resnet50)" >&2; exit 2 ;; esac
done
if [ "$DO_LOOM" = 1 ]; then bench_loom resnet_bench.sh; fi
case "$BUILD" in /*) ;; *) BUILD=$ROOT/$BUILD ;; esac

if [ ! -x "$PY" ]; then echo "resnet_bench.sh: $PY not found" >&2; exit 1; fi
if [ "$DO_TORCH" = 1 ] && ! "$PY" -c 'import torch' 2>/dev/null; then
    echo "resnet_bench.sh: PyTorch is not importable by $PY; install it: apt-get install -y python3-torch" >&2
    exit 1
fi

TMP=$(mktemp -d "${TMPDIR:-/tmp}/loom_resnet_bench.XXXXXX")
if [ "$KEEP" = 1 ]; then echo "scratch: $TMP" >&2; else trap 'rm -rf "$TMP"' EXIT; fi
RESULTS=$TMP/results.jsonl
: >"$RESULTS"

cfg_of() { [ "$1" = resnet20 ] && echo configs/fashion_mnist_resnet.cfg || echo configs/resnet50.cfg; }

# --- does this loom accept the configs? (before issue 23's graph layers it refuses them) ---
REFUSED=()
declare -A LOOM_OK
for m in "${MODEL_LIST[@]}"; do
    LOOM_OK[$m]=0
    [ "$DO_LOOM" = 1 ] || continue
    cfg=$(cfg_of "$m")
    if [ ! -f "$ROOT/$cfg" ]; then
        echo "resnet_bench.sh: $cfg not found in $ROOT; Loom's $m side is not run" >&2
        REFUSED+=("$m")
        continue
    fi
    if (cd "$ROOT" && "${LOOM_ENV[@]}" "$LOOM" check "$cfg") >"$TMP/check_$m.out" 2>&1; then
        LOOM_OK[$m]=1
    else
        echo "resnet_bench.sh: $LOOM refuses $cfg (a build without issue 23's graph layers?);" \
            "Loom's $m side is not run. Its first errors:" >&2
        grep -m 8 . "$TMP/check_$m.out" | sed 's/^/    /' >&2
        REFUSED+=("$m")
    fi
done

# --- the FMA peak: gemm_peak's 1024^3 sgemm (Loom's BLAS loader) ---
GEMM=$TMP/gemm.json
echo '{}' >"$GEMM"
if [ -n "${BENCH_PEAK_GFLOPS:-}" ]; then
    echo "{\"peak_gflops\": {\"2\": $BENCH_PEAK_GFLOPS}, \"core\": \"given\"}" >"$GEMM"
elif [ -x "$BUILD/tests/bench/gemm_peak" ]; then
    echo "== gemm_peak" >&2
    if ! "${LOOM_ENV[@]}" "$BUILD/tests/bench/gemm_peak" -q -r 7 >"$GEMM" 2>"$TMP/gemm.err"; then
        cat "$TMP/gemm.err" >&2
        echo "resnet_bench.sh: gemm_peak failed; peak fractions left out" >&2
        echo '{}' >"$GEMM"
    fi
else
    echo "resnet_bench.sh: $BUILD/tests/bench/gemm_peak not built; peak fractions left out" >&2
fi
PEAK=$("$PY" -c 'import json,sys; print((json.load(open(sys.argv[1])).get("peak_gflops") or {}).get("2") or 0)' "$GEMM")

# --- `loom check` time on ResNet-50 (target < 100 ms) ---
if [ "${LOOM_OK[resnet50]:-0}" = 1 ]; then
    for i in 1 2 3 4 5; do
        t0=$(date +%s%N)
        (cd "$ROOT" && "${LOOM_ENV[@]}" "$LOOM" check configs/resnet50.cfg) >/dev/null 2>&1
        t1=$(date +%s%N)
        echo "{\"impl\": \"loom\", \"model\": \"resnet50\", \"check_ms\": $(( (t1 - t0) / 1000 ))e-3}" >>"$RESULTS"
    done
fi

# --- one Loom run: metrics.jsonl -> one result line ---
run_loom() { # model run
    local m=$1 r=$2 dir=$TMP/loom_$1_$2 cfg sets=()
    cfg=$(cfg_of "$m")
    sets=(--set run.progress=none)
    if [ "$m" = resnet50 ]; then
        sets+=(--set "run.max_steps=$((R50_WARMUP + R50_STEPS))" --set run.summary_steps=1)
    elif [ "$MODE" = quick ]; then
        sets+=(--set "run.max_steps=$R20_STEPS" --set "run.summary_steps=$((R20_STEPS >= 50 ? 50 : R20_STEPS))"
            --set run.eval_each_epoch=false)
    else
        sets+=(--set "run.epochs=$R20_EPOCHS")
    fi
    if ! (cd "$ROOT" && "${LOOM_ENV[@]}" "$LOOM" train "$cfg" --model-dir "$dir" "${sets[@]}") \
        >"$TMP/loom.out" 2>"$TMP/loom.err"; then
        echo "resnet_bench.sh: loom train ($m, run $r) failed; its stderr:" >&2
        cat "$TMP/loom.err" >&2
        exit 1
    fi
    if ! "$PY" - "$dir/metrics.jsonl" "$m" "$r" "$R50_WARMUP" >>"$RESULTS" 2>"$TMP/parse.err" <<'EOF'; then
import json, statistics, sys
path, model, run, warm = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
lines = [json.loads(l) for l in open(path) if l.strip()]
end = [l for l in lines if l.get("event") == "end"]
if not end:
    sys.exit(f"{path}: no \"event\": \"end\" line")
end = end[-1]
ep = [l for l in lines if "epoch" in l and l.get("event") not in ("end", "summary") and l.get("samples_per_sec")]
summ = [l for l in lines if l.get("event") == "summary" and l.get("samples_per_sec")]
out = {"impl": "loom", "model": model, "run": run, "eval_accuracy": end.get("eval_accuracy"),
       "peak_rss_mb": end.get("peak_rss_mb"), "first_step_ms": end.get("first_step_ms"), "steps": end.get("step")}
if model == "resnet50":
    # one summary line a step (summary_steps = 1): the median after the warm-up steps
    timed = [l["samples_per_sec"] for l in summ if l["step"] > warm]
    if not timed:
        sys.exit(f"{path}: no summary lines after step {warm}")
    out["samples_per_sec"] = statistics.median(timed)
    out["timed_steps"] = len(timed)
elif ep:
    # whole epochs (--full): the harmonic mean of the epoch lines = samples / training time
    out["samples_per_sec"] = len(ep) / sum(1.0 / l["samples_per_sec"] for l in ep)
    out["epochs"] = len(ep)
    out["epoch_sps"] = [l["samples_per_sec"] for l in ep]
    out["epoch_acc"] = [l.get("eval_accuracy") for l in ep]
elif end.get("samples_per_sec"):
    # --quick: every training step's samples over their time (the end line's run_examples / run_train_sec), as
    # resnet_torch_ref.py counts all of its steps; the summary windows left out the steps after the last full one
    out["samples_per_sec"] = end["samples_per_sec"]
    if summ:
        out["window_sps"] = len(summ) / sum(1.0 / l["samples_per_sec"] for l in summ)
else:
    sys.exit(f"{path}: no epoch or summary lines to take samples/s from")
print(json.dumps(out))
EOF
        echo "resnet_bench.sh: cannot read Loom's metrics ($m, run $r):" >&2
        cat "$TMP/parse.err" >&2
        exit 1
    fi
}

# --- one PyTorch run ---
run_torch() { # model run
    local m=$1 r=$2 args
    if [ "$m" = resnet50 ]; then
        args=(--model resnet50 --threads "$TORCH_RESNET50_THREADS" --warmup "$R50_WARMUP" --steps "$R50_STEPS"
            --peak-gflops "$PEAK" --seed "$r")
    elif [ "$MODE" = quick ]; then
        args=(--model resnet20 --threads "$TORCH_RESNET20_THREADS" --epochs 1 --max-steps "$R20_STEPS" --seed "$r")
    else
        args=(--model resnet20 --threads "$TORCH_RESNET20_THREADS" --epochs "$R20_EPOCHS" --seed "$r")
    fi
    # the same augmentation as the config's (pad 2, random 28x28 crop, random flip), when it has one
    [ "$m" = resnet20 ] && grep -q '"random_crop"' "$ROOT/$(cfg_of resnet20)" && args+=(--augment)
    if ! "${TORCH_ENV[@]}" "$PY" "$HERE/resnet_torch_ref.py" "${args[@]}" \
        >"$TMP/torch.out" 2>"$TMP/torch.err"; then
        echo "resnet_bench.sh: resnet_torch_ref.py ($m, run $r) failed; its stderr:" >&2
        cat "$TMP/torch.err" >&2
        exit 1
    fi
    "$PY" -c 'import json,sys; d=json.loads(open(sys.argv[1]).read().strip().splitlines()[-1]); d["run"]=int(sys.argv[2]); print(json.dumps(d))' \
        "$TMP/torch.out" "$r" >>"$RESULTS"
}

LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)
for m in "${MODEL_LIST[@]}"; do
    for r in $(seq 1 "$RUNS"); do
        if [ "${LOOM_OK[$m]}" = 1 ]; then
            echo "== $m: loom, run $r/$RUNS ($MODE)" >&2
            run_loom "$m" "$r"
        fi
        if [ "$DO_TORCH" = 1 ]; then
            echo "== $m: pytorch, run $r/$RUNS ($MODE)" >&2
            run_torch "$m" "$r"
        fi
    done
done

# --- the table ---
"$PY" - "$RESULTS" "$GEMM" "$MODE" "$RUNS" "$LOAD_BEFORE" "$(cut -d' ' -f1-3 /proc/loadavg)" \
    "${REFUSED[*]:-}" "$R20_STEPS" "$R20_EPOCHS" "$ISA" <<'EOF'
import json, statistics, sys
res = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
gemm = json.load(open(sys.argv[2]))
mode, runs, load_before, load_after = sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6]
refused = sys.argv[7].split()
r20_steps, r20_epochs = int(sys.argv[8]), int(sys.argv[9])
isa = sys.argv[10]
peak = (gemm.get("peak_gflops") or {}).get("2")
# Forward FLOPs per sample (convs and dense, multiply-add = 2): resnet50_count.py and
# resnet_torch_ref.py's hooks agree on these.
FWD = {"resnet20": 62043904, "resnet50": 7715946496}
TARGET_SPEED = {"resnet20": 1.5, "resnet50": 1.3}

def med(impl, model, key):
    v = [r[key] for r in res if r["impl"] == impl and r["model"] == model and r.get(key) is not None]
    return statistics.median(v) if v else None

def f(v, fmt):
    return "-" if v is None else format(v, fmt)

print(f"\nissue 23's residual models, {mode}, medians of {runs} run(s)"
      + (", both sides confined to AVX2 + FMA (Loom: LOOM_TEST_CPU=avx2; PyTorch: oneDNN, ATen and OpenBLAS capped)"
         if isa == "avx2" else ""))
if peak:
    src = "BENCH_PEAK_GFLOPS" if gemm.get("core") == "given" else f"gemm_peak, 1024^3 sgemm, 2 threads, {gemm.get('core')}"
    print(f"FMA peak ({src}): {peak:.1f} GFLOP/s")
print(f"load average before/after: {load_before} / {load_after} (2 cores; above ~0.5 the figures are noisy)")
hdr = f"{'model':9} {'impl':7} {'samples/s':>10} {'ratio':>6} {'target':>7} {'acc':>7} {'RSS MB':>8} {'RSS ratio':>9} {'peak':>6}"
print(hdr)
print("-" * len(hdr))
out = {"mode": mode, "isa": isa, "runs": runs, "peak_gflops_2t": peak, "refused": refused, "models": {}}
for model in ("resnet20", "resnet50"):
    keys = ("samples_per_sec", "eval_accuracy", "peak_rss_mb")
    L = {k: med("loom", model, k) for k in keys}
    P = {k: med("pytorch", model, k) for k in keys}
    if L["samples_per_sec"] is None and P["samples_per_sec"] is None and model not in refused:
        continue
    ratio = L["samples_per_sec"] / P["samples_per_sec"] if L["samples_per_sec"] and P["samples_per_sec"] else None
    rss_ratio = L["peak_rss_mb"] / P["peak_rss_mb"] if L["peak_rss_mb"] and P["peak_rss_mb"] else None
    frac = lambda s: 3 * FWD[model] * s / (peak * 1e9) if s and peak else None
    ok = lambda c: " ok" if c else " MISS"
    for name, d in (("loom", L), ("torch", P)):
        if name == "loom" and model in refused:
            print(f"{model:9} {name:7} {'refused: loom check fails on the config (see above)':>50}")
            continue
        if d["samples_per_sec"] is None:
            continue
        flag = ""
        if name == "loom" and ratio is not None:
            flag += ok(ratio >= TARGET_SPEED[model])
            if model == "resnet20" and mode == "full" and d["eval_accuracy"] is not None:
                flag += " acc" + ok(d["eval_accuracy"] >= 0.935)
            if model == "resnet50" and rss_ratio is not None:
                flag += " rss" + ok(rss_ratio <= 1.0)
        fr = frac(d["samples_per_sec"])
        print(f"{model:9} {name:7} {f(d['samples_per_sec'], '10.1f')} {f(ratio if name == 'loom' else None, '6.2f')} "
              f"{(f'>={TARGET_SPEED[model]}x' if name == 'loom' else ''):>7} {f(d['eval_accuracy'], '7.4f')} "
              f"{f(d['peak_rss_mb'], '8.0f')} {f(rss_ratio if name == 'loom' else None, '9.2f')} "
              f"{f(fr and 100 * fr, '5.1f')}%{flag}")
    m = {"loom": L, "pytorch": P, "ratio": ratio, "rss_ratio": rss_ratio, "target_ratio": TARGET_SPEED[model],
         "loom_peak_fraction": frac(L["samples_per_sec"]), "pytorch_peak_fraction": frac(P["samples_per_sec"]),
         "fwd_flops_per_sample": FWD[model]}
    if model == "resnet50":
        ck = [r["check_ms"] for r in res if r.get("check_ms") is not None]
        m["loom_check_ms"] = statistics.median(ck) if ck else None
        tw = [r for r in res if r["impl"] == "pytorch" and r["model"] == model]
        m["pytorch_best_threads"] = [r.get("best_threads") for r in tw]
    out["models"][model] = m
print("-" * len(hdr))
if "resnet20" in out["models"]:
    print("resnet20: " + (f"{r20_epochs} epochs, accuracy target >= 0.935" if mode == "full"
                          else f"{r20_steps} steps (speed; the accuracy after them is not the target's)")
          + "; samples/s of the training steps (evaluation excluded), target >= 1.5x")
if "resnet50" in out["models"]:
    r50 = out["models"]["resnet50"]
    th = r50.get("pytorch_best_threads")
    print(f"resnet50: batch 32, median step after warm-up; target >= 1.3x PyTorch's best (threads {th}), "
          f"peak RSS <= PyTorch's; peak = 3 x forward FLOPs x samples/s / the FMA peak")
    print("resnet50 steps/s: " + ", ".join(f"{k} {f(v and v / 32, '.4f')}" for k, v in
                                         (("loom", r50["loom"]["samples_per_sec"]), ("pytorch", r50["pytorch"]["samples_per_sec"]))))
    if r50.get("loom_check_ms") is not None:
        c = r50["loom_check_ms"]
        print(f"loom check configs/resnet50.cfg: {c:.1f} ms (median of 5; target < 100 ms){' ok' if c < 100 else ' MISS'}")
out["load_before"], out["load_after"] = load_before, load_after
print("json: " + json.dumps(out))
EOF
if [ ${#REFUSED[@]} -gt 0 ]; then
    echo "resnet_bench.sh: loom refused ${REFUSED[*]}: no Loom figures for them" >&2
    exit 3
fi
