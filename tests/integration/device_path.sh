#!/usr/bin/env bash
# device_path.sh - training through the device interface (nn's executor,
# model_device.c) with the CPU reference backend (strategy.device_backend =
# "cpu"), as a GPU would run it, against nn's native host code, on
# configs/fashion_mnist_mlp.cfg (with tanh for relu, see ACT) for 100 steps:
# one_device, mirrored(2) and central_storage(2) end within 1e-5 of the
# native weights (ckpt_diff: ||a - b|| / ||a||); a device run stopped at step 45 and resumed ends
# bit-identical to an uninterrupted one (the restore reaches the devices);
# two device runs are bit-identical; a custom Lua step gives the built-in
# step's weights; evaluate and predict work; `loom check` says which
# backend runs the replicas; a bad device_backend, the cpu backend on gpu
# devices and configs/fashion_mnist_gpu.cfg without a GPU are clear errors
# at the setting's file:line.
# Gradients reduced in device memory: with the dev_mem_sum fixture (an op of
# device memory only, as nccl is, summing in replica order: the bits of
# reduce_to_one_device, the default op, and of central_storage's own sum)
# mirrored(2) and central_storage(2) keep their gradients on the devices; the
# op is called once per step on the device buffers (its call log), the
# weights equal the host-reduce device path's bit for bit and are within
# 1e-5 of the native ones, runs repeat bit for bit, a resume at step 45 is
# bit-exact, packs and a custom Lua step work; nccl, which needs CUDA
# memory, fails at the first step on the CPU reference backend, saying why.
source "$(dirname "$0")/lib.sh"
DIFF="${LOOM_CKPT_DIFF:-$(dirname "$LOOM")/tests/ckpt_diff}"
CFG=configs/fashion_mnist_mlp.cfg
# The two paths round differently (the CPU reference writes its softmax
# gradient and column sums in its own order), so their weights are compared
# with a tolerance; that measures rounding only where the model is smooth.
# ReLU is not: when a rounding difference moves a pre-activation across 0, the
# unit's gradient for that example switches on or off, a jump of ~3e-5 of the
# weights in one step that later steps amplify (5% apart by step 100, between
# two correct paths, decided by which build or kernel rounds how). tanh keeps
# the paths ~1e-6 apart after 100 steps in the release, sanitized and
# fused-multiply-add builds alike.
ACT=(--set 'model.layers.[1].activation="tanh"' --set 'model.layers.[2].activation="tanh"')
RUN=("${ACT[@]}" --set run.max_steps=100 --set run.checkpoint_steps=45 --set run.eval_steps=2 --set run.progress='"none"')
DEV=(--set strategy.device_backend=cpu)
MIR=(--set strategy.type=mirrored --set strategy.replicas=2)
CEN=(--set strategy.type=central_storage --set strategy.replicas=2)
# close NAME A B: the weights of A and B within 1e-5 (relative, whole buffer)
close() {
    local d
    if d=$("$DIFF" $CFG "$2" "$3" 2>&1) && awk -v d="$d" -v t="${TOL:-1e-5}" 'BEGIN { exit !(d <= t) }'; then
        pass "$1 (${d} apart)"
    else
        fail "$1" "ckpt_diff: $d"
    fi
}

# the plan says what computes
out=$("$LOOM" check $CFG "${DEV[@]}" 2>&1)
contains "check: one_device on the cpu device backend" 'compute: the "cpu" device backend (the reference' "$out"
out=$("$LOOM" check $CFG "${MIR[@]}" "${DEV[@]}" 2>&1)
contains "check: mirrored replicas on the cpu device backend" 'compute: the "cpu" device backend (the reference' "$out"
contains "check: ... gradients reduced in host memory by the op" \
    'gradients: reduced in host memory by "reduce_to_one_device", after every replica downloads its own' "$out"
out=$("$LOOM" check $CFG "${CEN[@]}" 2>&1)
contains "check: without device_backend, nn's native code" "compute: nn's native host code" "$out"

# 100 steps each way, per strategy
for s in one MIR CEN; do
    case $s in one) set=() ;; MIR) set=("${MIR[@]}") ;; CEN) set=("${CEN[@]}") ;; esac
    check "$s: native run" "$LOOM" train $CFG --model-dir "$WORK/n$s" "${RUN[@]}" "${set[@]}"
    check "$s: device run" "$LOOM" train $CFG --model-dir "$WORK/d$s" "${RUN[@]}" "${set[@]}" "${DEV[@]}"
    close "$s: the device path's weights are the native ones" "$WORK/n$s/ckpt-100.loom" "$WORK/d$s/ckpt-100.loom"
done
check "mirrored: a second device run" "$LOOM" train $CFG --model-dir "$WORK/dMIR2" "${RUN[@]}" "${MIR[@]}" "${DEV[@]}"
same_weights "mirrored: two device runs are bit-identical" "$WORK/dMIR/ckpt-100.loom" "$WORK/dMIR2/ckpt-100.loom"

