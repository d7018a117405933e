"""Where a host's cores go during a benchmark point: TorchServe's frontend (its Java process),
its Python workers, the load generator (this process's children), interrupt handling and
everything else, read from Linux's /proc between two snapshots. Counts CPU time, not wall time: 2.0 means two cores busy
for the whole window.

/proc/stat's first line holds the host's jiffies per state (user nice system idle iowait irq
softirq steal ...; absent trailing fields count as 0); /proc/PID/stat fields 14 and 15 (utime, stime) a process's, both in
SC_CLK_TCK units. A process that exits inside the window is not counted.
"""
from __future__ import annotations

import os
import re
import time
from typing import Optional

GROUPS = ("frontend", "workers", "load_generator")


def _host() -> tuple:
    """(busy, interrupts, total) jiffies of the host; interrupts (irq + softirq) is where
    loopback networking is mostly accounted, outside any process."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]] + [0] * 8
    idle = values[3] + values[4]
    return sum(values) - idle, values[5] + values[6], sum(values)


def _group(pid: str, cmdline: bytes, ppid: int, me: int) -> Optional[str]:
    if b"org.pytorch.serve" in cmdline and b"java" in cmdline:
        return "frontend"
    # a worker forked by compiled_serving/prefork.py keeps its warm process's command line,
    # counted with the workers as the zygote is (idle between forks)
    if b"model_service_worker" in cmdline or b"prefork.py\x00--zygote" in cmdline:
        return "workers"
    if b"py-spy" in cmdline:  # bench_e2e --spy's samplers: measuring, not load (counted as other)
        return None
    if ppid == me:
        return "load_generator"
    return None


def read_stat(path: str) -> tuple:
    """(name, fields after the name) of a /proc/.../stat file. The name, in brackets, may itself
    hold spaces and brackets, so the fields start after the last ')'."""
    with open(path) as f:
        head, _, rest = f.read().rpartition(")")
    return head.partition("(")[2], rest.split()


def _jiffies(fields: list) -> int:
    """utime + stime: stat fields 14 and 15, the 12th and 13th after the name."""
    return int(fields[11]) + int(fields[12])


def _threads(pid: str) -> dict:
    """{thread id: (kind, CPU jiffies)} of a process. A thread's kind is its name
    (/proc/PID/task/TID/stat field 2, which the JVM sets to the Java thread's name cut to 15
    characters) with each run of digits written as "#", so all "GC Thread#3"-like threads are
    one kind, as are the "W-9000-ours_1.0" threads that talk to the workers, or Netty's
    "epollEventLoopG"."""
    threads: dict = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return threads
    for tid in tids:
        try:
            name, fields = read_stat(f"/proc/{pid}/task/{tid}/stat")
        except OSError:
            continue
        threads[tid] = (re.sub(r"\d+", "#", name), _jiffies(fields))
    return threads


def _cores_by_key(before: dict, after: dict, tick: int, seconds: float) -> tuple:
    """{member: (key, jiffies)} snapshots (processes by group, threads by kind) to, per key,
    (cores of all its members, cores of its busiest single member). A member that started inside
    the window counts from zero; one that exited inside it is not counted (a thread's time stays
    in its process's total, so the kinds may add up to less than that)."""
    total: dict = {}
    top: dict = {}
    for member, (key, jiffies) in after.items():
        cores = (jiffies - before.get(member, (key, 0))[1]) / tick / seconds
        total[key] = total.get(key, 0.0) + cores
        top[key] = max(top.get(key, 0.0), cores)
    return total, top


def snapshot() -> Optional[dict]:
    """CPU jiffies so far per process of each group (and per frontend thread) and for the host,
    with the time; None without /proc."""
    if not os.path.exists("/proc/stat"):
        return None
    me, procs, threads = os.getpid(), {}, {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            _, fields = read_stat(f"/proc/{pid}/stat")
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:  # exited while we looked
            continue
        name = _group(pid, cmdline, int(fields[1]), me)
        if name:
            procs[pid] = (name, _jiffies(fields))
            if name == "frontend":  # keyed by (pid, tid): several frontends merge, never collide
                threads.update({(pid, tid): v for tid, v in _threads(pid).items()})
    busy, irq, total = _host()
    return {"t": time.monotonic(), "procs": procs, "frontend_threads": threads,
            "host_busy": busy, "host_irq": irq, "host_total": total}


def usage(before: Optional[dict], after: Optional[dict]) -> Optional[dict]:
    """Cores busy on average between two snapshots: per group, interrupt handling ("irq"), the
    rest of the host ("other") and the host's total, next to how many cores it has."""
    if not before or not after or after["t"] <= before["t"]:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    seconds = after["t"] - before["t"]
    # per process, so that one exiting inside the window drops out instead of subtracting its
    # whole life from its group; the busiest single process of each group alongside (a Python
    # process near 1.0 is bound by its GIL)
    total, top = _cores_by_key(before["procs"], after["procs"], tick, seconds)
    out = {g: round(total.get(g, 0.0), 2) for g in GROUPS}
    out["busiest"] = {g: round(top.get(g, 0.0), 2) for g in GROUPS}
    # the frontend's cores by thread kind, the busiest kinds first (Netty event loops, GC, the
    # workers' I/O threads), and its busiest single thread of each kind: a Netty event loop near
    # 1.0 is saturated whatever the others do (each connection stays on one loop)
    total, top = _cores_by_key(before["frontend_threads"], after["frontend_threads"], tick, seconds)
    kinds = [k for k, v in sorted(total.items(), key=lambda kv: -kv[1])[:8] if v >= 0.01]
    out["frontend_threads"] = {k: round(total[k], 2) for k in kinds}
    out["frontend_busiest_thread"] = {k: round(top[k], 2) for k in kinds}
    cores = os.cpu_count() or 1
    # host jiffies count every core: their share busy times the cores is the cores in use
    span = after["host_total"] - before["host_total"]
    busy = (after["host_busy"] - before["host_busy"]) / span * cores if span else 0.0
    irq = (after["host_irq"] - before["host_irq"]) / span * cores if span else 0.0
    out["irq"] = round(irq, 2)
    out["other"] = round(max(0.0, busy - irq - sum(out[g] for g in GROUPS)), 2)
    out["host_busy"] = round(busy, 2)
    out["host_cores"] = cores
    return out
