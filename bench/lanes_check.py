"""The engine's lanes in process (handlers/run/lanes.py; issue 64 item 3), on bench_generate's
decoder: what the lanes alone allow, and which of the served streams' differences come from the
prompt's chunking.

The package bench/bench_generate.py serves (a 0.535 B Llama-architecture decoder, fp16, TorchChat
export), imported and loaded as the engine loads it (load_lanes, LaneRunner, warm-up, graphs), then:

- `step_ms`: a decode step of 1 lane, of half the lanes and of every lane, timed on the device (the lanes' own limit in
  tokens/s, `lane_tok_s`, with no serving around them);
- `first_difference` (the index of the first greedy token that differs from the same prompt put in
  whole and decoded alone on one lane; `decode` means none): the same again 3 times on one lane
  (`alone_again`; a difference there is the model's kernels, run to run), every lane at once with the prompt
  whole (`together`), one lane with the prompt in --chunk-token calls (`chunked`), and the
  continuous batch over the lanes (handlers/generation/engine.py, its budget of --chunk tokens) with
  one sequence started first and the rest joining while it decodes, as the served streams did
  (`batch_joining`: a prompt beside decoding sequences goes in chunks).

    python -m bench.lanes_check --lanes 8 --out docs/results/lanes8_llama05b_fp16_h200_TAG
"""
from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import torch

from bench.results_meta import header, page_head, plot_or_say, write_pages


def build_parser():
    from bench.bench_generate import add_model_args

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)  # the package bench_generate builds and serves
    p.add_argument("--lanes", type=int, default=8)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--decode", type=int, default=256)
    p.add_argument("--chunk", type=int, default=64, help="the prompt budget's tokens per turn (the served load line's)")
    p.add_argument("--out", required=True, help="results path without suffix (.json, .md, .png)")
    return p


def greedy(runner, slots: list, prompts: list, n: int, chunk: int = 0) -> list:
    """Greedy tokens of prompts[i] on lane slots[i], every lane stepping together; `chunk`: the
    prompts put in `chunk` tokens per call (0: whole; prompts of one length)."""
    with torch.inference_mode(), runner.stream_context():
        step = chunk or max(len(p) for p in prompts)
        logits, done = None, 0
        while done < max(len(p) for p in prompts):
            logits = runner.prefill_rows(slots, [p[done:done + step] for p in prompts], [done] * len(slots))
            done += step
        tokens, out = logits.argmax(-1), [[] for _ in slots]
        for t in range(n):
            for i, tok in enumerate(tokens.tolist()):
                out[i].append(tok)
            tokens = runner.step(slots, tokens, [len(p) + t for p in prompts]).argmax(-1)
    return out


def first_difference(got: list, want: list):
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), "none")


def step_ms(runner, k: int, repeats: int = 50) -> float:
    """A decode step of lanes 0..k-1 at position 8, mean ms (device-synchronised)."""
    dev = runner.device
    tokens = torch.zeros(k, dtype=torch.int64, device=dev)
    with torch.inference_mode(), runner.stream_context():
        runner.step(list(range(k)), tokens, [8] * k)
        sync = torch.cuda.synchronize if runner.cuda else (lambda *a: None)
        sync(dev)
        t0 = time.perf_counter()
        for _ in range(repeats):
            runner.step(list(range(k)), tokens, [8] * k)
        sync(dev)
    return (time.perf_counter() - t0) / repeats * 1e3


def batch_joining(runner, prompts: list, n: int, chunk: int, config) -> list:
    """The continuous batch over the lanes: prompts[0] started, the rest submitted once it has made
    3 tokens; each sequence's greedy tokens."""
    import dataclasses

    from handlers.generation import engine as batching
    from handlers.generation import loop
    from handlers.generation.request import GenerateRequest, Params

    done, made, cond = {}, {}, threading.Condition()

    def deliver(updates):
        with cond:
            for job, events, _err in updates:
                made[job.tag] = made.get(job.tag, 0) + sum(isinstance(e, loop.Token) for e in events)
                done.update({job.tag: e.ids for e in events if isinstance(e, loop.Finished)})
            cond.notify_all()
    eng = batching.Engine(runner, deliver, 64, batching.Budget(1, chunk)).start()
    cfg = dataclasses.replace(config, max_new_tokens=n)

    def submit(i):
        req = GenerateRequest(None, prompts[i], Params(max_tokens=n, ignore_eos=True))
        eng.submit(batching.Job(loop.Sequence(req, loop.plan(req, None, runner.dec.vocab, runner.dec.cache_length, cfg),
                                              None), i))
    submit(0)
    with cond:
        cond.wait_for(lambda: made.get(0, 0) >= 3, timeout=120)
    for i in range(1, len(prompts)):
        submit(i)
    with cond:
        cond.wait_for(lambda: len(done) == len(prompts), timeout=600)
    return [done.get(i, []) for i in range(len(prompts))]


