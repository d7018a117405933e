"""Generation on the GPU machine (issue 45 item 4): a Llama-architecture decoder (examples/
tiny_decoder.py's Transformer at 0.5 B parameters, random weights, fp16, a 1024-position KV cache)
exported and packaged the TorchChat way (torch.export with Dim("seq"), aoti_compile_and_package),
then in the same run on the same GPU:

- the loop a TorchChat user runs on that package (`aoti_load_package`, the prompt one token per
  call as generate.py's sequential_prefill does for AOTI models, greedy decode, each token read
  back as it comes), in this process;
- the same package archived with no options (cs-archive --artifact PKG --program PROGRAM) and
  served by real TorchServe (on a GPU through its engine, handler.engine auto): time to first
  token and decode tokens/s seen by a streaming HTTP client (one process per stream), 1 stream
  and N at once.

  python -m bench.bench_generate --streams 8 --out docs/results/generate_llama05b_fp16_TAG
"""
from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing as mp
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.results_meta import header, page_head, plot_or_say, write_pages
from compiled_serving.local_server import ROOT, LocalTorchServe
from examples import tiny_decoder


def add_model_args(p) -> None:
    """The decoder `package` builds (and bench/lanes_check.py loads): its shape and device."""
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--max-seq", type=int, default=1024)
    p.add_argument("--device", default="cuda", help="cuda (the measurement); cpu only checks the script")


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--prompts", default="128,512", help="prompt lengths for time to first token")
    p.add_argument("--decode", type=int, default=256, help="tokens generated per stream")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--out", required=True, help="results path without suffix (.json, .md, .png)")
    return p


def package(args, work: Path) -> tuple:
    """(program path, package path, parameter count, compile seconds)."""
    cfg = tiny_decoder.Config(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                              max_seq_length=args.max_seq)
    model = tiny_decoder.build(cfg, std=0.02, device=args.device,
                               dtype=torch.float16 if args.device == "cuda" else torch.float32)
    params = sum(p.numel() for p in model.parameters())
    t0 = time.perf_counter()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):  # as torchchat/export.py exports
        ep = tiny_decoder.export(model, "torchchat")
    program, pkg = work / "program.pt2", work / "model.pt2"
    torch.export.save(ep, program)
    from torch._inductor import aoti_compile_and_package

    aoti_compile_and_package(ep, package_path=str(pkg))
    del model, ep
    return program, pkg, params, time.perf_counter() - t0


def torchchat_loop(pkg: Path, prompts: dict, n: int, dev: str) -> dict:
    """The TorchChat-style loop on the package: {ttft_ms per prompt length, decode tokens/s, tokens}."""
    from torch._inductor import aoti_load_package

    model = aoti_load_package(str(pkg))
    out = {"ttft_ms": {}, "tokens": {}}
    with torch.inference_mode():
        for rnd in range(2):  # the first round warms up; the second is reported
            for length, prompt in prompts.items():
                if dev == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                for i, tok in enumerate(prompt):  # sequential_prefill
                    logits = model(torch.tensor([[tok]], device=dev), torch.tensor([i], device=dev))
                ids = [int(logits[0, -1].argmax())]
                t1 = time.perf_counter()
                for i in range(n - 1):
                    logits = model(torch.tensor([[ids[-1]]], device=dev), torch.tensor([length + i], device=dev))
                    ids.append(int(logits[0, -1].argmax()))
                t2 = time.perf_counter()
                if rnd == 1:
                    out["ttft_ms"][length] = (t1 - t0) * 1e3
                    out["decode_tok_s"] = (n - 1) / (t2 - t1)
                    out["tokens"][length] = ids
    return out


