#!/usr/bin/env bash
# files.sh - the files loom reads and writes, against hostile or unlucky
# input: a FIFO as the config or as a checkpoint is refused, not waited on;
# checkpoint names are parsed strictly; a checkpoint with valid CRCs but
# impossible content (a duplicated tensor, step 2^62, a negative
# step_in_epoch, a NaN loss sum, a file named for another step) is refused
# naming the file; stale *.tmp.<pid> files are removed; metrics.jsonl agrees
# with the checkpoint after a kill; a rerun of a finished run says so and
# writes no second "end" line.
source "$(dirname "$0")/lib.sh"
FORGE="${LOOM_CKPT_FORGE:-$(dirname "$LOOM")/tests/ckpt_forge}"
CFG=tests/configs/small_mlp.cfg
OPT=(--set run.progress='"none"' --set run.eval_each_epoch=false --set run.eval_steps=1)
T0=$SECONDS

# --- FIFOs: refused at once, naming them --------------------------------------
mkfifo "$WORK/fifo.cfg"
expect_fail 2 "a FIFO as the config is refused, not waited on" "fifo.cfg: cannot read the config file: is a FIFO (named pipe)" \
    timeout 20 "$LOOM" check "$WORK/fifo.cfg"
printf 'version = 1;\n@include "inc.cfg"\n' > "$WORK/top.cfg"
mkfifo "$WORK/inc.cfg"
expect_fail 2 "a FIFO as an @include'd file is refused at its line" "top.cfg:2: @include \"$WORK/inc.cfg\": is a FIFO" \
    timeout 20 "$LOOM" check "$WORK/top.cfg"

# --- a small run to work on: 3 steps, a checkpoint at each -------------------
check "train 3 steps" "$LOOM" train $CFG --model-dir "$WORK/m" "${OPT[@]}" --set run.max_steps=3 --set run.checkpoint_steps=1
[ -f "$WORK/m/ckpt-3.loom" ] && pass "ckpt-3.loom written" || fail "ckpt-3.loom written" "$(ls "$WORK/m")"
fresh() { rm -rf "$WORK/$1"; mkdir -p "$WORK/$1"; cp "$WORK/m/ckpt-3.loom" "$WORK/$1/"; }

mkfifo "$WORK/m/ckpt-5.loom"
expect_fail 1 "a FIFO as the latest checkpoint is refused, not waited on" "ckpt-5.loom: is a FIFO (named pipe), not a regular file" \
    timeout 20 "$LOOM" train $CFG --model-dir "$WORK/m" "${OPT[@]}" --set run.max_steps=6
rm -f "$WORK/m/ckpt-5.loom"

# --- checkpoint names ----------------------------------------------------------
fresh names
for bad in ckpt-99999999999999999999999.loom ckpt-007.loom ckpt-+9.loom ckpt--9.loom ckpt-9x.loom ckpt-9007199254740993.loom; do
    cp "$WORK/names/ckpt-3.loom" "$WORK/names/$bad"
done
out=$("$LOOM" train $CFG --model-dir "$WORK/names" "${OPT[@]}" --set run.max_steps=4 2>&1); status=$?
[ $status -eq 0 ] && pass "bad checkpoint names do not stop a run" || fail "bad checkpoint names do not stop a run" "$out"
contains "it resumes from the real latest" "resuming from $WORK/names/ckpt-3.loom (step 3" "$out"
contains "a saturating name is ignored with a warning" "ckpt-99999999999999999999999.loom: ignored: not a checkpoint name" "$out"
contains "a leading zero is ignored with a warning" "ckpt-007.loom: ignored" "$out"
contains "a step past 2^53 is ignored with a warning" "ckpt-9007199254740993.loom: ignored" "$out"
[ -f "$WORK/names/ckpt-4.loom" ] && pass "and the next checkpoint is step 4" || fail "and the next checkpoint is step 4" "$(ls "$WORK/names")"

