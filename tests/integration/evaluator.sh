#!/usr/bin/env bash
# evaluator.sh - the sidecar evaluator: a cluster's evaluator task (launch
# --local --evaluator) evaluates each checkpoint of a job exactly once and
# stops after the final one (final.json, written by the chief); `loom
# evaluate --watch` outside the cluster does the same for any strategy,
# started late it skips to the newest checkpoint, a rerun evaluates nothing
# twice, a job resumed in the same model_dir is followed past its earlier
# end, and a watcher with nothing to watch gives up after --idle-timeout.
# Every process runs under `timeout`.
source "$(dirname "$0")/lib.sh"
CHECK_EVENTS="${LOOM_EVENTS_CHECK:?set by meson}"
CFG=tests/configs/mwm_mlp.cfg
S=(--set run.max_steps=40 --set run.eval_steps=1 --set run.checkpoint_steps=10)
# ~50 ms a step, so the evaluator (about 0.1 s an evaluation) keeps up
SLOW='hooks.callbacks=({ fn = "../lua/mwm_slow.lua:slow"; args = { seconds = 0.05; }; })'
eval_steps() { grep '"event": "eval"' "$1/metrics.jsonl" 2>/dev/null | sed 's/.*"step": \([0-9]*\),.*/\1/' | tr '\n' ' '; }

# ---- a cluster's evaluator task -----------------------------------------------------
# Whatever the pace, no checkpoint is evaluated twice, and every one is either
# evaluated or named as skipped (the evaluator fell behind). Training paced at
# ~50 ms a step leaves the evaluator 0.5 s a checkpoint, so it normally
# evaluates all four; on a machine loaded enough to skip one, the job is run
# again (up to 3 attempts) before that fails.
for attempt in 1 2 3; do
    rm -rf "$WORK/job"
    timeout 120 "$LOOM" launch --local $CFG --workers 2 --evaluator --model-dir "$WORK/job" "${S[@]}" --set "$SLOW" \
        >"$WORK/job.out" 2>&1
    st=$?
    got=$(eval_steps "$WORK/job")
    [ $st -eq 0 ] && [ "$got" = "10 20 30 40 " ] && break
    echo "# attempt $attempt: status $st, evaluated steps: $got"
done
[ $st -eq 0 ] && pass "launch --workers 2 --evaluator ends with status 0" || fail "launch --workers 2 --evaluator ends with status 0" "status $st" "$(tail -5 "$WORK/job.out" | sed 's/^/# /')"
dups=$(echo "$got" | tr ' ' '\n' | grep . | sort | uniq -d)
skipped=$(grep -o "skipping [0-9]* older" "$WORK/job.out" | awk '{ s += $2 } END { print s + 0 }')
n=$(echo "$got" | wc -w)
if [ -z "$dups" ] && [ $((n + skipped)) -eq 4 ] && [[ " $got" == *" 40 " ]]; then
    pass "no checkpoint evaluated twice; each evaluated or named as skipped ($got; $skipped skipped)"
else
    fail "no checkpoint evaluated twice; each evaluated or named as skipped" "steps: $got; skipped: $skipped"
