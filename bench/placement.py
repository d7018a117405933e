"""Every export device on every GPU of the host, through real TorchServe (issue 62).

    python -m bench.placement --out docs/results/placement_2gpu_TAG.json [--work DIR]
        [--scaling e2e_resnet50_fp16_scaling_TAG.json] [--ready-timeout S]

Cases: a model exported on cuda:0, on cuda:1 (where the host has it) and on the CPU, handed over as
the program alone and as its AOTInductor package with the program, for a stateless model (conv +
BatchNorm, a registered buffer, a plain tensor attribute, `arange(device=x.device)` and a device
named in forward: examples/models.py:devices_named), the one-sequence decoder
(examples/tiny_decoder.py) and the slot form (examples/slot_decoder.py). Each is archived by
cs-archive with no options (decoders with --workers N, N the GPUs, to bound the host's load), all
are served by one TorchServe from the shipped config, and for each: `archived`, `ready_s`,
`answers_equal` (stateless: every answer within 1e-4 of the eager model on the CPU; decoders: the
greedy tokens of the eager model on cuda:0), `workers_per_gpu` (its workers holding GPU memory, by
GPU: none where each GPU's engine runs the model, handler.engine auto) and `stray_contexts` (a
worker or engine of the server holding memory on more than one GPU, from nvidia-smi); the engines
per GPU. `ready_failures` names every model not READY within --ready-timeout. --scaling merges a bench_e2e --gpus 1,all
results file (ResNet-50, ours and echo) as `throughput`. Writes OUT (JSON), OUT.md and OUT.png.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import requests
import torch

from bench.bench_shared import smi
from bench.results_meta import header, page_head, write_pages
from compiled_serving.local_server import LocalTorchServe, ROOT, server_env

MODELS = ("stateless", "decoder", "slot")
PROMPT = [5, 17, 33, 2, 9, 44, 120]
TOKENS = 8


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="results file (JSON); OUT.md and OUT.png beside it")
    p.add_argument("--work", default="/tmp/placement", help="artifacts, the store and the server's files")
    p.add_argument("--scaling", help="a bench.bench_e2e --gpus 1,all results file to merge as `throughput`")
    p.add_argument("--ready-timeout", type=float, default=240.0)
    p.add_argument("--models", default=",".join(MODELS), help="a subset of " + ",".join(MODELS))
    p.add_argument("--engine", type=int, default=0, metavar="N",
                   help="also serve each stateless package with engine: on and N workers per GPU (issue 64; "
                        "the archive's default serves it through the engine too, with its own worker count)")
    return p.parse_args(argv)


def export_devices() -> list:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [f"cuda:{i}" for i in range(min(gpus, 2))] + ["cpu"]


def build(model: str, device: str):
    """(the model on `device`, its torch.export program)."""
    from examples import models, slot_decoder, tiny_decoder

    if model == "stateless":
        m = models.devices_named("cuda:0" if device.startswith("cuda") else "cpu").to(device).eval()
        batch = torch.export.Dim("batch", min=1, max=8)
        args = tuple(t.to(device) for t in models.devices_named_inputs(2))
        return m, torch.export.export(m, args, dynamic_shapes=({0: batch}, {0: batch}))
    if model == "decoder":
        m = tiny_decoder.build(device=device)
        return m, tiny_decoder.export(m)
    m = slot_decoder.build(slot_decoder.Config(max_seq_length=64), slots=8, device=device)
    return m, slot_decoder.export(m)


def make(model: str, device: str, work: str) -> dict:
    """Exports (and packages) one case in this process: {program, package} paths."""
    d = Path(work) / f"{model}_{device.replace(':', '')}"
    d.mkdir(parents=True, exist_ok=True)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))  # the compile's CUDA state on the export's GPU
    _, ep = build(model, device)
    torch.export.save(ep, d / "program.pt2")
    from torch._inductor import aoti_compile_and_package

    aoti_compile_and_package(ep, package_path=str(d / "package.pt2"))
    return {"program": str(d / "program.pt2"), "package": str(d / "package.pt2")}


def make_all(work: Path, models: list) -> dict:
    """Every (model, export device) made in its own process, at once: {(model, device): paths or error}."""
    jobs = {}
    with cf.ThreadPoolExecutor(max_workers=9) as pool:
        for model in models:
            for device in export_devices():
                cmd = [sys.executable, "-m", "bench.placement", "--make", model, device, str(work)]
                jobs[(model, device)] = pool.submit(subprocess.run, cmd, cwd=ROOT, capture_output=True, text=True,
                                                    timeout=560, env=server_env())
    made = {}
    for key, job in jobs.items():
        r = job.result()
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
        made[key] = json.loads(lines[-1]) if r.returncode == 0 and lines else {"error": r.stderr[-1500:]}
    return made


def archive(name: str, paths: dict, form: str, model: str, store: Path, gpus: int, engine: int = 0) -> dict:
    """cs-archive with no options (decoders: --workers, one per GPU; `engine`: engine: on with that
    many workers per GPU); {archived, seconds, said}."""
    cmd = [str(Path(sys.executable).parent / "cs-archive"), "--name", name, "--out", str(store)]
    if not Path(cmd[0]).exists():
        cmd[0:1] = [sys.executable, "-m", "compiled_serving.archive"]
    cmd += ["--artifact", paths["package"], "--program", paths["program"]] if form == "package" else [
        "--artifact", paths["program"]]
    if model != "stateless":
        cmd += ["--workers", str(max(gpus, 1))]
    if engine:
        cmd += ["--handler-option", "engine=on", "--workers", str(engine * max(gpus, 1))]
    t0 = time.time()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=server_env(), timeout=560)
    said = [ln for ln in (r.stdout + r.stderr).splitlines() if "checks run on" in ln or "error" in ln.lower()]
    return {"archived": r.returncode == 0, "archive_s": round(time.time() - t0, 1), "said": said[-3:]}


def eager_reference(model: str):
    """The answer each served case must give: stateless, a function of the inputs (the eager
    model on the CPU); decoders, the eager greedy tokens on the first GPU (else the CPU)."""
    from examples import models, tiny_decoder

    if model == "stateless":
        m = models.devices_named("cpu").eval()
        return lambda x, mask: m(x, mask)
    dev = "cuda:0" if torch.cuda.is_available() else "cpu"
    m, ids = tiny_decoder.build(device=dev), []
    with torch.no_grad():
        logits = m(torch.tensor([PROMPT], device=dev), torch.arange(len(PROMPT), device=dev))
        for i in range(TOKENS):
            ids.append(int(logits[0, -1].argmax()))
            logits = m(torch.tensor([[ids[-1]]], device=dev), torch.tensor([len(PROMPT) + i], device=dev))
    return ids


def ask_stateless(ts, name: str, ref, n: int = 24) -> dict:
    """n concurrent requests of 1..4 rows (so every worker answers some); the largest difference."""
    from examples import models

    def one(i):
        x, mask = models.devices_named_inputs(1 + i % 4, seed=100 + i)
        r = requests.post(f"{ts.base}/predictions/{name}", json={"inputs": {"x": x.tolist(), "mask": mask.tolist()}},
                          headers=ts.auth(), timeout=120)
        if r.status_code != 200:
            return None, f"{r.status_code} {r.text[:200]}"
        got = torch.tensor(r.json()["outputs"]["output"])
        return (got - ref(x, mask)).abs().max().item(), None

    with cf.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(n)))
    diffs = [d for d, _ in results if d is not None]
    errors = [e for _, e in results if e]
    return {"requests": n, "max_abs_diff": max(diffs) if diffs else None, "errors": errors[:3],
            "answers_equal": not errors and max(diffs) <= 1e-4}


def ask_decoder(ts, name: str, ref: list, n: int = 8) -> dict:
    def one(_):
        r = requests.post(f"{ts.base}/predictions/{name}", headers=ts.auth(), timeout=120, json={
            "input_ids": PROMPT, "parameters": {"max_tokens": TOKENS, "ignore_eos": True}})
        lines = [json.loads(x) for x in r.text.splitlines() if x.strip()] if r.status_code == 200 else []
        return lines[-1].get("token_ids") if lines else f"{r.status_code} {r.text[:200]}"

    with cf.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(one, range(n)))
    return {"requests": n, "answers_equal": all(g == ref for g in got), "tokens": ref,
            "different": [g for g in got if g != ref][:3]}


def gpu_processes() -> dict:
    """{pid: {GPU index: MiB}} of every process holding GPU memory (nvidia-smi)."""
    index = {uuid: int(i) for i, uuid in smi(["--query-gpu=index,uuid"])}
    out: dict = {}
    for pid, uuid, mib in smi(["--query-compute-apps=pid,gpu_uuid,used_memory"]):
        out.setdefault(int(pid), {})[index.get(uuid, -1)] = int(mib) if mib.isdigit() else -1
    return out


def placement_of(ts, name: str, on_gpu: dict) -> dict:
    """workers_per_gpu and stray_contexts (pids on more than one GPU) of a model's workers."""
    pids = [w.get("pid") for w in ts.workers(name)]
    per_gpu, stray = by_gpu(pids, on_gpu)
    return {"worker_pids": pids, "workers_per_gpu": per_gpu, "stray_contexts": len(stray), "strays": stray}