# --- forged checkpoints: valid CRCs, impossible content --------------------------
# the trainer blob: u32 version, i64 step @4, epoch @12, step_in_epoch @20, f64 loss_sum @28, i64 correct @36, examples @44
forged() { # NAME WANT FORGE-ARGS...
    local name="$1" want="$2"; shift 2
    fresh forged
    if ! "$FORGE" "$WORK/m/ckpt-3.loom" "$WORK/forged/ckpt-3.loom" "$@"; then fail "$name" "ckpt_forge $*"; return; fi
    expect_fail 1 "$name" "$want" "$LOOM" train $CFG --model-dir "$WORK/forged" "${OPT[@]}" --set run.max_steps=5
}
forged "a duplicated tensor record is refused" 'ckpt-3.loom: tensor "dense_1/kernel" appears twice' dup dense_1/kernel
forged "step 2^62 is refused" "(step is out of range)" blob-i64 trainer 4 4611686018427387904
forged "a negative step_in_epoch is refused" "(step_in_epoch is out of range)" blob-i64 trainer 20 -1
forged "a NaN loss sum is refused" "(loss_sum is out of range)" blob-f64 trainer 28 nan
forged "more correct than examples is refused" "(correct is out of range)" blob-i64 trainer 36 1000000
forged "a file named for another step is refused" "the file is named for step 3 but holds step 4" blob-i64 trainer 4 4
fresh forged
"$FORGE" "$WORK/m/ckpt-3.loom" "$WORK/forged/ckpt-3.loom" dup trainer
expect_fail 1 "loom inspect refuses a duplicated record too" 'record "trainer" appears twice' "$LOOM" inspect "$WORK/forged/ckpt-3.loom"

# --- stale temporary files --------------------------------------------------------
fresh tmp
sh -c 'exit 0' & dead=$!; wait $dead
echo partial > "$WORK/tmp/ckpt-4.loom.tmp.$dead"
echo partial > "$WORK/tmp/checkpoint.tmp.$dead"
echo live > "$WORK/tmp/ckpt-4.loom.tmp.$$"
# the current form names the host: a model_dir on NFS may hold another machine's live writer's file
host=$(hostname | tr -c 'A-Za-z0-9_\n-' '_' | head -c 64)
echo partial > "$WORK/tmp/metrics.jsonl.tmp.$host.$dead"
echo other > "$WORK/tmp/checkpoint.tmp.other_host.$dead"
out=$("$LOOM" train $CFG --model-dir "$WORK/tmp" "${OPT[@]}" --set run.max_steps=4 2>&1)
contains "a dead writer's tmp file is removed, and said" "ckpt-4.loom.tmp.$dead: removed a temporary file left by process $dead" "$out"
[ ! -e "$WORK/tmp/checkpoint.tmp.$dead" ] && pass "every one of them" || fail "every one of them" "$(ls "$WORK/tmp")"
[ -e "$WORK/tmp/ckpt-4.loom.tmp.$$" ] && pass "a live writer's tmp file stays" || fail "a live writer's tmp file stays" "$(ls "$WORK/tmp")"
[ ! -e "$WORK/tmp/metrics.jsonl.tmp.$host.$dead" ] && pass "a dead writer's tmp file of this host ($host) is removed" \
    || fail "a dead writer's tmp file of this host ($host) is removed" "$(ls "$WORK/tmp")"
[ -e "$WORK/tmp/checkpoint.tmp.other_host.$dead" ] && pass "another host's tmp file stays, whatever its pid is here" \
    || fail "another host's tmp file stays" "$(ls "$WORK/tmp")"

# --- metrics.jsonl after a kill between an epoch's line and its checkpoint -------
# 32 steps per epoch: run to step 35, then drop the checkpoints from step 32 on,
# as if the run had been killed after writing epoch 1's line (step 32) but
# before committing ckpt-32; the resumed run writes epoch 1's line again.
check "train to step 35" "$LOOM" train $CFG --model-dir "$WORK/k" "${OPT[@]}" --set run.max_steps=35 --set run.checkpoint_steps=10
rm -f "$WORK/k/ckpt-32.loom" "$WORK/k/ckpt-35.loom"
printf '{"event": "epoch", "epoch": 2, "st' >> "$WORK/k/metrics.jsonl" # a line cut short by the kill
out=$("$LOOM" train $CFG --model-dir "$WORK/k" "${OPT[@]}" --set run.max_steps=35 --set run.checkpoint_steps=10 2>&1)
contains "resumed from step 30" "resuming from $WORK/k/ckpt-30.loom (step 30" "$out"
contains "the lines after the checkpoint are removed, and said" "removed 3 lines written after the checkpoint of step 30" "$out"
n=$(grep -c '"event": "epoch", "epoch": 1,' "$WORK/k/metrics.jsonl")
[ "$n" = 1 ] && pass "epoch 1 has one line in metrics.jsonl" || fail "epoch 1 has one line in metrics.jsonl" "$n lines" "$(cat "$WORK/k/metrics.jsonl")"
n=$(grep -c '"event": "end"' "$WORK/k/metrics.jsonl")
[ "$n" = 1 ] && pass "and one end line" || fail "and one end line" "$n end lines"
bad=$(grep -vc '}$' "$WORK/k/metrics.jsonl")
[ "$bad" = 0 ] && pass "every line is whole" || fail "every line is whole" "$(grep -v '}$' "$WORK/k/metrics.jsonl")"

