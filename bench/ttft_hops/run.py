"""TTFT probe: where a streaming request's time to first token goes on its way into a TorchServe
async worker serving a slot-form decoder (handlers/continuous.py).

1. A tiny Qwen2 checkpoint (seeded random weights, byte-level BPE tokenizer: tests/test_export_lm.py's
   `checkpoint`, no network), `python -m compiled_serving.export_lm --slots 4 --max-seq 64 --device DEV`
   (with --package on cuda unless --no-package), `python -m compiled_serving.archive` with no options.
2. Real TorchServe (compiled_serving.local_server.LocalTorchServe) with bench/ttft_hops first on PYTHONPATH
   and TTFT_PROBE_DIR set: bench/ttft_hops/sitecustomize.py stamps each request in the worker.
3. --requests sequential streaming requests (one client, a fresh connection each unless
   --reuse-connection; max_tokens 4), each stamped at send, first body chunk and end, joined with the
   worker's stamps by TorchServe's request id (the x-request-id response header); the first --warmup
   discarded.
4. Per hop, median / p90 / mean in ms, printed and written to OUT/ttft_probe.json (per request too).

  python -m bench.ttft_hops.run --device cpu --out /tmp/ttft --requests 12

TTFT_TS_DEBUG=1 also logs the frontend's own lines at DEBUG with millisecond stamps (its worker
thread's flush of each request to the worker: `Flushing req.cmd PREDICT ... at: MS`) into
OUT/ts_debug.log; TTFT_SWITCH=S sets the worker's sys.setswitchinterval.
"""
from __future__ import annotations

import argparse
import glob
import http.client
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

from compiled_serving.local_server import LocalTorchServe

NAME = "ttft"
# the points of a request's way, in order: (name, where stamped)
POINTS = [("send", "client"), ("arrived", "worker: command byte read"), ("retrieved", "worker: retrieve_msg returned"),
          ("fetched", "worker: fetch_batches took it"), ("loop", "worker: call_predict started on the loop"),
          ("entry", "worker: handler entry"), ("frame", "worker: first frame written"),
          ("first_chunk", "client: first body chunk")]


def checkpoint(d: Path) -> None:
    """tests/test_export_lm.py's checkpoint("qwen2", d): small Qwen2, seeded weights, tiny tokenizer."""
    import torch
    import transformers as t

    from examples.transformers_decoder import tiny_tokenizer

    vocab = 320
    cfg = t.Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, eos_token_id=0,
                        bos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    model = t.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.1)
    model.save_pretrained(d)
    t.PreTrainedTokenizerFast(tokenizer_object=tiny_tokenizer(vocab - 20), eos_token="</s>").save_pretrained(d)


def run(cmd: list, env: dict) -> str:
    print("$", " ".join(cmd), flush=True)
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"{cmd[2]} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-4000:]}")
    return r.stdout


def build(args, work: Path, env: dict) -> dict:
    """The archive (the checkpoint and the artifact reused when built before with the same options)."""
    ckpt, art, store = work / "ckpt", work / f"art-{args.device}-{'pkg' if args.package else 'prog'}", work / "store"
    if not (ckpt / "config.json").exists():
        checkpoint(ckpt)
    cmd = [sys.executable, "-m", "compiled_serving.export_lm", "--model", str(ckpt), "--out", str(art),
           "--slots", "4", "--max-seq", "64", "--device", args.device] + (["--package"] if args.package else [])
    if not (art / "artifact.json").exists():
        t0 = time.time()
        print(run(cmd, env)[-1500:], f"export: {time.time() - t0:.0f} s", flush=True)
    shutil.rmtree(store, ignore_errors=True)
    out = run([sys.executable, "-m", "compiled_serving.archive", "--artifact", str(art), "--name", NAME,
               "--out", str(store)], env)
    return {"export_command": cmd[2:], "archive_printed": out.strip().splitlines()[-6:], "mar": store / f"{NAME}.mar"}


