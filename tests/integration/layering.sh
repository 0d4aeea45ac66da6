#!/usr/bin/env bash
# layering.sh - the modules' includes point one way (issue 12, item 4). Every
# #include "..." in appliance/<module>/ (main.c is the cli's) must name
#   - a header of its own module, or
#   - the public header of a module below it: <m>/<m>.h, or a header that
#     <m>/<m>.h itself includes from its folder (a part of the public header,
#     such as data/format/records.h); never another module's other headers
#     (x_internal.h and the like are private to their module).
# A header of a module that is not part of its public header is named
# *_internal.h, so the name alone tells a private header.
# The order, lowest first: core, config, tensor, data, nn, script, cluster,
# distribute, plugin, train, cli. plugins/loom_plugin.h (the plugin ABI)
# belongs to plugin. The checker also runs on a copy of the tree with a
# wrong-way include put in, and must fail there naming the file and line.
source "$(dirname "$0")/lib.sh"

layering() { # layering ROOT: prints one line per bad include; exits 1 if any
    python3 - "$1" <<'PY'
import os, re, sys
root = sys.argv[1]
order = ["core", "config", "tensor", "data", "nn", "script", "cluster", "distribute", "plugin", "train", "cli"]
level = {m: i for i, m in enumerate(order)}
inc = re.compile(r'^\s*#\s*include\s+"([^"]+)"')

def includes(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            m = inc.match(line)
            if m:
                yield n, m.group(1)

def public(m):  # <m>/<m>.h and the headers of m it includes, transitively
    seen, todo = set(), [f"{m}/{m}.h"]
    while todo:
        h = todo.pop()
        if h in seen or not os.path.exists(os.path.join(root, h)):
            continue
        seen.add(h)
        todo += [t for _, t in includes(os.path.join(root, h)) if t.split("/")[0] == m]
    return seen

bad = 0
pub = {m: public(m) for m in order}
for dirpath, _, names in sorted(os.walk(root)):
    for name in sorted(names):
        if not name.endswith((".c", ".h")):
            continue
        path = os.path.join(dirpath, name)
        rel = os.path.relpath(path, root)
        mod = rel.split("/")[0] if "/" in rel else "cli"  # main.c
        if mod not in level:
            print(f"{rel}: folder {mod}/ is not in the module order; add it to tests/integration/layering.sh")
            bad += 1
            continue
        if name.endswith(".h") and rel not in pub[mod] and not name.endswith("_internal.h"):
            print(f"{rel}: a header outside {mod}'s public header {mod}/{mod}.h must be named *_internal.h "
                  f"(private to {mod}/)")
            bad += 1
        for n, target in includes(path):
            if target == "loom_plugin.h":
                tmod = "plugin"
            elif "/" in target:
                tmod = target.split("/")[0]
            else:
                continue  # beside the file: its own module
            if tmod not in level:
                continue  # not a module's header (tests' helpers and the like)
            if level[tmod] > level[mod]:
                print(f"{rel}:{n}: #include \"{target}\": {mod} is below {tmod} and may not use it "
                      f"(order: {', '.join(order)})")
                bad += 1
            elif tmod != mod and target != "loom_plugin.h" and target not in pub[tmod]:
                print(f"{rel}:{n}: #include \"{target}\": not part of {tmod}'s public header {tmod}/{tmod}.h "
                      f"(a module uses another only through its public header)")
                bad += 1
sys.exit(1 if bad else 0)
PY
}

out=$(layering appliance 2>&1) && pass "every include in appliance/ points down the module order" ||
    fail "every include in appliance/ points down the module order" "$out"

# The checker itself: a wrong-way include (data using distribute) and a
# private header of another module must each fail, naming file:line.
cp -r appliance "$WORK/tree"
printf '#include "distribute/distribute.h"\n' >> "$WORK/tree/data/engine/pipeline.c"
n=$(wc -l < "$WORK/tree/data/engine/pipeline.c")
out=$(layering "$WORK/tree" 2>&1); status=$?
if [ "$status" -ne 0 ] && grep -qF "data/engine/pipeline.c:$n: #include \"distribute/distribute.h\": data is below distribute" <<<"$out"; then
    pass "a wrong-way include fails, naming file:line"
else
    fail "a wrong-way include fails, naming file:line" "exit status $status" "$out"
fi
rm -rf "$WORK/tree" && cp -r appliance "$WORK/tree"
printf '#include "config/config_internal.h"\n' >> "$WORK/tree/nn/model.c"
out=$(layering "$WORK/tree" 2>&1); status=$?
if [ "$status" -ne 0 ] && grep -qF "not part of config's public header" <<<"$out"; then
    pass "another module's private header fails"
else
    fail "another module's private header fails" "exit status $status" "$out"
fi
rm -rf "$WORK/tree" && cp -r appliance "$WORK/tree"
mv "$WORK/tree/train/progress_internal.h" "$WORK/tree/train/progress.h"
out=$(layering "$WORK/tree" 2>&1); status=$?
if [ "$status" -ne 0 ] && grep -qF "train/progress.h: a header outside train's public header" <<<"$out"; then
    pass "a private header not named *_internal.h fails, naming it"
else
    fail "a private header not named *_internal.h fails, naming it" "exit status $status" "$out"
fi
finish