# --- a rerun of a finished run ------------------------------------------------------
before=$(cat "$WORK/k/metrics.jsonl")
out=$("$LOOM" train $CFG --model-dir "$WORK/k" "${OPT[@]}" --set run.max_steps=35 2>&1); status=$?
[ $status -eq 0 ] && pass "a rerun of a finished run succeeds" || fail "a rerun of a finished run succeeds" "$out"
contains "and says the run is finished" "nothing to do: the run in $WORK/k is finished, at step 35" "$out"
[ "$before" = "$(cat "$WORK/k/metrics.jsonl")" ] && pass "and writes no second end line" ||
    fail "and writes no second end line" "$(diff <(echo "$before") "$WORK/k/metrics.jsonl" | head -4)"

# --- a checkpoint at an epoch's last step, then its line, then a kill ------------------
# checkpoint_steps = 32 = one epoch: ckpt-32 is taken at the epoch's last step, before
# its end (epoch 0 in progress); its line (step 32, epoch 1) follows, then ckpt-32 is
# rewritten for epoch 1. A kill between the line and that rewrite resumes from the
# first ckpt-32, whose step is the line's: the line must go by its epoch.
check "train to the last step of epoch 1" "$LOOM" train $CFG --model-dir "$WORK/e" "${OPT[@]}" --set run.max_steps=32 \
    --set run.checkpoint_steps=32
grep -v '"event": "end"' "$WORK/e/metrics.jsonl" >"$WORK/e/m" && mv "$WORK/e/m" "$WORK/e/metrics.jsonl"
echo '{"event": "epoch", "epoch": 1, "step": 32, "train_loss": 1}' >>"$WORK/e/metrics.jsonl" # the line before the kill
check "resume at the epoch's end" "$LOOM" train $CFG --model-dir "$WORK/e" "${OPT[@]}" --set run.max_steps=40 \
    --set run.checkpoint_steps=32
n=$(grep -c '"event": "epoch", "epoch": 1,' "$WORK/e/metrics.jsonl")
[ "$n" = 1 ] && pass "epoch 1 has one line after a kill between its line and its end's checkpoint" ||
    fail "epoch 1 has one line after a kill between its line and its end's checkpoint" "$n lines" "$(cat "$WORK/e/metrics.jsonl")"

echo "# files.sh took $((SECONDS - T0)) s"
# --- FIFOs in the other places loom opens a user's file (issue 11 follow-up) ---
# metrics.jsonl in the model directory: --fresh skips reading it, so the append met it first
rm -rf "$WORK/mf"; mkdir -p "$WORK/mf"; mkfifo "$WORK/mf/metrics.jsonl"
expect_fail 1 "a FIFO as metrics.jsonl (--fresh) is refused, not waited on" \
    "metrics.jsonl: is a FIFO (named pipe), not a regular file: refused" \
    timeout 20 "$LOOM" train $CFG --model-dir "$WORK/mf" "${OPT[@]}" --set run.max_steps=2 --fresh
# ... and by the sidecar evaluator, which appends its eval lines there
rm -f "$WORK/m/metrics.jsonl"; mkfifo "$WORK/m/metrics.jsonl"
expect_fail 1 "a FIFO as metrics.jsonl is refused by evaluate --watch" \
    "metrics.jsonl: is a FIFO (named pipe), not a regular file: refused" \
    timeout 20 "$LOOM" evaluate $CFG --model-dir "$WORK/m" --watch --idle-timeout 5 --set run.eval_steps=1
rm -f "$WORK/m/metrics.jsonl"
# the npy plugin's arrays
mkfifo "$WORK/x.npy"
printf '\223NUMPY\001\000v\000{'"'"'descr'"'"': '"'"'<i8'"'"', '"'"'fortran_order'"'"': False, '"'"'shape'"'"': (1,), }%*s\n' 59 '' > "$WORK/y.npy"
printf '\001\000\000\000\000\000\000\000' >> "$WORK/y.npy"
cat > "$WORK/npy.cfg" <<CFG
version = 1;
data: { train: { source: { type = "npy"; options: { x = "$WORK/x.npy"; label = "$WORK/y.npy"; }; };
                 transforms = ( { op = "batch"; size = 1; } ); }; };
