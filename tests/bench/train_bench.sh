#!/bin/bash
# train_bench.sh - Loom vs PyTorch on Fashion-MNIST, side by side, in one run.
#
#   tests/bench/train_bench.sh [--quick | --full] [--models mlp,cnn] [--runs N] [--build DIR]
#                              [--isa native|avx2] [--no-loom] [--no-torch] [--keep]
#
#   --quick   speed only (default): 1 epoch of each model (BENCH_QUICK_EPOCHS)
#   --full    accuracy targets: MLP 10 epochs, CNN 5 epochs
#   --runs N  repetitions (default BENCH_RUNS or 3); medians are reported.
#             Loom and PyTorch runs alternate, so load from other processes
#             falls on both alike.
#   --build   meson build dir with `loom` and tests/bench/gemm_peak (default BUILD or ./build)
#   --keep    keep the scratch directory (model dirs, metrics.jsonl, raw JSON)
#   --isa avx2  both sides confined to AVX2 + FMA, as on an AVX2-only CPU (Zen 3,
#             Haswell..Comet Lake) on an AVX-512 machine: Loom with
#             LOOM_TEST_CPU=avx2 (its kernels and its OpenBLAS core, Haswell),
#             PyTorch with ONEDNN_MAX_CPU_ISA=DNNL_MAX_CPU_ISA=AVX2,
#             ATEN_CPU_CAPABILITY=avx2 and OPENBLAS_CORETYPE=Haswell (oneDNN's
#             verbose log then names jit:avx2 convolutions). The cap covers
#             Loom's element-wise loops too (im2col, pooling, the optimizers,
#             ...: tensor.h's LOOM_CLONES pick by the capped level).
#             (default: native, each at the machine's best)
#
# PyTorch runs at the best settings measured on this machine (torch_ref.py's
# header and README.md); override with TORCH_MLP_THREADS, TORCH_CNN_THREADS,
# TORCH_OPENBLAS_THREADS, TORCH_OPENBLAS_CORETYPE (empty: OpenBLAS decides),
# TORCH_CNN_CHANNELS_LAST (1/0). tests/bench/torch_sweep.sh re-measures them.
# Both run at their best BLAS kernel: an OPENBLAS_CORETYPE in the environment
# is dropped for each (Loom picks its kernel from the CPU's features whatever
# the environment says, OpenBLAS from the CPU model for PyTorch).
# Prints a table, then the raw medians as one JSON line (prefix "json: ").
set -euo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
PY=/usr/bin/python3
RUNS=${BENCH_RUNS:-3}
MODE=quick
MODELS=mlp,cnn
DO_LOOM=1
DO_TORCH=1
KEEP=0
TORCH_MLP_THREADS=${TORCH_MLP_THREADS:-1}
TORCH_CNN_THREADS=${TORCH_CNN_THREADS:-2}
TORCH_OPENBLAS_THREADS=${TORCH_OPENBLAS_THREADS:-2}
TORCH_OPENBLAS_CORETYPE=${TORCH_OPENBLAS_CORETYPE-}
TORCH_CNN_CHANNELS_LAST=${TORCH_CNN_CHANNELS_LAST:-1}
ISA=native

usage() { sed -n '2,32p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }
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
    *) echo "train_bench.sh: unknown argument '$1'" >&2; usage ;;
    esac
    shift