# stopped at step 45 and resumed: the restored variables reach every device
for s in one MIR CEN; do
    case $s in one) set=() ;; MIR) set=("${MIR[@]}") ;; CEN) set=("${CEN[@]}") ;; esac
    check "$s: device run to step 45" "$LOOM" train $CFG --model-dir "$WORK/r$s" "${RUN[@]}" "${set[@]}" "${DEV[@]}" \
        --set run.max_steps=45
    check "$s: ... resumed to 100" "$LOOM" train $CFG --model-dir "$WORK/r$s" "${RUN[@]}" "${set[@]}" "${DEV[@]}"
    same_weights "$s: resumed at 45 = uninterrupted, on the device path" "$WORK/d$s/ckpt-100.loom" "$WORK/r$s/ckpt-100.loom"
done
# a custom Lua step (lua/clipped_step.lua, tests/configs/small_step.cfg: dropout, no clipping) runs
# the step parts on the devices: the built-in step's weights, bit for bit
for s in one MIR CEN; do
    case $s in one) set=() ;; MIR) set=("${MIR[@]}") ;; CEN) set=("${CEN[@]}") ;; esac
    check "$s: device, built-in step" "$LOOM" train tests/configs/small_mlp.cfg --model-dir "$WORK/hb$s" "${set[@]}" \
        "${DEV[@]}" --set run.progress='"none"'
    check "$s: device, Lua step" "$LOOM" train tests/configs/small_step.cfg --model-dir "$WORK/hs$s" "${set[@]}" \
        "${DEV[@]}" --set run.progress='"none"'
    same_weights "$s: on the device path the Lua step's weights are the built-in step's" "$WORK/hb$s/ckpt-96.loom" \
        "$WORK/hs$s/ckpt-96.loom"
done
# evaluate and predict of one checkpoint, natively and on the device path
nat=$("$LOOM" evaluate $CFG --model-dir "$WORK/dMIR" "${ACT[@]}" "${MIR[@]}" --set run.eval_steps=2 2>/dev/null)
dev=$("$LOOM" evaluate $CFG --model-dir "$WORK/dMIR" "${ACT[@]}" "${MIR[@]}" "${DEV[@]}" --set run.eval_steps=2 2>/dev/null)
contains "evaluate on the device path" '"examples": 1000' "$dev"
acc() { sed 's/.*"eval_accuracy": \([0-9.]*\).*/\1/' <<<"$1"; }
if [ -n "$(acc "$dev")" ] && [ "$(acc "$dev")" = "$(acc "$nat")" ]; then pass "... with the native accuracy ($(acc "$dev"))"
else fail "evaluate: the native accuracy" "native: $nat" "device: $dev"; fi
for s in one MIR; do
    case $s in one) set=() ;; MIR) set=("${MIR[@]}") ;; esac
    check "$s: predict natively" "$LOOM" predict $CFG --model-dir "$WORK/dMIR" "${ACT[@]}" "${set[@]}" \
        --output "$WORK/pn$s.csv"
    check "$s: predict on the device path" "$LOOM" predict $CFG --model-dir "$WORK/dMIR" "${ACT[@]}" "${set[@]}" "${DEV[@]}" \
        --output "$WORK/pd$s.csv"
    if [ "$(wc -l <"$WORK/pd$s.csv")" -gt 1000 ] && [ "$(cut -d, -f2 "$WORK/pd$s.csv")" = "$(cut -d, -f2 "$WORK/pn$s.csv")" ]
    then pass "$s: the same predicted classes"; else fail "$s: the same predicted classes"; fi
done

# bad settings: exit status 2, the setting's file:line, what to do
expect_fail 2 "an unknown backend lists the known ones" \
    '--set strategy.device_backend: unknown device backend "cpux" (available: cpu' \
    "$LOOM" check $CFG --set strategy.device_backend=cpux
expect_fail 2 "... and suggests the closest" 'hint: did you mean "cpu"?' \
    "$LOOM" check $CFG --set strategy.device_backend=cpux
sed 's/^strategy: { type = "one_device"; };/strategy: { type = "mirrored"; replicas = 2;\n  device_backend = "cuda"; };/' \
    $CFG >"$WORK/bad_backend.cfg"
if [ -f "$(dirname "$LOOM")/plugins/cuda.so" ]; then
    expect_fail 2 "a gpu backend for cpu replicas names its file:line" \
        'bad_backend.cfg:46: strategy.device_backend: the "cuda" backend runs gpu devices; the replicas are on cpu devices' \
        "$LOOM" check "$WORK/bad_backend.cfg"
