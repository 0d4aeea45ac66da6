#!/usr/bin/env bash
# devices.sh - `loom devices` and GPU configs through the loom binary: the
# cpu devices are always listed; where the toolkit was found the cuda and
# nccl plugins load (with or without a GPU) and say what is missing; the
# binary itself links no CUDA or NCCL; a config naming gpu:N without a
# usable backend exits 2 saying what is missing (plugin, driver or device).
source "$(dirname "$0")/lib.sh"
SHIPPED="$(cd "$(dirname "$LOOM")" && pwd)/plugins"
CFG=configs/fashion_mnist_mirrored.cfg

out=$("$LOOM" devices 2>&1); status=$?
if [ "$status" -eq 0 ]; then pass "loom devices exits 0"; else fail "loom devices exits 0" "status $status" "$out"; fi
contains "it lists the cpu devices" "cpu:0 to cpu:$(($(nproc) - 1))  usable" "$out"
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
        expect_fail 2 "gpu devices are refused by the CPU-only replicas, by name" 'device "gpu:0"' \
            "$LOOM" check "$CFG" --set 'strategy.devices=["gpu:0"]'
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
        contains "loom plugins lists the nccl op" 'provides cross-device ops "nccl"' "$plugins"
    else
        pass "the nccl plugin # SKIP not built (no libnccl or nccl.h)"
    fi
else
    pass "the cuda plugin # SKIP not built (no CUDA toolkit)"
fi

# A loom without its plugins directory: nothing GPU is loaded, and both
# `loom devices` and a gpu config say so.
mkdir -p "$WORK/bin" && cp "$LOOM" "$WORK/bin/loom"
out=$(LOOM_PLUGIN_PATH= "$WORK/bin/loom" devices 2>&1)
contains "without the plugin, loom devices says it is not loaded" "cuda   not loaded: no cuda.so" "$out"
expect_fail 2 "and a gpu config names the missing plugin" \
    'device "gpu:1" is not usable: no GPU backend: the cuda plugin is not loaded' \
    env LOOM_PLUGIN_PATH= "$WORK/bin/loom" check "$CFG" --set 'strategy.devices=["gpu:1"]'
mkdir -p "$WORK/bad" && echo "not a plugin" > "$WORK/bad/cuda.so"
out=$(LOOM_PLUGIN_PATH="$WORK/bad" "$WORK/bin/loom" devices 2>&1)
contains "a broken cuda.so is shown as refused, with the reason" "cuda   refused: $WORK/bad/cuda.so: " "$out"

finish
