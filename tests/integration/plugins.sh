#!/usr/bin/env bash
# plugins.sh - plugins through the loom binary: docs/plugins.md's example plugin,
# extracted and compiled against plugins/loom_plugin.h alone, loads and
# trains; each kind of bad plugin is refused with its exact message and does
# not stop the others; plugins.require and plugins.path; local_sgd learns,
# is deterministic and resumes exactly.
source "$(dirname "$0")/lib.sh"
BUILD="${LOOM_BUILD_ROOT:-$(dirname "$LOOM")}"
FIX="$BUILD/tests/plugins"
SHIPPED="$(cd "$(dirname "$LOOM")" && pwd)/plugins"
CC="${CC:-cc}"

# --- docs/plugins.md's example, exactly ---------------------------------------
P="$WORK/p"; mkdir -p "$P"
awk '/^<!-- plugin-example: my_op.c/ { grab = 1; next }
     grab && /^```c$/ { inside = 1; next }
     inside && /^```$/ { exit }
     inside { print }' docs/plugins.md > "$P/my_op.c"
if grep -q 'loom_plugin_entry' "$P/my_op.c"; then pass "docs/plugins.md's example is extracted"; else fail "docs/plugins.md's example is extracted" "$(head -3 "$P/my_op.c")"; fi
check "docs/plugins.md's example compiles against plugins/loom_plugin.h only" \
    "$CC" -std=c11 -Wall -Wextra -Werror -shared -fPIC -O2 -I plugins/ "$P/my_op.c" -o "$P/my_op.so"
out=$(LOOM_PLUGIN_PATH="$P" "$LOOM" plugins 2>&1)
contains "loom plugins lists it" "my_op 1.0  $P/my_op.so" "$out"
contains "with what it provides" 'provides cross-device ops "my_sum"' "$out"
contains "and the shipped plugins" 'provides strategy "local_sgd"' "$out"
contains "and the built-in providers" 'strategy "one_device"' "$out"
check "training uses the example's op" env LOOM_PLUGIN_PATH="$P" "$LOOM" train configs/fashion_mnist_mirrored.cfg \
    --model-dir "$WORK/my_sum" --set strategy.cross_device_ops=my_sum --set run.max_steps=3 --set run.eval_steps=1 \
    --set run.progress='"none"'
expect_fail 2 "without the plugin the op is unknown, and the known ones are listed" \
    'unknown cross-device op "my_sum" (available: reduce_to_one_device' \
    "$LOOM" check configs/fashion_mnist_mirrored.cfg --set strategy.cross_device_ops=my_sum

# --- bad plugins, each refused with its exact message ---------------------------
B="$WORK/bad"; mkdir -p "$B"
echo "not a plugin" > "$B/x.so"
for f in abi_mismatch no_entry init_fails dup_provider; do cp "$FIX/$f.so" "$B/"; done
mkdir -p "$B/copy" && cp "$SHIPPED/halving_doubling.so" "$B/copy/"
cp "$P/my_op.so" "$B/zz_good.so"
out=$(LOOM_PLUGIN_PATH="$B:$B/copy" "$LOOM" plugins 2>/dev/null); status=$?
if [ $status -eq 0 ]; then pass "refusals do not fail loom plugins"; else fail "refusals do not fail loom plugins" "exit $status"; fi
contains "not an ELF file" "  $B/x.so: not a shared object (no ELF header)" "$out"
contains "another ABI, both versions named" "  $B/abi_mismatch.so: built for plugin ABI 100, this loom speaks 2" "$out"
contains "no entry point" "  $B/no_entry.so: no loom_plugin_entry function: not a Loom plugin" "$out"
contains "a failing init, with its own message" "  $B/init_fails.so: init failed: libfoo.so.3 not found" "$out"
contains "... and its hint" "    hint: install libfoo3" "$out"
contains "a provider name already taken, saying by whom" \
    "  $B/dup_provider.so: cross-device ops \"halving_doubling\" is already registered by $SHIPPED/halving_doubling.so" "$out"
