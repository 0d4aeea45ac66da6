#!/usr/bin/env bash
# xops.sh - the cross-device ops inside real mirrored training (Fashion-MNIST,
# tests/configs/strategy_mlp.cfg): at 2 replicas every built-in op and every
# packing give bit-identical weights (a + b == b + a); at 3 and 8 replicas an
# op's runs are bit-identical to each other; "auto" logs its choice; the
# packing keys are validated.
source "$(dirname "$0")/lib.sh"
CFG=tests/configs/strategy_mlp.cfg
final() { ls "$1"/ckpt-*.loom | sed 's/.*ckpt-\([0-9]*\).loom/\1 &/' | sort -n | tail -1 | cut -d' ' -f2; }
# run DIR REPLICAS OP [--set ...]: 30 mirrored steps
run() {
    local dir=$1 n=$2 op=$3; shift 3
    check "mirrored($n), $op $*" "$LOOM" train $CFG --model-dir "$WORK/$dir" --set strategy.type=mirrored \
        --set strategy.replicas="$n" --set strategy.cross_device_ops="$op" --set run.max_steps=30 "$@"
}

run ring2 2 ring
run hier2 2 hierarchical_copy
run rto2 2 reduce_to_one_device
run packs2 2 ring --set strategy.bytes_per_pack=1024
run split2 2 hierarchical_copy --set strategy.num_packs=3
same_weights "2 replicas: ring = reduce_to_one_device, bit for bit" "$(final "$WORK/ring2")" "$(final "$WORK/rto2")"
same_weights "2 replicas: hierarchical_copy = reduce_to_one_device" "$(final "$WORK/hier2")" "$(final "$WORK/rto2")"
same_weights "2 replicas: ring in 2 packs (bytes_per_pack 1024) = one pack" "$(final "$WORK/packs2")" "$(final "$WORK/ring2")"
same_weights "2 replicas: 3 equal packs = one pack" "$(final "$WORK/split2")" "$(final "$WORK/ring2")"

run ring3a 3 ring --set strategy.bytes_per_pack=65536
run ring3b 3 ring --set strategy.bytes_per_pack=65536
same_weights "3 replicas, ring in packs: two runs bit-identical" "$(final "$WORK/ring3a")" "$(final "$WORK/ring3b")"
run hier3a 3 hierarchical_copy
run hier3b 3 hierarchical_copy
same_weights "3 replicas, hierarchical_copy: two runs bit-identical" "$(final "$WORK/hier3a")" "$(final "$WORK/hier3b")"
run ring8a 8 ring
run ring8b 8 ring
same_weights "8 replicas on $(nproc) cores, ring: two runs bit-identical" "$(final "$WORK/ring8a")" "$(final "$WORK/ring8b")"

out=$("$LOOM" check $CFG --set strategy.type=mirrored --set strategy.replicas=3 --set strategy.cross_device_ops=auto 2>&1)
contains "auto: logs the op it picked and why" 'cross_device_ops = "auto": ring (3 replicas' "$out"
out=$("$LOOM" check $CFG --set strategy.type=mirrored --set strategy.replicas=2 --set strategy.bytes_per_pack=1024 2>&1)
contains "check: the packs, last layers first" "2 packs (2.5 KiB, 196.2 KiB) in reduction order" "$out"
expect_fail 2 "bytes_per_pack and num_packs together are refused" \
    "strategy.num_packs: num_packs and bytes_per_pack both set" \
    "$LOOM" check $CFG --set strategy.type=mirrored --set strategy.bytes_per_pack=4096 --set strategy.num_packs=2
expect_fail 2 "a negative bytes_per_pack is refused" "strategy.bytes_per_pack" \
    "$LOOM" check $CFG --set strategy.type=mirrored --set strategy.bytes_per_pack=-1
finish
