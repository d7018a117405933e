"""Where the engine process's threads spend their time, sampled (a benchmark's aid, off unless
CS_ENGINE_SAMPLE names a file): every SAMPLE_S seconds each thread's innermost frames of this
package are counted, and the counts are written as JSON when the process ends. cProfile sees
one thread only; the engine's time is spread over its loop and one socket reader per worker."""
from __future__ import annotations

import collections
import json
import os
import sys
import threading
import time

ENV = "CS_ENGINE_SAMPLE"
SAMPLE_S = 0.001


class Sampler:
    def __init__(self, path: str):
        self.path, self.counts, self.samples = path, collections.Counter(), 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-sampler", daemon=True)

    @classmethod
    def from_env(cls):
        path = os.environ.get(ENV)
        if not path:
            return None
        sampler = cls(f"{path}.{os.getpid()}.json")
        sampler._thread.start()
        return sampler

    def _run(self) -> None:
        me = threading.get_ident()
        names = {}
        while not self._stop.wait(SAMPLE_S):
            names.update((t.ident, t.name.split("-")[0]) for t in threading.enumerate())
            for ident, frame in sys._current_frames().items():
                if ident != me:
                    self.counts[f"{names.get(ident, '?')}: {_where(frame)}"] += 1
            self.samples += 1

    def write(self, **totals) -> None:
        """`totals`: the engine's counts (calls, jobs, rows) beside where its time went."""
        self._stop.set()
        self._thread.join(1.0)
        with open(self.path, "w") as f:
            json.dump({"samples": self.samples, "sample_s": SAMPLE_S, **totals, "where": self.counts.most_common(60)},
                      f, indent=1)


def _where(frame, depth: int = 3) -> str:
    """The innermost `depth` frames as file:function, innermost first."""
    parts = []
    while frame is not None and len(parts) < depth:
        code = frame.f_code
        parts.append(f"{os.path.basename(code.co_filename)}:{code.co_name}:{frame.f_lineno}")
        frame = frame.f_back
    return " < ".join(parts)
