"""The engine's own account of a benchmark run, second by second, added to a bench_e2e result:
what held it back (the device busy, or its one loop), from the files an engine process writes
when CS_ENGINE_SAMPLE is set (handlers/engine/sampler.py: a snapshot of its totals and of its
loop's wall clock by phase once a second, the device's busy time from timed events per step).

    CS_ENGINE_SAMPLE=/tmp/s/sample python -m bench.bench_e2e ... --variant engine12:engine=on,workers=12 ...

bench_e2e adds the account itself when CS_ENGINE_SAMPLE is set (its engines' files, after the run);
by hand, for files kept from a run:

    python -m bench.engine_seconds --result docs/results/engine_bert_fp16_TAG.json --samples /tmp/s/sample.*.json

Each engine of the run wrote one file (sample.PID.json) naming its engine (engine-MODEL, the
TorchServe model it served: ours, ours_late, ...). Files from before engines were so named
need --variants: the files sorted by their first snapshot are the engines in the order the run
started them.

Every second in which the engine answered at least --min-rows rows is kept: rows, jobs, steps
(launches) and replays per second, the device's busy fraction, the loop's fraction by phase
(idle: waiting with nothing to do; poll: looking at the sockets while a step runs; read:
reading the workers' messages; land: answering finished steps; launch: planning and queueing a
step) and a job's mean time queued and in flight (launched to answered), ms.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.results_meta import invocation

PHASES = ("idle", "poll", "read", "land", "launch", "run")


def seconds(snapshots: list, min_rows: float) -> list:
    """Per second between two snapshots where the engine answered at least `min_rows` rows."""
    out = []
    for a, b in zip(snapshots, snapshots[1:]):
        dt = b["t"] - a["t"]
        if dt <= 0 or (b["rows"] - a["rows"]) / dt < min_rows:
            continue
        rate = {k: (b[k] - a[k]) / dt for k in ("rows", "jobs", "calls", "replays")}
        clock = {k: (b["clock_s"].get(k, 0.0) - a["clock_s"].get(k, 0.0)) / dt
                 for k in set(a["clock_s"]) | set(b["clock_s"])}
        jobs = max(rate["jobs"], 1e-9)
        busy = None if b.get("device_busy_s") is None else (b["device_busy_s"] - a["device_busy_s"]) / dt
        out.append({"rows_s": round(rate["rows"], 1), "jobs_s": round(rate["jobs"], 1),
                    "steps_s": round(rate["calls"], 1), "replays_s": round(rate["replays"], 1),
                    "device_busy": None if busy is None else round(busy, 3),
                    "loop": {k: round(clock.get(k, 0.0), 3) for k in PHASES if k in clock},
                    "queued_ms_per_job": round(1e3 * clock.get("job_queued", 0.0) / jobs, 3),
                    "flight_ms_per_job": round(1e3 * clock.get("job_flight", 0.0) / jobs, 3)})
    return out


def markdown(engine_seconds: dict) -> list:
    lines = ["", "## The engine's own account (bench/engine_seconds.py)", "",
             "Each second in which the engine answered many rows: the device's busy fraction (timed events",
             "per step) and its loop's fraction of the second by phase; the mean job's ms queued and in flight.", "",
             "| variant | rows/s | jobs/s | steps/s | device busy | idle | poll | read | land | launch | "
             "queued ms | in flight ms |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for variant, v in engine_seconds.items():
        for s in v["seconds"]:
            loop = s["loop"]
            lines.append(f"| {variant} | {s['rows_s']} | {s['jobs_s']} | {s['steps_s']} | {s['device_busy']} | "
                         + " | ".join(str(loop.get(k, 0.0)) for k in ("idle", "poll", "read", "land", "launch"))
                         + f" | {s['queued_ms_per_job']} | {s['flight_ms_per_job']} |")
    return lines


def by_engine(files: list, models: list) -> dict:
    """{model: sample} of the files whose engine is named for one of `models` (engine-MODEL:
    handlers/engine/link.py names each engine for the TorchServe model it serves)."""
    out = {}
    for f in files:
        d = json.loads(Path(f).read_text()) | {"file": Path(f).name}
        model = str(d.get("engine", "")).removeprefix("engine-")
        if model in models:
            out[model] = d
    return out


def merge_by_engine(result_path: Path, files: list, min_rows: float, command: str) -> None:
    """`files` matched by their engines' names to the result's handlers (by_engine), merged where any is."""
    models = sorted({p["handler"] for p in json.loads(result_path.read_text())["points"]})
    samples = by_engine(files, models)
    if samples:
        merge(result_path, samples, min_rows, command)


def merge(result_path: Path, samples: dict, min_rows: float, command: str) -> None:
    """The engines' seconds ({variant: sample}) into a bench_e2e result and a section of its .md."""
    result = json.loads(result_path.read_text())
    result["engine_seconds_command"] = command
    result["engine_seconds"] = {v: {"file": s["file"], "seconds": seconds(s["snapshots"], min_rows)}
                                for v, s in samples.items()}
    result_path.write_text(json.dumps(result, indent=1) + "\n")
    md = result_path.with_suffix(".md")
    if md.exists():
        text = md.read_text().split("\n## The engine's own account")[0].rstrip("\n")
        md.write_text(text + "\n" + "\n".join(markdown(result["engine_seconds"])) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--result", required=True, help="a bench_e2e results JSON (its .md beside it gets a section)")
    ap.add_argument("--samples", nargs="+", required=True, help="the engines' sample.PID.json files")
    ap.add_argument("--variants", help="the engine variants' names, in the run's order (files written before the "
                    "engines were named for their models); default: each file's engine name")
    ap.add_argument("--min-rows", type=float, default=2000.0, help="rows per second a kept second answered")
    args = ap.parse_args(argv)
    result_path = Path(args.result)
    if not args.variants:
        merge_by_engine(result_path, args.samples, args.min_rows, invocation(argv))
        return 0
    samples = sorted((json.loads(Path(f).read_text()) | {"file": Path(f).name} for f in args.samples),
                     key=lambda d: d["snapshots"][0]["t"] if d["snapshots"] else float("inf"))
    variants = args.variants.split(",")
    if len(samples) != len(variants):
        raise SystemExit(f"{len(samples)} sample files for {len(variants)} variants ({args.variants}): "
                         "give one file per engine the run started")
    merge(result_path, dict(zip(variants, samples)), args.min_rows, invocation(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
