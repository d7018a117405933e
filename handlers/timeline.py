"""A timeline of one worker's batch cycle, for benchmarks: with CS_TIMELINE_DIR set in the
worker's environment, each batch's cycle is recorded as the times of its marks and written,
one JSON line per batch, to DIR/timeline-PID.jsonl (bench/timeline_report.py reads them).

The marks, in the order a TorchServe 0.12 worker passes them (its loop: read a message, predict,
send the reply, read the next; ts/model_service_worker.py):
  wait      the worker is back for its next message (the last reply was sent)
  arrived   the first byte of the next message is in (wait -> arrived: the worker idles)
  read      the whole message is read (handlers/torchserve/frontend_frames.py)
  handle    the entry is called (read -> handle: TorchServe's Service.predict before it)
  decoded   every request read, decoded and admitted (handlers/pipeline.py)
  launched  a worker served by the engine: every job written into its arena and sent
            (handlers/engine/runner.py); a CUDA runner's own call (handlers/run/cuda.py): inputs
            copied to the device, the call queued, outputs' copies queued behind it
  synced    every job answered by the engine; a CUDA runner: the host waited for the GPU
  ran       the outputs split per request (synced -> ran: unpadding, splitting)
  encoded   every answer encoded
  replied   the answers set on TorchServe's context (encoded -> replied; replied -> the next
            wait: TorchServe builds the reply message and sends it)

Off (the default) a mark is one global read. Times are time.perf_counter, CLOCK_MONOTONIC on
Linux: one clock for every process of the host, so a benchmark can cut the lines to its
measured window."""
from __future__ import annotations

import json
import os
import time

ENV = "CS_TIMELINE_DIR"
MARKS = ("wait", "arrived", "read", "handle", "decoded", "launched", "synced", "ran", "encoded", "replied")
FLUSH_S = 0.5  # buffered batches are written at most this often (at a `wait` mark)

ON = bool(os.environ.get(ENV))
_cycle: dict = {}
_done: list = []
_last_flush = 0.0


def mark(name: str, rows: int = 0) -> None:
    """Records `name` (one of MARKS) for the current batch; `wait` starts the next batch's
    record. `rows`: the batch's requests, given at `read`."""
    global _cycle
    now = time.perf_counter()
    if name == "wait":
        if "arrived" in _cycle:
            _done.append(_cycle)
        _cycle = {}
        if _done and now - _last_flush > FLUSH_S:
            _flush(now)
    _cycle[name] = now
    if rows:
        _cycle["rows"] = rows


def _flush(now: float) -> None:
    global _last_flush
    _last_flush = now
    path = os.path.join(os.environ[ENV], f"timeline-{os.getpid()}.jsonl")
    with open(path, "a") as f:
        f.write("".join(json.dumps(c) + "\n" for c in _done))
    _done.clear()
