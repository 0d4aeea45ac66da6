#!/usr/bin/env bash
# devices.sh - `loom devices` and GPU configs through the loom binary: the
# cpu devices are always listed; where the toolkit was found the cuda and
# nccl plugins load (with or without a GPU) and say what is missing; the
# binary itself links no CUDA or NCCL; a config naming gpu:N without a
# usable backend exits 2 saying what is missing (plugin, driver or device).
# Cross-device ops say which memory they work on, and one for GPU memory
# only (nccl, or the gpu_mem_op fixture) is refused for CPU replicas when
# the strategy opens, at the setting's file:line; "auto" never picks it.
source "$(dirname "$0")/lib.sh"
SHIPPED="$(cd "$(dirname "$LOOM")" && pwd)/plugins"
FIX="${LOOM_BUILD_ROOT:-$(dirname "$LOOM")}/tests/plugins"
CFG=configs/fashion_mnist_mirrored.cfg

out=$("$LOOM" devices 2>&1); status=$?
if [ "$status" -eq 0 ]; then pass "loom devices exits 0"; else fail "loom devices exits 0" "status $status" "$out"; fi
contains "it lists the cpu devices" "cpu:0 to cpu:$(($(nproc) - 1))  usable" "$out"
contains "and the memory each cross-device op works on" \
    "  ring                   host memory: any replicas           built-in" "$out"
contains "plugins' ops included" "  halving_doubling       host memory: any replicas           $SHIPPED/halving_doubling.so" "$out"
libs=$(ldd "$LOOM")
if grep -qE 'libcudart|libcublas|libnccl|libcuda\.' <<<"$libs"; then
    fail "the loom binary links no CUDA or NCCL library" "$(grep -E 'cuda|nccl|cublas' <<<"$libs")"
else
    pass "the loom binary links no CUDA or NCCL library"
fi

if [ -f "$SHIPPED/cuda.so" ]; then
    contains "the cuda plugin is loaded" "cuda   loaded: $SHIPPED/cuda.so (CUDA runtime" "$out"
    if grep -q "gpu:0  " <<<"$out"; then
        pass "a GPU is listed"
        out=$("$LOOM" check "$CFG" --set 'strategy.devices=["gpu:0"]' --set strategy.cross_device_ops=ring 2>&1)
        contains "a config naming gpu:0 runs its replica on cuda" 'compute: the "cuda" device backend' "$out"
    else
        contains "without a GPU it says which part is missing" "gpu: none usable: no CUDA" "$out"
        expect_fail 2 "a config naming gpu:0 says the driver or device is missing" \
            'device "gpu:0" is not usable: the cuda plugin ('"$SHIPPED/cuda.so"') is loaded but no CUDA' \
            "$LOOM" check "$CFG" --set 'strategy.devices=["gpu:0"]'
        expect_fail 2 "so does gpu:*" 'device "gpu:*" is not usable' \
            "$LOOM" train "$CFG" --model-dir "$WORK/gpu" --set 'strategy.devices=["gpu:*"]'
    fi
    plugins=$("$LOOM" plugins 2>&1)
    contains "loom plugins lists the device backend" 'provides device backend "cuda"' "$plugins"
    if [ -f "$SHIPPED/nccl.so" ]; then
        contains "the nccl plugin is loaded, with the NCCL version" "nccl   loaded: $SHIPPED/nccl.so (NCCL 2." "$out"
        contains "loom plugins lists the nccl op, for GPU memory" 'provides cross-device ops "nccl" (GPU memory only)' "$plugins"
        contains "loom devices says nccl works on GPU memory only" \
            "  nccl                   device memory: device replicas      $SHIPPED/nccl.so" "$out"
        sed 's/cross_device_ops = "auto";.*/cross_device_ops = "nccl";/' $CFG >"$WORK/nccl_cpu.cfg"
        line=$(grep -n 'cross_device_ops = "nccl"' "$WORK/nccl_cpu.cfg" | cut -d: -f1)
        expect_fail 2 "nccl with CPU replicas: refused by loom check, at its file:line, saying why" \
            "nccl_cpu.cfg:$line: strategy.cross_device_ops: \"nccl\" reduces GPU memory only, but the mirrored replicas are on the CPU (cpu:0, cpu:1)" \
            "$LOOM" check "$WORK/nccl_cpu.cfg"
        expect_fail 2 "... listing the ops that work on host memory, plugins' included" \
            'hint: for CPU replicas use an op that works on host memory: reduce_to_one_device, hierarchical_copy, ring, halving_doubling, or "auto"' \
            "$LOOM" check "$WORK/nccl_cpu.cfg"
        expect_fail 2 "... and by loom train before any step" 'reduces GPU memory only' \
            "$LOOM" train "$WORK/nccl_cpu.cfg" --model-dir "$WORK/nccl_cpu"
        if [ ! -e "$WORK/nccl_cpu/ckpt-1.loom" ] && ! ls "$WORK/nccl_cpu"/events* >/dev/null 2>&1; then
            pass "no step ran"; else fail "no step ran" "$(ls "$WORK/nccl_cpu")"; fi
        expect_fail 2 "nccl with gpu devices is not refused for its memory: the missing GPU is the error" \
            'device "gpu:0" is not usable' \
            "$LOOM" check $CFG --set 'strategy.devices=["gpu:0"]' --set strategy.cross_device_ops=nccl
        out=$("$LOOM" check $CFG --set strategy.cross_device_ops=auto 2>&1)
        contains "with nccl loaded, auto picks an op for host memory for CPU replicas" 'cross_device_ops = "auto": ring (' "$out"
    else
        pass "the nccl plugin # SKIP not built (no libnccl or nccl.h)"
    fi