def ask(port: int, token: str, reuse) -> dict:
    """One streaming request; its client stamps and TorchServe's request id."""
    conn = reuse or http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    if conn.sock is None:
        conn.connect()
    body = json.dumps({"text_input": "the quick brown fox", "parameters": {"max_tokens": 4, "stream": True}})
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    send = time.time()
    conn.request("POST", f"/predictions/{NAME}", body, headers)
    resp = conn.getresponse()
    head = time.time()
    first, lines = None, []
    while True:
        line = resp.readline()
        if not line:
            break
        if first is None:
            first = time.time()
        lines.append(line)
    end = time.time()
    if resp.status != 200 or first is None:
        raise RuntimeError(f"status {resp.status}: {b''.join(lines)[:500]!r}")
    if reuse is None:
        conn.close()
    return {"id": resp.getheader("x-request-id"), "send": send, "headers": head, "first_chunk": first, "end": end,
            "chunks": len(lines)}


def worker_stamps(d: Path) -> tuple:
    """{request id: {hop: first time}}, the retrieved ids in order, and the meta lines."""
    by_id, order, meta = {}, [], []
    for path in sorted(glob.glob(str(d / "worker-*.jsonl"))):
        for line in open(path):
            rec = json.loads(line)
            if rec["hop"] == "meta" or "threads" in rec:
                meta.append(rec)
            for rid in rec["request_ids"]:
                by_id.setdefault(rid, {}).setdefault(rec["hop"], rec["t"])
                if rec["hop"] == "retrieved":
                    order.append(rid)
    return by_id, order, meta


