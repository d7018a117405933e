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
    if b"model_service_worker" in cmdline:
        return "workers"
    if ppid == me:
        return "load_generator"
    return None


def _thread_kinds(pid: str) -> dict:
    """CPU jiffies of a process's threads by kind: the thread's name (/proc/PID/task/TID/stat
    field 2, which the JVM sets to the Java thread's name cut to 15 characters) with each run
    of digits written as "#", so all "GC Thread#3"-like threads are one kind, as are the
    "W-9000-ours_1.0" threads that talk to the workers, or Netty's "epollEventLoopG"."""
    kinds: dict = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return kinds
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                head, _, rest = f.read().rpartition(")")
        except OSError:
            continue
        name = re.sub(r"\d+", "#", head.partition("(")[2])
        fields = rest.split()
        kinds[name] = kinds.get(name, 0) + int(fields[11]) + int(fields[12])
    return kinds


def snapshot() -> Optional[dict]:
    """CPU jiffies so far per group and for the host, with the time; None without /proc."""
    if not os.path.exists("/proc/stat"):
        return None
    me, groups, procs, threads = os.getpid(), dict.fromkeys(GROUPS, 0), {}, {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:  # exited while we looked
            continue
        name = _group(pid, cmdline, int(fields[1]), me)
        if name:
            jiffies = int(fields[11]) + int(fields[12])
            groups[name] += jiffies
            procs[pid] = (name, jiffies)
            if name == "frontend":
                threads = _thread_kinds(pid)
    busy, irq, total = _host()
    return {"t": time.monotonic(), "groups": groups, "procs": procs, "frontend_threads": threads,
            "host_busy": busy, "host_irq": irq, "host_total": total}


def usage(before: Optional[dict], after: Optional[dict]) -> Optional[dict]:
    """Cores busy on average between two snapshots: per group, interrupt handling ("irq"), the
    rest of the host ("other") and the host's total, next to how many cores it has."""
    if not before or not after or after["t"] <= before["t"]:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    seconds = after["t"] - before["t"]
    out = {g: round((after["groups"][g] - before["groups"][g]) / tick / seconds, 2) for g in GROUPS}
    # the busiest single process of each group: a Python process near 1.0 is bound by its GIL
    busiest = dict.fromkeys(GROUPS, 0.0)
    for pid, (name, jiffies) in after["procs"].items():
        start = before["procs"].get(pid, (name, 0))[1]
        busiest[name] = max(busiest[name], round((jiffies - start) / tick / seconds, 2))
    out["busiest"] = busiest
    # the frontend's cores by thread kind, the busiest first (Netty event loops, GC, workers' I/O)
    kinds = {k: (v - before["frontend_threads"].get(k, 0)) / tick / seconds
             for k, v in after["frontend_threads"].items()}
    out["frontend_threads"] = {k: round(v, 2) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])[:8]
                               if v >= 0.01}
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