fi
[ "$got" = "10 20 30 40 " ] && pass "the evaluator evaluated each checkpoint exactly once" || fail "the evaluator evaluated each checkpoint exactly once" "eval lines for steps: $got"
contains "it stopped after the final checkpoint" "training ended at step 40, evaluated: done (4 evaluations here)" "$(cat "$WORK/job.out")"
if grep -q "stopping evaluator:0\|evaluator:0 did not stop" "$WORK/job.out"; then fail "launch lets it finish instead of stopping it" "$(grep evaluator:0 "$WORK/job.out" | tail -3)"; else pass "launch lets it finish instead of stopping it"; fi
contains "the chief names the final checkpoint in final.json" '"step": 40, "checkpoint": "ckpt-40.loom"' "$(cat "$WORK/job/final.json" 2>&1)"
contains "the chief leaves evaluation to the evaluator" "done: step 40, evaluated by the evaluator task" "$(cat "$WORK/job.out")"
n=$(ls "$WORK/job/eval" 2>/dev/null | grep -c '^events.out.tfevents')
[ "$n" = 1 ] && pass "one eval/ event file, the evaluator's" || fail "one eval/ event file, the evaluator's" "$(ls "$WORK/job/eval" 2>&1)"
if grep -aq accuracy "$WORK"/job/eval/events.out.tfevents.* 2>/dev/null; then pass "it holds the eval scalars"; else fail "it holds the eval scalars"; fi
# the same accuracy as loom evaluate of the final checkpoint
a=$(grep '"event": "eval", "step": 40' "$WORK/job/metrics.jsonl" | sed 's/.*"eval_accuracy": \([0-9.]*\).*/\1/')
b=$(timeout 60 "$LOOM" evaluate $CFG --model-dir "$WORK/job" "${S[@]}" 2>/dev/null | sed 's/.*"eval_accuracy": \([0-9.]*\).*/\1/')
[ -n "$a" ] && [ "$a" = "$b" ] && pass "its accuracy at step 40 = loom evaluate's ($a)" || fail "its accuracy at step 40 = loom evaluate's" "$a vs $b"

# ---- loom evaluate --watch started late: the newest only ----------------------------------
mkdir -p "$WORK/late"
cp "$WORK"/job/ckpt-*.loom "$WORK/job/checkpoint" "$WORK/job/final.json" "$WORK/late/"
timeout 60 "$LOOM" evaluate $CFG --watch --model-dir "$WORK/late" "${S[@]}" >"$WORK/late.out" 2>&1
st=$?
[ $st -eq 0 ] && pass "a late watcher ends with status 0" || fail "a late watcher ends with status 0" "status $st" "$(tail -5 "$WORK/late.out")"
got=$(eval_steps "$WORK/late")
[ "$got" = "40 " ] && pass "a late watcher evaluates only the newest checkpoint" || fail "a late watcher evaluates only the newest checkpoint" "steps: $got"
contains "it says it skipped the older ones" "4 new checkpoints: evaluating the newest (step 40), skipping 3 older" "$(cat "$WORK/late.out")"
contains "it prints the evaluation as JSON" '"step": 40, "examples": 500' "$(cat "$WORK/late.out")"
timeout 60 "$LOOM" evaluate $CFG --watch --model-dir "$WORK/late" "${S[@]}" >"$WORK/late2.out" 2>&1
st=$?
got=$(eval_steps "$WORK/late")
[ $st -eq 0 ] && [ "$got" = "40 " ] && pass "a second watcher evaluates nothing twice" || fail "a second watcher evaluates nothing twice" "status $st, steps: $got" "$(tail -3 "$WORK/late2.out")"
contains "it says what was evaluated before" "ckpt-40.loom (step 40) was evaluated before (metrics.jsonl)" "$(cat "$WORK/late2.out")"

