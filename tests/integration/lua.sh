#!/usr/bin/env bash
# lua.sh - Lua map and filter functions end to end: configs/fashion_mnist_lua.cfg
# gives the same weights with parallel = 1 and 2; and each kind of bad Lua gets
# a clear error naming the Lua file and line (and the element), no crash: a
# syntax error and a missing function (found by `loom check`, exit 2), and (exit 1) a
# runtime error on the 10,000th element (a checkpoint is saved; once the
# function is fixed the resumed run ends with the weights of one that never
# failed), an endless loop (instruction limit), an allocation without bound
# (memory limit), a sandbox escape; predict refuses a Lua map on a bare file.
source "$(dirname "$0")/lib.sh"
D="$WORK/cfg"; mkdir -p "$D"

# mk NAME LUA_REF: a small MLP config whose train pipeline enumerates, then maps with LUA_REF
mk() {
    cat > "$D/$1.cfg" <<CFG
version = 1;
data: { train: {
  source: { type = "catalog"; name = "fashion_mnist"; split = "train"; };
  transforms = (
    { op = "enumerate"; },
    { op = "map"; lua = "$2"; },
    { op = "batch"; size = 100; }
  );
}; };
model: { layers = ( { type = "flatten"; }, { type = "dense"; units = 10; } ); };
optimizer: { type = "sgd"; learning_rate = 0.1; };
run: { model_dir = "$WORK/m_$1"; epochs = 1; progress = "none"; };
CFG
}

# --- the shipped config: Lua randomness does not depend on the thread count --------------
for p in 1 2; do
    check "fashion_mnist_lua: 30 steps with parallel = $p" "$LOOM" train configs/fashion_mnist_lua.cfg --model-dir "$WORK/par$p" \
        --set run.max_steps=30 --set run.eval_steps=1 --set run.progress='"none"' --set "data.train.transforms.[3].parallel=$p"
done
a=$("$LOOM" inspect "$WORK/par1/ckpt-30.loom" 2>&1 | grep '^tensor'); b=$("$LOOM" inspect "$WORK/par2/ckpt-30.loom" 2>&1 | grep '^tensor')
if [ -n "$a" ] && [ "$a" = "$b" ]; then pass "parallel 1 and 2 give bit-identical weights"; else fail "parallel 1 and 2 give bit-identical weights" "$a" "$b"; fi

# --- bad Lua ---------------------------------------------------------------------------
mk syntax "$ROOT/tests/lua/syntax.lua:broken"
out=$("$LOOM" check "$D/syntax.cfg" 2>&1); status=$?
if [ $status -eq 2 ]; then pass "syntax error: loom check fails (exit 2)"; else fail "syntax error: loom check fails (exit 2)" "status $status" "$out"; fi
contains "syntax error: the Lua file:line" "tests/lua/syntax.lua:3: " "$out"
contains "syntax error: what is wrong" "syntax error: unexpected symbol near 'end'" "$out"

mk missing "$ROOT/lua/augment.lua:no_such"
out=$("$LOOM" check "$D/missing.cfg" 2>&1); status=$?
if [ $status -eq 2 ]; then pass "missing function: loom check fails (exit 2)"; else fail "missing function: loom check fails (exit 2)" "status $status" "$out"; fi
contains "missing function: named, with what the file defines" 'no function "no_such" in' "$out"
contains "missing function: the defined ones listed" "augment" "$out"
contains "missing function: the config line" "missing.cfg:6" "$out"

mk nofile "$ROOT/tests/lua/absent.lua:f"
expect_fail 2 "missing Lua file: a config error at its line" "nofile.cfg:6" "$LOOM" check "$D/nofile.cfg"

