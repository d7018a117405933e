"""Where TorchServe's Python workers spend their time while a benchmark point runs: py-spy
samples of every worker process, summed into microseconds per request by stage.

py-spy (https://github.com/benfred/py-spy) samples a running Python process's stacks from
outside, reading its memory; with `--nonblocking` it never pauses the process. `record -f raw`
writes one line per distinct stack: the frames joined by ";" from the outermost in, each
`function (file:line)`, then a space and how many samples had that stack. py-spy leaves out the
samples of a thread that the OS reports idle (sleeping in a system call: a blocking receive, a
blocking CUDA event wait), so samples / rate is the time a worker was running, and divided by
the requests answered in the same window it is the worker's time per request.

A sample belongs to the first stage in STAGES that any frame of its stack names, so the logging
that TorchServe's metrics call does counts as metrics, a `torch` call inside the handler's run as
run, and what no earlier stage claims falls to the last ("worker loop": TorchServe's
`handle_connection`, which also sends the answer). Samples outside even that (the worker's
start) are "outside the worker loop".
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from bench import cpu_usage

# (stage, function names that mark it), in priority order; names with a class are matched as
# py-spy 0.4.3 and later write them (Class.method). Our handler's stage functions
# are handlers/pipeline.py's; TorchServe 0.12's are ts/model_service_worker.py, ts/service.py
# and ts/protocol/otf_message_handler.py's.
STAGES = (
    ("read request frames", ("retrieve_msg",)),
    ("TorchServe metrics", ("add_time", "emit_metrics", "add_or_update")),
    ("logging", ("Logger.info", "Logger.warning", "Logger._log", "Logger.exception")),
    ("build response frames", ("create_predict_response",)),
    ("handler: admission", ("admit_all", "Batch.__init__")),
    ("handler: run", ("infer",)),
    ("handler: encode", ("encode_all",)),
    ("handler: other", ("handle", "serve")),
    ("TorchServe predict (other)", ("Service.predict", "retrieve_data_for_inference")),
    ("worker loop (send, other)", ("handle_connection",)),
)
_LINE = re.compile(r"^(?P<stack>.*) (?P<n>\d+)$")
_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>.*?)(?::\d+)?\)$")


def executable() -> str:
    """py-spy from $PYSPY, beside this Python, or on PATH; SystemExit if there is none (this
    module's stage names need 0.4.3 or later, which pyproject.toml's test extra installs)."""
    for path in (os.environ.get("PYSPY"), str(Path(sys.executable).parent / "py-spy"), shutil.which("py-spy")):
        if path and os.access(path, os.X_OK):
            return path
    raise SystemExit("--spy needs py-spy: pip install py-spy, or set PYSPY to its path")


def worker_pids(root=None) -> list:
    """TorchServe's Python workers (their command line runs model_service_worker) on this host,
    or only those descending from process `root` (one server's: its launcher's pid), so another
    server's workers on the same host are never sampled."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"model_service_worker" not in f.read():
                    continue
            if root is None or _descends(int(pid), root):
                pids.append(int(pid))
        except OSError:  # gone meanwhile
            continue
    return pids


def _descends(pid: int, root: int) -> bool:
    """Whether `root` is among `pid`'s ancestors (/proc/PID/stat's 4th field is the parent, the
    second after the process's name)."""
    for _ in range(64):
        pid = int(cpu_usage.read_stat(f"/proc/{pid}/stat")[1][1])
        if pid == root:
            return True
        if pid <= 1:
            return False
    return False


