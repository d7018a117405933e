"""Where the engine process's time goes (a benchmark's aid, off unless CS_ENGINE_SAMPLE names a
file), written as JSON when the process ends:

- `snapshots`: once a second, the engine's totals (calls, jobs, rows, replays, the device's busy
  seconds) and its loop's wall clock by phase (Engine.clock: idle, poll, read, land, launch,
  run), so a benchmark point's window is the difference of two snapshots. These are exact.
- `where` (CS_ENGINE_SAMPLE_WHERE=1 as well; a thread that takes the interpreter lock every
  millisecond slows the loop): every SAMPLE_S seconds each thread's innermost frames are counted. A sampling thread
  runs only when it holds the interpreter lock, so a loop busy in Python is under-counted and
  its waits in C (epoll, send) are over-counted: read it as "where", the clock as "how long".
- `CS_ENGINE_PROFILE=START:COUNT` as well: torch's profiler over the loop from its START-th call
  (or launched step) for COUNT more, CPU and CUDA activities, its table by self CPU time (the
  CUDA runtime calls a step makes, and what each costs the loop) written beside the file
  (`.profile.txt`) when the window closes. The profiler slows what it records: read it for
  which calls and how many, the sample's clock for how long. CUPTI's teardown at the window's
  end is turned off (TEARDOWN_CUPTI=0, as torch's profiler does for graphs under CUDA < 12.6:
  pytorch/pytorch#112507): with CUDA graphs replaying, the engine stopped answering when it ran
  (s78, torch 2.11+cu130: both engines profiled, at the window's end)."""
from __future__ import annotations

import collections
import json
import os
import sys
import threading
import time

ENV = "CS_ENGINE_SAMPLE"
WHERE_ENV = "CS_ENGINE_SAMPLE_WHERE"
PROFILE_ENV = "CS_ENGINE_PROFILE"
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


class Profile:
    """torch's profiler over a window of the loop's calls (CS_ENGINE_PROFILE=START:COUNT, beside
    CS_ENGINE_SAMPLE): `tick(calls)` after each turn of the loop starts and stops it."""

    def __init__(self, path: str, start: int, count: int):
        self.path, self.start, self.end = path, start, start + count
        self._prof, self._from = None, 0  # the running profiler and the call it started at
        self.done = False

    @classmethod
    def from_env(cls) -> "Profile | None":
        path, window = os.environ.get(ENV), os.environ.get(PROFILE_ENV)
        if not path or not window:
            return None
        start, _, count = window.partition(":")
        return cls(f"{path}.{os.getpid()}.profile.txt", int(start), int(count or 1000))

    def tick(self, calls: int) -> None:
        if self.done:
            return
        if self._prof is None and calls >= self.start:
            import torch.profiler as tp

            # what torch's profiler sets itself for CUDA graphs under CUDA < 12.6 (the docstring)
            os.environ.setdefault("TEARDOWN_CUPTI", "0")
            os.environ.setdefault("DISABLE_CUPTI_LAZY_REINIT", "1")
            acts = [tp.ProfilerActivity.CPU] + ([tp.ProfilerActivity.CUDA] if _cuda() else [])
            self._prof = tp.profile(activities=acts)
            self._prof.__enter__()
            self._from = calls
        elif self._prof is not None and calls >= self.end:
            self._prof.__exit__(None, None, None)
            table = self._prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
            with open(self.path, "w") as f:
                f.write(f"calls {self._from}..{calls}\n{table}\n")
            self._prof, self.done = None, True


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_initialized()