else # (a build without the GPU plugins: the ASan build of CI)
    expect_fail 2 "a gpu backend not loaded names its file:line" \
        'bad_backend.cfg:46: strategy.device_backend: unknown device backend "cuda" (available: cpu)' \
        "$LOOM" check "$WORK/bad_backend.cfg"
fi
expect_fail 2 "the cpu backend does not run gpu devices" 'the cpu backend runs cpu devices, not "gpu:0"' \
    "$LOOM" check $CFG --set strategy.device=gpu:0 "${DEV[@]}"
if "$LOOM" plugins 2>&1 | grep -q 'cross-device ops "nccl"'; then
    out=$("$LOOM" check $CFG "${MIR[@]}" "${DEV[@]}" --set strategy.cross_device_ops=nccl 2>&1)
    contains "nccl with replicas on a device backend: accepted, reducing device memory" \
        'gradients: reduced in device memory by "nccl"' "$out"
    expect_fail 1 "... but the CPU reference's device memory is not CUDA memory: nccl says so at the first step" \
        'nccl: ' "$LOOM" train $CFG --model-dir "$WORK/nccl_cpu" "${MIR[@]}" "${DEV[@]}" \
        --set strategy.cross_device_ops=nccl --set run.max_steps=2
else
    pass "nccl with device replicas # SKIP the nccl plugin is not built"
fi
if ! "$LOOM" devices 2>&1 | grep -q "gpu:[0-9]*  "; then
    expect_fail 2 "one_device on gpu:0 without a GPU says what is missing" \
        '--set strategy.device: device "gpu:0" is not usable: ' "$LOOM" check $CFG --set strategy.device=gpu:0
    expect_fail 2 "configs/fashion_mnist_gpu.cfg without a GPU: not usable, at its file:line" \
        'configs/fashion_mnist_gpu.cfg:60: strategy.devices: device "gpu:*" is not usable: ' \
        "$LOOM" check configs/fashion_mnist_gpu.cfg
else
    check "configs/fashion_mnist_gpu.cfg checks on this GPU machine" "$LOOM" check configs/fashion_mnist_gpu.cfg
fi

# ---- gradients reduced in device memory (the dev_mem_sum fixture) ----------------
FIX="${LOOM_BUILD_ROOT:-$(dirname "$LOOM")}/tests/plugins"
mkdir -p "$WORK/dm" && cp "$FIX/dev_mem_sum.so" "$WORK/dm/"
DM=(--set strategy.cross_device_ops=dev_mem_sum)
# dm LOG CMD...: CMD with the fixture loaded, its calls logged to LOG (emptied first)
dm() {
    local log="$1"; shift
    : >"$log"
    env LOOM_PLUGIN_PATH="$WORK/dm" LOOM_TEST_DEV_MEM_SUM_LOG="$log" "$@"
}
# calls NAME LOG N COUNT: LOG holds exactly N all-reduces, each of COUNT floats over 2 buffers
calls() {
    local got
    got=$(sort "$2" | uniq -c | sed 's/^ *//')
    if [ "$got" = "$3 all_reduce n=2 count=$4" ]; then pass "$1"
    else fail "$1" "calls: $got" "want: $3 of $4 floats"; fi
}
P=235146
out=$(dm "$WORK/c.log" "$LOOM" check $CFG "${MIR[@]}" "${DEV[@]}" "${DM[@]}" 2>&1)
contains "check: mirrored says the gradients are reduced in device memory, by which op" \
    'gradients: reduced in device memory by "dev_mem_sum" (it works on device memory), then each replica downloads' \
    "$out"
contains "... all-reduced on the devices" "(SUM of the gradients, all-reduced on the devices)" "$out"
out=$(dm "$WORK/c.log" "$LOOM" check $CFG "${CEN[@]}" "${DEV[@]}" "${DM[@]}" 2>&1)
contains "check: so does central_storage" \
    'gradients: reduced in device memory by "dev_mem_sum" (it works on device memory), then replica 0 downloads' "$out"
expect_fail 2 "an op of device memory only is still refused for replicas run natively" \
    '"dev_mem_sum" reduces GPU memory only, but the mirrored replicas are on the CPU' \
    dm "$WORK/c.log" "$LOOM" check $CFG "${MIR[@]}" "${DM[@]}"
expect_fail 2 "central_storage refuses an op that would reduce in host memory" \
    '"ring" would reduce the gradients in host memory, where central_storage sums them itself' \
    "$LOOM" check $CFG "${CEN[@]}" "${DEV[@]}" --set strategy.cross_device_ops=ring
