"""What grew in a process between two heap snapshots (proxy.memtrace; `ATDP_TRACEMALLOC_DIR`).

  python bench/memdiff.py DIR [--from 1] [--top 25] [--frames]

For each process (role and pid) that wrote snapshots: the traced total in each one, then the lines
(or, with --frames, the call stacks) whose memory grew most from snapshot --from (after warm-up) to
the last one.
"""

from __future__ import annotations

import argparse
import re
import tracemalloc
from collections import defaultdict
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--from", dest="first", type=int, default=1, help="index of the baseline snapshot")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--frames", action="store_true", help="group by call stack, not by line")
    args = ap.parse_args()
    procs: dict[str, list[Path]] = defaultdict(list)
    for p in sorted(Path(args.dir).glob("*.snap")):
        m = re.fullmatch(r"(.+)-(\d+)-(\d+)\.snap", p.name)
        if m:
            procs[f"{m[1]} {m[2]}"].append(p)
    for name, files in procs.items():
        files.sort()
        if len(files) <= args.first:
            print(f"{name}: {len(files)} snapshot(s), too few")
            continue
        snaps = [tracemalloc.Snapshot.load(str(f)) for f in files]
        totals = [sum(s.size for s in snap.statistics("filename")) / 2**20 for snap in snaps]
        print(f"== {name}: traced MiB per snapshot: {' '.join(f'{t:.1f}' for t in totals)}")
        key = "traceback" if args.frames else "lineno"
        for stat in snaps[-1].compare_to(snaps[args.first], key)[: args.top]:
            where = " <- ".join(f"{f.filename.rsplit('/', 2)[-2:]!s}:{f.lineno}" for f in stat.traceback)
            print(f"{stat.size_diff / 2**20:+8.2f} MiB {stat.count_diff:+9d} blocks  {where}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