mk late "$ROOT/tests/lua/bad.lua:fail_at_10000"
out=$("$LOOM" train "$D/late.cfg" 2>&1); status=$?
if [ $status -eq 1 ]; then pass "runtime error on element 10,000: exit 1"; else fail "runtime error on element 10,000: exit 1" "status $status" "$out"; fi
contains "runtime error: Lua file:line" "tests/lua/bad.lua:6: " "$out"
contains "runtime error: the message" "cannot augment element 9999" "$out"
contains "runtime error: the element" "element 9999 of epoch 0" "$out"
contains "runtime error: a traceback" "stack traceback:" "$out"
if [ -f "$WORK/m_late/ckpt-99.loom" ]; then pass "runtime error: a checkpoint of the 99 steps done was saved"; else fail "runtime error: a checkpoint of the 99 steps done was saved" "$(ls "$WORK/m_late" 2>&1)"; fi
out=$("$LOOM" train "$D/late.cfg" 2>&1); status=$?
if [ $status -eq 1 ] && grep -q "element 9999 of epoch 0" <<<"$out" && [ ! -f "$WORK/m_late/ckpt-100.loom" ]; then
    pass "runtime error: resuming from it reaches the same element"
else
    fail "runtime error: resuming from it reaches the same element" "status $status" "$out"
fi

# lua_fails NAME SUBSTRING... : `loom train` of $D/NAME.cfg (extra args in ARGS) exits 1 and says each SUBSTRING
lua_fails() {
    local name=$1 out status; shift
    out=$("$LOOM" train "$D/$name.cfg" "${ARGS[@]}" 2>&1); status=$?
    if [ $status -eq 1 ]; then pass "$name: exit 1"; else fail "$name: exit 1" "status $status" "$out"; fi
    for sub in "$@"; do contains "$name: says $sub" "$sub" "$out"; done
}
# fixed, the function goes on from that checkpoint to the weights of a run that never failed
cp tests/lua/bad.lua "$WORK/fixable.lua"
mk fixable "$WORK/fixable.lua:fail_at_10000"
sed -i 's/{ op = "batch"/{ op = "take"; count = 12000; },\n    { op = "batch"/' "$D/fixable.cfg"
"$LOOM" train "$D/fixable.cfg" >/dev/null 2>&1
sed -i 's/== 9999 then/== -1 then/' "$WORK/fixable.lua"
check "fixed function: the run resumes from the checkpoint it saved" "$LOOM" train "$D/fixable.cfg"
sed 's#m_fixable#m_unbroken#' "$D/fixable.cfg" > "$D/unbroken.cfg"
check "fixed function: an unbroken run" "$LOOM" train "$D/unbroken.cfg"
a=$("$LOOM" inspect "$WORK/m_fixable/ckpt-120.loom" 2>&1 | grep '^tensor'); b=$("$LOOM" inspect "$WORK/m_unbroken/ckpt-120.loom" 2>&1 | grep '^tensor')
if [ -n "$a" ] && [ "$a" = "$b" ]; then pass "fixed function: resumed weights equal the unbroken run's"; else fail "fixed function: resumed weights equal the unbroken run's" "$a" "$b"; fi

FM=${LOOM_DATASETS_DIR:-/usr/share/datasets}/fashion-mnist
expect_fail 2 "predict --input FILE.idx refuses a Lua map (it maps whole elements)" "the preprocessing has a Lua map" \
    "$LOOM" predict "$D/late.cfg" --input "$FM/t10k-images-idx3-ubyte.gz" --output "$WORK/pred.txt"

mk spin "$ROOT/tests/lua/bad.lua:spin"
ARGS=(--set hooks.instruction_limit=1000000)
lua_fails spin "tests/lua/bad.lua:12: " "instruction limit of 1000000 reached (hooks.instruction_limit)" "element 5 of epoch 0"

mk hog "$ROOT/tests/lua/bad.lua:hog"
ARGS=(--set hooks.memory_limit=16777216)
lua_fails hog "tests/lua/bad.lua:18: " "memory limit of 16 MiB reached (hooks.memory_limit)"

rm -f /tmp/loom_lua_escape
mk shell "$ROOT/tests/lua/bad.lua:shell"
expect_fail 1 "sandbox: os.execute refused" "os.execute is not available in the sandbox (set hooks.unsafe = true" \
    "$LOOM" train "$D/shell.cfg"
if [ ! -e /tmp/loom_lua_escape ]; then pass "sandbox: nothing ran"; else fail "sandbox: nothing ran"; rm -f /tmp/loom_lua_escape; fi
finish