for s in MIR CEN; do
    case $s in MIR) set=("${MIR[@]}") ;; CEN) set=("${CEN[@]}") ;; esac
    check "$s: device-memory reduction, 100 steps" dm "$WORK/m$s.log" "$LOOM" train $CFG --model-dir "$WORK/m$s" \
        "${RUN[@]}" "${set[@]}" "${DEV[@]}" "${DM[@]}"
    calls "$s: ... the op all-reduced the device buffers once per step, all $P gradients" "$WORK/m$s.log" 100 $P
    same_weights "$s: ... the weights of the host-reduce device path, bit for bit" "$WORK/d$s/ckpt-100.loom" \
        "$WORK/m$s/ckpt-100.loom"
    close "$s: ... and of the native path" "$WORK/n$s/ckpt-100.loom" "$WORK/m$s/ckpt-100.loom"
    check "$s: ... a second run" dm "$WORK/m$s.log" "$LOOM" train $CFG --model-dir "$WORK/m${s}2" "${RUN[@]}" \
        "${set[@]}" "${DEV[@]}" "${DM[@]}"
    same_weights "$s: ... is bit-identical" "$WORK/m$s/ckpt-100.loom" "$WORK/m${s}2/ckpt-100.loom"
    check "$s: ... to step 45" dm "$WORK/r$s.log" "$LOOM" train $CFG --model-dir "$WORK/mr$s" "${RUN[@]}" \
        "${set[@]}" "${DEV[@]}" "${DM[@]}" --set run.max_steps=45
    check "$s: ... resumed to 100" dm "$WORK/r$s.log" "$LOOM" train $CFG --model-dir "$WORK/mr$s" "${RUN[@]}" \
        "${set[@]}" "${DEV[@]}" "${DM[@]}"
    calls "$s: ... the resumed run reduced its 55 steps on the devices" "$WORK/r$s.log" 55 $P
    same_weights "$s: ... resumed at 45 = uninterrupted" "$WORK/m$s/ckpt-100.loom" "$WORK/mr$s/ckpt-100.loom"
    check "$s: device memory, built-in step" dm "$WORK/hb$s.log" "$LOOM" train tests/configs/small_mlp.cfg \
        --model-dir "$WORK/mhb$s" "${set[@]}" "${DEV[@]}" "${DM[@]}" --set run.progress='"none"'
    check "$s: device memory, Lua step" dm "$WORK/hs$s.log" "$LOOM" train tests/configs/small_step.cfg \
        --model-dir "$WORK/mhs$s" "${set[@]}" "${DEV[@]}" "${DM[@]}" --set run.progress='"none"'
    nb=$(wc -l <"$WORK/hb$s.log") ns=$(wc -l <"$WORK/hs$s.log")
    if [ "$ns" -gt 0 ] && [ "$ns" = "$nb" ]; then pass "$s: ... its all-reduce ran on the devices too ($ns calls)"
    else fail "$s: the Lua step's all-reduce on the devices" "built-in: $nb calls, Lua: $ns"; fi
    same_weights "$s: ... the Lua step's weights are the built-in step's" "$WORK/mhb$s/ckpt-96.loom" \
        "$WORK/mhs$s/ckpt-96.loom"
done
# packs: each pack is one all-reduce on the devices; summed in replica order,
# the weights do not depend on the cut
check "mirrored: device memory, 3 packs" dm "$WORK/p.log" "$LOOM" train $CFG --model-dir "$WORK/mp" "${RUN[@]}" \
    "${MIR[@]}" "${DEV[@]}" "${DM[@]}" --set strategy.num_packs=3
first3=$(awk -F'count=' 'NR <= 3 { s += $2 } END { print s }' "$WORK/p.log")
if [ "$(wc -l <"$WORK/p.log")" = 300 ] && [ "$first3" = $P ]; then
    pass "... 3 all-reduces per step, covering the $P gradients"
else fail "3 all-reduces per step" "$(head -4 "$WORK/p.log")" "$(wc -l <"$WORK/p.log") calls"; fi
same_weights "... the weights of one pack" "$WORK/mMIR/ckpt-100.loom" "$WORK/mp/ckpt-100.loom"
# a layer no device backend runs: refused at load at its line, before any GPU is looked for (any machine)
bn_line=$(grep -n 'type = "batch_normalization"' configs/fashion_mnist_cnn_bn.cfg | head -1 | cut -d: -f1)
expect_fail 2 "batch_normalization on gpu: refused at the layer's line, saying what to do" \
    'fashion_mnist_cnn_bn.cfg:'"$bn_line"': layer "batch_normalization_1" (batch_normalization) is not implemented on the "cuda" device backend' \
    "$LOOM" check configs/fashion_mnist_cnn_bn.cfg --set 'strategy.device="gpu:0"'
expect_fail 2 "batch_normalization on the cpu reference backend: the hint says to drop device_backend" \
    'hint: remove strategy.device_backend' \
    "$LOOM" check configs/fashion_mnist_cnn_bn.cfg --set strategy.type=mirrored --set 'strategy.devices=["cpu:0"]' \
    --set 'strategy.device_backend="cpu"'
finish