# ---- loom evaluate --watch beside a one-process run (mirrored) ---------------------------
ONE=(--set strategy.type=mirrored --set cluster.worker=[] --model-dir "$WORK/one")
timeout 60 "$LOOM" evaluate $CFG --watch --idle-timeout 30 "${ONE[@]}" "${S[@]}" >"$WORK/one_watch.out" 2>&1 &
wp=$!
sleep 0.3
timeout 60 "$LOOM" train $CFG "${ONE[@]}" "${S[@]}" --set "$SLOW" >"$WORK/one.out" 2>&1
trc=$?
wait $wp
wrc=$?
[ $trc -eq 0 ] && [ $wrc -eq 0 ] && pass "a one-process run and its watcher both end with status 0" || fail "a one-process run and its watcher both end with status 0" "train $trc, watch $wrc" "$(tail -3 "$WORK/one_watch.out")"
got=$(eval_steps "$WORK/one")
dups=$(echo "$got" | tr ' ' '\n' | grep . | sort | uniq -d)
if [ -z "$dups" ] && [[ " $got" == *" 40 " ]]; then pass "the watcher evaluated checkpoints once each, the final one last ($got)"; else fail "the watcher evaluated checkpoints once each, the final one last" "steps: $got"; fi
contains "the run itself still evaluates inline" "done: step 40, eval accuracy" "$(cat "$WORK/one.out")"
# one writer per event directory (issue 22, item 8): the run writes eval/, the
# watcher its own eval_watch/, each one curve with strictly increasing steps
ev=$("$CHECK_EVENTS" --one-writer "$WORK/one/eval" loss 2>&1)
[[ "$ev" == "files 1 writers 1 steps"*" 40" ]] && pass "eval/: the run's own evaluations, one writer ($ev)" || fail "eval/: the run's own evaluations, one writer" "$ev"
ew=$("$CHECK_EVENTS" --one-writer "$WORK/one/eval_watch" loss 2>&1)
[ "$ew" = "files 1 writers 1 steps $(echo $got)" ] && pass "eval_watch/: the watcher's evaluations, one writer ($ew)" || fail "eval_watch/: the watcher's evaluations, one writer" "$ew; metrics.jsonl: $got"
contains "the watcher names its directory" "TensorBoard: $WORK/one/eval_watch" "$(cat "$WORK/one_watch.out")"
# a second watcher of the same model_dir is refused while the first runs (it would write eval_watch/ too)
timeout 60 "$LOOM" evaluate $CFG --watch --idle-timeout 20 --model-dir "$WORK/two" "${S[@]}" >"$WORK/two_watch.out" 2>&1 &
wp=$!
for _ in $(seq 100); do grep -q "evaluating each new checkpoint" "$WORK/two_watch.out" && break; sleep 0.1; done
expect_fail 1 "a second watcher is refused, naming the first" "the event files here are written by another process: pid" \
    timeout 30 "$LOOM" evaluate $CFG --watch --idle-timeout 1 --model-dir "$WORK/two" "${S[@]}"
kill $wp 2>/dev/null; wait $wp 2>/dev/null

# ---- a finished job resumed with more steps: the evaluator follows it past its old end ------
timeout 120 "$LOOM" launch --local $CFG --workers 2 --evaluator --model-dir "$WORK/job" "${S[@]}" --set "$SLOW" \
    --set run.max_steps=60 >"$WORK/job60.out" 2>&1
st=$?
got=$(eval_steps "$WORK/job")
[ $st -eq 0 ] && [ "$got" = "10 20 30 40 50 60 " ] && pass "resumed to step 60: the evaluator evaluated 50 and 60 once" || fail "resumed to step 60: the evaluator evaluated 50 and 60 once" "status $st, steps: $got" "$(grep evaluator "$WORK/job60.out" | tail -4)"
contains "final.json names the new end" '"step": 60' "$(cat "$WORK/job/final.json" 2>&1)"

# ---- --fresh in the same model_dir: the new checkpoints are evaluated, not taken for the old ones ----
timeout 120 "$LOOM" launch --local $CFG --workers 2 --evaluator --fresh --model-dir "$WORK/job" "${S[@]}" \
    --set "$SLOW" --set run.max_steps=20 >"$WORK/fresh.out" 2>&1
st=$?
n10=$(grep -c '"event": "eval", "step": 10,' "$WORK/job/metrics.jsonl")
n20=$(grep -c '"event": "eval", "step": 20,' "$WORK/job/metrics.jsonl")
if [ $st -eq 0 ] && [ "$n20" = 2 ] && grep -q "training ended at step 20, evaluated" "$WORK/fresh.out"; then
    pass "--fresh: the evaluator evaluates the new run's checkpoints (step 20 again; step 10: $n10 lines)"
else
    fail "--fresh: the evaluator evaluates the new run's checkpoints" "status $st, step 10: $n10 lines, step 20: $n20" "$(grep evaluator "$WORK/fresh.out" | tail -4)"
fi

# ---- nothing to watch --------------------------------------------------------------------
expect_fail 1 "a watcher with nothing to watch gives up after --idle-timeout" "no new checkpoint for 1 s" \
    timeout 30 "$LOOM" evaluate $CFG --watch --idle-timeout 1 --model-dir "$WORK/empty" "${S[@]}"
expect_fail 2 "--watch takes no --checkpoint" "takes no --checkpoint" \
    timeout 30 "$LOOM" evaluate $CFG --watch --checkpoint "$WORK/job/ckpt-10.loom" --model-dir "$WORK/job"
finish
