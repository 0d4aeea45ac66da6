#!/usr/bin/env bash
# loom.sh - set up, build and run Loom on a Debian 12 machine.
#   ./loom.sh train configs/fashion_mnist_mlp.cfg   install what is missing, build, train
#   ./loom.sh test                                  install, build, run the test suite
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
          libopenblas-dev libopenblas0-pthread
          dataset-fashion-mnist)
# The tests also make fixtures with python3 (the project itself never uses it).
TEST_PACKAGES=(python3
               clang libclang-rt-14-dev) # the fuzz suite: clang's libFuzzer and sanitizer runtimes
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

cmd="${1:-}"
case "$cmd" in
    test)
        install_missing "${TEST_PACKAGES[@]}"
        build
        exec tests/run.sh build
        ;;
    build)
        install_missing
        build
        ;;
    ""|-h|--help)
        sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'
        ;;
    *)
        install_missing
        build
        exec build/loom "$@"
        ;;
esac
