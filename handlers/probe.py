"""Child process of the crash-safe load: `python -m handlers.probe VARIANT_DIR KIND INDEX`.

Loads the artifact and runs one forward at the smallest accepted batch. Exits 0 on success,
1 with a `PROBE-ERROR: message` line on a Python-level failure; a native crash kills it with
a signal, which the parent turns into a load error.
"""
import sys


def main():
    variant_dir, kind, index = sys.argv[1], sys.argv[2], int(sys.argv[3])
    try:
        import os

        import torch

        # The parent's thread budget (handlers/threads.py ThreadBudget.child_env).
        if os.environ.get("TS_HANDLER_CPU_THREADS"):
            torch.set_num_threads(int(os.environ["TS_HANDLER_CPU_THREADS"]))
        from handlers.device import Placement
        from handlers.load import load_artifact
        from handlers.metadata import read_spec

        spec = read_spec(variant_dir)
        placement = Placement(kind, index if index >= 0 else None)
        model = load_artifact(spec, placement)
        with torch.inference_mode():
            args = [torch.zeros((spec.batch_min,) + tuple(s.shape[1:]), dtype=getattr(torch, s.dtype),
                                device=placement.torch_device) for s in spec.inputs]
            model(*args)
        if kind == "cuda":
            torch.cuda.synchronize()
    except Exception as e:
        print(f"PROBE-ERROR: {e}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
