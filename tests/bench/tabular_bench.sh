#!/bin/bash
# tabular_bench.sh - issue 16's wide tabular target, in one run: test accuracy
# of configs/breast_cancer.cfg (30 CSV columns as one feature, 80/20 split by
# a fixed seed, normalize adapt) beside scikit-learn's LogisticRegression
# (StandardScaler + LogisticRegression, its defaults) on exactly the same
# split: the ids of each part come from `loom predict --id id`, so sklearn
# fits on loom's training rows and scores on loom's eval rows.
#
#   tests/bench/tabular_bench.sh [--build DIR] [--runs N] [--keep]
#
#   --runs N  loom trainings with run.seed 1..N (default 3); each is reported,
#             and the verdict uses their median
# Needs python3 with scikit-learn (pip install scikit-learn); never downloads.
# Prints a table, then one JSON line (prefix "json: ").
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
BUILD=${BUILD:-$ROOT/build}
RUNS=3
KEEP=0
while [ $# -gt 0 ]; do
    case "$1" in
        --build) BUILD=$(cd "$2" && pwd); shift 2 ;;
        --runs) RUNS=$2; shift 2 ;;
        --keep) KEEP=1; shift ;;
        *) echo "usage: $0 [--build DIR] [--runs N] [--keep]" >&2; exit 2 ;;
    esac
done
LOOM=$BUILD/loom
WORK=$(mktemp -d /tmp/loom_tabular_XXXXXX)
[ "$KEEP" = 1 ] && echo "scratch: $WORK" || trap 'rm -rf "$WORK"' EXIT

python3 "$ROOT/tests/fixtures/make_sklearn_csv.py" "$WORK/sklearn" || { echo "scikit-learn is missing: pip install scikit-learn" >&2; exit 77; }
# the config as shipped, reading the CSV made here
sed "s#\.\./runs/sklearn/#$WORK/sklearn/#" "$ROOT/configs/breast_cancer.cfg" > "$WORK/breast_cancer.cfg"

accs=()
for seed in $(seq 1 "$RUNS"); do
    md="$WORK/run_$seed"
    t0=$(date +%s.%N)
    "$LOOM" train "$WORK/breast_cancer.cfg" --model-dir "$md" --set run.seed=$seed --set 'run.progress="none"' > "$WORK/train_$seed.log" 2>&1
    t1=$(date +%s.%N)
    "$LOOM" predict "$WORK/breast_cancer.cfg" --model-dir "$md" --input eval --id id,label --output "$WORK/eval_$seed.csv" 2>/dev/null
    "$LOOM" predict "$WORK/breast_cancer.cfg" --model-dir "$md" --input train --id id --output "$WORK/train_$seed.csv" 2>/dev/null
    acc=$(python3 -c "
import csv, sys
r = list(csv.DictReader(open('$WORK/eval_$seed.csv')))
print('%.6f %d' % (sum(int(x['class']) == int(x['label']) for x in r) / len(r), len(r)))")
    accs+=("$acc $(echo "$t1 - $t0" | bc)")
done

python3 - "$WORK" "$RUNS" "${accs[@]}" <<'PY'
import csv, json, statistics, sys, time
import numpy as np
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

work, runs = sys.argv[1], int(sys.argv[2])
vals = " ".join(sys.argv[3:]).split()
loom = [(float(vals[3 * i]), int(vals[3 * i + 1]), float(vals[3 * i + 2])) for i in range(runs)]
rows = list(csv.reader(open(work + "/sklearn/breast_cancer.csv")))[1:]
X = {int(r[0]): [float(v) for v in r[1:31]] for r in rows}
y = {int(r[0]): int(r[31]) for r in rows}
tr = [int(r["id"]) for r in csv.DictReader(open(work + "/train_1.csv"))]
ev = [int(r["id"]) for r in csv.DictReader(open(work + "/eval_1.csv"))]
assert not set(tr) & set(ev) and len(tr) + len(ev) == len(rows), "the parts must be disjoint and cover the file"
t0 = time.time()
clf = make_pipeline(StandardScaler(), LogisticRegression(max_iter=1000))
clf.fit(np.array([X[i] for i in tr]), np.array([y[i] for i in tr]))
sk = float(clf.score(np.array([X[i] for i in ev]), np.array([y[i] for i in ev])))
sk_sec = time.time() - t0
med = statistics.median(a for a, _, _ in loom)
print("breast cancer: %d training rows, %d test rows (split 0.8, seed 7)" % (len(tr), len(ev)))
print("%-44s %10s %10s" % ("", "test acc", "seconds"))
for i, (a, n, s) in enumerate(loom):
    print("%-44s %10.4f %10.2f" % ("loom configs/breast_cancer.cfg, run.seed %d" % (i + 1), a, s))
print("%-44s %10.4f %10.2f" % ("sklearn StandardScaler + LogisticRegression", sk, sk_sec))
verdict = "met" if med >= sk else "NOT met"
print("target (loom median >= sklearn): %s (%.4f vs %.4f)" % (verdict, med, sk))
print("json: " + json.dumps({"loom_test_accuracy": [a for a, _, _ in loom], "loom_median": med,
                             "sklearn_logreg_test_accuracy": sk, "train_rows": len(tr), "test_rows": len(ev),
                             "target_met": med >= sk}))
PY