def pct(xs: list, q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def report(clients: list, by_id: dict, order: list, warmup: int) -> dict:
    """Per request its hops in ms; per hop median, p90, mean over the requests after the warm-up."""
    joined_by = "x-request-id" if all(c["id"] in by_id for c in clients) else "order"
    rows = []
    for i, c in enumerate(clients):
        rid = c["id"] if joined_by == "x-request-id" else (order[i] if i < len(order) else None)
        w = by_id.get(rid, {})
        t = {**{k: w.get(k) for k, _ in POINTS}, "send": c["send"], "first_chunk": c["first_chunk"]}
        missing = [k for k, v in t.items() if v is None]
        hops = {} if missing else {f"{a}->{b}": (t[b] - t[a]) * 1000 for (a, _), (b, _) in zip(POINTS, POINTS[1:])}
        hops and hops.update({"total send->first_chunk": (c["first_chunk"] - c["send"]) * 1000,
                              "way in send->entry": (t["entry"] - c["send"]) * 1000,
                              "(after) first_chunk->end": (c["end"] - c["first_chunk"]) * 1000})
        rows.append({"request": i, "id": rid, "missing": missing, "hops_ms": hops, "chunks": c["chunks"]})
    kept = [r for r in rows[warmup:] if r["hops_ms"]]
    summary = {}
    for key in (kept[0]["hops_ms"] if kept else {}):
        xs = [r["hops_ms"][key] for r in kept]
        summary[key] = {"median": statistics.median(xs), "p90": pct(xs, 0.9), "mean": statistics.fmean(xs),
                        "min": min(xs), "max": max(xs)}
    checks = {"requests_kept": len(kept), "incomplete": [r["request"] for r in rows if not r["hops_ms"]],
              "all_hops_positive": all(v >= 0 for r in kept for k, v in r["hops_ms"].items()),
              "max_abs(sum of hops - total) ms": max((abs(sum(v for k, v in r["hops_ms"].items() if "->" in k
                                                             and not k.startswith(("total", "way", "(")))
                                                         - r["hops_ms"]["total send->first_chunk"]) for r in kept),
                                                     default=None)}
    return {"joined_by": joined_by, "summary_ms": summary, "checks": checks, "requests": rows}


DEBUG_LOG = ('<Configuration><Appenders><File name="f" fileName="${env:LOG_LOCATION:-logs}/ts_debug.log">'
             '<PatternLayout pattern="%d{UNIX_MILLIS} %t %c - %m%n"/></File>'
             '<File name="m" fileName="${env:LOG_LOCATION:-logs}/model_log.log"><PatternLayout '
             'pattern="%d{ISO8601} [%-5p] %t %c - %m%n"/></File></Appenders><Loggers>'
             '<Logger name="MODEL_LOG" level="info" additivity="false"><AppenderRef ref="m"/></Logger>'
             '<Logger name="org.pytorch.serve" level="debug" additivity="false"><AppenderRef ref="f"/></Logger>'
             '<Root level="info"><AppenderRef ref="f"/></Root></Loggers></Configuration>')


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--requests", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3, help="first requests discarded")
    p.add_argument("--package", action=argparse.BooleanOptionalAction, default=None,
                   help="export with --package (AOTInductor; default: on cuda)")
    p.add_argument("--reuse-connection", action="store_true", help="one keep-alive connection for every request")
    p.add_argument("--pause", type=float, default=0.2, help="seconds between requests")
    args = p.parse_args(argv)
    args.package = args.device == "cuda" if args.package is None else args.package
    return args


def served(args, built: dict, work: Path, out: Path, ts_env: dict) -> tuple:
    """(the clients' stamps, the worker's load line) of --requests sequential requests; with
    TTFT_TS_DEBUG set, the frontend's DEBUG log copied to OUT/ts_debug.log."""
    debug_log = DEBUG_LOG if os.environ.get("TTFT_TS_DEBUG") else None
    ts = LocalTorchServe(work / "ts", built["mar"].parent, {NAME: built["mar"]}, env=ts_env, log_config=debug_log)
    clients = []
    try:
        print(f"ready after {ts.wait_ready(timeout=600):.1f} s", flush=True)
        reuse = http.client.HTTPConnection("127.0.0.1", ts.ports["inf"], timeout=120) if args.reuse_connection else None
        token = ts.key()
        for _ in range(args.requests):
            clients.append(ask(ts.ports["inf"], token, reuse))
            time.sleep(args.pause)
        time.sleep(0.5)  # the worker's last lines written
        load_line = next((ln.split("MODEL_LOG - ", 1)[1] for ln in ts.log().splitlines() if "loaded" in ln
                          and "decoder" in ln), "")
    finally:
        ts.stop()
        for f in glob.glob(str(work / "ts" / "**" / "ts_debug.log"), recursive=True) if debug_log else ():
            shutil.copy(f, out / "ts_debug.log")
    return clients, load_line


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    work, stamps = out / "work", out / "stamps"
    work.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(stamps, ignore_errors=True)
    stamps.mkdir()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # the tools run with cwd ROOT
    built = build(args, work, env)
    ts_env = {**env, "TTFT_PROBE_DIR": str(stamps), "PYTHONPATH": os.pathsep.join(
        [str(HERE)] + [x for x in env.get("PYTHONPATH", "").split(os.pathsep) if x])}
    clients, load_line = served(args, built, work, out, ts_env)
    by_id, order, meta = worker_stamps(stamps)
    res = {"device": args.device, "package": args.package, "requests": args.requests, "warmup": args.warmup,
           "reuse_connection": args.reuse_connection, "python": sys.version.split()[0], **built, "mar": str(built["mar"]),
           "load_line": load_line, "worker_meta": meta, **report(clients, by_id, order, args.warmup), "clients": clients}
    (out / "ttft_probe.json").write_text(json.dumps(res, indent=1))
    print(f"\njoined by {res['joined_by']}; {res['checks']}")
    for m in meta:
        print({k: v for k, v in m.items() if k in ("switchinterval", "threads", "thread", "argv")})
    print(f"\n{'hop (ms)':34} {'median':>8} {'p90':>8} {'mean':>8} {'min':>8} {'max':>8}")
    for k, s in res["summary_ms"].items():
        print(f"{k:34} {s['median']:8.3f} {s['p90']:8.3f} {s['mean']:8.3f} {s['min']:8.3f} {s['max']:8.3f}")
    print(f"\nwrote {out / 'ttft_probe.json'}")
    return 0 if res["checks"]["requests_kept"] and not res["checks"]["incomplete"] else 1


if __name__ == "__main__":
    sys.exit(main())
