#!/usr/bin/env bash
# mwm_lua_step.sh - a custom (Lua) train_step under multi_worker_mirrored:
# 2 workers through `loom launch --local` give mirrored(2)'s weights bit for
# bit (lua/clipped_step.lua, without and with clipping after the
# all-reduce), the chief logs the job's loss, and a step that forgets
# ctx:all_reduce_gradients() stops the job naming the step.
source "$(dirname "$0")/lib.sh"
CFG=tests/configs/mwm_mlp.cfg
S=(--set run.max_steps=40 --set run.eval_steps=1 --set run.summary_steps=10)
STEP='hooks.train_step="../../lua/clipped_step.lua:train_step"'
CLIP='hooks.train_step={ fn = "../../lua/clipped_step.lua:train_step"; args = { clip_norm = 0.5; }; }'
launch2() { # DIR ARGS...: 2 workers under launch --local
    local dir=$1; shift
    timeout 120 "$LOOM" launch --local $CFG --workers 2 --model-dir "$dir" "${S[@]}" "$@" >"$dir.out" 2>&1
}
mirrored2() { # DIR ARGS...: mirrored(2) in one process
    local dir=$1; shift
    timeout 60 "$LOOM" train $CFG --model-dir "$dir" "${S[@]}" --set strategy.type=mirrored \
        --set strategy.replicas=2 --set cluster.worker=[] "$@" >"$dir.out" 2>&1
}
losses() { grep '"event": "summary"' "$1/metrics.jsonl" | sed 's/.*"loss": \([^,]*\),.*/\1/'; }

for v in plain clip; do
    if [ $v = plain ]; then set_=$STEP; else set_=$CLIP; fi
    launch2 "$WORK/two_$v" --set "$set_"
    st=$?
    if [ $st -eq 0 ]; then pass "$v: 2 workers run a custom train_step"; else fail "$v: 2 workers run a custom train_step" "status $st" "$(tail -5 "$WORK/two_$v.out")"; fi
    check "$v: mirrored(2) runs it" mirrored2 "$WORK/mir_$v" --set "$set_"
    same_weights "$v: 2 workers = mirrored(2), bit for bit" "$WORK/two_$v/ckpt-40.loom" "$WORK/mir_$v/ckpt-40.loom"
done
contains "loom check takes a Lua train_step under multi_worker_mirrored" "a custom (Lua) training step" \
    "$("$LOOM" check $CFG --set "$STEP" 2>&1)"
# the built-in step: the Lua step without clipping is the built-in one
launch2 "$WORK/two_builtin"
same_weights "the Lua step = the built-in step under multi_worker_mirrored" "$WORK/two_plain/ckpt-40.loom" \
    "$WORK/two_builtin/ckpt-40.loom"
# the chief logs the job's loss (both workers' examples), as mirrored(2) does
a=$(losses "$WORK/two_plain"); b=$(losses "$WORK/mir_plain")
if [ -n "$a" ] && [ "$(echo "$a" | wc -l)" = 4 ] && paste <(echo "$a") <(echo "$b") |
    awk '{ d = $1 - $2; if (d < 0) d = -d; if (d > 1e-5 * ($2 < 0 ? -$2 : $2)) bad = 1 } END { exit bad }'; then
    pass "the summaries' loss is the job's (= mirrored(2)'s within 1e-5)"
else
    fail "the summaries' loss is the job's" "workers: $(echo $a)" "mirrored: $(echo $b)"
fi

# a step that skips the all-reduce: every worker stops naming step 3
launch2 "$WORK/skip" --set 'hooks.train_step="../lua/skip_reduce_step.lua:train_step"'
st=$?
[ $st -ne 0 ] && pass "a step without all_reduce_gradients fails the job" || fail "a step without all_reduce_gradients fails the job" "status 0"
contains "it names the step and the rule" "did not call ctx:all_reduce_gradients() in step 3" "$(cat "$WORK/skip.out")"
if grep -q "done: step" "$WORK/skip.out"; then fail "no worker finishes training after it" "$(grep done: "$WORK/skip.out")"; else pass "no worker finishes training after it"; fi
finish
