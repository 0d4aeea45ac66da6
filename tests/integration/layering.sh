#!/usr/bin/env bash
# layering.sh - the modules' includes point one way (issue 12, item 4). Every
# #include "..." in appliance/<module>/ (main.c is the cli's) must name
#   - a header of its own module, or
#   - the one public header of a module below it, <m>/<m>.h; never another
#     module's other headers: neither x_internal.h (private to its module)
#     nor a part that <m>/<m>.h includes from its own folder to keep it
#     readable (tensor/device.h, script/hooks.h, data/format/records.h).
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
            elif tmod != mod and target != "loom_plugin.h" and target != f"{tmod}/{tmod}.h":
                print(f"{rel}:{n}: #include \"{target}\": not {tmod}'s public header {tmod}/{tmod}.h "
                      f"(a module uses another only through its one public header)")
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
if [ "$status" -ne 0 ] && grep -qF "not config's public header" <<<"$out"; then
    pass "another module's private header fails"
else
    fail "another module's private header fails" "exit status $status" "$out"
fi
rm -rf "$WORK/tree" && cp -r appliance "$WORK/tree"
printf '#include "tensor/device.h"\n' >> "$WORK/tree/nn/layers.c"
out=$(layering "$WORK/tree" 2>&1); status=$?
if [ "$status" -ne 0 ] && grep -qF "#include \"tensor/device.h\": not tensor's public header tensor/tensor.h" <<<"$out"; then
    pass "a part of another module's public header, included directly, fails"
else
    fail "a part of another module's public header, included directly, fails" "exit status $status" "$out"
fi
rm -rf "$WORK/tree" && cp -r appliance "$WORK/tree"
mv "$WORK/tree/train/progress_internal.h" "$WORK/tree/train/progress.h"
out=$(layering "$WORK/tree" 2>&1); status=$?
if [ "$status" -ne 0 ] && grep -qF "train/progress.h: a header outside train's public header" <<<"$out"; then
    pass "a private header not named *_internal.h fails, naming it"
else
    fail "a private header not named *_internal.h fails, naming it" "exit status $status" "$out"
fi

# The build enforces the same order: each module's library is compiled with
# only build/include/<module>/ (meson.build's module_views), which links its
# own folder and those of the modules below it. Checked on the build that
# made $LOOM: every view holds only modules at or below its own, no module
# library sees the whole of appliance/, and with each library's own compile
# command a file including its own public header compiles while one
# including the public header of the next module up fails, "No such file".
BUILD=$(dirname "$LOOM")
views() { # views BUILD: prints one line per problem; exits 1 if any
    python3 - "$1" "$ROOT" "$WORK" <<'PY'
import json, os, re, shlex, subprocess, sys
build, root, work = sys.argv[1:4]
order = ["core", "config", "tensor", "data", "nn", "script", "cluster", "distribute", "plugin", "train"]
level = {m: i for i, m in enumerate(order)}
bad = 0
def say(s):
    global bad
    print(s)
    bad += 1
cmds = json.load(open(os.path.join(build, "compile_commands.json")))
for m in order:
    view = os.path.join(build, "include", m)
    if not os.path.isdir(view):
        say(f"{view}: no include view for {m} (meson.build's module_views)")
        continue
    seen = sorted(os.listdir(view))
    if m not in seen:
        say(f"{view}: does not hold {m} itself")
    for e in seen:
        if e not in level or level[e] > level[m]:
            say(f"{view}/{e}: {m} may not see {e} (order: {', '.join(order)})")
        elif os.path.realpath(os.path.join(view, e)) != os.path.realpath(os.path.join(root, "appliance", e)):
            say(f"{view}/{e}: does not lead to appliance/{e}")
    entry = next((c for c in cmds if re.search(rf"(^|/)appliance/{m}/[^ ]*\.c$", c["file"])), None)
    if entry is None:
        say(f"compile_commands.json: no source of {m}")
        continue
    argv = shlex.split(entry["command"]) if "command" in entry else list(entry["arguments"])
    incs = [a[2:] for a in argv if a.startswith("-I")]
    for d in incs:
        full = os.path.realpath(os.path.join(entry["directory"], d))
        if full == os.path.realpath(os.path.join(root, "appliance")):
            say(f"{entry['file']}: compiled with -I{d}, the whole of appliance/ (use the view build/include/{m})")
    if not any(os.path.realpath(os.path.join(entry["directory"], d)) == os.path.realpath(view) for d in incs):
        say(f"{entry['file']}: not compiled with its view -I{view}")
    # the library's own command on a probe: drop the output, dependency file and source
    keep, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("-o", "-MF", "-MQ", "-MT", "-c"):
            skip = True
            continue
        if a in ("-MD", "-MMD") or a == entry["file"] or a.endswith(os.path.basename(entry["file"])):
            continue
        keep.append(a)
    def compiles(header):
        probe = os.path.join(work, f"probe_{m}.c")
        with open(probe, "w") as f:
            f.write(f'#include "{header}"\nint probe_{m};\n')
        r = subprocess.run(keep + ["-fsyntax-only", probe], cwd=entry["directory"], capture_output=True, text=True)
        return r.returncode == 0, r.stderr
    ok, out = compiles(f"{m}/{m}.h")
    if not ok:
        say(f"{m}: its own public header {m}/{m}.h does not compile with its library's command:\n{out[-600:]}")
    if level[m] + 1 < len(order):
        up = order[level[m] + 1]
        ok, out = compiles(f"{up}/{up}.h")
        if ok or "No such file" not in out:
            say(f"{m}: a wrong-way include of {up}/{up}.h " + ("compiles" if ok else "fails otherwise:\n" + out[-600:]))
sys.exit(1 if bad else 0)
PY
}
if [ -f "$BUILD/compile_commands.json" ]; then
    out=$(views "$BUILD" 2>&1) && pass "each module's library sees only its own and lower modules' headers (a wrong-way include does not compile)" ||
        fail "each module's library sees only its own and lower modules' headers (a wrong-way include does not compile)" "$out"
    # The check itself: a view given a module above its own fails, naming it.
    mkdir -p "$WORK/build/include"
    cp "$BUILD/compile_commands.json" "$WORK/build/"
    cp -a "$BUILD/include/." "$WORK/build/include/"
    ln -s "$ROOT/appliance/train" "$WORK/build/include/data/train"
    out=$(views "$WORK/build" 2>&1); status=$?
    if [ "$status" -ne 0 ] && grep -qF "include/data/train: data may not see train" <<<"$out"; then
        pass "a view holding a module above its own fails, naming it"
    else
        fail "a view holding a module above its own fails, naming it" "exit status $status" "$out"
    fi