model: { input = "x"; layers = ( { type = "flatten"; }, { type = "dense"; units = 2; } ); };
optimizer: { type = "sgd"; learning_rate = 0.1; };
run: { model_dir = "$WORK/npy_run"; epochs = 1; };
CFG
expect_fail 2 "a FIFO as an npy source's array is refused, not waited on" \
    "$WORK/x.npy is a FIFO (named pipe), not a regular file: refused" timeout 20 "$LOOM" check "$WORK/npy.cfg"
# the cache transform's data file (replaced after a first run wrote it) and its lock file
cat > "$WORK/cache.cfg" <<CFG
version = 1;
data: { train: { source: { type = "catalog"; name = "fashion_mnist"; split = "train"; };
                 transforms = ( { op = "take"; count = 64; }, { op = "cache"; file = "$WORK/cc/c"; }, { op = "batch"; size = 32; },
                                  { op = "map"; fn = "scale"; feature = "image"; scale = 0.00392156862745098; } ); }; };
model: { layers = ( { type = "flatten"; }, { type = "dense"; units = 10; } ); };
optimizer: { type = "sgd"; learning_rate = 0.01; };
run: { model_dir = "$WORK/c0"; epochs = 2; progress = "none"; };
CFG
mkdir -p "$WORK/cc"
check "a cached run writes the cache" timeout 60 "$LOOM" train "$WORK/cache.cfg" --model-dir "$WORK/c1"
[ -f "$WORK/cc/c.data" ] && [ -f "$WORK/cc/c.index" ] && pass "c.data and c.index written" || fail "c.data and c.index written" "$(ls "$WORK/cc")"
rm -f "$WORK/cc/c.data"; mkfifo "$WORK/cc/c.data"
expect_fail 2 "a FIFO as the cache's data file is refused, not waited on" \
    "cache: $WORK/cc/c.data: is a FIFO (named pipe), not a regular file: refused" \
    timeout 20 "$LOOM" train "$WORK/cache.cfg" --model-dir "$WORK/c2"
rm -f "$WORK/cc/"*; mkfifo "$WORK/cc/c.lock"
expect_fail 2 "a FIFO as the cache's lock file is refused" "cache: $WORK/cc/c.lock is not a regular file: refused" \
    timeout 20 "$LOOM" train "$WORK/cache.cfg" --model-dir "$WORK/c3"

# --- the paths loom writes for the user (issue 22): export, predict, records
# convert wrote a temporary file and renamed it over whatever was there, so a
# FIFO, a directory or a device node (as root, --output /dev/null) became a
# regular file and the command exited 0. Now: refused before anything is
# written, naming the path; a symbolic link to a regular file is written
# through (the link stays, its target gets the content).
O="$WORK/out"; mkdir -p "$O/dir"; mkfifo "$O/fifo"; ln -s "$O/fifo" "$O/to_fifo"
kind_is() { # NAME PATH TEST-FLAG: PATH is still of its kind
    if [ "$3" "$2" ] && [ ! -L "$2" -o "$3" = -L ]; then pass "$1"; else fail "$1" "$(ls -la "$2")"; fi
}
for fmt in npz onnx; do
    EX=(timeout 60 "$LOOM" export $CFG --model-dir "$WORK/m" --format $fmt --output)
    expect_fail 1 "export $fmt --output FIFO: refused" "$O/fifo: is a FIFO (named pipe), not a regular file: refused, nothing was written" \
        "${EX[@]}" "$O/fifo"
    kind_is "export $fmt --output FIFO: still a FIFO" "$O/fifo" -p
    expect_fail 1 "export $fmt --output DIR: refused" "$O/dir: is a directory, not a regular file: refused" "${EX[@]}" "$O/dir"
    kind_is "export $fmt --output DIR: still a directory" "$O/dir" -d
    expect_fail 1 "export $fmt --output LINK-TO-FIFO: refused" "$O/to_fifo: is a symbolic link to $O/fifo, which is a FIFO" \
        "${EX[@]}" "$O/to_fifo"
    kind_is "export $fmt --output LINK-TO-FIFO: still a link" "$O/to_fifo" -L
    echo old > "$O/real_$fmt"; ln -sf "real_$fmt" "$O/link_$fmt"
    check "export $fmt --output LINK-TO-FILE: written through" "${EX[@]}" "$O/link_$fmt"
    kind_is "export $fmt --output LINK-TO-FILE: the link stays a link" "$O/link_$fmt" -L
    check "export $fmt: the link's target holds the export" cmp -s "$O/real_$fmt" "$O/link_$fmt"
    [ "$(stat -c %s "$O/real_$fmt")" -gt 1000 ] && pass "export $fmt: the target has the new content" || fail "export $fmt: the target has the new content" "$(ls -la "$O")"
