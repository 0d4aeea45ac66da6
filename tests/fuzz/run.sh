#!/usr/bin/env bash
# run.sh - builds every libFuzzer target tests/fuzz/fuzz_<name>.c with clang
# -fsanitize=fuzzer,address,undefined and runs each for a time budget over its
# committed seed corpus tests/fuzz/corpus/<name>/, printing one TAP line per target.
#   tests/fuzz/run.sh [SECONDS] [NAME...]   default 20 s per target (LOOM_FUZZ_TIME too), all targets
# A target needs no registration: it links against an archive of every appliance
# source (all but main.c and cli/), built once with the same sanitizers, so a
# fuzzer for any module just includes that module's headers. Optional per target:
# tests/fuzz/fuzz_<name>.dict (a libFuzzer dictionary).
# Environment:
#   LOOM_FUZZ_BUILD  where objects, binaries, new inputs and crash files go
#                    (default build-fuzz/; meson's test passes <build>/fuzz)
#   LOOM_FUZZ_JOBS   parallel compiles (default 2)
#   LOOM_FUZZ_REQUIRE=1  a missing clang/libFuzzer fails instead of skipping (CI sets it)
#   LOOM_FUZZ_SEED   libFuzzer's seed (the suite fixes it, so that a CI run replays the
#                    exploration that was clean when committed; by hand it is random)
#   CLANG            the compiler (default clang)
# Exit: 0 all clean, 1 a target crashed, leaked, timed out or failed to build,
# 0 with "1..0 # SKIP" (TAP) without clang's libFuzzer runtime. See tests/fuzz/README.
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
budget="${LOOM_FUZZ_TIME:-20}"
if [[ "${1:-}" =~ ^[0-9]+$ ]]; then budget="$1"; shift; fi
cc="${CLANG:-clang}"
out="${LOOM_FUZZ_BUILD:-$root/build-fuzz}"
jobs="${LOOM_FUZZ_JOBS:-2}"
cd "$root"

skip() {
    if [ "${LOOM_FUZZ_REQUIRE:-0}" = 1 ]; then
        echo "1..1"; echo "not ok 1 - fuzz: $1 (LOOM_FUZZ_REQUIRE=1)"; exit 1
    fi
    echo "1..0 # SKIP $1"; exit 0  # TAP skip (meson counts 77 under tap as an error)
}
command -v "$cc" >/dev/null 2>&1 || skip "$cc not found (apt-get install clang libclang-rt-14-dev)"
mkdir -p "$out/obj" "$out/bin" "$out/new" "$out/artifacts" || exit 1
echo 'int LLVMFuzzerTestOneInput(const unsigned char *d, unsigned long n) { (void)d; (void)n; return 0; }' > "$out/probe.c"
"$cc" -fsanitize=fuzzer,address,undefined "$out/probe.c" -o "$out/probe" >/dev/null 2>&1 ||
    skip "$cc cannot link -fsanitize=fuzzer, no libFuzzer runtime (apt-get install libclang-rt-14-dev)"