contains "a plugin name already taken" \
    "  $B/copy/halving_doubling.so: plugin name \"halving_doubling\" is already taken by $SHIPPED/halving_doubling.so" "$out"
contains "six refused" "refused: 6" "$out"
contains "the good plugin among them still loads" "my_op 1.0  $B/zz_good.so" "$out"
err=$(LOOM_PLUGIN_PATH="$B" "$LOOM" check configs/fashion_mnist_mlp.cfg 2>&1 >/dev/null)
contains "a refusal is a warning on every command" "loom: warning: plugin refused: $B/x.so: not a shared object (no ELF header)" "$err"

# --- plugins.require and plugins.path -------------------------------------------
expect_fail 2 "a required plugin that is absent" 'plugins.require: plugin "my_op" is not loaded (searched: ' \
    "$LOOM" train configs/fashion_mnist_mlp.cfg --model-dir "$WORK/r1" --set 'plugins.require=["my_op"]'
expect_fail 2 "a required plugin that was refused says why" \
    "plugins.require: plugin \"init_fails\" was refused: $B/init_fails.so: init failed: libfoo.so.3 not found" \
    env LOOM_PLUGIN_PATH="$B" "$LOOM" train configs/fashion_mnist_mlp.cfg --model-dir "$WORK/r2" \
    --set 'plugins.require=["init_fails"]'
if [ ! -e "$WORK/r1" ] && [ ! -e "$WORK/r2" ]; then pass "nothing written"; else fail "nothing written"; fi
D="$WORK/cfgdir"; mkdir -p "$D/my_plugins" && cp "$P/my_op.so" "$D/my_plugins/"
sed -e 's|^strategy: { type = "one_device"; };|strategy: { type = "mirrored"; replicas = 2; cross_device_ops = "my_sum"; };\nplugins: { path = ["my_plugins"]; require = ["my_op"]; };|' \
    configs/fashion_mnist_mlp.cfg > "$D/with_path.cfg"
out=$("$LOOM" check "$D/with_path.cfg" 2>&1)
contains "plugins.path is relative to the config's directory" "with_path.cfg: ok" "$out"
out=$("$LOOM" plugins --config "$D/with_path.cfg" 2>&1)
contains "loom plugins --config searches plugins.path" "my_op 1.0  $D/my_plugins/my_op.so" "$out"
expect_fail 2 "a plugins.path directory that does not exist" \
    "--set plugins.path: plugins.path.[0]: \"nowhere\" (resolved to $ROOT/configs/nowhere) is not a directory" \
    "$LOOM" check configs/fashion_mnist_mlp.cfg --set 'plugins.path=["nowhere"]'

# --- plugin strategies in the config ------------------------------------------------
LS=configs/fashion_mnist_local_sgd.cfg
expect_fail 2 "an unknown strategy suggests the nearest, plugins included" 'did you mean "local_sgd"?' \
    "$LOOM" check $LS --set strategy.type=local_sdg
line=$(grep -n 'average_every = 7' $LS | cut -d: -f1)
sed 's/average_every = 7/average_evry = 7/' $LS > "$WORK/typo.cfg"
expect_fail 2 "an unknown strategy option names its line and the valid ones" \
    "typo.cfg:$line: strategy.options.average_evry: unknown option of strategy \"local_sgd\" (valid: average_every)" \
    "$LOOM" check "$WORK/typo.cfg"
out=$("$LOOM" check $LS --set strategy.cross_device_ops=auto 2>&1)
contains "cross_device_ops = auto lets local_sgd choose" "averaged every 7 steps with reduce_to_one_device" "$out"
expect_fail 2 "a bad option value" "strategy.options.average_every: expected an integer in [1, 1000000000], got 0" \
    "$LOOM" check $LS --set strategy.options.average_every=0
