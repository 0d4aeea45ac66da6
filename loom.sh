#!/usr/bin/env bash
# loom.sh - set up, build and run Loom on a Debian 12 machine.
#   ./loom.sh train configs/fashion_mnist_mlp.cfg   install what is missing, build, train
#   ./loom.sh test                                  install, build, run the test suite
#   ./loom.sh test-asan                             the unit and integration suites under ASan+UBSan
#   ./loom.sh ci                                    both, as CI runs them (.ci/run), one total at the end
#                                                   (plus the unit suite with LOOM_TEST_CPU=avx2: the AVX2 kernels)
#   ./loom.sh build                                 install and build only
#   ./loom.sh COMMAND ...                           any other loom command, after building
# Installing needs root (or sudo); nothing is installed that is already there.
set -euo pipefail
cd "$(dirname "$0")"

# Debian packages: build tools, the declared libraries, the data set, and
# (for tests) valgrind-free essentials only.
PACKAGES=(meson ninja-build pkg-config gcc libc6-dev
          libconfig-dev libzstd-dev liblua5.4-dev libevent-dev zlib1g-dev
          libjansson-dev libssl-dev
          libopenmpi-dev openmpi-bin   # the mpi plugin, and mpirun for its test (tests/integration/mpi.sh)
          libpng-dev libjpeg62-turbo-dev   # decode_image: PNG and JPEG
          libopenblas-dev libopenblas0-pthread
          dataset-fashion-mnist
          fortunes)                    # the text corpus (configs/fortunes_*.cfg, tests/integration/text.sh)
# The tests also make fixtures with python3 (the project itself never uses it).
TEST_PACKAGES=(python3
               clang libclang-rt-14-dev # the fuzz suite: clang's libFuzzer and sanitizer runtimes
               curl)                    # integration/status.sh scrapes the status endpoint with it
# Where the CUDA toolkit is installed, nvcc compiles host code with g++
# (the cuda plugin; its kernels' host-emulation test too).
if [ -x /usr/local/cuda/bin/nvcc ] || command -v nvcc >/dev/null; then PACKAGES+=(g++); fi

install_missing() {
    local missing=()
    for p in "${PACKAGES[@]}" "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    echo "loom.sh: installing ${missing[*]}" >&2
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
}

build() {
    # The GPU plugins build when meson finds nvcc; the toolkit's usual home
    # is often not on PATH (meson_options.txt: -Dcuda=disabled skips them).
    if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
        export PATH="/usr/local/cuda/bin:$PATH"
    fi
    if [ ! -f build/build.ninja ]; then
        meson setup build --buildtype=release >&2
    fi
    ninja -C build >&2
}

# The suites run as on a user's machine: this one sets OpenBLAS's kernel and
# cache size in the environment, a user's does not (loom picks them itself).
clean_env() { unset OPENBLAS_CORETYPE OPENBLAS_L2_SIZE; }

# build-asan: the same sources with AddressSanitizer and UBSan (debugoptimized;
# -Dcuda=disabled: the GPU plugins never run here, and with nccl.so beside the
# binary LeakSanitizer's tracer crashed at the exit of mpi.sh's mpirun jobs;
# b_lundef=false because plugins are shared modules resolved against the
# sanitized binary). Any report fails the run: UBSan halts, and every report of
# every process (also ones run in the background or expected to fail) lands in
# build-asan/sanitizer/ as well, which must stay empty. Leaks are checked too.
test_asan() {
    if [ ! -f build-asan/build.ninja ]; then
        meson setup build-asan --buildtype=debugoptimized -Db_sanitize=address,undefined -Db_lundef=false -Dcuda=disabled >&2
    fi
    ninja -C build-asan >&2
    local logs="$PWD/build-asan/sanitizer"
    rm -rf "$logs"; mkdir -p "$logs"
    export ASAN_OPTIONS="detect_leaks=1:log_path=$logs/asan:log_exe_name=1"
    export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:log_path=$logs/ubsan:log_exe_name=1"
    local status=0 out
    tests/run.sh build-asan --suite unit --suite integration 2>&1 | tee build-asan/ci.log || status=1
    out=$(tail -n 1 build-asan/ci.log)
    unset ASAN_OPTIONS UBSAN_OPTIONS
    local reports=("$logs"/*)
    if [ -e "${reports[0]}" ]; then
        echo "loom.sh: ${#reports[@]} sanitizer report(s) in $logs:" >&2
        for r in "${reports[@]}"; do echo "== $r" >&2; head -n 40 "$r" >&2; done
        status=1
        out=$(awk -v n="${#reports[@]}" '{ $3 = $3 + n; print }' <<<"$out")   # "P passed, F failed"
    fi
    echo "$out" | tee build-asan/ci-total
    return $status
}

cmd="${1:-}"
case "$cmd" in
    test)
        install_missing "${TEST_PACKAGES[@]}"
        build
        clean_env
        exec tests/run.sh build
        ;;
    test-asan)
        install_missing "${TEST_PACKAGES[@]}"
        clean_env
        test_asan
        ;;
    ci)
        # The release suite (fuzzers included, and required), then the sanitized
        # one; the last line adds both up.
        install_missing "${TEST_PACKAGES[@]}"
        build
        clean_env
        export LOOM_FUZZ_REQUIRE=1
        status=0
        tests/run.sh build 2>&1 | tee build/ci.log || status=1
        r1=$(tail -n 1 build/ci.log)
        # The AVX2 kernels, also on an AVX-512 machine: the unit suite again with
        # the CPU features above AVX2 hidden (LOOM_TEST_CPU, a tests-only cap).
        LOOM_TEST_CPU=avx2 tests/run.sh build --suite unit 2>&1 | tee build/ci-avx2.log || status=1
        r3=$(tail -n 1 build/ci-avx2.log)
        test_asan || status=1
        r2=$(cat build-asan/ci-total)
        # What failed, again at the end, where a log cut to its tail still shows it.
        grep -h '^FAILED: ' build/ci.log | sed 's/^/release /' || true
        grep -h '^FAILED: ' build-asan/ci.log | sed 's/^/asan+ubsan /' || true
        grep -h '^FAILED: ' build/ci-avx2.log | sed 's/^/release, LOOM_TEST_CPU=avx2 /' || true
        echo "release: $r1; release unit, LOOM_TEST_CPU=avx2: $r3; asan+ubsan: $r2; ${SECONDS}s in all"
        printf '%s\n%s\n%s\n' "$r1" "$r2" "$r3" | awk '{ p += $1; f += $3 } END { print p " passed, " f " failed" }'
        exit $status
        ;;
    build)
        install_missing
        build
        ;;
    ""|-h|--help)
        sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'
        ;;
    *)
        install_missing
        build
        exec build/loom "$@"
        ;;
esac
