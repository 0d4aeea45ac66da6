#!/usr/bin/env python3
"""peak_rss.py - run a command and report the peak resident memory of its
whole process tree (the command and every descendant, e.g. DataLoader
workers), sampled from /proc every 5 ms, plus getrusage's ru_maxrss of the
largest single child. The command's stdout/stderr pass through; the last
line printed is "peak_rss: {json}".
    peak_rss.py CMD [ARGS...]
Exits with the command's status."""
import json
import os
import resource
import subprocess
import sys
import time

PAGE = os.sysconf("SC_PAGE_SIZE")


def tree_rss(root):
    """Summed RSS in bytes of root and its descendants (by /proc parent links)."""
    kids, rss = {}, {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                st = f.read()
            fields = st[st.rindex(")") + 2:].split()
            kids.setdefault(int(fields[1]), []).append(int(d))
            rss[int(d)] = int(fields[21]) * PAGE
        except (OSError, ValueError, IndexError):
            continue
    total, todo = 0, [root]
    while todo:
        p = todo.pop()
        total += rss.get(p, 0)
        todo.extend(kids.get(p, []))
    return total


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    p = subprocess.Popen(sys.argv[1:])
    peak = 0
    while p.poll() is None:
        peak = max(peak, tree_rss(p.pid))
        time.sleep(0.005)
    maxrss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    print("peak_rss: " + json.dumps({"tree_mb": round(peak / 2**20, 1), "maxrss_mb": round(maxrss / 2**20, 1)}),
          flush=True)
    sys.exit(p.returncode)


if __name__ == "__main__":
    main()