class Spies:
    """One py-spy per TorchServe worker of the server whose launcher is `root` (all on the host
    when None; idle workers of other models add no samples: py-spy leaves out idle threads), recording for `seconds` into a directory of
    their own; `finish` sums them and removes everything."""

    def __init__(self, seconds: int, rate: int = 200, exe: str = "", root=None):
        self.rate, self.seconds = rate, max(1, int(seconds))
        exe = exe or executable()
        self.dir = Path(tempfile.mkdtemp(prefix="worker_spy_"))
        self.procs = []
        try:
            for pid in worker_pids(root):
                path, err = self.dir / f"{pid}.txt", open(self.dir / f"{pid}.err", "wb")
                cmd = [exe, "record", "--pid", str(pid), "--duration", str(self.seconds), "--rate", str(rate),
                       "--nonblocking", "--format", "raw", "--output", str(path)]
                with err:
                    self.procs.append((path, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)))
        except BaseException:  # the samplers started so far do not outlive a failed start
            self.stop()
            raise

    def finish(self, req_s: float) -> dict:
        """Waits for the samplers and sums their samples; `req_s`: requests per second answered
        while they sampled. Whatever happens, no sampler outlives this call."""
        lines, failures = [], []
        try:
            for path, proc in self.procs:
                try:
                    proc.wait(timeout=self.seconds + 60)
                except subprocess.TimeoutExpired:
                    failures.append(f"py-spy on {path.stem} did not finish")
                    continue
                if path.exists():
                    lines += path.read_text().splitlines()
                elif proc.returncode != 0:
                    err = path.with_suffix(".err").read_bytes().decode(errors="replace")
                    failures.append(f"py-spy on {path.stem}: {err.strip()[-200:]}")
        finally:
            self.stop()
        out = summarize(lines, self.rate, req_s * self.seconds)
        out["processes"] = len(self.procs)
        if failures:
            out["failures"] = failures[:3]
        return out

    def stop(self) -> None:
        for _, proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


_PACKAGES = re.compile(r"/(?:site-packages|dist-packages)/(.*)$")
_STDLIB = re.compile(r"/lib/python3\.\d+/(.*)$")
# this project's packages, wherever they run from (TorchServe extracts an archive into a
# directory of its own)
_OURS = re.compile(r"(?:^|/)((?:handlers|compiled_serving|bench|pod|examples)/.*)$")


def frame_name(frame: str) -> str:
    """`function (file:line)` -> `function (file)`, the file from its package on (ts/...,
    torch/..., handlers/...; the standard library's from its top)."""
    m = _FRAME.match(frame)
    if not m:
        return frame
    path = m["file"]
    short = _PACKAGES.search(path) or _STDLIB.search(path) or _OURS.search(path)
    if short:
        path = short.group(1)
    return f"{m['func']} ({path})"


def stage_of(frames: list) -> str:
    """The first stage in STAGES that a frame of `frames` (names from frame_name) names."""
    funcs = {f.split(" (", 1)[0] for f in frames}
    funcs |= {f.rsplit(".", 1)[1] for f in funcs if "." in f}  # Class.method also as method
    for stage, names in STAGES:
        if any(n in funcs for n in names):
            return stage
    return "outside the worker loop"


def summarize(lines, rate: int, requests: float, top: int = 12) -> dict:
    """Microseconds per request by stage, and the functions with the most own and inclusive time,
    from py-spy raw lines (`stack count`) of all workers together."""
    stages, own, inclusive = Counter(), Counter(), Counter()
    total = 0
    for line in lines:
        m = _LINE.match(line.strip())
        if not m:
            continue
        n = int(m["n"])
        frames = [frame_name(f) for f in m["stack"].split(";")]
        total += n
        stages[stage_of(frames)] += n
        own[frames[-1]] += n
        for f in set(frames):
            inclusive[f] += n
    per = 1e6 / rate / requests if requests else 0.0
    return {
        "rate": rate, "samples": total, "requests": round(requests),
        "us_per_request": round(total * per, 1),
        "stages": {k: round(v * per, 1) for k, v in stages.most_common()},
        "top_own": [[k, round(v * per, 2)] for k, v in own.most_common(top)],
        "top_inclusive": [[k, round(v * per, 2)] for k, v in inclusive.most_common(top * 2)],
    }
