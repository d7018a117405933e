"""Where the engine process's time goes (a benchmark's aid, off unless CS_ENGINE_SAMPLE names a
file), written as JSON when the process ends:

- `snapshots`: once a second, the engine's totals (calls, jobs, rows, replays, the device's busy
  seconds) and its loop's wall clock by phase (Engine.clock: idle, poll, read, land, launch,
  run), so a benchmark point's window is the difference of two snapshots. These are exact.
- `where` (CS_ENGINE_SAMPLE_WHERE=1 as well; a thread that takes the interpreter lock every
  millisecond slows the loop): every SAMPLE_S seconds each thread's innermost frames are counted. A sampling thread
  runs only when it holds the interpreter lock, so a loop busy in Python is under-counted and
  its waits in C (epoll, send) are over-counted: read it as "where", the clock as "how long"."""
from __future__ import annotations

import collections
import json
import os
import sys
import threading
import time

ENV = "CS_ENGINE_SAMPLE"
WHERE_ENV = "CS_ENGINE_SAMPLE_WHERE"
SAMPLE_S = 0.001


class Sampler:
    def __init__(self, path: str, totals=None, name: str = "engine"):
        # name: the engine's (engine-MODEL, handlers/engine/link.py), which a benchmark matches to its model
        self.path, self.counts, self.samples, self.name = path, collections.Counter(), 0, name
        self.totals, self.snapshots = totals, []  # totals(): the engine's figures, taken once a second
        self.where = os.environ.get(WHERE_ENV) == "1"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-sampler", daemon=True)

    @classmethod
    def from_env(cls, totals=None, name: str = "engine"):
        path = os.environ.get(ENV)
        if not path:
            return None
        sampler = cls(f"{path}.{os.getpid()}.json", totals, name)
        sampler._thread.start()
        return sampler

    def _run(self) -> None:
        me = threading.get_ident()
        names, next_snapshot = {}, time.monotonic()
        while not self._stop.wait(SAMPLE_S if self.where else 1.0):
            if self.totals is not None and time.monotonic() >= next_snapshot:
                next_snapshot += 1.0
                try:
                    self.snapshots.append({"t": round(time.time(), 3), **self.totals()})
                except RuntimeError:  # a phase counted for the first time while copied: the next second's
                    pass
            if not self.where:
                continue
            names.update((t.ident, t.name.split("-")[0]) for t in threading.enumerate())
            for ident, frame in sys._current_frames().items():
                if ident != me:
                    self.counts[f"{names.get(ident, '?')}: {_where(frame)}"] += 1
            self.samples += 1

    def write(self, **totals) -> None:
        """`totals`: the engine's counts (calls, jobs, rows) beside where its time went."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(1.0)
        with open(self.path, "w") as f:
            json.dump({"engine": self.name, "samples": self.samples, "sample_s": SAMPLE_S, **totals,
                       "snapshots": self.snapshots,
                       "where": self.counts.most_common(60)}, f, indent=1)


def _where(frame, depth: int = 3) -> str:
    """The innermost `depth` frames as file:function, innermost first."""
    parts = []
    while frame is not None and len(parts) < depth:
        code = frame.f_code
        parts.append(f"{os.path.basename(code.co_filename)}:{code.co_name}:{frame.f_lineno}")
        frame = frame.f_back
    return " < ".join(parts)