# a plugin's strategy describes the roles it uses as a built-in does (ops version 5)
out=$("$LOOM" check $LS --task worker:0 --set 'cluster.worker=["127.0.0.1:24001", "127.0.0.1:24002"]' 2>&1); st=$?
[ $st -eq 0 ] && contains "local_sgd declares itself one process: a cluster is ignored with a warning" \
    "strategy \"local_sgd\" runs in one process: the cluster's 2 tasks (from --set cluster.worker) and --task worker:0 are ignored" \
    "$out" || fail "local_sgd declares itself one process: a cluster is ignored with a warning" "status $st" "$(tail -3 <<<"$out")"
expect_fail 2 "launch asks local_sgd's description too" "launch starts a cluster, but strategy \"local_sgd\" runs in one process" \
    "$LOOM" launch --local $LS --workers 2

# --- local_sgd learns, is deterministic and resumes exactly ---------------------------
check "local_sgd trains 150 steps" "$LOOM" train $LS --model-dir "$WORK/ls" --set run.max_steps=150 \
    --set run.eval_steps=4 --set run.progress='"none"'
acc=$(tail -1 "$WORK/ls/metrics.jsonl" | sed -n 's/.*"eval_accuracy": \([0-9.]*\).*/\1/p')
if awk -v a="$acc" 'BEGIN { exit !(a > 0.75) }'; then pass "local_sgd learns (eval accuracy $acc > 0.75 on 2000 test images)"; else fail "local_sgd learns" "eval accuracy '$acc'"; fi
weights() { "$LOOM" inspect "$1" | grep '^tensor'; }
run() { "$LOOM" train $LS --model-dir "$1" --set run.progress='"none"' --set run.eval_steps=1 "${@:2}" 2>/dev/null; }
run "$WORK/d1" --set run.max_steps=28 && run "$WORK/d2" --set run.max_steps=28
if [ -n "$(weights "$WORK/d1/ckpt-28.loom")" ] && [ "$(weights "$WORK/d1/ckpt-28.loom")" = "$(weights "$WORK/d2/ckpt-28.loom")" ]; then
    pass "two local_sgd runs are bit-identical"; else fail "two local_sgd runs are bit-identical"; fi
run "$WORK/d3" --set run.max_steps=14 && run "$WORK/d3" --set run.max_steps=28
if [ "$(weights "$WORK/d1/ckpt-28.loom")" = "$(weights "$WORK/d3/ckpt-28.loom")" ]; then
    pass "local_sgd resumed after an averaging equals an uninterrupted run"; else fail "local_sgd resumed after an averaging equals an uninterrupted run"; fi

# --- the shipped plugin layer and its vtable version -------------------------------------
out=$("$LOOM" plugins 2>&1)
contains "the shipped plugin layer is listed" 'provides layer "prelu"' "$out"
contains "layer is a provider kind" ', device backend, layer' "$out"
L="$WORK/layers"; mkdir -p "$L"; cp "$FIX/layer_prelu_v99.so" "$FIX/layer_prelu_broken.so" "$L/"
out=$(LOOM_PLUGIN_PATH="$L" "$LOOM" plugins 2>&1)
contains "a layer vtable of another version is refused, both versions named" \
    "  $L/layer_prelu_v99.so: init failed: layer \"prelu_v99\": version 99, this loom speaks 1" "$out"
contains "... without stopping the other layer plugins" 'provides layer "prelu_broken"' "$out"
# --- startup stays fast with plugins ------------------------------------------------------
TIMEFORMAT=%R
t=$( { time LOOM_PLUGIN_PATH="$P" "$LOOM" plugins >/dev/null; } 2>&1 )
if awk -v t="$t" 'BEGIN { exit !(t < 0.5) }'; then pass "loading 3 plugins takes ${t}s"; else fail "loading 3 plugins is fast" "${t}s"; fi
finish
