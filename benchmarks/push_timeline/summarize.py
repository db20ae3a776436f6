"""Medians of the stamps ``sitecustomize.py`` (this folder) wrote, per push.

    python benchmarks/push_timeline/summarize.py TIMELINE_DIR [--skip N] [--json]

Each push is the span of one ``WeightSync._send`` in the trainer; every stamp of any process
inside that span (give or take 0.3 ms, not into the next or last push) is read as milliseconds
from the span's start. Printed: per label, the median and the least over the pushes after the
first ``--skip`` (default 5: the warm-up pushes), in the order of the medians. A label seen more
than once in a push reports its first occurrence, and ``label (last)`` its last.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import statistics

SLACK_NS = 300_000


def pushes(folder: str) -> list[dict[str, float]]:
    stamps: list[tuple[int, str]] = []
    for path in glob.glob(os.path.join(folder, "tl.*.json")):
        with open(path) as f:
            stamps += [(t, label) for label, t, _thread in json.load(f)["stamps"]]
    stamps.sort()
    starts = [t for t, label in stamps if label == "sync.send>"]
    ends = [t for t, label in stamps if label == "sync.send<"]
    out = []
    spans = list(zip(starts, ends, strict=False))
    for i, (start, end) in enumerate(spans):
        low = max(start - SLACK_NS, spans[i - 1][1] + 1 if i else 0)  # not the last push's tail
        high = min(end + SLACK_NS, spans[i + 1][0] - 1 if i + 1 < len(spans) else end + SLACK_NS)
        seen: dict[str, float] = {}
        for t, label in stamps:
            if low <= t <= high and (t >= start or label.endswith(">")):
                seen[label + " (last)" if label in seen else label] = (t - start) / 1e6
        out.append(seen)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder")
    parser.add_argument("--skip", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows: dict[str, list[float]] = collections.defaultdict(list)
    found = pushes(args.folder)
    for seen in found[args.skip:] or found:
        for label, ms in seen.items():
            rows[label].append(ms)
    table = {label: {"median_ms": round(statistics.median(v), 3), "least_ms": round(min(v), 3), "n": len(v)}
             for label, v in sorted(rows.items(), key=lambda kv: statistics.median(kv[1]))}
    if args.json:
        print(json.dumps({"pushes": len(found), "skipped": args.skip, "labels": table}))
        return
    print(f"{len(found)} pushes, medians over pushes {args.skip + 1}..{len(found)} (ms from the push's start)")
    for label, row in table.items():
        print(f"{row['median_ms']:9.3f}  {row['least_ms']:9.3f}  n={row['n']:<3d} {label}")


if __name__ == "__main__":
    main()
