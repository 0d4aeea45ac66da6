#!/usr/bin/env bash
# progress.sh - the progress display counts what the epoch lines count
# (issue 22, item 10): with run.max_steps (which overrides run.epochs) the
# bar, the plain progress lines, the epoch lines and the resume line all say
# the epochs those steps take; a source of unknown length (csv) shows an ETA
# once its first epoch has ended (or from the start with run.max_steps), and
# the ETA is near the time the run really takes. The bar is forced with
# run.progress = "bar" (what a terminal gets), its redraws split at \r.
source "$(dirname "$0")/lib.sh"
CFG=tests/configs/small_mlp.cfg # 32 steps an epoch, 3 epochs

# 1. max_steps = 70 with epochs = 10: 3 epochs (32 + 32 + 6 steps), everywhere
out=$("$LOOM" train $CFG --model-dir "$WORK/ms" --set run.epochs=10 --set run.max_steps=70 --set run.progress='"bar"' 2>&1 | tr '\r' '\n')
bars=$(grep -o 'epoch [0-9]*/[0-9?]* \[' <<<"$out" | sort -u | tr '\n' ' ')
[ "$bars" = "epoch 1/3 [ epoch 2/3 [ epoch 3/3 [ " ] && pass "the bar counts 3 epochs for max_steps 70 ($bars)" || fail "the bar counts 3 epochs for max_steps 70" "$bars"
contains "... and so do the epoch lines" "epoch 1/3: step 32," "$out"
contains "... (the second)" "epoch 2/3: step 64," "$out"
if grep -q 'epoch [0-9]*/10' <<<"$out"; then fail "no line says /10" "$(grep 'epoch [0-9]*/10' <<<"$out" | head -2)"; else pass "no line counts run.epochs = 10, which max_steps overrides"; fi
out=$("$LOOM" train $CFG --model-dir "$WORK/ms" --set run.epochs=10 --set run.max_steps=90 --set run.progress='"plain"' --set run.log_steps=4 2>&1)
contains "the resume line counts them too" "(step 70, 6 steps into epoch 3 of 3)" "$out"
contains "... and the plain progress lines" "loom: epoch 3/3 step 72 (8 in epoch)" "$out"

# 2. a csv source (its length unknown ahead): 4 epochs of 40 steps, ~25 ms a step
python3 - "$WORK/t.csv" <<'PY'
import random, sys
random.seed(3)
with open(sys.argv[1], "w") as f:
    f.write("c0,c1,c2,c3,label\n")
    for i in range(400):
        xs = [random.gauss(0, 1) for k in range(4)]
        f.write(",".join("%.5f" % x for x in xs) + ",%d\n" % (xs[0] > 0))
PY
cat > "$WORK/csv.cfg" <<'CFG'
version = 1;
data: { train: {
  source: { type = "csv"; files = ["t.csv"];
            columns: { c0 = { dtype = "float32"; }; c1 = { dtype = "float32"; }; c2 = { dtype = "float32"; };
                       c3 = { dtype = "float32"; }; label = { dtype = "int64"; }; x = { dtype = "float32"; index = "0-3"; }; }; };
  transforms = ( { op = "batch"; size = 10; } ); }; };
model: { input = "x"; label = "label"; layers = ( { type = "dense"; units = 2; } ); };
optimizer: { type = "adam"; learning_rate = 0.05; };
hooks: { callbacks = ( { fn = "slow.lua:slow"; args = { seconds = 0.025; }; } ); };
run: { model_dir = "run"; epochs = 4; seed = 1; log_steps = 10; };
CFG
cp tests/lua/mwm_slow.lua "$WORK/slow.lua"
out=$("$LOOM" train "$WORK/csv.cfg" --set run.progress='"bar"' 2>&1 | tr '\r' '\n')
e1=$(grep -c 'epoch 1/4 \[> *\] [0-9]*/?  .*ETA ?$' <<<"$out")
n1=$(grep -c 'epoch 1/4 \[' <<<"$out")
[ "$e1" -ge 1 ] && [ "$e1" = "$n1" ] && pass "csv, bar: in the first epoch its size and the ETA are unknown ($e1 redraws)" ||
    fail "csv, bar: in the first epoch its size and the ETA are unknown" "$e1 of $n1 redraws say so"
e2=$(grep -c 'epoch [234]/4 \[[=> ]*\] [0-9]*/40  .*ETA [0-9]*:[0-9][0-9]$' <<<"$out")
n2=$(grep -c 'epoch [234]/4 \[' <<<"$out")
[ "$e2" -ge 3 ] && [ "$e2" = "$n2" ] && pass "csv, bar: from epoch 2 on it knows 40 steps an epoch and gives an ETA ($e2 redraws)" ||
    fail "csv, bar: from epoch 2 on it knows 40 steps an epoch and gives an ETA" "$e2 of $n2 redraws" "$(grep 'epoch [234]/4 \[' <<<"$out" | head -2)"
# the ETA against the time the run really takes: each plain line's arrival timed
rm -rf "$WORK/run"
python3 - "$LOOM" "$WORK/csv.cfg" <<'PY' && pass "csv, plain lines: the ETA is near the time left (within 50% or 1.5 s)" || fail "csv: the ETA is near the time left"
import re, subprocess, sys, time
p = subprocess.Popen([sys.argv[1], "train", sys.argv[2], "--set", 'run.progress="plain"'], stderr=subprocess.PIPE, text=True)
lines = [(time.monotonic(), l) for l in p.stderr]
p.wait()
end = lines[-1][0]
eta = [(t, l) for t, l in lines if " ETA " in l]
unknown = [l for t, l in eta if l.startswith("loom: epoch 1/4") and l.rstrip().endswith("ETA ?")]
known = [(t, l) for t, l in eta if not l.startswith("loom: epoch 1/4")]
ok = p.returncode == 0 and len(unknown) == 4 and len(known) == 12
for t, l in known:
    m = re.search(r"ETA (\d+):(\d\d)$", l.rstrip())
    if not m: ok = False; print("# no ETA:", l.rstrip()); continue
    est, real = int(m[1]) * 60 + int(m[2]), end - t
    print("# %s -> %.1f s left" % (l.rstrip()[:40] + " ... ETA " + m[0][4:], real))
    if abs(est - real) > max(1.5, 0.5 * real): ok = False
sys.exit(0 if ok else 1)
PY
finish