def by_gpu(pids: list, on_gpu: dict) -> tuple:
    """({GPU index: how many of `pids` hold memory on it first}, [the pids on more than one GPU])."""
    per_gpu: dict = {}
    stray = []
    for pid in pids:
        gpus = sorted(on_gpu.get(pid, {}))
        for g in gpus[:1]:
            per_gpu[str(g)] = per_gpu.get(str(g), 0) + 1
        if len(gpus) > 1:
            stray.append({"pid": pid, "gpus_mib": on_gpu[pid]})
    return per_gpu, stray


def wait_all(ts, names: list, timeout: float) -> dict:
    """{name: seconds until all its workers were READY, or None}, polled each second."""
    t0, ready = time.time(), {}
    while time.time() - t0 < timeout and len(ready) < len(names):
        for n in names:
            s = ts.model_status(n)
            if n not in ready and s and all(x == "READY" for x in s):
                ready[n] = round(time.time() - t0, 1)
        time.sleep(1)
    return {n: ready.get(n) for n in names}


def serve_and_check(cases: dict, store: Path, work: Path, timeout: float) -> tuple:
    names = [n for n, c in cases.items() if c.get("archived")]
    ts = LocalTorchServe(work / "ts", store, {n: store / f"{n}.mar" for n in names})
    try:
        ready = wait_all(ts, names, timeout)
        time.sleep(3)  # trial loads settle: what stays on a GPU is what serves
        refs = {m: eager_reference(m) for m in {cases[n]["model"] for n in names}}
        on_gpu = gpu_processes() if torch.cuda.is_available() else {}
        for n in names:
            c = cases[n]
            c["ready_s"] = ready[n]
            if ready[n] is None:
                c["ready_failure"] = [ln[-300:] for ln in ts.log().splitlines() if n in ln][-5:]
                continue
            ask = ask_stateless if c["model"] == "stateless" else ask_decoder
            c.update(ask(ts, n, refs[c["model"]]))
            c.update(placement_of(ts, n, on_gpu))
        # this process made the decoders' eager reference on the first GPU
        others = sorted(set(on_gpu) - {p for c in cases.values() for p in c.get("worker_pids", [])} - {os.getpid()})
        return engines_of(others, on_gpu), others
    finally:
        ts.stop()


