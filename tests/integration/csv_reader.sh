#!/usr/bin/env bash
# csv_reader.sh - one CSV reader (issue 12, item 1): `loom records convert --csv`
# and the csv source read files with the same RFC 4180 reader
# (data/source/csv.c), so a malformed file gets the same error, at the same
# file:line, from both; and quoting, CRLF, blank lines and a quoted line break
# mean the same to both.
source "$(dirname "$0")/lib.sh"

cfg() { # cfg NAME CSV: a config training on CSV's columns x (float32) and label (int64)
    cat > "$WORK/$1.cfg" <<CFG
version = 1;
data: {
  train: {
    source: { type = "csv"; files = ["$2"]; columns: { x = { dtype = "float32"; }; label = { dtype = "int64"; }; }; };
    transforms = ( { op = "batch"; size = 2; } );
  };
};
model: {
  input = "x"; label = "label"; loss = "sparse_softmax_cross_entropy";
  layers = ( { type = "flatten"; }, { type = "dense"; units = 2; } );
};
optimizer: { type = "sgd"; learning_rate = 0.1; };
strategy: { type = "one_device"; };
run: { model_dir = "$WORK/run_$1"; epochs = 1; seed = 1; };
CFG
}

# both NAME FILE WANT: convert and train both fail (exit 1) with WANT in their output.
both() {
    cfg "$1" "$2"
    expect_fail 1 "records convert: $1" "$3" timeout 60 "$LOOM" records convert --csv "$WORK/$2" --output "$WORK/out_$1"
    expect_fail 1 "csv source: $1" "$3" timeout 60 "$LOOM" train "$WORK/$1.cfg"
}

printf 'x,label\n0.5,1\n"0.25,0\n1,1\n' > "$WORK/open.csv"
both unterminated open.csv "open.csv:3: unterminated quoted field (field 1)"
printf 'x,label\n"0.5"x,1\n' > "$WORK/after.csv"
both after_quote after.csv "after.csv:2: field 1: 'x' after the closing quote"

# The same well-formed file (quoted numbers, CRLF, a blank line, a quoted line
# break in a column the source ignores) is 4 rows to both.
printf 'x,label,note\r\n"0.5",1,a\r\n\r\n-0.5,0,"two\nlines"\r\n0.25,"1",b\r\n-1,0,\r\n' > "$WORK/good.csv"
out=$(timeout 60 "$LOOM" records convert --csv "$WORK/good.csv" --output "$WORK/good" 2>&1)
contains "records convert: 4 rows, typed from all of them" "good.csv: 4 rows; features: x float_list, label int64_list, note bytes_list" "$out"
out=$(timeout 60 "$LOOM" records head -n 4 "$WORK/good-00000-of-00001.tfrecord" 2>&1)
contains "records convert: the quoted line break stays in the field" '["two\nlines"]' "$out"
cfg good good.csv
out=$(timeout 60 "$LOOM" train "$WORK/good.cfg" --set run.max_steps=2 2>&1)
contains "csv source: the same file is 2 batches of 2" "step 2" "$out"
finish