else
    fail "each module's library sees only its own and lower modules' headers" "no $BUILD/compile_commands.json"
fi
# Every name a module's library exports is public (loom_*) or internal,
# ending in _ (STYLE.md); the config engine's internals also carry its prefix
# cfg_. All modules link into one binary, so a short exported name (ctx,
# is_int, parse_opts) could collide with another module's and reads as local.
exports() { # exports BUILD: prints one line per bad exported name; exits 1 if any
    local bad=0 a sym
    for a in "$1"/libloom_*.a; do
        [ -f "$a" ] || continue
        while read -r sym; do
            case "$sym" in
            loom_*) ;;
            cfg_*_) ;;
            *_) [ "$(basename "$a")" != libloom_config.a ] && continue
                echo "$(basename "$a"): exports $sym (config's internals are named cfg_*_)"; bad=1 ;;
            *) echo "$(basename "$a"): exports $sym (name it loom_* if public, or give it the module's prefix and a trailing _)"; bad=1 ;;
            esac
        done < <(nm -g --defined-only "$a" 2>/dev/null | awk 'NF == 3 { print $3 }' | sort -u)
    done
    if ! ls "$1"/libloom_*.a >/dev/null 2>&1; then echo "$1: no libloom_*.a"; bad=1; fi
    return $bad
}
out=$(exports "$BUILD" 2>&1) && pass "every module library exports only loom_* or prefixed, _-suffixed internal names" ||
    fail "every module library exports only loom_* or prefixed, _-suffixed internal names" "$out"
# The check itself: a library exporting a short name fails, naming it.
mkdir -p "$WORK/nm"
printf 'int is_int(int x) { return x; }\nint cfg_ok_(int x) { return x; }\nint loom_fine(int x) { return x; }\n' > "$WORK/nm/short.c"
if cc -c -o "$WORK/nm/short.o" "$WORK/nm/short.c" && ar rcs "$WORK/nm/libloom_config.a" "$WORK/nm/short.o"; then
    out=$(exports "$WORK/nm" 2>&1); status=$?
    if [ "$status" -ne 0 ] && grep -qF "libloom_config.a: exports is_int" <<<"$out" && ! grep -qE "cfg_ok_|loom_fine" <<<"$out"; then
        pass "a library exporting a short name fails, naming it"
    else
        fail "a library exporting a short name fails, naming it" "exit status $status" "$out"
    fi
else
    fail "a library exporting a short name fails, naming it" "cannot build the probe library"
fi
finish