def run(args) -> dict:
    work = Path(args.work)
    store = work / "store"
    store.mkdir(parents=True, exist_ok=True)
    models = args.models.split(",")
    made = make_all(work, models)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cases = {}
    for (model, device), paths in made.items():
        for form in ("program", "package"):
            name = f"{model}_{device.replace(':', '')}_{form}"
            twins = [("", 0)] + ([("_engine", args.engine)] if args.engine and model == "stateless"
                                 and form == "package" else [])
            for suffix, engine in twins:
                cases[name + suffix] = {"model": model, "exported_on": device, "form": form, "engine": engine}
                if "error" in paths:
                    cases[name + suffix].update(archived=False, said=[paths["error"][-600:]])
    todo = [n for n, c in cases.items() if "archived" not in c]
    with cf.ThreadPoolExecutor(9) as pool:
        for n, res in zip(todo, pool.map(lambda n: archive(n, made[(cases[n]["model"], cases[n]["exported_on"])],
                                                           cases[n]["form"], cases[n]["model"], store, gpus,
                                                           cases[n]["engine"]), todo)):
            cases[n].update(res)
    engines, others = serve_and_check(cases, store, work, args.ready_timeout)
    return summarize(args, cases, engines, others, gpus)


def engines_of(others: list, on_gpu: dict) -> dict:
    """The engine processes (python -m handlers.engine.serve) among the other processes on a GPU:
    how many per GPU, and those on more than one GPU."""
    from handlers.engine.runner import is_engine

    per_gpu, stray = by_gpu([pid for pid in others if is_engine(pid)], on_gpu)
    return {"engines_per_gpu": per_gpu, "engine_strays": stray}