# The targets: every fuzz_*.c, or the names given.
targets=()
if [ $# -gt 0 ]; then
    for n in "$@"; do
        n="${n#fuzz_}"; n="${n%.c}"
        [ -f "tests/fuzz/fuzz_$n.c" ] || { echo "fuzz: no tests/fuzz/fuzz_$n.c" >&2; exit 2; }
        targets+=("$n")
    done
else
    for f in tests/fuzz/fuzz_*.c; do n="${f#tests/fuzz/fuzz_}"; targets+=("${n%.c}"); done
fi
echo "1..${#targets[@]}"
echo "# fuzz: ${#targets[@]} targets, ${budget}s each; build, new inputs and crashes in $out"

# The appliance as one sanitized archive; an object is rebuilt when its source
# or any appliance/plugin header is newer.
pkgs=(zlib libzstd libconfig lua5.4 libpng libjpeg)
for p in libevent libevent_pthreads libevent_openssl jansson openssl; do
    pkg-config --exists "$p" 2>/dev/null && pkgs+=("$p")
done
# shellcheck disable=SC2207
pkgcflags=($(pkg-config --cflags "${pkgs[@]}")) pkglibs=($(pkg-config --libs "${pkgs[@]}"))
blasdir="$(pkg-config --variable=libdir openblas 2>/dev/null)"
cflags=(-g -O1 -std=gnu11 -D_GNU_SOURCE -fno-strict-aliasing -fno-sanitize-recover=undefined
        -I appliance -I plugins "${pkgcflags[@]}" "-DLOOM_OPENBLAS_LIBDIR=\"${blasdir#/}\""
        "-DLOOM_PLUGIN_INSTALL_DIR=\"/usr/local/lib/loom/plugins\"")
newest_h=$(find appliance plugins -name '*.h' -printf '%T@\n' | sort -n | tail -1)
srcs=() stale=()
while IFS= read -r s; do
    srcs+=("$s")
    o="$out/obj/$(echo "${s%.c}" | tr / _).o"
    if [ ! -f "$o" ] || [ "$s" -nt "$o" ] || awk -v h="$newest_h" -v t="$(stat -c %Y "$o")" 'BEGIN{exit !(h > t)}'; then
        stale+=("$s")
    fi
done < <(find appliance -name '*.c' ! -path 'appliance/main.c' ! -path 'appliance/cli/*' | sort)
if [ ${#stale[@]} -gt 0 ]; then
    echo "# fuzz: compiling ${#stale[@]} appliance sources with $cc"
    export cc out
    if ! printf '%s\n' "${stale[@]}" | xargs -P "$jobs" -I{} bash -c \
        'o="$out/obj/$(echo "${1%.c}" | tr / _).o"; "$cc" "${@:2}" -fsanitize=fuzzer-no-link,address,undefined -c "$1" -o "$o" 2>"$o.log" || { cat "$o.log" >&2; rm -f "$o"; exit 1; }' \
        _ {} "${cflags[@]}"; then
        for i in "${!targets[@]}"; do echo "not ok $((i + 1)) - fuzz_${targets[$i]}: the appliance did not compile (see above)"; done
        exit 1
    fi
fi
rm -f "$out/libloom_fuzz.a"
objs=()
for s in "${srcs[@]}"; do objs+=("$out/obj/$(echo "${s%.c}" | tr / _).o"); done
ar rcs "$out/libloom_fuzz.a" "${objs[@]}" || exit 1

status=0 i=0
for t in "${targets[@]}"; do
    i=$((i + 1))
    exe="$out/bin/fuzz_$t"
    if ! "$cc" "${cflags[@]}" -fsanitize=fuzzer,address,undefined "tests/fuzz/fuzz_$t.c" "$out/libloom_fuzz.a" \
        "${pkglibs[@]}" -lm -ldl -lpthread -o "$exe" 2>"$out/build_$t.log"; then
        echo "not ok $i - fuzz_$t: build failed"
        sed 's/^/#   /' "$out/build_$t.log" | head -40
        status=1
        continue
    fi
    mkdir -p "$out/new/$t" "tests/fuzz/corpus/$t"
    dict=()
    [ -f "tests/fuzz/fuzz_$t.dict" ] && dict=(-dict="tests/fuzz/fuzz_$t.dict")
    rm -f "$out"/artifacts/"$t"-*
    # New inputs go to $out/new/<name> (first directory); the committed corpus is only read.
    # lsan.supp: leaks inside libconfig 1.5 itself on parse errors (not loom's)
    if ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
        LSAN_OPTIONS="suppressions=$root/tests/fuzz/lsan.supp" \
        "$exe" ${LOOM_FUZZ_SEED:+-seed="$LOOM_FUZZ_SEED"} -max_total_time="$budget" -timeout=10 -rss_limit_mb=2048 -max_len=65536 "${dict[@]}" \
        -artifact_prefix="$out/artifacts/$t-" "$out/new/$t" "tests/fuzz/corpus/$t" >"$out/run_$t.log" 2>&1; then
        echo "ok $i - fuzz_$t: $(grep -E '^#[0-9]+' "$out/run_$t.log" | tail -n 1 | awk '{print $1, "runs,", $3, $4}' | tr -d '#')"
    else
        echo "not ok $i - fuzz_$t: crashed, leaked or timed out; the end of its log:"
        grep -v '^#[0-9]' "$out/run_$t.log" | tail -n 40 | sed 's/^/#   /'
        for a in "$out"/artifacts/"$t"-*; do
            [ -e "$a" ] && echo "#   reproduce: $exe $a"
        done
        status=1
    fi
done
exit $status