else
    pass "the cuda plugin # SKIP not built (no CUDA toolkit)"
fi

# The same without CUDA: a fixture plugin whose op works on GPU memory only.
mkdir -p "$WORK/gm" && cp "$FIX/gpu_mem_op.so" "$WORK/gm/"
out=$(LOOM_PLUGIN_PATH="$WORK/gm" "$LOOM" plugins 2>&1)
contains "loom plugins says an op works on GPU memory only" 'provides cross-device ops "gpu_mem_op" (GPU memory only)' "$out"
expect_fail 2 "an op for GPU memory only is refused for CPU replicas (replicas = 3)" \
    '--set strategy.cross_device_ops: "gpu_mem_op" reduces GPU memory only, but the mirrored replicas are on the CPU (cpu:0 to cpu:2)' \
    env LOOM_PLUGIN_PATH="$WORK/gm" "$LOOM" check tests/configs/strategy_mlp.cfg --set strategy.type=mirrored \
    --set strategy.replicas=3 --set strategy.cross_device_ops=gpu_mem_op
expect_fail 2 "... by a plugin's strategy too (local_sgd)" '"gpu_mem_op" reduces GPU memory only, but the local_sgd replicas' \
    env LOOM_PLUGIN_PATH="$WORK/gm" "$LOOM" check configs/fashion_mnist_local_sgd.cfg --set strategy.cross_device_ops=gpu_mem_op
out=$(LOOM_PLUGIN_PATH="$WORK/gm" "$LOOM" check $CFG --set strategy.cross_device_ops=auto 2>&1)
contains "auto does not pick it for CPU replicas" 'cross_device_ops = "auto": ring (' "$out"
expect_fail 2 "an unknown op lists the known ones, the shipped plugins' included" \
    'unknown cross-device op "rnig" (available: reduce_to_one_device, hierarchical_copy, ring, halving_doubling, ' \
    env LOOM_PLUGIN_PATH="$WORK/gm" "$LOOM" check $CFG --set strategy.cross_device_ops=rnig
expect_fail 2 "... and those of plugins.path / \$LOOM_PLUGIN_PATH" 'gpu_mem_op, auto)' \
    env LOOM_PLUGIN_PATH="$WORK/gm" "$LOOM" check $CFG --set strategy.cross_device_ops=rnig

# A loom without its plugins directory: nothing GPU is loaded, and both
# `loom devices` and a gpu config say so.
mkdir -p "$WORK/bin" && cp "$LOOM" "$WORK/bin/loom"
out=$(LOOM_PLUGIN_PATH= "$WORK/bin/loom" devices 2>&1)
contains "without the plugin, loom devices says it is not loaded" "cuda   not loaded: no cuda.so" "$out"
contains "... that no GPU is usable, and why" "gpu: none usable: no GPU backend: the cuda plugin is not loaded" "$out"
contains "... and where nccl stands" "nccl   not loaded: no nccl.so" "$out"
expect_fail 2 "and a gpu config names the missing plugin" \
    'device "gpu:1" is not usable: no GPU backend: the cuda plugin is not loaded' \
    env LOOM_PLUGIN_PATH= "$WORK/bin/loom" check "$CFG" --set 'strategy.devices=["gpu:1"]'
mkdir -p "$WORK/bad" && echo "not a plugin" > "$WORK/bad/cuda.so"
out=$(LOOM_PLUGIN_PATH="$WORK/bad" "$WORK/bin/loom" devices 2>&1)
contains "a broken cuda.so is shown as refused, with the reason" "cuda   refused: $WORK/bad/cuda.so: " "$out"

# The kernels come from the CPU's features, printed here; an OPENBLAS_CORETYPE
# in the environment does not change them (it is named as overridden).
out=$(env -u OPENBLAS_CORETYPE "$LOOM" devices 2>&1)
contains "devices names the CPU's features and Loom's kernel level" "Loom's kernels: " "$out"
core=$(sed -n 's/^  BLAS core: \([^ ]*\) .*/\1/p' <<<"$out")
if grep -q "chosen from CPU features" <<<"$out"; then
    out2=$(OPENBLAS_CORETYPE=Sandybridge "$LOOM" devices 2>&1)
    contains "an OPENBLAS_CORETYPE in the environment is overridden" \
        "  BLAS core: $core (chosen from CPU features" "$out2"
    contains "and named as such" "OPENBLAS_CORETYPE=Sandybridge in the environment overridden" "$out2"
else
    contains "without a core for these features OpenBLAS detects it" "detected by OpenBLAS" "$out"
fi
finish