def summarize(args, cases: dict, engines: dict, others: list, gpus: int) -> dict:
    names = [torch.cuda.get_device_name(i) for i in range(gpus)] or ["cpu"]
    report = header(names)
    report.update(gpus=gpus, cases=cases, other_gpu_pids=others, engines=engines)
    report["summary"] = {
        "cases": len(cases), "archived": sum(bool(c.get("archived")) for c in cases.values()),
        "ready": sum(c.get("ready_s") is not None for c in cases.values()),
        "answers_equal": sum(bool(c.get("answers_equal")) for c in cases.values()),
        "stray_contexts": sum(c.get("stray_contexts", 0) for c in cases.values()) + len(engines["engine_strays"]),
        # every case a GPU runs is served by its GPU's engine (handler.engine auto, or on): its
        # workers must hold no GPU memory, and one engine serves each GPU per model
        "engine_workers_on_a_gpu": sum(sum(c.get("workers_per_gpu", {}).values()) for c in cases.values()),
        "engines_per_gpu": engines["engines_per_gpu"],
        "ready_failures": sum(bool(c.get("archived")) and c.get("ready_s") is None for c in cases.values()),
        "slowest_ready_s": max([c["ready_s"] for c in cases.values() if c.get("ready_s") is not None], default=None)}
    if args.scaling:
        report["throughput"] = throughput(json.loads(Path(args.scaling).read_text()))
    return report


def throughput(scaling: dict) -> dict:
    """A bench_e2e --gpus 1,all file's figures (ours and echo req/s per GPU count) and the ratios the
    issue asks for: ours on all GPUs over ours on one, and over echo on all (what TorchServe's own
    transport allows there)."""
    rows = [{k: p.get(k) for k in ("handler", "gpus", "clients", "req_s", "p50_ms", "p99_ms")}
            for p in scaling.get("points", []) if p.get("handler") in ("ours", "echo")]
    by = {(r["handler"], r["gpus"]): r["req_s"] for r in rows}
    most = max((r["gpus"] for r in rows), default=1)
    ours1, ours_n, echo_n = by.get(("ours", 1)), by.get(("ours", most)), by.get(("echo", most))
    return {"from": scaling.get("command"), "points": rows,
            "ours_speedup": round(ours_n / ours1, 2) if ours1 and ours_n else None,
            "ours_vs_echo_all_gpus": round(ours_n / echo_n, 2) if echo_n and ours_n else None,
            "echo_speedup": round(echo_n / by[("echo", 1)], 2) if echo_n and by.get(("echo", 1)) else None}


def page(report: dict) -> str:
    lines = page_head(report, "Every export device on every GPU (issue 62)")
    s = report["summary"]
    lines += [f"{s['cases']} cases, {s['archived']} archived, {s['ready']} READY (slowest {s['slowest_ready_s']} s), "
              f"{s['answers_equal']} with answers equal, {s['stray_contexts']} stray contexts, "
              f"{s['ready_failures']} ready failures.", "",
              "| case | exported on | handed over | archived | READY (s) | answers equal | workers per GPU | stray |",
              "|---|---|---|---|---|---|---|---|"]
    for name, c in report["cases"].items():
        lines.append(f"| {c['model']}{' (engine)' if c.get('engine') else ''} | {c['exported_on']} | {c['form']} | {c.get('archived')} | {c.get('ready_s')} | "
                     f"{c.get('answers_equal')} | {c.get('workers_per_gpu')} | {c.get('stray_contexts')} |")
    lines += ["", f"Other processes on a GPU: {report['other_gpu_pids']}; engines: {report.get('engines')}; "
              f"workers on a GPU: {s.get('engine_workers_on_a_gpu')}.", ""]
    return "\n".join(lines)


def plot(path: Path, report: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = report["cases"]
    names = list(cases)
    fig, ax = plt.subplots(figsize=(10, 0.3 * len(names) + 1.5))
    ax.barh(names, [cases[n].get("ready_s") or 0 for n in names],
            color=["tab:green" if cases[n].get("answers_equal") else "tab:red" for n in names])
    ax.set_xlabel("seconds from TorchServe's start to every worker READY (red: not READY or answers differ)")
    fig.tight_layout()
    fig.savefig(path)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--make"]:
        print(json.dumps(make(*argv[1:4])), flush=True)
        return 0
    args = parse_args(argv)
    report = run(args)
    out = Path(args.out)
    write_pages(out, report, page(report))
    plot(out.with_suffix(".png"), report)
    print(page(report))
    s = report["summary"]
    return 0 if (s["stray_contexts"] == 0 and s["ready_failures"] == 0 and s["answers_equal"] == s["ready"]
                 and not s["engine_workers_on_a_gpu"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
