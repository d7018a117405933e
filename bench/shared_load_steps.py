"""Where a worker's load of an AOTInductor package goes, step by step, with held weights
(handlers/weights) and with its own copy, no server: each worker a fresh process, one after the
other, as TorchServe's workers of one GPU take turns on the holder's lock.

    python -m bench.shared_load_steps --artifact DIR --workers 2 --out OUT.json

Per worker: the attach (the first also starts the holder: its own load), the package's library
extracted, the container runner built (its own copy filled), the held weights swapped in
and the own copy freed (aoti_runner.adopt, the handler's own call), the first call, and the device memory the
process holds after (torch.cuda.mem_get_info). A stuck step prints every thread's stack to
stderr every 30 s (faulthandler), so a hang names its place.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import subprocess
import sys
import tempfile
import time


def child(args) -> None:
    faulthandler.dump_traceback_later(30, repeat=True, file=sys.stderr)
    t0 = time.perf_counter()
    import torch

    from handlers.artifact.device import Placement, use_device
    from handlers.artifact.kinds import aoti_runner, kind_of, recognise
    from handlers.artifact.load import load_artifact
    from handlers.artifact.metadata import read_spec
    from handlers.torchserve import scratch
    from handlers.weights import attach

    steps, mark = {"imports": time.perf_counter() - t0}, [time.perf_counter()]

    def done(name):
        now = time.perf_counter()
        steps[name] = round(now - mark[0], 3)
        mark[0] = now

    scratch.enter()
    spec = recognise(read_spec(args.artifact))
    placement = Placement("cuda", 0) if torch.cuda.is_available() else Placement("cpu", None)
    use_device(placement)
    free0 = torch.cuda.mem_get_info()[0] if placement.kind == "cuda" else 0
    done("cuda init")
    x = list(spec.example(spec.batch_min, placement.torch_device).values())
    if args.own:
        model = load_artifact(spec, placement)
        done("own load")
    else:
        with attach.attached(scratch.shared_root(), spec, placement, kind_of(spec).load_copies_weights) as held:
            done("attach" + (" (started the holder)" if held.started else ""))
            so, kernels = aoti_runner.package_library(spec.artifact_path, tempfile.mkdtemp(prefix="aoti-"))
            done("extract library")
            runner = aoti_runner.new_runner(so, placement, kernels)
            done("runner (own copy filled)")
            aoti_runner.adopt(runner, held.tensors)
            done("held weights in, own copy freed (aoti_runner.adopt)")
        model = runner.run
        x = [x]
    with torch.inference_mode():
        out = model(*x)
    if placement.kind == "cuda":
        torch.cuda.synchronize()
    done("first call")
    if placement.kind == "cuda":
        steps["device_mib_taken"] = round((free0 - torch.cuda.mem_get_info()[0]) / 2**20)
    leaves = out if isinstance(out, list) else list(out.values())
    steps["answer_sum"] = float(leaves[0].float().sum())
    print(json.dumps(steps), flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", required=True)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--timeout", type=float, default=240)
    p.add_argument("--out", default="")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--own", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    rows = []
    for i in range(args.workers + 1):
        own = i == args.workers  # the last: its own copy, for comparison
        cmd = [sys.executable, "-m", "bench.shared_load_steps", "--child", "--artifact", args.artifact]
        t = time.perf_counter()
        try:
            r = subprocess.run(cmd + (["--own"] if own else []), capture_output=True, text=True, timeout=args.timeout)
            row = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else {
                "error": r.returncode, "stderr": r.stderr[-3000:]}
        except subprocess.TimeoutExpired as e:
            row = {"error": "timeout", "stderr": (e.stderr or b"")[-4000:].decode(errors="replace")}
        row.update(worker="own" if own else i, wall_s=round(time.perf_counter() - t, 2))
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        from bench.results_meta import header

        with open(args.out, "w") as f:
            json.dump({**header("see rows", argv), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
