#!/usr/bin/env bash
# numerics.sh - non-finite inputs and updates (issue 11, item 2) and a cache
# after an infinite repeat (item 3), through the loom binary.
source "$(dirname "$0")/lib.sh"

# 500 rows of (x, label = x > 0); d.csv has a nan at row 300 and an inf at row 400
python3 - "$WORK" <<'PY'
import random, sys
random.seed(1)
for name, bad in (("c.csv", {}), ("d.csv", {300: "nan", 400: "inf"})):
    with open(f"{sys.argv[1]}/{name}", "w") as f:
        f.write("x,label\n")
        for i in range(500):
            x = random.uniform(-1, 1)
            f.write(f"{bad.get(i, '%.4f' % x)},{int(x > 0)}\n")
PY
cfg() { # cfg FILE CSV EXTRA_DATASET_KEYS EXTRA_TOP
    cat > "$WORK/$1" <<CFG
version = 1;
data: {
  train: {
    source: { type = "csv"; files = ["$2"]; columns: { x = { dtype = "float32"; }; label = { dtype = "int64"; }; }; };
    $3
    transforms = ( { op = "batch"; size = 50; } );
  };
};
model: {
  input = "x"; label = "label"; loss = "sparse_softmax_cross_entropy";
  layers = ( { type = "flatten"; }, { type = "dense"; units = 8; activation = "relu"; }, { type = "dense"; units = 2; } );
};
optimizer: { type = "sgd"; learning_rate = 0.1; };
strategy: { type = "one_device"; };
run: { model_dir = "run_$1"; epochs = 2; seed = 1; };
$4
CFG
}

cfg nan.cfg d.csv "" ""
# row 300 of the data is line 302 of the file (header, 1-based)
expect_fail 1 "a nan in a csv is an error naming the file and row" "d.csv:302:1: column 1 (feature \"x\"): non-finite value \"nan\"" \
    timeout 60 "$LOOM" train "$WORK/nan.cfg"
out=$(cd "$WORK" && timeout 60 "$LOOM" train nan.cfg 2>&1)
contains "the error says how to skip such records" 'on_nonfinite = "skip"' "$out"
[ ! -e "$WORK/run_nan.cfg/checkpoint" ] && pass "no checkpoint from the failed run" || fail "no checkpoint from the failed run"

cfg skip.cfg d.csv 'on_nonfinite = "skip";' ""
out=$(cd "$WORK" && timeout 60 "$LOOM" train skip.cfg 2>&1); rc=$?
[ $rc -eq 0 ] && pass "on_nonfinite = skip trains" || fail "on_nonfinite = skip trains" "exit $rc" "$(echo "$out" | tail -3)"
contains "skip mode reports the count per pass" "csv source: 2 records with a NaN or infinite value skipped (on_nonfinite = skip)" "$out"
n=$(grep -c "records with a NaN or infinite value skipped" <<<"$out")
[ "$n" -eq 2 ] && pass "one report per epoch (2 epochs)" || fail "one report per epoch (2 epochs)" "got $n"

cfg bad_enum.cfg d.csv 'on_nonfinite = "drop";' ""
expect_fail 2 "on_nonfinite takes error or skip" 'on_nonfinite: unknown value "drop"' timeout 60 "$LOOM" check "$WORK/bad_enum.cfg"

# a Lua step that applies an update with an infinite (float) learning rate at step 4: the loss is finite
cat > "$WORK/nanstep.lua" <<'LUA'
local function train_step(ctx, batch, args)
  ctx:forward(batch)
  local loss = ctx:loss()
  ctx:backward()
  ctx:all_reduce_gradients()
  if ctx.step == 3 then ctx:set_learning_rate(1e300) end -- finite as a double, inf as the float update
  ctx:apply_gradients()
  return ctx:reduce("SUM", loss)
end
return { train_step = train_step }
LUA
cfg upd.cfg c.csv "" 'hooks: { train_step = { fn = "nanstep.lua:train_step"; }; };'
expect_fail 1 "a non-finite update stops training, naming the step and the variable" \
    "a weight is not finite after step 4 (epoch 1): dense_1/kernel[" timeout 60 "$LOOM" train "$WORK/upd.cfg"

finish
