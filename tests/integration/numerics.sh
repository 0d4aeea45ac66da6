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
run: { model_dir = "$WORK/run_$1"; epochs = 2; seed = 1; };
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

# ---- IDX float features: x (200, 1) float32 with a nan at item 50, labels uint8 ----
python3 - "$WORK" <<'PY'
import struct, sys
xs = [(i % 7) / 7.0 - 0.5 for i in range(200)]
xs[50] = float("nan")
with open(f"{sys.argv[1]}/x.idx", "wb") as f:
    f.write(bytes([0, 0, 0x0D, 2]) + struct.pack(">II", 200, 1) + b"".join(struct.pack(">f", x) for x in xs))
with open(f"{sys.argv[1]}/y.idx", "wb") as f:
    f.write(bytes([0, 0, 0x08, 1]) + struct.pack(">I", 200) + bytes(int(x > 0) for x in [0 if i == 50 else xs[i] for i in range(200)]))
PY
idxcfg() { # idxcfg FILE EXTRA_DATASET_KEYS
    cfg "$1" c.csv "$2" ""
    sed -i 's|source: { type = "csv"; files = \["c.csv"\]; columns: { x = { dtype = "float32"; }; label = { dtype = "int64"; }; }; };|source: { type = "idx"; features: { x = "x.idx"; label = "y.idx"; }; };|' "$WORK/$1"
}
idxcfg idx_nan.cfg ""
expect_fail 2 "a nan in an IDX float file is an error naming the file and item" \
    'x.idx: data.train: item 50 (0-based) of feature "x": non-finite value nan at offset 0' timeout 60 "$LOOM" train "$WORK/idx_nan.cfg"
idxcfg idx_skip.cfg 'on_nonfinite = "skip";'
out=$(cd "$WORK" && timeout 60 "$LOOM" train idx_skip.cfg 2>&1); rc=$?
[ $rc -eq 0 ] && pass "idx on_nonfinite = skip trains" || fail "idx on_nonfinite = skip trains" "exit $rc" "$(echo "$out" | tail -3)"
contains "idx skip mode reports the count" "idx source: 1 item with a NaN or infinite value skipped (on_nonfinite = skip)" "$out"

# ---- a cache after an infinite repeat (item 3) ----
cachecfg() { # cachecfg FILE BUDGET TRANSFORMS
    cfg "$1" c.csv "" ""
    python3 - "$WORK/$1" "$2" "$3" <<'PY'
import sys
p, budget, tr = sys.argv[1:]
s = open(p).read()
s = s.replace('data: {', 'data: {\n  options: { autotune: { ram_budget = %s; }; };' % budget, 1)
s = s.replace('transforms = ( { op = "batch"; size = 50; } );', 'transforms = ( %s, { op = "batch"; size = 50; } );' % tr)
open(p, "w").write(s)
PY
}
cachecfg rc1.cfg '"1GiB"' '{ op = "repeat"; count = -1; }, { op = "filter"; feature = "label"; in = [0, 1]; }, { op = "cache"; }'
expect_fail 2 "cache after repeat(-1) is refused at check, naming its line" 'rc1.cfg:7: data.train: cache: the repeat before it (transforms.[0]) has count = -1' \
    timeout 30 "$LOOM" check "$WORK/rc1.cfg"
out=$(timeout 30 "$LOOM" check "$WORK/rc1.cfg" 2>&1)
contains "and told to put cache before repeat" "put cache before repeat" "$out"
start=$(date +%s)
expect_fail 2 "loom train refuses it before training" "never ends and the cache would grow without bound" \
    timeout 30 "$LOOM" train "$WORK/rc1.cfg"
[ $(( $(date +%s) - start )) -lt 10 ] && pass "refused within seconds" || fail "refused within seconds"

# an endless source (synthetic count = -1) into a memory cache
cachecfg rc2.cfg '"1GiB"' '{ op = "cache"; }'
sed -i 's|source: { type = "csv"; files = \["c.csv"\];|source: { type = "synthetic"; count = -1; features: { x = { dtype = "float32"; shape = []; }; label = { dtype = "int64"; max = 2; }; }; }; old: { files = ["c.csv"];|' "$WORK/rc2.cfg"
sed -i 's|old: { files = \["c.csv"\]; columns: { x = { dtype = "float32"; }; label = { dtype = "int64"; }; }; };||' "$WORK/rc2.cfg"
expect_fail 2 "cache of an endless source is refused at open" "cache: its input is infinite" \
    timeout 30 "$LOOM" check "$WORK/rc2.cfg"

