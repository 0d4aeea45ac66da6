#!/usr/bin/env bash
# cli.sh - the command line: help, version, usage errors, --set, check --print.
source "$(dirname "$0")/lib.sh"

out=$("$LOOM" --help 2>&1); contains "--help lists the commands" "predict" "$out"
out=$("$LOOM" --version 2>&1); contains "--version" "loom 0." "$out"
for c in train evaluate predict check; do
    out=$("$LOOM" $c --help 2>&1); contains "$c --help shows its usage" "usage: loom $c" "$out"
done
expect_fail 2 "no command is a usage error" "usage:" "$LOOM"
expect_fail 2 "unknown command suggests the nearest" 'did you mean "train"' "$LOOM" trian x.cfg
expect_fail 2 "missing config argument" "missing CONFIG" "$LOOM" train
expect_fail 2 "unknown option" "unknown option --bogus" "$LOOM" train configs/fashion_mnist_mlp.cfg --bogus
expect_fail 2 "option that does not apply" "does not apply" "$LOOM" check configs/fashion_mnist_mlp.cfg --fresh
expect_fail 2 "missing config file" "nonexistent.cfg" "$LOOM" check nonexistent.cfg
expect_fail 2 "--set without =" "expected key.path=value" "$LOOM" check configs/fashion_mnist_mlp.cfg --set run.epochs

# --print gives the resolved config with defaults, and it loads back
out=$("$LOOM" check --print configs/fashion_mnist_mlp.cfg --set run.epochs=2 --set strategy.type=one_device 2>&1)
contains "--set overrides an int" "epochs = 2" "$out"
contains "--print fills in defaults" "keep_checkpoints" "$out"
echo "$out" > "$WORK/printed.cfg"
check "printed config loads back" "$LOOM" check --print "$WORK/printed.cfg"
a=$("$LOOM" check --print "$WORK/printed.cfg" 2>&1)
if [ "$(echo "$a" | grep -v '^#')" = "$(echo "$out" | grep -v '^#')" ]; then pass "print is a fixed point"; else fail "print is a fixed point" "$(diff <(echo "$out") <(echo "$a") | head -5)"; fi
expect_fail 2 "--set with a wrong type is checked like the file" "--set" "$LOOM" check configs/fashion_mnist_mlp.cfg --set run.epochs='"ten"'
expect_fail 2 "--set of an unknown key suggests the nearest" "epochs" "$LOOM" check configs/fashion_mnist_mlp.cfg --set run.epocs=3

# loom profile: every stage of data.train, then the bottleneck
out=$("$LOOM" profile configs/fashion_mnist_mlp.cfg --steps 50 --set 'data.train.transforms.[2].parallel="auto"' 2>&1)
for s in "catalog(fashion_mnist)" "shuffle" "batch" "map(scale)" "prefetch(auto)"; do
    contains "profile lists stage $s" "$s" "$out"
done
contains "profile counts the batches" "50 elements" "$out"
contains "profile names the bottleneck" "bottleneck: " "$out"
expect_fail 2 "profile --steps must be a positive integer" "--steps expects" "$LOOM" profile configs/fashion_mnist_mlp.cfg --steps 0
finish
