#!/usr/bin/env bash
# tabular.sh - own tabular data in (issue 16, sections 1, 5, 6): more than 8
# features, CSV column ranges gathered into one vector feature, split,
# normalize with adapt, predict on a CSV with an id column passed through,
# and their bad input. Data are made here with Python's standard library.
source "$(dirname "$0")/lib.sh"

# A synthetic table: id, 12 float columns, label (sum of the first 3 > 0).
python3 - "$WORK/t.csv" <<'PY'
import random, sys
random.seed(3)
with open(sys.argv[1], "w") as f:
    f.write("id," + ",".join("c%d" % i for i in range(12)) + ",label\n")
    for i in range(400):
        xs = [random.gauss(5.0 * (k % 3), 1.0 + k) for k in range(12)]
        y = 1 if (xs[0] - 0.0) / 1 + (xs[1] - 5.0) / 2 + (xs[2] - 10.0) / 3 > 0 else 0
        f.write("%d," % (1000 + i) + ",".join("%.5f" % x for x in xs) + ",%d\n" % y)
PY

# cfg NAME COLUMNS TRANSFORMS [EVAL]: a config over t.csv
cfg() {
    cat > "$WORK/$1.cfg" <<CFG
version = 1;
data: {
  train: {
    source: { type = "csv"; files = ["t.csv"]; columns: { $2 }; };
    transforms = ( $3 );
  };
  ${4:-}
};
model: { input = "x"; label = "label"; layers = ( { type = "dense"; units = 2; } ); };
optimizer: { type = "adam"; learning_rate = 0.05; };
run: { model_dir = "run_$1"; epochs = 3; seed = 1; progress = "none"; };
CFG
}

# 1. wide: 13 scalar columns (more than the old cap of 8) stack through a range instead
many=""
for i in $(seq 0 11); do many="$many c$i = { dtype = \"float32\"; };"; done
cfg many "$many label = { dtype = \"int64\"; }; x = { dtype = \"float32\"; index = \"1-12\"; };" '{ op = "batch"; size = 32; }'
out=$(cd "$WORK" && timeout 60 "$LOOM" check many.cfg 2>&1)
contains "14 features in one csv source" "c11: float32 (-1,); label: int64 (-1,); x: float32 (-1, 12)" "$out"
contains "a range is one vector feature" "x: float32 (-1, 12)" "$out"

# 2. a range outside the file names the file, the header's width and the config line
cfg range "x = { dtype = \"float32\"; index = \"1-20\"; }; label = { dtype = \"int64\"; };" '{ op = "batch"; size = 32; }'
expect_fail 2 "column range outside the file" 't.csv:1: data.train: feature "x" gathers fields 1-20 (0-based), but the header has only 14 fields (0-13)' \
    bash -c "cd '$WORK' && timeout 60 '$LOOM' train range.cfg"
cfg range2 "x = { dtype = \"float32\"; index = \"5-2\"; }; label = { dtype = \"int64\"; };" '{ op = "batch"; size = 32; }'
expect_fail 2 "a reversed range is a config error" 'range2.cfg:4: data.train.source.columns.x.index: expected a field index >= 0 or a range "first-last"' \
    bash -c "cd '$WORK' && timeout 60 '$LOOM' check range2.cfg"
finish
