#!/usr/bin/env bash
# input_pipelines.sh - `loom profile CONFIG --input-pipeline ID/N` on real
# TFRecord shards (the Fashion-MNIST test split, `loom records convert
# --shards 4`): data.train.shard_policy FILE, DATA, AUTO and OFF give each of N
# pipelines exactly its files or its final elements, the N pipelines together
# read every sample once, and a pipeline that would get no data is an error
# naming it (not an empty pass). Identity of every element is in the unit test
# (test_distribute_input).
source "$(dirname "$0")/lib.sh"
FM="${LOOM_DATASETS_DIR:-/usr/share/datasets}/fashion-mnist"
R="$WORK/rec"
if ! [ -r "$FM/t10k-images-idx3-ubyte.gz" ]; then
    echo "1..0 # SKIP $FM is missing (apt install dataset-fashion-mnist)"
    exit 0
fi
"$LOOM" records convert --images "$FM/t10k-images-idx3-ubyte.gz" --labels "$FM/t10k-labels-idx1-ubyte.gz" \
    --output "$R/test" --shards 4 --compression zstd >/dev/null || { echo "Bail out! records convert failed"; exit 1; }
CFG="$WORK/shards.cfg"
cat >"$CFG" <<EOF
version = 1;
data: {
  train: {
    source: {
      type = "tfrecord";
      files = ["$R/test-*.tfrecord.zst"];
      features: {
        image = { dtype = "uint8"; shape = [28, 28]; };
        label = { dtype = "int64"; shape = []; };
      };
    };
    transforms = ({ op = "batch"; size = 100; }, { op = "prefetch"; buffer = 2; });
    shard_policy = "file";
  };
};
model: { layers = ({ type = "flatten"; }, { type = "dense"; units = 10; }); };
optimizer: { type = "sgd"; learning_rate = 0.1; };
run: { model_dir = "$WORK/model"; };
EOF

# profile POLICY ID/N: one whole pass of that pipeline; sets $out and $status.
profile() { out=$("$LOOM" profile "$CFG" --steps 1000000 --set "data.train.shard_policy=\"$1\"" --input-pipeline "$2" 2>&1); status=$?; }
# samples: the sample count of the last profile.
samples() { sed -n 's/^profile data.train: [0-9]* elements (\([0-9]*\) samples).*/\1/p' <<<"$out"; }
# cover POLICY N WANT_EACH...: every pipeline of N succeeds with its expected sample count; they add up to 10000.
cover() {
    local policy=$1 n=$2 total=0 bad=""; shift 2
    for ((i = 0; i < n; i++)); do
        profile "$policy" "$i/$n"
        local s; s=$(samples)
        [ "$status" -eq 0 ] && [ "$s" = "$1" ] || bad="$bad pipeline $i: status $status, ${s:-no} samples (want $1);"
        total=$((total + ${s:-0})); shift
    done
    if [ -z "$bad" ] && [ "$total" -eq 10000 ]; then pass "$policy over $n pipelines reads all 10000 samples once"
    else fail "$policy over $n pipelines" "$bad total $total" "$(echo "$out" | tail -3)"; fi
}

# FILE: pipeline i of 2 reads shards i and i+2, whole
profile file 1/2
contains "file 1/2: the policy applied" 'input pipeline 1 of 2: shard_policy "file" applies file' "$out"
contains "file 1/2: 2 of the 4 files" "input pipeline 1 of 2: 2 of 4 files:" "$out"
contains "file 1/2: its first file" "  $R/test-00001-of-00004.tfrecord.zst" "$out"
contains "file 1/2: its second file" "  $R/test-00003-of-00004.tfrecord.zst" "$out"
if grep -q "test-00000\|test-00002" <<<"$out"; then fail "file 1/2 reads no other shard" "$out"; else pass "file 1/2 reads no other shard"; fi
contains "file 1/2: 5000 samples" "50 elements (5000 samples)" "$out"
cover file 2 5000 5000
cover file 4 2500 2500 2500 2500
# DATA: 100 batches of 100 dealt round-robin, before the trailing prefetch
profile data 2/3
contains "data 2/3: which elements" "input pipeline 2 of 3: the final elements p with p % 3 == 2 (before the trailing prefetch)" "$out"
contains "data 2/3: the shard stage in the report" "auto_shard(data 2/3)" "$out"
cover data 3 3400 3300 3300
# AUTO: FILE with 4 files for 4 pipelines, DATA for 6
profile auto 3/4
contains "auto with 4 files for 4 pipelines is FILE" 'shard_policy "auto" applies file' "$out"
cover auto 4 2500 2500 2500 2500
profile auto 5/6
contains "auto with 4 files for 6 pipelines falls back to DATA" 'shard_policy "auto" applies data' "$out"
contains "auto says why it fell back" "4 files for 6 input pipelines, so each reads every file" "$out"
cover auto 6 1700 1700 1700 1700 1600 1600
cover off 1 10000
profile off 1/3
contains "off: every pipeline reads everything" "100 elements (10000 samples)" "$out"

# no data: an error naming the pipeline and what to change, exit status 2
expect_fail 2 "file with fewer files than pipelines is refused" \
    'data.train: input pipeline 0 of 5 would receive no data: shard_policy "file" splits 4 files among 5 pipelines, so pipeline 4 gets none' \
    "$LOOM" profile "$CFG" --input-pipeline 0/5
expect_fail 2 "the refusal says what to do" 'hint: write at least 5 files (loom records convert --shards 5), or set data.train.shard_policy = "data" or "off"' \
    "$LOOM" profile "$CFG" --input-pipeline 4/5
expect_fail 1 "DATA over more pipelines than batches fails when the pass ends" \
    'input pipeline 100 of 101 received no data in epoch 0: shard_policy "data" keeps 1 element in 101 and the dataset ended after 100' \
    "$LOOM" profile "$CFG" --set 'data.train.shard_policy="data"' --input-pipeline 100/101 --steps 1000000
expect_fail 2 "--input-pipeline needs ID < N" 'expects ID/N with 0 <= ID < N, got "2/2"' "$LOOM" profile "$CFG" --input-pipeline 2/2
expect_fail 2 "--input-pipeline needs ID/N" 'got "1"' "$LOOM" profile "$CFG" --input-pipeline 1
expect_fail 2 "an unknown policy is a config error" 'did you mean "data"?' \
    "$LOOM" profile "$CFG" --set 'data.train.shard_policy="dat"'
finish
