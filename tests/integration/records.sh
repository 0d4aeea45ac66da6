#!/usr/bin/env bash
# records.sh - `loom records convert|count|verify|head`: Fashion-MNIST IDX to
# TFRecord shards (zstd and gzip), counting, verifying (also a corrupted shard),
# showing, CSV conversion with RFC 4180 quoting, TensorFlow's own fixtures,
# bad usage, and, when TensorFlow is importable, tf.data reading the shards back.
source "$(dirname "$0")/lib.sh"
FM="${LOOM_DATASETS_DIR:-/usr/share/datasets}/fashion-mnist"
R="$WORK/rec"; mkdir -p "$R"
FIX=tests/fixtures/tf

skip() { T=$((T + 1)); echo "ok $T - $1 # SKIP $2"; }
# run CMD...: sets $out (stdout+stderr) and $status.
run() { out=$("$@" 2>&1); status=$?; }
# status_is NAME WANT: passes when the last run exited with WANT.
status_is() { if [ "$status" -eq "$2" ]; then pass "$1"; else fail "$1" "exit status $status, expected $2" "$(echo "$out" | tail -5)"; fi; }
# flip FILE OFFSET: inverts one byte in place.
flip() { python3 -c 'import sys; p, o = sys.argv[1], int(sys.argv[2]); b = bytearray(open(p, "rb").read()); b[o] ^= 0xff; open(p, "wb").write(b)' "$1" "$2"; }
# idx_label FILE INDEX: the label at INDEX of a gzip IDX label file.
idx_label() { python3 -c 'import gzip, sys; print(gzip.open(sys.argv[1]).read()[8 + int(sys.argv[2])])' "$1" "$2"; }

# --- Fashion-MNIST: convert, count, verify, head ----------------------------
if [ -r "$FM/train-images-idx3-ubyte.gz" ] && [ -r "$FM/t10k-labels-idx1-ubyte.gz" ]; then
    run "$LOOM" records convert --images "$FM/train-images-idx3-ubyte.gz" --labels "$FM/train-labels-idx1-ubyte.gz" \
        --output "$R/train" --shards 4 --compression zstd
    status_is "convert train split to 4 zstd shards" 0
    contains "convert prints a summary" "converted 60000 records into 4 zstd shards" "$out"
    names=$(cd "$R" && ls train-*)
    want=$(printf 'train-%05d-of-00004.tfrecord.zst\n' 0 1 2 3)
    if [ "$names" = "$want" ]; then pass "shards named as TensorFlow names them, no .tmp left"; else fail "shard names" "$names"; fi
    run "$LOOM" records convert --images "$FM/t10k-images-idx3-ubyte.gz" --labels "$FM/t10k-labels-idx1-ubyte.gz" \
        --output "$R/test" --compression gzip
    status_is "convert test split to one gzip file" 0
    magic=$(head -c 2 "$R/test-00000-of-00001.tfrecord.gz" | od -An -tx1 | tr -d ' ')
    if [ "$magic" = "1f8b" ]; then pass "the gzip file starts with the gzip magic"; else fail "gzip magic" "$magic"; fi

    run "$LOOM" records count "$R"/train-*
    status_is "count the train shards" 0
    contains "count says 60000 in total" "60000  total (4 files)" "$out"
    contains "count: contiguous shards of 15000, zstd detected" "15000  zstd  $R/train-00003-of-00004.tfrecord.zst" "$out"
    run "$LOOM" records count "$R/test-00000-of-00001.tfrecord.gz"
    contains "count says 10000 for the test split (gzip detected)" "10000  gzip" "$out"

    run "$LOOM" records verify "$R"/train-* "$R/test-00000-of-00001.tfrecord.gz"
    status_is "verify passes on sound files" 0
    contains "verify reports all sound" "all 5 files sound" "$out"

    cp "$R/train-00001-of-00004.tfrecord.zst" "$R/bad.tfrecord.zst"
    flip "$R/bad.tfrecord.zst" $(( $(stat -c %s "$R/bad.tfrecord.zst") / 2 ))
    run "$LOOM" records verify "$R/bad.tfrecord.zst" "$R/train-00000-of-00004.tfrecord.zst"
    status_is "verify exits 1 on a shard with one corrupted byte" 1
    if grep -q "^$R/bad.tfrecord.zst: BAD: .*offset [0-9]" <<<"$out"; then pass "verify names the bad file and an offset"
    else fail "verify names the bad file and an offset" "$out"; fi
    contains "verify goes on with the next file" "$R/train-00000-of-00004.tfrecord.zst: ok, 15000 records" "$out"

    # Uncompressed: each record is 16 + 822 bytes, so record 5 starts at 4190.
    run "$LOOM" records convert --images "$FM/t10k-images-idx3-ubyte.gz" --labels "$FM/t10k-labels-idx1-ubyte.gz" \
        --output "$R/plain"
    status_is "convert the test split uncompressed" 0
    flip "$R/plain-00000-of-00001.tfrecord" $((838 * 5 + 100))
    run "$LOOM" records verify "$R/plain-00000-of-00001.tfrecord"
    status_is "verify: payload CRC mismatch exits 1" 1
    contains "verify: the exact offset of the bad record" "data CRC mismatch" "$out"
    contains "verify: offset 4190" "at offset 4190" "$out"
    run "$LOOM" records count "$R/plain-00000-of-00001.tfrecord"
    status_is "count fails on a damaged file" 1

    run "$LOOM" records head "$R/test-00000-of-00001.tfrecord.gz"
    status_is "head on the test split" 0
    contains "head shows the image as 784 bytes" "bytes_list  length 1    [784 bytes: 00" "$out"
    contains "head shows the first label" "label  int64_list  length 1    [$(idx_label "$FM/t10k-labels-idx1-ubyte.gz" 0)]" "$out"
    contains "head shows 3 records by default" "record 2 (offset 1676, 822 bytes): 2 features" "$out"
    run "$LOOM" records head -n 1 "$R/train-00001-of-00004.tfrecord.zst"
    contains "contiguous sharding: shard 1 starts at item 15000" \
        "label  int64_list  length 1    [$(idx_label "$FM/train-labels-idx1-ubyte.gz" 15000)]" "$out"
    if grep -q "record 1 " <<<"$out"; then fail "head -n 1 shows one record" "$out"; else pass "head -n 1 shows one record"; fi
