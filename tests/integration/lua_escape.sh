#!/usr/bin/env bash
# lua_escape.sh - the Lua escape corpus: each tests/lua/escape/NAME.lua is a
# map function trying one way out of the sandbox (a shell, C code, bytecode,
# the debug library, writes outside the model directory, stdin, memory,
# instruction and string bombs, finalizers and coroutines that would outlive
# the limits...). `loom train` on it must exit 1 (2 when it fails in the first
# call, at open) within BOUND seconds saying
# the file's `-- expect:` text, and leave nothing in the directory outside the
# model directory. A case with a `-- todo: REASON` line is reported as a TAP
# TODO (a known hole fixed elsewhere) until it passes.
# loom runs with a stdin that never delivers data, so a read from it would hang.
source "$(dirname "$0")/lib.sh"
BOUND=20
RUN="$WORK/run"; OUT="$WORK/out"; mkdir -p "$RUN" "$OUT"
printf '\033LuaT\000\031\223\r\n\032\n\004\010\010xV\000\000garbage' > "$RUN/bc.lua"   # altered bytecode, for require
mkfifo "$WORK/stdin"
exec 3<>"$WORK/stdin"   # a writer that never writes: reads block instead of seeing EOF

# todo_or_fail NAME TODO DETAIL...: a failure, or a TAP TODO when the case has one
todo_or_fail() {
    local name=$1 todo=$2; shift 2
    if [ -n "$todo" ]; then T=$((T + 1)); echo "not ok $T - $name # TODO $todo"; for l in "$@"; do echo "#   $l"; done
    else fail "$name" "$@"; fi
}

for case in "$ROOT"/tests/lua/escape/*.lua; do
    name=$(basename "$case" .lua)
    lua="$RUN/$name.lua"; cp "$case" "$lua"   # run from $RUN, beside bc.lua: require searches the file's directory
    expect=$(sed -n 's/^-- expect: //p' "$case")
    todo=$(sed -n 's/^-- todo: //p' "$case")
    model="$WORK/m_$name"
    rm -rf "$model" "${OUT:?}"/*; mkdir -p "$model"
    [ "$name" = dangling_symlink ] && ln -s "$OUT/target" "$model/link"
    cat > "$RUN/$name.cfg" <<CFG
version = 1;
data: { train: {
  source: { type = "synthetic"; count = 64;
            features: { image = { dtype = "float32"; shape = [4]; }; label = { dtype = "int64"; max = 10; }; }; };
  transforms = ( { op = "map"; lua = "$lua:escape"; }, { op = "batch"; size = 8; } );
}; };
model: { layers = ( { type = "flatten"; }, { type = "dense"; units = 10; } ); };
optimizer: { type = "sgd"; learning_rate = 0.1; };
run: { model_dir = "$model"; epochs = 1; progress = "none"; };
hooks: { memory_limit = 16777216; instruction_limit = 10000000; };
CFG
    start=$(date +%s)
    out=$(cd "$RUN" && LOOM_ESCAPE_MODEL="$model" LOOM_ESCAPE_OUT="$OUT" timeout -k 5 "$BOUND" "$LOOM" train "$name.cfg" 2>&1 <"$WORK/stdin"); status=$?
    secs=$(( $(date +%s) - start ))
    left=$(ls -A "$OUT")
    if [ $status -eq 124 ] || [ $status -eq 137 ]; then
        todo_or_fail "$name: loom exits within ${BOUND}s" "$todo" "still running after ${BOUND}s" "$(tail -3 <<<"$out")"
    elif [ $status -ne 1 ] && [ $status -ne 2 ]; then   # 2: the error came in the first call, at open
        todo_or_fail "$name: exit 1 or 2" "$todo" "status $status" "$(tail -5 <<<"$out")"
    elif ! grep -qF -- "$expect" <<<"$out"; then
        todo_or_fail "$name: says \"$expect\"" "$todo" "$(tail -5 <<<"$out")"
    elif ! grep -qF -- "$lua:" <<<"$out"; then
        todo_or_fail "$name: names the Lua file and line" "$todo" "$(tail -5 <<<"$out")"
    elif [ -n "$left" ]; then
        todo_or_fail "$name: nothing written outside the model directory" "$todo" "found: $left"
    else
        pass "$name: refused in ${secs}s with \"$expect\""
    fi
done
exec 3>&-
finish