done
case "$BUILD" in /*) ;; *) BUILD=$ROOT/$BUILD ;; esac
# Loom's environment, PyTorch's ISA cap (empty for native)
LOOM_ENV=(env -u OPENBLAS_CORETYPE -u LOOM_TEST_CPU)
TORCH_ISA_ENV=()
case "$ISA" in
native) ;;
avx2)
    LOOM_ENV+=(LOOM_TEST_CPU=avx2)
    TORCH_ISA_ENV=(ONEDNN_MAX_CPU_ISA=AVX2 DNNL_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2)
    TORCH_OPENBLAS_CORETYPE=Haswell
    ;;
*) echo "train_bench.sh: unknown --isa '$ISA' (native, avx2)" >&2; usage ;;
esac

epochs_for() { # model -> epochs
    if [ "$MODE" = full ]; then
        [ "$1" = mlp ] && echo "${BENCH_MLP_EPOCHS:-10}" || echo "${BENCH_CNN_EPOCHS:-5}"
    else
        echo "${BENCH_QUICK_EPOCHS:-1}"
    fi
}

TMP=$(mktemp -d "${TMPDIR:-/tmp}/loom_bench.XXXXXX")
if [ "$KEEP" = 1 ]; then echo "scratch: $TMP" >&2; else trap 'rm -rf "$TMP"' EXIT; fi
RESULTS=$TMP/results.jsonl
: >"$RESULTS"

if [ ! -x "$PY" ]; then echo "train_bench.sh: $PY not found" >&2; exit 1; fi
if [ "$DO_TORCH" = 1 ] && ! "$PY" -c 'import torch' 2>/dev/null; then
    echo "train_bench.sh: PyTorch is not importable by $PY; install it: apt-get install -y python3-torch" >&2
    exit 1
fi
if [ "$DO_LOOM" = 1 ] && [ ! -x "$BUILD/loom" ]; then
    echo "train_bench.sh: $BUILD/loom not found; build it (meson setup build && ninja -C build) or pass --build DIR" >&2
    exit 1
fi

# --- GEMM peak (Loom's BLAS loader, 1 and 2 threads) ---
GEMM=$TMP/gemm.json
if [ -x "$BUILD/tests/bench/gemm_peak" ]; then
    echo "== gemm_peak" >&2
    if ! "${LOOM_ENV[@]}" "$BUILD/tests/bench/gemm_peak" -q -r 7 >"$GEMM" 2>"$TMP/gemm.err"; then
        cat "$TMP/gemm.err" >&2
        echo "train_bench.sh: gemm_peak failed; GEMM-limit fractions left out" >&2
        echo '{}' >"$GEMM"
    fi
else
    echo "train_bench.sh: $BUILD/tests/bench/gemm_peak not built; GEMM-limit fractions left out" >&2
    echo '{}' >"$GEMM"
fi

# --- one Loom run: metrics.jsonl -> one result line ---
run_loom() { # model epochs run
    local m=$1 e=$2 r=$3 dir=$TMP/loom_${1}_$3
    local t0 t1
    t0=$(date +%s.%N)
    if ! (cd "$ROOT" && "${LOOM_ENV[@]}" "$BUILD/loom" train "configs/fashion_mnist_$m.cfg" --model-dir "$dir" \
        --set "run.epochs=$e" --set run.progress=none) >"$TMP/loom.out" 2>"$TMP/loom.err"; then
        echo "train_bench.sh: loom train ($m, run $r) failed; its stderr:" >&2
        cat "$TMP/loom.err" >&2
        exit 1
    fi
    t1=$(date +%s.%N)
    if ! "$PY" - "$dir/metrics.jsonl" "$m" "$r" "$t0" "$t1" >>"$RESULTS" 2>"$TMP/parse.err" <<'EOF'; then
import json, sys
path, model, run, t0, t1 = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
lines = [json.loads(l) for l in open(path) if l.strip()]
end = [l for l in lines if l.get("event") == "end"]
if not end:
    sys.exit(f"{path}: no \"event\": \"end\" line")
end = end[-1]
ep = [l for l in lines if "epoch" in l and l.get("event") != "end" and l.get("samples_per_sec")]
# Training samples/s: harmonic mean of the epoch lines (each epoch = the same
# 60000 samples), i.e. samples / time spent in training steps incl. the input
# pipeline, eval and checkpoints excluded - the same as PyTorch's figure.
# Without epoch lines (max_steps runs) fall back to the end line's whole-run
# figure, which includes evaluation.
sps = len(ep) / sum(1.0 / l["samples_per_sec"] for l in ep) if ep else end.get("samples_per_sec")
print(json.dumps({"impl": "loom", "model": model, "run": run, "epochs": len(ep),
    "samples_per_sec": sps, "samples_per_sec_source": "epochs" if ep else "end",
    "samples_per_sec_run": end.get("samples_per_sec"),
    "eval_accuracy": end.get("eval_accuracy"), "first_step_ms": end.get("first_step_ms"),
    "decode_ms": end.get("decode_ms"), "peak_rss_mb": end.get("peak_rss_mb"),
    "epoch_sps": [l["samples_per_sec"] for l in ep], "wall_s": round(t1 - t0, 3)}))
EOF
        echo "train_bench.sh: cannot read Loom's metrics ($m, run $r):" >&2
        cat "$TMP/parse.err" >&2
        echo "--- loom stderr:" >&2
        cat "$TMP/loom.err" >&2
        exit 1
    fi
}

# --- one PyTorch run ---
run_torch() { # model epochs run
    local m=$1 e=$2 r=$3 th
    [ "$m" = mlp ] && th=$TORCH_MLP_THREADS || th=$TORCH_CNN_THREADS
    local extra=()
    [ "$m" = cnn ] && [ "$TORCH_CNN_CHANNELS_LAST" = 1 ] && extra+=(--channels-last)
    local envs=(OPENBLAS_NUM_THREADS="$TORCH_OPENBLAS_THREADS" ${TORCH_ISA_ENV[@]+"${TORCH_ISA_ENV[@]}"})
    [ -n "$TORCH_OPENBLAS_CORETYPE" ] && envs+=(OPENBLAS_CORETYPE="$TORCH_OPENBLAS_CORETYPE")
    if ! env -u OPENBLAS_CORETYPE "${envs[@]}" "$PY" "$HERE/torch_ref.py" --model "$m" --epochs "$e" \
        --threads "$th" --seed "$r" ${extra[@]+"${extra[@]}"} >"$TMP/torch.out" 2>"$TMP/torch.err"; then
        echo "train_bench.sh: torch_ref.py ($m, run $r) failed; its stderr:" >&2
        cat "$TMP/torch.err" >&2
        exit 1
    fi
    "$PY" -c 'import json,sys; d=json.loads(open(sys.argv[1]).read().strip().splitlines()[-1]); d["run"]=int(sys.argv[2]); print(json.dumps(d))' \
        "$TMP/torch.out" "$r" >>"$RESULTS"
}

LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)
IFS=, read -r -a MODEL_LIST <<<"$MODELS"
for m in "${MODEL_LIST[@]}"; do
    case "$m" in mlp | cnn) ;; *) echo "train_bench.sh: unknown model '$m' (mlp, cnn)" >&2; exit 2 ;; esac
    e=$(epochs_for "$m")
    for r in $(seq 1 "$RUNS"); do
        if [ "$DO_LOOM" = 1 ]; then
            echo "== $m: loom, $e epoch(s), run $r/$RUNS" >&2
            run_loom "$m" "$e" "$r"
        fi
        if [ "$DO_TORCH" = 1 ]; then
            echo "== $m: pytorch, $e epoch(s), run $r/$RUNS" >&2
            run_torch "$m" "$e" "$r"
        fi
    done
done

# --- the table ---
"$PY" - "$RESULTS" "$GEMM" "$MODE" "$RUNS" "$LOAD_BEFORE" "$(cut -d' ' -f1-3 /proc/loadavg)" "$ISA" <<'EOF'
import json, statistics, sys
res = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
gemm = json.load(open(sys.argv[2]))
mode, runs = sys.argv[3], int(sys.argv[4])
load_before, load_after = sys.argv[5], sys.argv[6]
isa = sys.argv[7]

# Forward FLOPs per sample (multiply-add = 2), from the architectures.
def conv(h, w, k, cin, cout): return 2 * h * w * k * k * cin * cout
FWD = {"mlp": 2 * (784 * 256 + 256 * 128 + 128 * 10),
       "cnn": conv(28, 28, 5, 1, 32) + conv(14, 14, 5, 32, 64) + 2 * (7 * 7 * 64 * 128 + 128 * 10)}
TARGET_SPEED = {"mlp": 1.5, "cnn": 1.5}  # issue 17
TARGET_ACC = {"mlp": 0.885, "cnn": 0.91}
peak = (gemm.get("peak_gflops") or {}).get("2")
run2 = [r for r in gemm.get("runs", []) if r.get("threads") == 2]
mlp_bound = run2[0].get("mlp_gemm_bound_samples_per_sec") if run2 else None

def med(impl, model, key):
    v = [r[key] for r in res if r["impl"] == impl and r["model"] == model and r.get(key) is not None]
    return statistics.median(v) if v else None

def f(v, fmt):
    return "-" if v is None else format(v, fmt)

out = {"mode": mode, "isa": isa, "runs": runs, "gemm_peak_gflops_2t": peak, "blas_core": gemm.get("core"), "models": {}}
print(f"\nFashion-MNIST, batch 128, {mode} ({'accuracy' if mode == 'full' else 'speed'}), medians of {runs} run(s)"
      + (", both sides confined to AVX2 + FMA (Loom: LOOM_TEST_CPU=avx2; PyTorch: oneDNN, ATen and OpenBLAS capped)"
         if isa == "avx2" else ""))
if peak:
    print(f"sgemm peak (1024^3, Loom's BLAS loader, {gemm.get('core')}): "
          f"{gemm['peak_gflops'].get('1', 0):.1f} GFLOP/s at 1 thread, {peak:.1f} at 2 (medians)")
    pmax = (gemm.get("peak_gflops_max") or {}).get("2")
    if pmax and pmax > 1.2 * peak:
        print(f"warning: the cores were busy during gemm_peak (fastest rep {pmax:.1f} GFLOP/s vs median {peak:.1f})")
print(f"load average before/after: {load_before} / {load_after} (2 cores; above ~0.5 the figures are noisy)")
hdr = f"{'':5} {'':8} {'samples/s':>10} {'ratio':>6} {'target':>7} {'acc':>7} {'acc tgt':>7} {'1st step':>9} {'decode':>8} {'RSS MB':>7} {'GEMM lim':>8}"
print(hdr)
print("-" * len(hdr))
for model in ("mlp", "cnn"):
    if not any(r["model"] == model for r in res):
        continue
    L = {k: med("loom", model, k) for k in ("samples_per_sec", "eval_accuracy", "first_step_ms", "decode_ms", "peak_rss_mb")}
    P = {k: med("pytorch", model, k) for k in ("samples_per_sec", "eval_accuracy", "first_step_ms", "decode_ms", "peak_rss_mb")}
    ratio = L["samples_per_sec"] / P["samples_per_sec"] if L["samples_per_sec"] and P["samples_per_sec"] else None
    fl = 3 * FWD[model]  # training ~ 3x forward
    frac = lambda s: s * fl / (peak * 1e9) if s and peak else None
    acc_tgt = TARGET_ACC[model] if mode == "full" else None
    ok = lambda c: "" if c is None else (" ok" if c else " MISS")
    for name, d, r_, t in (("loom", L, ratio, TARGET_SPEED[model]), ("torch", P, None, None)):
        if d["samples_per_sec"] is None:
            continue
        flag = ok(r_ >= t) if r_ is not None else ""
        aflag = (" acc" + ok(d["eval_accuracy"] >= acc_tgt)) if acc_tgt and d["eval_accuracy"] is not None and name == "loom" else ""
        # < 50 ms applies to the MLP: one CNN step alone takes ~100 ms on 2 cores.
        fflag = (" 1st" + ok(d["first_step_ms"] < 50)) if name == "loom" and model == "mlp" and d["first_step_ms"] is not None else ""
        print(f"{model:5} {name:8} {f(d['samples_per_sec'], '10.0f')} {f(r_, '6.2f')} "
              f"{(f'>={t}x' if t else ''):>7} {f(d['eval_accuracy'], '7.4f')} {f(acc_tgt if name == 'loom' else None, '7.3f')} "
              f"{f(d['first_step_ms'], '7.1f')}ms {f(d['decode_ms'], '6.0f')}ms {f(d['peak_rss_mb'], '7.1f')} "
              f"{f(frac(d['samples_per_sec']) and 100 * frac(d['samples_per_sec']), '7.1f')}%{flag}{aflag}{fflag}")
    if model == "mlp" and mlp_bound and L["samples_per_sec"]:
        print(f"{'':5} {'':8} Loom at {100 * L['samples_per_sec'] / mlp_bound:.0f}% of the MLP's GEMM-only bound at its real shapes "
              f"({mlp_bound:.0f} samples/s, gemm_peak)")
    out["models"][model] = {"fwd_flops_per_sample": FWD[model], "loom": L, "pytorch": P, "ratio": ratio,
                            "target_ratio": TARGET_SPEED[model], "target_accuracy": TARGET_ACC[model],
                            "loom_gemm_fraction": frac(L["samples_per_sec"]),
                            "pytorch_gemm_fraction": frac(P["samples_per_sec"])}
print("-" * len(hdr))
print("ratio = Loom/PyTorch samples/s (target: MLP >= 1.5x, CNN >= 1.5x PyTorch's best); first step: process start ->")
print("first step done, decode excluded (MLP target < 50 ms; PyTorch's includes `import torch`); GEMM lim = 3 x forward")
print("FLOPs/sample x samples/s / 2-thread sgemm peak.")
if mlp_bound and any(r["model"] == "mlp" for r in res):
    print(f"MLP GEMM-only bound at its real shapes (gemm_peak, 2 threads): {mlp_bound:.0f} samples/s")
    out["mlp_gemm_bound_samples_per_sec"] = mlp_bound
tw = [r for r in res if r["impl"] == "pytorch"]
if tw:
    t = tw[-1]
    print(f"PyTorch {t.get('torch')}: OpenBLAS core {t.get('blas_core')}, {t.get('blas_threads')} BLAS thread(s), "
          f"env {t.get('env')}, oneDNN {t.get('mkldnn')}; torch threads "
          + ", ".join(f"{r['model']}={r.get('torch_threads')}" for r in {r['model']: r for r in tw}.values()))
out["load_before"], out["load_after"] = load_before, load_after
print("json: " + json.dumps(out))
EOF