# a pass of unknown length (csv) held to the RAM budget as it fills: 4000
# bytes hold 333 elements of 12 bytes; bounded in time and memory
cachecfg rc3.cfg 4000 '{ op = "cache"; }, { op = "repeat"; count = -1; }'
# (memory bound: ulimit -v, except under AddressSanitizer, which reserves
# terabytes of address space for its shadow at start and cannot run under
# it: there ASan's own cap on the resident size bounds it)
if ldd "$LOOM" 2>/dev/null | grep -q libasan; then
    out=$( (cd "$WORK" && ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}hard_rss_limit_mb=4000" \
        timeout 30 "$LOOM" train rc3.cfg) 2>&1); rc=$?
else
    out=$( (ulimit -v 4000000; cd "$WORK" && timeout 30 "$LOOM" train rc3.cfg) 2>&1); rc=$?
fi
[ $rc -eq 1 ] && pass "a cache over the RAM budget stops training" || fail "a cache over the RAM budget stops training" "exit $rc" "$(echo "$out" | tail -3)"
contains "the error names the cache's line, the bytes and the budget" \
    "rc3.cfg:7: data.train.transforms.[0]: cache: the pass being cached in memory reached 333 elements (3996 bytes); one more would exceed the 4000 bytes left of the RAM budget of 4000 bytes" "$out"
contains "and says what to do" "put it before repeat so the pass is finite" "$out"


# --- a plugin's source (image_ops' npy): float32 rows with a NaN (row 5) and an inf (row 9) -------------
python3 - "$WORK" <<'PY'
import struct, sys
def npy(path, descr, shape, data):
    h = "{'descr': '%s', 'fortran_order': False, 'shape': %s, }" % (descr, shape)
    h += " " * (63 - (10 + len(h)) % 64) + "\n"
    with open(path, "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(h)) + h.encode() + data)
rows = [[(i * 4 + k) / 40.0 - 0.5 for k in range(4)] for i in range(12)]
rows[5][2] = float("nan"); rows[9][0] = float("inf")
npy(f"{sys.argv[1]}/x.npy", "<f4", "(12, 4)", b"".join(struct.pack("<4f", *r) for r in rows))
npy(f"{sys.argv[1]}/y.npy", "<i8", "(12,)", b"".join(struct.pack("<q", i % 2) for i in range(12)))
PY
npycfg() { # npycfg FILE EXTRA_DATASET_KEYS
    cat > "$WORK/$1" <<CFG
version = 1;
data: { train: {
    source: { type = "npy"; options: { x = "$WORK/x.npy"; label = "$WORK/y.npy"; }; };
    $2
    transforms = ( { op = "batch"; size = 2; } );
}; };
model: { input = "x"; label = "label"; loss = "sparse_softmax_cross_entropy";
         layers = ( { type = "flatten"; }, { type = "dense"; units = 2; } ); };
optimizer: { type = "sgd"; learning_rate = 0.1; };
run: { model_dir = "$WORK/run_$1"; epochs = 2; seed = 1; progress = "none"; };
CFG
}
npycfg npy.cfg ""
expect_fail 1 "a NaN from a plugin source is an error naming the source, the element and the feature" \
    'source "npy": element 5 of the pass (0-based, in the source'"'"'s order), feature "x": non-finite value nan at offset 2' \
    timeout 60 "$LOOM" train "$WORK/npy.cfg"
out=$(timeout 60 "$LOOM" train "$WORK/npy.cfg" 2>&1)
contains "... naming the config's line" "npy.cfg:3" "$out"
contains "... and saying how to skip such elements" 'on_nonfinite = "skip"' "$out"
npycfg npyskip.cfg 'on_nonfinite = "skip";'
out=$(timeout 60 "$LOOM" train "$WORK/npyskip.cfg" 2>&1); rc=$?
[ $rc -eq 0 ] && pass "on_nonfinite = skip trains on the plugin source" || fail "on_nonfinite = skip trains on the plugin source" "exit $rc" "$(tail -3 <<<"$out")"
contains "skip mode reports the count per pass" 'source "npy": 2 elements with a NaN or infinite value skipped (on_nonfinite = skip)' "$out"
steps=$(grep -o '"step": [0-9]*' "$WORK/run_npyskip.cfg/metrics.jsonl" | tail -1 | grep -o '[0-9]*$')
[ "$steps" = 10 ] && pass "10 of 12 elements kept: 5 batches of 2 per epoch, 10 steps" || fail "10 steps from the 10 kept elements" "last step '$steps'"

finish