def load(args, work: Path):
    """(LaneRunner, its config, load note, graphs note, parameter count): bench_generate's package
    imported and loaded as the engine loads it."""
    from bench.bench_generate import package
    from compiled_serving.import_artifact import import_artifact
    from handlers.artifact.decoder import of as decoder_of
    from handlers.artifact.variants import choose_variant
    from handlers.config import parse_config
    from handlers.generation.engine import warm
    from handlers.run.lanes import LaneRunner, load_lanes

    program, pkg, params, _ = package(args, work)
    art = import_artifact(str(pkg), str(work / "art"), program=str(program))
    cfg = parse_config({"handler": {"cache_copies": args.lanes}})
    spec, placement, _ = choose_variant(art, 0 if args.device == "cuda" else None, cfg, None)
    lanes, note = load_lanes(spec, decoder_of(spec), placement, cfg)
    runner = LaneRunner(lanes, cfg)
    warm(runner)
    return runner, cfg, note, runner.capture("auto"), params


def measure(args, runner, cfg) -> dict:
    k = len(runner.lanes)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, args.vocab, (args.prompt,), generator=g).tolist()
    alone = greedy(runner, [0], [prompt], args.decode)[0]
    ms = {n: step_ms(runner, n) for n in sorted({1, max(1, k // 2), k})}
    return {
        "step_ms": {str(n): round(v, 3) for n, v in ms.items()},
        "lane_tok_s": {str(n): round(n * 1e3 / v, 1) for n, v in ms.items()},
        "first_difference": {
            "alone_again": [first_difference(greedy(runner, [0], [prompt], args.decode)[0], alone) for _ in range(3)],
            "together": [first_difference(t, alone) for t in greedy(runner, list(range(k)), [prompt] * k, args.decode)],
            "chunked": first_difference(greedy(runner, [0], [prompt], args.decode, args.chunk)[0], alone),
            "batch_joining": [first_difference(t, alone) for t in batch_joining(runner, [prompt] * k, args.decode,
                                                                                args.chunk, cfg)]}}


def page(r: dict) -> str:
    lines = page_head(r, "The engine's lanes in process: their limit, and where their tokens differ")
    lines += [f"Model: {r['model']}. {r['load']}; {r['graphs']}.", "", "| lanes stepping | step ms | tokens/s |",
              "|---|---|---|"]
    lines += [f"| {n} | {r['step_ms'][n]} | {r['lane_tok_s'][n]} |" for n in r["step_ms"]]
    d = r["first_difference"]
    lines += ["", f"First token differing from the prompt put in whole on one lane (of {r['decode']}; none: equal): "
                  f"the same again, one lane alone, 3 times {d.get('alone_again')}; every lane at once {d['together']}; prompt in {r['chunk']}-token calls {d['chunked']}; the "
                  f"continuous batch, the rest joining a decoding sequence {d['batch_joining']}.", ""]
    return "\n".join(lines)


def plot(r: dict, path: str) -> None:
    """Tokens/s by lanes stepping together (the lanes' own limit)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ns = list(r["lane_tok_s"])
    ax.bar(ns, [r["lane_tok_s"][n] for n in ns])
    ax.set_xlabel("lanes stepping together")
    ax.set_ylabel("tokens/s (in process)")
    ax.set_title(f"the lanes' limit on {r['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        runner, cfg, note, graphs, params = load(args, Path(tmp))
        figures = measure(args, runner, cfg)
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    report = {**header(device, argv), "model": (
        f"Llama-architecture decoder, {params / 1e9:.3f} B parameters (dim {args.dim}, {args.layers} layers), "
        f"vocabulary {args.vocab}, KV cache {args.max_seq}, random weights, AOTInductor package"),
        "load": note, "graphs": graphs, "prompt": args.prompt, "decode": args.decode, "chunk": args.chunk, **figures}
    write_pages(args.out + ".json", report, page(report))
    plot_or_say(plot, report, args.out, "bench.lanes_check")
    print(page(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
