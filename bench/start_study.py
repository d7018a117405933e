"""Where a worker's start goes before it serves, piece by piece: each step timed in a fresh
Python (what a restarted worker pays; files already in the page cache), median of --repeats.

    python -m bench.start_study --artifact DIR --out docs/results/start_study_TAG.json

Steps, each measured cumulatively in its own process so imports are not shared: the bare
interpreter; `import torch`; torch plus the CUDA context (first tensor on the device); TorchServe's
worker modules (what model_service_worker imports before a load message); the handler package
(`handlers.ts_entry`); `torch._inductor` (what aoti_load_package imports); then the package's
load two ways: torch's `aoti_load_package` (its load_pt2 path) and the loader it wraps
(`torch._C._aoti.AOTIModelPackageLoader`) called directly; and the first call of each.
Writes OUT.json (device, date, torch, command first) and OUT.md beside it.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from bench.results_meta import header, page_head

PRELUDE = "import time, sys; t0 = time.perf_counter()\n"
CUDA = "import torch; torch.cuda.set_device(0); torch.zeros(1, device='cuda'); torch.cuda.synchronize()\n"
LOAD_TORCH = """
from unittest import mock
from torch._inductor import aoti_load_package, codecache
# as the handler called it until the direct loader: inductor's CPU ISA probe builds skipped
with mock.patch.object(codecache, "get_device_information", lambda device_type: {}):
    fn = aoti_load_package(PATH, device_index=0, run_single_threaded=True)
"""
LOAD_DIRECT = """
loader = torch._C._aoti.AOTIModelPackageLoader(PATH, "model", True, 1, 0)
"""
STEPS = {
    "interpreter": "",
    "import torch": "import torch\n",
    "torch + CUDA context": CUDA,
    "TorchServe worker modules": "import ts.model_service_worker, ts.model_loader, ts.service, ts.context\n",
    "handler package": "import handlers.ts_entry\n",
    "torch + CUDA + torch._inductor": CUDA + "import torch._inductor\n",
    "torch + CUDA + aoti_load_package": CUDA + LOAD_TORCH,
    "torch + CUDA + AOTIModelPackageLoader": CUDA + LOAD_DIRECT,
}


def time_step(code: str, path: str) -> float:
    src = PRELUDE + code.replace("PATH", repr(path)) + "print(time.perf_counter() - t0)\n"
    t = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True)
    if t.returncode != 0:
        raise SystemExit(f"step failed: {code!r}: {t.stderr[-2000:]}")
    return float(t.stdout.strip().splitlines()[-1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", required=True, help="directory written by compiled_serving/compile.py (an AOTI package)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    import torch

    from handlers.artifact.metadata import read_spec

    path = read_spec(args.artifact).artifact_path
    steps = {}
    for name, code in STEPS.items():
        runs = [round(time_step(code, path), 3) for _ in range(args.repeats)]
        steps[name] = {"median_s": statistics.median(runs), "runs_s": runs}
        print(name, steps[name], flush=True)
    result = {**header(torch.cuda.get_device_name(0), argv), "artifact": args.artifact, "steps": steps}
    out = Path(args.out)
    out.write_text(json.dumps(result, indent=1) + "\n")
    lines = page_head(result, "Where a worker's start goes, step by step (fresh Python each)")
    lines += ["Each row is measured from the interpreter's first line in a new process, cumulatively "
              "(a row includes what its code imports or does before), median of the runs.", "",
              "| step (cumulative) | median s | runs |", "|---|---|---|"]
    lines += [f"| {k} | {v['median_s']} | {', '.join(map(str, v['runs_s']))} |" for k, v in steps.items()]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
