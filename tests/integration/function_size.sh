#!/usr/bin/env bash
# function_size.sh - no function over about 100 lines without a reason in a
# comment (issue 12, "how it is judged"). A function of more than 100 lines
# in a checked module must say why in the comment just above it, with a line
# holding "long:" and the reason. The modules checked are those whose rooms
# were rebuilt so far (MODULES below); a module joins when its long functions
# are split or explained. The checker also runs on a copy of the tree with a
# long function put in, and must fail there naming the file and line.
source "$(dirname "$0")/lib.sh"
MODULES="train config"

too_long() { # too_long DIR...: prints file:line: NAME is N lines, once per function; exits 1 if any
    python3 - "$@" <<'PY'
import os, re, sys
LIMIT = 100
# a definition starts in column 0 (the code's style: return type, name and
# parameters, then "{" at the end of its last line) and ends at a "}" in column 0
start = re.compile(r'^(?!typedef\b|struct\b|enum\b|union\b|static const\b|#)[A-Za-z_][^;=]*\(')
bad = 0
for root in sys.argv[1:]:
    for dirpath, _, names in sorted(os.walk(root)):
        for name in sorted(names):
            if not name.endswith(".c"):
                continue
            path = os.path.join(dirpath, name)
            with open(path, encoding="utf-8", errors="replace") as f:
                lines = f.read().split("\n")
            i = 0
            while i < len(lines):
                if not start.match(lines[i]):
                    i += 1
                    continue
                j = i
                while j < len(lines) and not lines[j].rstrip().endswith(("{", ";", "}")):
                    j += 1
                if j >= len(lines) or not lines[j].rstrip().endswith("{"):  # a prototype, or a one-line body
                    i = j + 1
                    continue
                k = j + 1
                while k < len(lines) and lines[k] != "}":
                    k += 1
                size = k - i + 1
                a, above = i - 1, []
                while a >= 0 and lines[a].lstrip().startswith(("/*", "*", "//")):
                    above.append(lines[a])
                    a -= 1
                if size > LIMIT and not any("long:" in l for l in above):
                    fn = re.search(r'([A-Za-z_][A-Za-z0-9_]*)\s*\(', lines[i]).group(1)
                    print(f"{path}:{i + 1}: {fn} is {size} lines; split it, or say why in a \"long:\" comment above it")
                    bad += 1
                i = k + 1
sys.exit(1 if bad else 0)
PY
}

dirs=()
for m in $MODULES; do dirs+=("appliance/$m"); done
out=$(too_long "${dirs[@]}" 2>&1) && pass "no function over 100 lines without a reason in: $MODULES" ||
    fail "no function over 100 lines without a reason in: $MODULES" "$out"

# The checker itself: a 120-line function must fail, naming file:line; the
# same function with a "long:" comment above it passes.
mkdir -p "$WORK/tree"
{
    echo "static int x;"
    echo "static int long_one(int a)"
    echo "{"
    for i in $(seq 118); do echo "    a += $i;"; done
    echo "    return a;"
    echo "}"
} > "$WORK/tree/f.c"
out=$(too_long "$WORK/tree" 2>&1); status=$?
if [ "$status" -ne 0 ] && grep -qF "$WORK/tree/f.c:2: long_one is 122 lines" <<<"$out"; then
    pass "a 122-line function fails, naming file:line"
else
    fail "a 122-line function fails, naming file:line" "exit status $status" "$out"
fi
sed -i '1a /* long: a test of the checker */' "$WORK/tree/f.c"
out=$(too_long "$WORK/tree" 2>&1) && pass "a \"long:\" comment above it is its reason" ||
    fail "a \"long:\" comment above it is its reason" "$out"
finish
