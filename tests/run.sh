#!/usr/bin/env bash
# tests/run.sh BUILD_DIR - run the whole suite and end with "N passed, N failed",
# counting TAP test points across every test program.
set -uo pipefail
build="${1:-build}"
log="$build/meson-logs/testlog.txt"
meson test -C "$build" --print-errorlogs --num-processes 1 "${@:2}"
status=$?
# Count the TAP lines of every test from meson's JSON log.
json="$build/meson-logs/testlog.json"
python_count() {
    local passed=0 failed=0 skipped=0
    while IFS= read -r line; do
        case "$line" in
            "ok "*"# SKIP"*) skipped=$((skipped + 1)) ;;
            "not ok "*"# TODO"*) ;;   # a known hole, marked as TAP says (meson counts it an expected failure)
            "ok "*) passed=$((passed + 1)) ;;
            "not ok "*) failed=$((failed + 1)) ;;
        esac
    done < <(grep -ohE '^(not )?ok [0-9]+.*' "$log" 2>/dev/null)
    echo "$passed $failed $skipped"
}
read -r passed failed skipped < <(python_count)
# Name every failed test point (and every test program that failed without
# one) so that a CI log cut down to its tail still says what failed.
awk '/^test: / { name = $NF } /^not ok / && !/# TODO/ { print "FAILED: " name ": " $0 }
     /^result: / && !/exit status 0/ && !/exit status 77/ { print "FAILED: " name ": " $0 }' "$log" 2>/dev/null | head -n 40
# A test program that crashed or timed out may have printed no "not ok" line.
if [ $status -ne 0 ] && [ "$failed" -eq 0 ]; then failed=1; fi
if [ "$skipped" -gt 0 ]; then
    echo "$passed passed, $failed failed, $skipped skipped"
else
    echo "$passed passed, $failed failed"
fi
[ "$failed" -eq 0 ] && [ $status -eq 0 ]
