#!/usr/bin/env bash
# summaries.sh - TensorBoard event files from real training runs
# (tests/configs/small_mlp.cfg: 32 steps an epoch): every record's CRCs and
# the scalars against metrics.jsonl (fixtures/events_check.c), eval/ beside
# the model dir, histograms and the config text, a resumed run adds a file
# and continues the curve without a duplicate step, ctx:log_scalar in the
# event file, an unwritable summary directory refused before training,
# summary_steps = 0, and run.checkpoint_secs.
source "$(dirname "$0")/lib.sh"
CHECK_EVENTS="${LOOM_EVENTS_CHECK:?set by meson}"
CFG=tests/configs/small_mlp.cfg
Q=(--set run.progress='"none"' --set run.summary_steps=10 --set run.checkpoint_steps=0)

# 1. two epochs: scalars every 10 steps, eval per epoch, histograms per epoch, the config as text
check "train 2 epochs with summaries" "$LOOM" train $CFG --model-dir "$WORK/a" "${Q[@]}" --set run.epochs=2 \
    --set run.histogram_epochs=1
ls "$WORK/a" | grep -qE '^events\.out\.tfevents\.[0-9]{10}\.[^.]+.*\.[0-9]+\.0$' && pass "event file named as TensorBoard's writer names it" ||
    fail "event file name" "$(ls "$WORK/a")"
ls "$WORK/a/eval" | grep -q tfevents && pass "eval/ holds the evaluation's event file" || fail "eval/ event file"
out=$("$CHECK_EVENTS" "$WORK/a" 2>&1) && pass "every CRC checks and the scalars equal metrics.jsonl" ||
    fail "events agree with metrics.jsonl" "$out"
# 64 steps: summaries at 10..60 (6 lines of 5 scalars), 2 evals of 2; 4 variables x 2 epochs of
# histograms; one config text; 2 version events: 30 + 4 + 8 + 1 + 2 = 45 events
contains "6 summary points, 2 evals, 8 histograms, 1 text, 2 files" "files 2 events 45 scalars 34 histograms 8 texts 1 starts 0 summaries 6 evals 2" "$out"

# 2. resumed to 4 epochs: a new file per directory, a SessionLog START at step 64, no duplicate step
sleep 1 # file names sort by their start second, as TensorBoard reads them
check "resume to 4 epochs" "$LOOM" train $CFG --model-dir "$WORK/a" "${Q[@]}" --set run.epochs=4 --set run.histogram_epochs=1
out=$("$CHECK_EVENTS" "$WORK/a" 2>&1) && pass "resumed: CRCs, values, and strictly increasing steps across the files" ||
    fail "resumed events" "$out"
# the second run adds 2 versions, 2 STARTs, 30 + 4 + 8 + 1 summaries: 47
contains "resumed: 4 files, 2 START events, summaries 10..120, 4 evals" "files 4 events 92 scalars 68 histograms 16 texts 2 starts 2 summaries 12 evals 4" "$out"

n=$(find "$WORK/a" -name '*tfevents*' | wc -l)
check "rerun of the finished run" "$LOOM" train $CFG --model-dir "$WORK/a" "${Q[@]}" --set run.epochs=4
[ "$(find "$WORK/a" -name '*tfevents*' | wc -l)" = "$n" ] && pass "a finished run's rerun adds no event file" ||
    fail "rerun adds no event file" "$(ls "$WORK/a")"

# 3. ctx:log_scalar goes to the event file too
check "logger hook" "$LOOM" train $CFG --model-dir "$WORK/log" "${Q[@]}" \
    --set 'hooks.callbacks=( { fn = "../../lua/logger.lua:logger"; args = { every = 16; param = "dense_1/kernel"; }; } )'
out=$("$CHECK_EVENTS" "$WORK/log" 2>&1) && pass "log_scalar run: events agree" || fail "log_scalar events" "$out"
# 3 epochs: 9 summary points x 5 + 3 evals x 2, and logger.lua's 6 train/loss + 6 train/learning_rate
# (every 16 steps) + 3 param norms + 3 eval/accuracy (per epoch) = 69
contains "log_scalar's scalars are in the event file" "scalars 69 " "$out"

# 4. an unwritable summary directory: a clear error, nothing trained
mkdir -p "$WORK/bad" && echo x > "$WORK/bad/eval"
expect_fail 1 "an unwritable eval/ is refused naming it" "$WORK/bad/eval" \
    "$LOOM" train $CFG --model-dir "$WORK/bad" "${Q[@]}" --set run.epochs=1
ls "$WORK/bad" | grep -q '^ckpt-' && fail "nothing trained" "$(ls "$WORK/bad")" || pass "nothing trained: no checkpoint"

# 5. summary_steps = 0: no event file, no summary line
check "summary_steps = 0" "$LOOM" train $CFG --model-dir "$WORK/off" "${Q[@]}" --set run.summary_steps=0 --set run.epochs=1
[ -z "$(find "$WORK/off" -name '*tfevents*')" ] && ! grep -q '"summary"' "$WORK/off/metrics.jsonl" &&
    pass "summary_steps = 0 writes no event file" || fail "summary_steps = 0" "$(ls -R "$WORK/off")"

# 6. run.checkpoint_secs: with a tiny interval every step boundary checkpoints
check "checkpoint_secs" "$LOOM" train $CFG --model-dir "$WORK/secs" "${Q[@]}" --set run.max_steps=6 \
    --set run.checkpoint_secs=0.000001
n=$(ls "$WORK/secs" | grep -c '^ckpt-[0-9]*\.loom$')
[ "$n" -eq 6 ] && pass "checkpoint_secs checkpoints when the time has passed (6 of 6 steps)" || fail "checkpoint_secs" "$(ls "$WORK/secs")"
check "checkpoint_secs = 3600 adds none" "$LOOM" train $CFG --model-dir "$WORK/secs2" "${Q[@]}" --set run.max_steps=6 \
    --set run.checkpoint_secs=3600
n=$(ls "$WORK/secs2" | grep -c '^ckpt-[0-9]*\.loom$')
[ "$n" -eq 1 ] && pass "checkpoint_secs = 3600: only the final checkpoint" || fail "checkpoint_secs 3600" "$(ls "$WORK/secs2")"
finish
