#!/usr/bin/env bash
# compression.sh - strategy.compression (bf16, fp16) for multi_worker_mirrored's
# gradient all-reduce, over loopback (netns.sh runs it across emulated hosts):
# the bad settings; `loom check`'s plan; the same bits on a second run, and
# on a run stopped and resumed (the error feedback is in the checkpoint); and
# Fashion-MNIST (configs/fashion_mnist_multi_worker.cfg, 2 workers, 3 epochs,
# the cosine schedule run to its end) within 0.3% eval accuracy of float32,
# for bf16 with error feedback and for fp16. Every launch runs under timeout.
source "$(dirname "$0")/lib.sh"
CFG=tests/configs/mwm_mlp.cfg
MW=configs/fashion_mnist_multi_worker.cfg
kill_jobs_at_exit

# ---- bad settings ------------------------------------------------------------------------
expect_fail 2 "an unknown format, with the choices" 'strategy.compression: unknown value "bf15" (expected one of: none, bf16, fp16)' \
    "$LOOM" check $CFG --task worker:0 --set strategy.compression=bf15
expect_fail 2 "error feedback without a compression" "compression_error_feedback = true without a compression" \
    "$LOOM" check $CFG --task worker:0 --set strategy.compression_error_feedback=true
expect_fail 2 "compression needs the ring" 'compression = "fp16" needs communication = "ring" (it is "mpi")' \
    "$LOOM" check $CFG --task worker:0 --set strategy.compression=fp16 --set strategy.communication=mpi
expect_fail 2 "compression is multi_worker_mirrored's" 'compression applies only to type = "multi_worker_mirrored" (type is "mirrored")' \
    "$LOOM" check $CFG --set strategy.type=mirrored --set strategy.compression=bf16 --set cluster.worker=[]
out=$("$LOOM" check $CFG --task worker:0 --set strategy.compression=fp16 2>&1)
contains "check: the plan says what crosses the wire" 'compression = "fp16": the gradients cross as 16 bits (half the bytes)' "$out"
contains "check: compressed packs overlap backward by default" 'in 8 packs (strategy.bytes_per_pack / num_packs)' "$out"
out=$("$LOOM" check $CFG --task worker:0 --set strategy.compression=fp16 --set strategy.num_packs=1 2>&1)
if grep -q ' packs (strategy' <<<"$out"; then fail "check: num_packs = 1 keeps one pack with compression" "$out"
else pass "check: num_packs = 1 keeps one pack with compression"; fi
out=$("$LOOM" check $CFG --task worker:0 --set strategy.compression=fp16 --print 2>&1)
contains "check --print keeps the setting" 'compression = "fp16";' "$out"

# ---- the same bits twice (2 workers, bf16 with error feedback, 4 packs overlapping backward) -----
L() { timeout -k 5 120 "$LOOM" launch --local $CFG --workers 2 --set run.max_steps=60 --set run.eval_steps=1 "$@"; }
C=(--set strategy.compression=bf16 --set strategy.compression_error_feedback=true --set strategy.num_packs=4)
check "bf16 + error feedback, 4 packs: trains" L --model-dir "$WORK/a" "${C[@]}"
check "bf16 + error feedback, 4 packs: again" L --model-dir "$WORK/b" "${C[@]}"
same_weights "bf16 + error feedback: the same bits on a second run" "$WORK/a/ckpt-60.loom" "$WORK/b/ckpt-60.loom"
# the error feedback is in the checkpoint: stopped at step 30 and resumed, the same bits as never stopped
check "bf16 + error feedback: run to step 30" L --model-dir "$WORK/r" "${C[@]}" --set run.max_steps=30
check "bf16 + error feedback: resume to step 60" L --model-dir "$WORK/r" "${C[@]}"
same_weights "bf16 + error feedback: resumed at step 30 = uninterrupted (the residuals kept)" \
    "$WORK/a/ckpt-60.loom" "$WORK/r/ckpt-60.loom"
# a checkpoint written without error feedback: a run that turns it on resumes, starting it at zero, and says so
check "bf16 without error feedback: run to step 30" L --model-dir "$WORK/n" --set strategy.compression=bf16 --set run.max_steps=30
out=$(L --model-dir "$WORK/n" "${C[@]}" --set run.max_steps=40 2>&1)
contains "resumed with error feedback from a checkpoint without it: starts at zero, with a warning" \
    "the checkpoint holds no error feedback (written without compression_error_feedback): it starts at zero" "$out"
check "float32, 4 packs" L --model-dir "$WORK/f" --set strategy.num_packs=4
if [ "$(tensors "$WORK/a/ckpt-60.loom")" != "$(tensors "$WORK/f/ckpt-60.loom")" ]; then pass "bf16: other bits than float32"
else fail "bf16: other bits than float32" "the same tensors: was anything compressed?"; fi

# ---- Fashion-MNIST: within 0.3% of float32's eval accuracy ------------------------------------
E=(--set run.epochs=3 --set optimizer.schedule.decay_steps=1407 --set run.progress='"none"')
acc() { sed -n 's/.*done: step [0-9]*, eval accuracy \([0-9.]*\).*/\1/p' <<<"$1" | tail -1; }
base=$(acc "$(timeout -k 5 300 "$LOOM" launch --local $MW --model-dir "$WORK/f32" "${E[@]}" 2>&1)")
for c in "bf16 true" "fp16 false"; do
    set -- $c
    a=$(acc "$(timeout -k 5 300 "$LOOM" launch --local $MW --model-dir "$WORK/$1" "${E[@]}" --set strategy.compression=$1 \
        --set strategy.compression_error_feedback=$2 2>&1)")
    if [ -n "$a" ] && [ -n "$base" ] && awk -v a="$a" -v b="$base" 'BEGIN { exit !(a >= b - 0.003) }'; then
        pass "Fashion-MNIST, $1 (error feedback $2): eval accuracy $a, float32 $base (within 0.3%)"
    else
        fail "Fashion-MNIST, $1 (error feedback $2): within 0.3% of float32" "compressed '$a', float32 '$base'"
    fi
done
finish
