"""Where a worker's batch cycle goes: reads the lines handlers/timeline.py writes
(CS_TIMELINE_DIR in the workers' environment) and accounts for every interval between two
batches, mean and median milliseconds per batch, over the batches whose cycle began inside a
window (a benchmark's measured seconds).

    python -m bench.timeline_report DIR [--start T0 --end T1]   (perf_counter seconds)
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics

from handlers.timeline import MARKS

# (interval, from mark, to mark): the cycle from one `wait` to the next, every part named
INTERVALS = (("idle: waiting for the frontend", "wait", "arrived"),
             ("read the message", "arrived", "read"),
             ("TorchServe before the entry", "read", "handle"),
             ("read, decode, admit", "handle", "decoded"),
             # a worker runs no CUDA (the per-worker GPU path was retired, issue 64): on a GPU the
             # next three are the engine's round trip (handlers/engine/runner.py marks launched
             # and synced); a worker calling the model itself (on the CPU, handler.engine not on)
             # marks neither (each takes the mark before it), so its call is in the third
             ("pad, into the arena, sent", "decoded", "launched"),
             ("the engine's answers", "launched", "synced"),
             ("split outputs (a worker calling the model itself: its call)", "synced", "ran"),
             ("encode", "ran", "encoded"),
             ("set replies on the context", "encoded", "replied"),
             ("TorchServe sends the reply", "replied", "next"))


# A batch refused in admission has no ran mark: its run counts as zero, at the mark before it.
NEEDED = ("wait", "arrived", "read", "handle", "decoded", "encoded", "replied")


def _filled(c: dict) -> dict:
    last = c["wait"]
    for m in MARKS:
        last = c.setdefault(m, last)
    return c


def cycles(directory: str, start: float = float("-inf"), end: float = float("inf")) -> dict:
    """{pid: [cycle]}, each cycle its marks plus `next` (the following cycle's wait), those
    beginning in [start, end) and complete."""
    out = {}
    for path in glob.glob(os.path.join(directory, "timeline-*.jsonl")):
        pid = int(path.rsplit("-", 1)[1].split(".")[0])
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        rows.sort(key=lambda c: c["wait"])
        kept = []
        for c, nxt in zip(rows, rows[1:]):
            if start <= c["wait"] < end and all(m in c for m in NEEDED):
                kept.append(_filled({**c, "next": nxt["wait"]}))
        if kept:
            out[pid] = kept
    return out


def report(directory: str, start: float = float("-inf"), end: float = float("inf")) -> dict:
    """Per interval: mean and median ms per batch, and its share of the cycle; with the
    batches, rows per batch, and batches per second per worker."""
    by_worker = cycles(directory, start, end)
    allc = [c for cs in by_worker.values() for c in cs]
    if not allc:
        return {"batches": 0}
    span = max(c["next"] for c in allc) - min(c["wait"] for c in allc)
    total = statistics.fmean(c["next"] - c["wait"] for c in allc) * 1e3
    rows = {}
    for name, a, b in INTERVALS:
        ms = [(c[b] - c[a]) * 1e3 for c in allc]
        mean = statistics.fmean(ms)
        rows[name] = {"mean_ms": round(mean, 4), "p50_ms": round(statistics.median(ms), 4),
                      "share": round(mean / total, 3) if total else None}
    return {"batches": len(allc), "workers": len(by_worker),
            "rows_per_batch": round(statistics.fmean(c.get("rows", 0) for c in allc), 2),
            "cycle_ms": round(total, 4),
            "batches_per_s_per_worker": round(len(allc) / span / len(by_worker), 1) if span > 0 else None,
            "intervals": rows}


def markdown(rep: dict) -> str:
    if not rep.get("batches"):
        return "(no batches recorded)\n"
    lines = [f"{rep['batches']} batches on {rep['workers']} workers, {rep['rows_per_batch']} requests per batch, "
             f"a cycle of {rep['cycle_ms']:.3f} ms on average\n", "| interval | mean ms | p50 ms | share |",
             "|---|---|---|---|"]
    for name, r in rep["intervals"].items():
        lines.append(f"| {name} | {r['mean_ms']:.3f} | {r['p50_ms']:.3f} | {r['share']:.0%} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("directory")
    p.add_argument("--start", type=float, default=float("-inf"))
    p.add_argument("--end", type=float, default=float("inf"))
    a = p.parse_args(argv)
    print(markdown(report(a.directory, a.start, a.end)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