done
if [ "$(id -u)" = 0 ]; then # a device node, as root only (mknod); /dev/null itself is never touched
    mknod "$O/null" c 1 3
    expect_fail 1 "export --output CHAR-DEVICE: refused" "$O/null: is a character device, not a regular file: refused" \
        timeout 60 "$LOOM" export $CFG --model-dir "$WORK/m" --format npz --output "$O/null"
    kind_is "export --output CHAR-DEVICE: still a character device" "$O/null" -c
fi
PR=(timeout 60 "$LOOM" predict $CFG --model-dir "$WORK/m" --output)
expect_fail 1 "predict --output FIFO: refused, not waited on" "$O/fifo: is a FIFO (named pipe), not a regular file: refused" "${PR[@]}" "$O/fifo"
kind_is "predict --output FIFO: still a FIFO" "$O/fifo" -p
expect_fail 1 "predict --output DIR: refused" "$O/dir: is a directory, not a regular file: refused" "${PR[@]}" "$O/dir"
echo old > "$O/real.csv"; ln -s real.csv "$O/pred.csv"
check "predict --output LINK-TO-FILE: written through" "${PR[@]}" "$O/pred.csv"
kind_is "predict --output LINK-TO-FILE: the link stays a link" "$O/pred.csv" -L
[ "$(head -c 6 "$O/real.csv")" = "index," ] && [ "$(wc -l < "$O/real.csv")" -gt 100 ] && pass "predict: the link's target holds the CSV" ||
    fail "predict: the link's target holds the CSV" "$(head -2 "$O/real.csv")"
ls "$O" | grep -q '\.tmp\.' && fail "no temporary files left" "$(ls "$O")" || pass "no temporary files left"
printf 'a,label\n1,0\n2,1\n' > "$O/t.csv"
mkfifo "$O/rec-00001-of-00002.tfrecord"
expect_fail 1 "records convert: a FIFO among the shards is refused before any shard is written" \
    "$O/rec-00001-of-00002.tfrecord: is a FIFO (named pipe), not a regular file: refused" \
    timeout 60 "$LOOM" records convert --csv "$O/t.csv" --label-column label --output "$O/rec" --shards 2
[ ! -e "$O/rec-00000-of-00002.tfrecord" ] && pass "records convert: shard 0 not written" || fail "records convert: shard 0 not written" "$(ls "$O")"
kind_is "records convert: the FIFO is still a FIFO" "$O/rec-00001-of-00002.tfrecord" -p
echo old > "$O/shard_target"; ln -s shard_target "$O/one-00000-of-00001.tfrecord"
check "records convert: a link to a regular file is written through" \
    timeout 60 "$LOOM" records convert --csv "$O/t.csv" --label-column label --output "$O/one"
kind_is "records convert: the link stays a link" "$O/one-00000-of-00001.tfrecord" -L
n=$("$LOOM" records count "$O/shard_target" 2>&1 | awk '/shard_target/ {print $1}')
[ "$n" = 2 ] && pass "records convert: the target holds the records" || fail "records convert: the target holds the records" "count: $n"

# --- paths in messages are normalised (issue 22): --model-dir DIR/j6/../j5
# named its checkpoints "DIR/j6/../j5/ckpt-N.loom"
mkdir -p "$WORK/j6"
out=$(cd "$WORK/j6" && "$LOOM" train "$ROOT/$CFG" --model-dir ../j5 "${OPT[@]}" --set run.max_steps=2 2>&1)
contains "a relative --model-dir with .. is shown normalised" "checkpoint $WORK/j5/ckpt-2.loom" "$out"
out=$("$LOOM" train $CFG --model-dir "$WORK/j6/../j5/" "${OPT[@]}" --set run.max_steps=3 2>&1)
contains "an absolute --model-dir with .. is shown normalised" "checkpoint $WORK/j5/ckpt-3.loom" "$out"
grep -q '/\.\./' <<<"$out" && fail "no /../ left in any message" "$out" || pass "no /../ left in any message"
cp $CFG "$WORK/j6/rel.cfg"
out=$("$LOOM" train "$WORK/j6/rel.cfg" --set run.model_dir='"../j8"' "${OPT[@]}" --set run.max_steps=1 2>&1)
contains "run.model_dir relative to the config's directory is normalised too" "checkpoint $WORK/j8/ckpt-1.loom" "$out"

finish