else
    for n in convert names convert-test magic count count-total count-shards count-test verify verify-ok \
             corrupt corrupt-offset corrupt-next plain plain-status plain-crc plain-offset plain-count \
             head head-784 head-label head-3 head-contiguous head-n1; do
        skip "Fashion-MNIST $n" "Fashion-MNIST is not installed under $FM"
    done
fi

# --- CSV ----------------------------------------------------------------------
printf 'id,name,score,species,notes\r\n1,"Smith, John",3.5,0,"said ""hi"""\r\n2,Jane,4,1,\r\n\r\n3,"two\nlines",-2e3,2,plain\r\n' > "$R/pets.csv"
run "$LOOM" records convert --csv "$R/pets.csv" --label-column species --output "$R/pets" --compression zlib
status_is "convert a CSV with quoted fields" 0
contains "CSV column kinds inferred from all rows" \
    "id int64_list, name bytes_list, score float_list, label int64_list (from column \"species\"), notes bytes_list" "$out"
run "$LOOM" records head -n 5 "$R/pets-00000-of-00001.tfrecord.zz"
contains "CSV: a quoted comma stays in the field" '["Smith, John"]' "$out"
contains "CSV: doubled quotes are one quote" '["said \"hi\""]' "$out"
contains "CSV: a quoted line break stays in the field" '["two\nlines"]' "$out"
contains "CSV: numbers typed as floats" "score  float_list  length 1    [-2000]" "$out"
contains "CSV: the label column is stored as label" "label  int64_list  length 1    [2]" "$out"
contains "CSV: blank line skipped, 3 records" "record 2 (" "$out"
printf 'a,b\n1,"open\n2,3\n' > "$R/unterminated.csv"
expect_fail 1 "CSV: an unterminated quote names file:line" "unterminated.csv:2: unterminated quoted field" \
    "$LOOM" records convert --csv "$R/unterminated.csv" --output "$R/bad1"
printf 'a,b\n1,2\n3\n' > "$R/short.csv"
expect_fail 1 "CSV: a short row names file:line" "short.csv:3: row has 1 field but the header has 2 columns" \
    "$LOOM" records convert --csv "$R/short.csv" --output "$R/bad2"
if compgen -G "$R/bad[12]*" >/dev/null; then fail "failed conversions leave no files" "$(ls "$R")"; else pass "failed conversions leave no files"; fi
expect_fail 2 "CSV: --label-column names a missing column" "no such column (columns: id, name, score, species, notes)" \
    "$LOOM" records convert --csv "$R/pets.csv" --label-column kind --output "$R/bad3"

# --- TensorFlow's fixtures ------------------------------------------------------
for f in examples.tfrecord examples.tfrecord.gz examples.tfrecord.zlib; do
    run "$LOOM" records count "$FIX/$f"
    contains "count the TensorFlow fixture $f" "20  total (1 file)" "$out"
