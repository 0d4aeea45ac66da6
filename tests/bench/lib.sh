# lib.sh - what the benchmark scripts share. Source it first: it sets HERE
# (tests/bench), ROOT (the checkout) and BUILD ($BUILD, else $ROOT/build).
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
BUILD=${BUILD:-$ROOT/build}

# bench_loom NAME [PROGRAM...]: after the options, BUILD made absolute and
# LOOM=$BUILD/loom; it and each PROGRAM under $BUILD must exist, else NAME
# says which is missing and how to build it, and the script exits 1.
bench_loom() {
    local name=$1 f
    shift
    case "$BUILD" in /*) ;; *) BUILD=$ROOT/$BUILD ;; esac
    LOOM=$BUILD/loom
    for f in "$LOOM" "${@/#/$BUILD/}"; do
        [ -x "$f" ] || { echo "$name: $f not found: ninja -C ${BUILD#$ROOT/} first (or pass --build DIR)" >&2; exit 1; }
    done
}

# median [X...]: the median of its arguments, or of the numbers on stdin
# (one a line; blank lines ignored); the mean of the middle two for an even count.
median() {
    if [ $# -gt 0 ]; then printf '%s\n' "$@"; else cat; fi | grep . | sort -g |
        awk '{ a[NR] = $1 } END { print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2 }'
}
