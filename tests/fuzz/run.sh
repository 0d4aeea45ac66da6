#!/usr/bin/env bash
# run.sh - builds the libFuzzer targets (tfrecord, example, idx, csv, topology) with
# clang -fsanitize=fuzzer,address,undefined and runs each for a short budget
# over its committed seed corpus (tests/fuzz/corpus/<target>/; new inputs go to
# a scratch directory, never into the repository).
#   tests/fuzz/run.sh [SECONDS]        default 20 per target (LOOM_FUZZ_TIME too)
# Exits 77 (meson's skip) when clang or its libFuzzer runtime is missing
# (Debian: apt-get install clang libclang-rt-14-dev), 1 when a target crashes
# or fails to build. Run from anywhere; paths are relative to the repository.
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
budget="${1:-${LOOM_FUZZ_TIME:-20}}"
cc="${CLANG:-clang}"

if ! command -v "$cc" >/dev/null 2>&1; then
    echo "fuzz: $cc not found; skipping (apt-get install clang libclang-rt-14-dev)"
    exit 77
fi
work="$(mktemp -d /tmp/loom-fuzz.XXXXXX)"
trap 'rm -rf "$work"' EXIT
echo 'int LLVMFuzzerTestOneInput(const unsigned char *d, unsigned long n) { (void)d; (void)n; return 0; }' > "$work/probe.c"
if ! "$cc" -fsanitize=fuzzer,address,undefined "$work/probe.c" -o "$work/probe" >/dev/null 2>&1; then
    echo "fuzz: $cc cannot link -fsanitize=fuzzer (no libFuzzer runtime); skipping (apt-get install libclang-rt-14-dev)"
    exit 77
fi

cd "$root"
core=(appliance/core/[a-z]*.c appliance/tensor/tensor.c appliance/tensor/blas.c)
flags=(-g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -D_GNU_SOURCE -I appliance)
libs=(-lz -lzstd -lm -ldl -lpthread)
declare -A srcs=(
    [tfrecord]="tests/fuzz/fuzz_tfrecord.c appliance/data/tfrecord.c appliance/data/example.c"
    [example]="tests/fuzz/fuzz_example.c appliance/data/example.c"
    [idx]="tests/fuzz/fuzz_idx.c appliance/data/source_idx.c appliance/data/elem.c"
    [csv]="tests/fuzz/fuzz_csv.c appliance/data/source_csv.c appliance/data/source_files.c appliance/data/elem.c"
    [topology]="tests/fuzz/fuzz_topology.c appliance/cluster/topology.c appliance/config/config.c appliance/config/config_print.c -lconfig -ljansson -lcrypto"
)
status=0
for t in tfrecord example idx csv topology; do
    # shellcheck disable=SC2086
    if ! "$cc" "${flags[@]}" ${srcs[$t]} "${core[@]}" "${libs[@]}" -o "$work/fuzz_$t" 2>"$work/build_$t.log"; then
        echo "fuzz_$t: build failed:"
        sed 's/^/  /' "$work/build_$t.log"
        status=1
        continue
    fi
    mkdir -p "$work/corpus_$t"
    echo "fuzz_$t: running for ${budget}s"
    if ! ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
        "$work/fuzz_$t" -max_total_time="$budget" -timeout=10 -rss_limit_mb=2048 -max_len=65536 \
        -artifact_prefix="$work/" "$work/corpus_$t" "tests/fuzz/corpus/$t" >"$work/run_$t.log" 2>&1; then
        echo "fuzz_$t: FAILED; the end of its log:"
        tail -n 60 "$work/run_$t.log" | sed 's/^/  /'
        for a in "$work"/crash-* "$work"/leak-* "$work"/timeout-* "$work"/oom-*; do
            [ -e "$a" ] || continue
            mkdir -p "$root/build-fuzz-artifacts"
            cp "$a" "$root/build-fuzz-artifacts/fuzz_${t}_$(basename "$a")"
            echo "  reproducer kept: build-fuzz-artifacts/fuzz_${t}_$(basename "$a")"
            rm -f "$a"
        done
        status=1
    else
        grep -E "^#[0-9]+.*DONE" "$work/run_$t.log" | tail -n 1 | sed "s/^/fuzz_$t: /"
    fi
done
exit $status
