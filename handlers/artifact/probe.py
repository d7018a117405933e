"""Crash-safe trial load: load the artifact and run one forward in a child process first, so a
segfault, abort or illegal instruction there becomes a LoadError in the worker instead of a
worker that TorchServe restarts in a loop.

Parent side: crash_safe_probe(). Child side:
`python -m handlers.artifact.probe VARIANT_DIR KIND INDEX [CUDA_GRAPHS]` (KIND is the device kind, INDEX
-1 on CPU, CUDA_GRAPHS the worker's handler.cuda_graphs, which decides how AOTI loads); exits 0
on success, 1 with a `PROBE-ERROR: message` line on a Python-level failure; a native crash kills
it with a signal.
"""
from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time

from handlers.artifact import confine, verdicts
from handlers.artifact.device import Placement
from handlers.artifact.kinds import recognise
from handlers.artifact.load import load_artifact
from handlers.artifact.metadata import ArtifactSpec, read_spec
from handlers.config import parse_config
from handlers.errors import LoadError

SIGNAL_HINTS = {
    "SIGSEGV": "a segmentation fault: typically an AOTInductor wrapper built with a toolchain "
               "whose C++ runtime does not match (rebuild with CXX=g++-12, see README), a torch "
               "version mismatch, or a corrupt library",
    "SIGILL": "an illegal instruction: the artifact uses CPU instructions this CPU lacks; "
              "recompile on the serving CPU generation",
    "SIGABRT": "an abort in native code (see the stderr tail)",
    "SIGBUS": "a bus error: a truncated or corrupt shared library",
}


def child_env(pkg_parent: str, budget=None) -> dict:
    """This process's environment, with the handler package importable and, given a
    ThreadBudget (handlers/torchserve/threads.py), the same CPU thread budget from the child's first torch
    import."""
    env = budget.child_env(os.environ) if budget is not None else dict(os.environ)
    env["PYTHONPATH"] = pkg_parent + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def crash_safe_probe(spec: ArtifactSpec, placement: Placement, config, budget=None) -> float:
    """Costs one extra load and forward (and, on GPU, a second CUDA context for its duration).
    Returns the seconds it took."""
    t0 = time.perf_counter()
    # the directory holding the `handlers` package (this file is handlers/artifact/probe.py)
    pkg_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # The child loads the artifact as the worker will (cuda_graphs decides how AOTI loads).
    # the child starts in pkg_parent: a relative directory would be read from there
    # the child sees the placement's GPU alone (confine.py): its context lands on no other GPU
    env, index = confine.child_env(child_env(pkg_parent, budget), placement.kind, placement.index)
    cmd = [sys.executable, "-m", "handlers.artifact.probe", os.path.abspath(spec.variant_dir), placement.kind,
           str(index if index is not None else -1), config.cuda_graphs]
    try:
        r = subprocess.run(cmd, env=env, cwd=pkg_parent, capture_output=True,
                           text=True, timeout=config.crash_safe_timeout_s)
    except subprocess.TimeoutExpired:
        err = LoadError(f"trial load of {spec.artifact} on {placement} did not finish within "
                        f"{config.crash_safe_timeout_s:.0f}s (handler.crash_safe_timeout_s)")
        err.recurs = False  # a busy machine may finish next time
        raise err from None
    if r.returncode < 0:
        try:
            sig = signal.Signals(-r.returncode).name
        except ValueError:
            sig = f"signal {-r.returncode}"
        tail = "\n".join(r.stderr.strip().splitlines()[-5:])
        raise LoadError(f"loading {spec.artifact} ({spec.backend}) on {placement} crashed the trial "
                        f"process with {sig}: {SIGNAL_HINTS.get(sig, 'a native crash')}. "
                        f"Last output: {tail or '(none)'}")
    if r.returncode != 0:
        lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
        msg = next((ln.split("PROBE-ERROR: ", 1)[1] for ln in reversed(lines) if "PROBE-ERROR: " in ln),
                   "\n".join(lines[-5:]))
        raise LoadError(msg)
    return time.perf_counter() - t0


VERDICTS = "probe-verdicts"


def _verdict_key(spec: ArtifactSpec, placement: Placement, config) -> dict:
    """What a trial load's success depends on: the artifact's bytes, where it loads, how (AOTI
    loads differently with CUDA graphs), the torch build and this machine."""
    import torch

    from handlers.artifact.machine import this_machine

    return {"sha256": spec.sha256, "placement": str(placement), "cuda_graphs": config.cuda_graphs,
            "torch": torch.__version__, "cuda": torch.version.cuda or "",
            "machine": this_machine(placement).describe()}


def probe_once(spec: ArtifactSpec, placement: Placement, config, budget=None, verdict_root=None) -> tuple:
    """The crash-safe trial load, unless one already passed for the same artifact bytes,
    placement, torch build and machine (a verdict kept under `verdict_root`, this user's private
    scratch root, so a restarted worker and its siblings skip it; None: every load runs it).
    Returns (seconds, note for the load line)."""
    key = _verdict_key(spec, placement, config)
    path = verdicts.path(key, verdict_root, VERDICTS)
    if path is None:
        secs = crash_safe_probe(spec, placement, config, budget)
        return secs, f"trial load {secs:.2f}s"
    t0 = time.perf_counter()
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    # Workers starting together queue on one lock per key: the first runs the trial load, the
    # others find its verdict (flock is released when the descriptor closes, also on a raise).
    fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if verdicts.trusted(path, key):
            return 0.0, f"trial load passed before (verdict reused; waited {time.perf_counter() - t0:.2f}s)"
        secs = crash_safe_probe(spec, placement, config, budget)
        verdicts.record(path, key)
        return secs, f"trial load {secs:.2f}s"
    finally:
        os.close(fd)


def main():
    variant_dir, kind, index = sys.argv[1], sys.argv[2], int(sys.argv[3])
    graphs = sys.argv[4] if len(sys.argv) > 4 else "off"
    try:
        import torch

        # The parent's thread budget (handlers/torchserve/threads.py ThreadBudget.child_env).
        if os.environ.get("TS_HANDLER_CPU_THREADS"):
            torch.set_num_threads(int(os.environ["TS_HANDLER_CPU_THREADS"]))
        # The parent checked this artifact's SHA-256 when it chose the variant, moments ago:
        # recognised here from its files, not hashed a second time.
        spec = recognise(read_spec(variant_dir))
        placement = Placement(kind, index if index >= 0 else None)
        model = load_artifact(spec, placement, parse_config({"handler": {"cuda_graphs": graphs}}))
        with torch.inference_mode():
            args = list(spec.example(spec.batch_min, placement.torch_device).values())
            model(*args)
        if kind == "cuda":
            torch.cuda.synchronize()
    except Exception as e:
        print(f"PROBE-ERROR: {e}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