done
run "$LOOM" records verify "$FIX"/examples.tfrecord*
status_is "verify the TensorFlow fixtures" 0
run "$LOOM" records head -n 3 "$FIX/examples.tfrecord.gz"
contains "head of a TF fixture: bytes as text" '["item-2"]' "$out"
contains "head of a TF fixture: floats" 'weights  float_list  length 3    [0.5, -3, 0.3333333]' "$out"
contains "head of a TF fixture: int64s" 'tokens   int64_list  length 2    [3000009, -6000018]' "$out"
contains "head of a TF fixture: empty list" 'tokens   int64_list  length 0    []' "$out"
run "$LOOM" records head "$FIX/expected.json"
status_is "head of a file that is not TFRecord exits 1" 1
contains "... and says so" "not a TFRecord file" "$out"

# --- missing files and bad usage --------------------------------------------------
expect_fail 1 "count: a missing file is a runtime error (1)" "$R/nope.tfrecord" "$LOOM" records count "$R/nope.tfrecord"
expect_fail 1 "verify: a missing file is a runtime error (1)" "$R/nope.tfrecord: BAD" "$LOOM" records verify "$R/nope.tfrecord"
expect_fail 1 "head: a missing file is a runtime error (1)" "No such file" "$LOOM" records head "$R/nope.tfrecord"
expect_fail 1 "convert: a missing IDX file is a runtime error (1)" "$R/nope.idx" \
    "$LOOM" records convert --images "$R/nope.idx" --labels "$R/nope.idx" --output "$R/x"
expect_fail 2 "no subcommand" "missing subcommand" "$LOOM" records
expect_fail 2 "unknown subcommand suggests one" 'did you mean "verify"' "$LOOM" records verfy x
expect_fail 2 "count without files" "missing FILE" "$LOOM" records count
expect_fail 2 "unknown compression lists the valid ones" "(expected one of: none, gzip, zlib, zstd)" \
    "$LOOM" records convert --csv "$R/pets.csv" --output "$R/x" --compression lz4
expect_fail 2 "--shards 0" "expected an integer from 1 to 99999" "$LOOM" records convert --csv "$R/pets.csv" --output "$R/x" --shards 0
expect_fail 2 "convert without input" "needs --images IDX and --labels IDX, or --csv FILE" "$LOOM" records convert --output "$R/x"
expect_fail 2 "convert without --output" "missing --output PREFIX" "$LOOM" records convert --csv "$R/pets.csv"
expect_fail 2 "an option of another subcommand" "does not apply" "$LOOM" records count --shards 2 "$R/pets.csv"
expect_fail 2 "head -n needs a number" "expected a number of records" "$LOOM" records head -n many "$R/pets.csv"
expect_fail 2 "unknown option" "unknown option --fast" "$LOOM" records verify --fast "$R/pets.csv"
run "$LOOM" records convert --help
status_is "convert --help exits 0" 0
contains "convert --help documents contiguous sharding" "Sharding is contiguous" "$out"
for s in count verify head; do
    run "$LOOM" records $s --help
    contains "$s --help" "usage: loom records $s FILE..." "$out"
done
run "$LOOM" --help
contains "loom --help lists records" "records   convert IDX or CSV" "$out"

# --- TensorFlow reads what Loom wrote -----------------------------------------------
if [ ! -e "$R/test-00000-of-00001.tfrecord.gz" ]; then
    skip "tf.data reads the gzip shard; labels and images match the IDX" "Fashion-MNIST is not installed"
elif ! python3 -c 'import tensorflow' >/dev/null 2>&1; then
    skip "tf.data reads the gzip shard; labels and images match the IDX" "tensorflow not installed"
else
    run env TF_CPP_MIN_LOG_LEVEL=3 python3 - "$R/test-00000-of-00001.tfrecord.gz" "$FM" <<'PY'
import gzip, sys
import tensorflow as tf
path, fm = sys.argv[1], sys.argv[2]
images = gzip.open(fm + "/t10k-images-idx3-ubyte.gz").read()[16:]
labels = gzip.open(fm + "/t10k-labels-idx1-ubyte.gz").read()[8:]
spec = {"image": tf.io.FixedLenFeature([], tf.string), "label": tf.io.FixedLenFeature([], tf.int64)}
want = {0, 1, 2, 4999, 9998, 9999}
n = 0
for i, raw in enumerate(tf.data.TFRecordDataset(path, compression_type="GZIP")):
    n += 1
    if i in want:
        ex = tf.io.parse_single_example(raw, spec)
        assert int(ex["label"]) == labels[i], (i, int(ex["label"]), labels[i])
        assert ex["image"].numpy() == images[784 * i: 784 * (i + 1)], i
assert n == 10000, n
print("tf ok", n)
PY
    if [ "$status" -eq 0 ] && grep -q "tf ok 10000" <<<"$out"; then
        pass "tf.data reads the gzip shard; labels and images match the IDX"
    else
        fail "tf.data reads the gzip shard; labels and images match the IDX" "$(echo "$out" | tail -5)"
    fi
fi

finish