def stream_once(port: int, token: str, model: str, prompt: list, n: int) -> dict:
    """One streaming request: time to first token, decode tokens/s, the tokens."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = json.dumps({"input_ids": prompt, "parameters": {"max_tokens": n, "ignore_eos": True}})
    t0 = time.perf_counter()
    conn.request("POST", f"/predictions/{model}", body, {"Authorization": f"Bearer {token}",
                                                         "Content-Type": "application/json"})
    resp = conn.getresponse()
    times, last = [], None
    for line in resp:
        if line.strip():
            times.append(time.perf_counter())
            last = json.loads(line)
    conn.close()
    if resp.status != 200 or last is None or "token_ids" not in last:
        raise RuntimeError(f"status {resp.status}: {last}")
    first, end = times[0], times[-2]  # the last line is the summary
    return {"ttft_ms": (first - t0) * 1e3, "decode_tok_s": (n - 1) / (end - first) if end > first else 0.0,
            "tokens": last["token_ids"], "wall_s": times[-1] - t0}


def _stream_job(a):
    return stream_once(*a)


def served(args, program: Path, pkg: Path, prompts: dict, work: Path) -> dict:
    """The package archived with no options and served: time to first token and one stream's
    decode, then args.streams at once."""
    store = work / "store"
    cmd = [sys.executable, "-m", "compiled_serving.archive", "--artifact", str(pkg), "--program", str(program),
           "--name", "lm", "--out", str(store)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stdout + r.stderr)
    archive_out = r.stdout.strip().splitlines()
    ts = LocalTorchServe(work / "ts", store, {"lm": store / "lm.mar"})
    try:
        ts.wait_ready(timeout=400)
        port, token = ts.ports["inf"], ts.key()
        out = {"archive": archive_out[-1], "ttft_ms": {}, "tokens": {}}
        for rnd in range(2):
            for length, prompt in prompts.items():
                res = stream_once(port, token, "lm", prompt, args.decode)
                if rnd == 1:
                    out["ttft_ms"][length], out["tokens"][length] = res["ttft_ms"], res["tokens"]
                    out["decode_tok_s"] = res["decode_tok_s"]
        jobs = [(port, token, "lm", prompts[min(prompts)], args.decode)] * args.streams
        with mp.get_context("spawn").Pool(args.streams) as pool:
            pool.map(_stream_job, jobs[:2])  # every worker's first stream out of the way
            t0 = time.perf_counter()
            many = pool.map(_stream_job, jobs)
            wall = time.perf_counter() - t0
        out["streams"] = {"n": args.streams, "aggregate_tok_s": args.streams * args.decode / wall,
                          "per_stream_decode_tok_s": sorted(round(m["decode_tok_s"], 1) for m in many),
                          "ttft_ms_max": max(m["ttft_ms"] for m in many),
                          # every stream has the same prompt: each answer equal to the one stream's
                          "equal_to_one_stream": sum(m["tokens"] == out["tokens"][min(prompts)] for m in many)}
        log = ts.log()
        out["load_line"] = next((ln.split("MODEL_LOG - ", 1)[1] for ln in log.splitlines()
                                 if "loaded aoti decoder" in ln or "served by the engine" in ln), "")
        return out
    finally:
        ts.stop()


def same_prefix(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def page(report: dict) -> str:
    b, o, r = report["torchchat_loop"], report["served"], report["ratios"]
    lines = page_head(report, "Generation: a 0.5 B decoder served with streamed tokens against the TorchChat-style loop")
    lines += [f"Model: {report['model']}.", "", "| | TorchChat-style loop (in process) | this handler through TorchServe | ratio |",
              "|---|---|---|---|"]
    for length in b["ttft_ms"]:
        lines.append(f"| time to first token, {length}-token prompt (ms) | {b['ttft_ms'][length]:.1f} | "
                     f"{o['ttft_ms'][length]:.1f} | {r['ttft'][length]:.3f}x |")
    lines.append(f"| decode tokens/s, one stream | {b['decode_tok_s']:.0f} | {o['decode_tok_s']:.0f} | "
                 f"{r['decode']:.2f}x |")
    s = o["streams"]
    lines.append(f"| tokens/s, {s['n']} concurrent streams (all together) | — | {s['aggregate_tok_s']:.0f} | |")
    if report.get("summary"):
        lines += ["", f"Summary: {report['summary']}"]
    lines += ["", f"Greedy tokens equal to the loop's: {report['greedy_equal']}.", "",
              f"Targets: decode >= 1.5x the loop's ({'met' if r['decode'] >= 1.5 else 'NOT met'}); time to first "
              f"token for the 512-token prompt <= 0.2x ({'met' if r['ttft'].get('512', r['ttft'].get(512, 9)) <= 0.2 else 'NOT met'}).",
              "", f"Archive: {o['archive']}", "", f"Worker's load line: {o['load_line']}", ""]
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    b, o = report["torchchat_loop"], report["served"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    labels = [str(k) for k in b["ttft_ms"]]
    x = range(len(labels))
    ax1.bar([i - 0.2 for i in x], list(b["ttft_ms"].values()), 0.4, label="TorchChat-style loop")
    ax1.bar([i + 0.2 for i in x], list(o["ttft_ms"].values()), 0.4, label="this handler (TorchServe)")
    ax1.set_xticks(list(x), [f"{k}-token prompt" for k in labels])
    ax1.set_ylabel("time to first token (ms)")
    ax1.set_yscale("log")
    ax1.legend()
    ax2.bar(["loop, 1 stream", "handler, 1 stream", f"handler, {o['streams']['n']} streams"],
            [b["decode_tok_s"], o["decode_tok_s"], o["streams"]["aggregate_tok_s"]])
    ax2.set_ylabel("decode tokens/s")
    fig.suptitle(f"{report['model']} on {report['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    g = torch.Generator().manual_seed(0)
    prompts = {n: torch.randint(0, args.vocab, (n,), generator=g).tolist() for n in map(int, args.prompts.split(","))}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        program, pkg, params, compile_s = package(args, work)
        print(f"packaged {params / 1e9:.3f} B parameters in {compile_s:.0f}s", flush=True)
        loop = torchchat_loop(pkg, prompts, args.decode, args.device)
        print("loop", {k: v for k, v in loop.items() if k != "tokens"}, flush=True)
        ours = served(args, program, pkg, prompts, work)
        print("served", {k: v for k, v in ours.items() if k != "tokens"}, flush=True)
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    report = {**header(device, argv), "model": (
        f"Llama-architecture decoder, {params / 1e9:.3f} B parameters (dim {args.dim}, {args.layers} layers, "
        f"{args.heads} heads, vocabulary {args.vocab}), fp16, KV cache {args.max_seq} positions, random weights; "
        f"AOTInductor package compiled in {compile_s:.0f}s"), "decode_tokens": args.decode,
        "torchchat_loop": {k: v for k, v in loop.items() if k != "tokens"},
        "served": {k: v for k, v in ours.items() if k != "tokens"},
        "ratios": {"ttft": {k: ours["ttft_ms"][k] / loop["ttft_ms"][k] for k in prompts},
                   "decode": ours["decode_tok_s"] / loop["decode_tok_s"]},
        "greedy_equal": {str(k): f"{same_prefix(loop['tokens'][k], ours['tokens'][k])} of {args.decode} tokens "
                                 "before the first difference" for k in prompts},
        "summary": {"one_stream_tok_s": round(ours["decode_tok_s"], 1),
                    "streams_tok_s": round(ours["streams"]["aggregate_tok_s"], 1), "streams": args.streams,
                    "streams_over_one": round(ours["streams"]["aggregate_tok_s"] / ours["decode_tok_s"], 2)}}
    write_pages(args.out + ".json", report, page(report))
    plot_or_say(plot, report, args.out, "bench.bench_generate")
    print(page(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
