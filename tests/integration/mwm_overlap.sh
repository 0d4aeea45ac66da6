#!/usr/bin/env bash
# mwm_overlap.sh - multi_worker_mirrored reduces gradient packs across the
# workers while the backward pass still runs (strategy.bytes_per_pack /
# num_packs: the last layers' pack first, on a communicator thread), with
# the same bits as reducing the same packs after the backward pass
# (LOOM_OVERLAP=0): 2 workers, 3 workers with one pack per tensor, 2 workers
# x 2 replicas; with 2 workers the same bits as one pack (today's default);
# the chief reports how many packs started during backward; a custom Lua
# step over packs gives the built-in step's weights. Jobs run under
# `loom launch --local` and `timeout`.
source "$(dirname "$0")/lib.sh"
CFG=tests/configs/mwm_mlp.cfg
S=(--set run.max_steps=40 --set run.eval_steps=1)
PACKS=(--set strategy.bytes_per_pack=1024) # the MLP's two dense layers: two packs
job() { # NAME ARGS...: launch --local, status checked
    local name=$1 st; shift
    timeout 120 "$LOOM" launch --local $CFG --model-dir "$WORK/$name" "${S[@]}" "$@" >"$WORK/$name.out" 2>&1
    st=$?
    [ $st -eq 0 ] || fail "$name: the job ends with status 0" "status $st" "$(tail -4 "$WORK/$name.out")"
}
off() { LOOM_OVERLAP=0 job "$@"; }

job one --workers 2
job on --workers 2 "${PACKS[@]}"
off off --workers 2 "${PACKS[@]}"
same_weights "2 workers, 2 packs: overlapped = after backward, bit for bit" "$WORK/on/ckpt-40.loom" "$WORK/off/ckpt-40.loom"
same_weights "2 workers: 2 packs overlapped = one pack (the default), bit for bit" "$WORK/on/ckpt-40.loom" "$WORK/one/ckpt-40.loom"
contains "the chief reports the packs that started during backward" \
    "40 of 80 pack all-reduces across the workers started while the backward pass still ran (2 packs a step)" \
    "$(cat "$WORK/on.out")"
if grep -q "pack all-reduces" "$WORK/off.out" "$WORK/one.out"; then fail "no such report without overlap" "$(grep -h "pack all-reduces" "$WORK/off.out" "$WORK/one.out")"; else pass "no such report without overlap"; fi

job on3 --workers 3 --set strategy.num_packs=0
off off3 --workers 3 --set strategy.num_packs=0
same_weights "3 workers, a pack per tensor: overlapped = after backward, bit for bit" "$WORK/on3/ckpt-40.loom" "$WORK/off3/ckpt-40.loom"
contains "3 workers: 3 of the 4 packs of each step started during backward" "120 of 160 pack all-reduces" "$(cat "$WORK/on3.out")"

job on22 --workers 2 --set strategy.replicas=2 "${PACKS[@]}"
off off22 --workers 2 --set strategy.replicas=2 "${PACKS[@]}"
same_weights "2 workers x 2 replicas, 2 packs: overlapped = after backward, bit for bit" "$WORK/on22/ckpt-40.loom" "$WORK/off22/ckpt-40.loom"
contains "2 x 2: the packs summed over the local replicas during backward go on across the workers" \
    "40 of 80 pack all-reduces" "$(cat "$WORK/on22.out")"

job lua --workers 2 "${PACKS[@]}" --set 'hooks.train_step="../../lua/clipped_step.lua:train_step"'
same_weights "a Lua train_step over 2 packs = the built-in step's" "$WORK/lua/ckpt-40.loom" "$WORK/on/ckpt-40.loom"
finish
