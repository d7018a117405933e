"""A transformers causal LM of a real configuration through cs-export-lm and cs-archive, served by
real TorchServe, against transformers on the same GPU in the same run (issue 65 item 7).

1. A checkpoint of a real configuration's shapes (--preset: qwen25-1.5b, Qwen2.5-1.5B's; llama32-1b,
   Llama-3.2-1B's, without its rope scaling; tiny, for a CPU check), seeded random weights (normal,
   std 0.02; tiny 0.1: logits far apart, no near ties on the CPU), bf16 on CUDA (fp32 on the CPU),
   save_pretrained with a byte-level BPE tokenizer of the full vocabulary.
2. `cs-export-lm --model CKPT --out ART --package --device DEV` (on CUDA with the GPU's memory,
   --gpu-memory-gib, and --max-seq; its printed sizing and seconds recorded), then `cs-archive
   --artifact ART --name lm` with no options, served by TorchServe (compiled_serving/local_server.py;
   on a GPU the slot batch runs in its engine, handler.engine auto).
3. 1, 8, 32, 64 concurrent streams (bench/bench_slots.py's clients: one process each, started
   together after --warmup seconds of rounds), each a --prompt token prompt and --decode new
   tokens, greedy, ignore_eos: aggregate tokens/s (median round), TTFT and inter-token p50/p99,
   the greedy tokens of one stream alone against the same prompt among 32 (or the largest count).
   Streams past the export's slot count queue; the results say so.
4. The package's own decode step at each stream count in this process, no server (bench_slots'
   step_limits: the handler's runner and CUDA graphs): the tokens/s the GPU allows.
5. After the server stopped: transformers on the same device. One stream: `generate(do_sample=False,
   cache_implementation="static")`, on CUDA compiled as transformers documents it (a static cache
   compiles the forward with generation_config.compile_config, CompileConfig(): mode
   reduce-overhead), warmed up, timed token by token through a streamer (TTFT, inter-token).
   Many streams: its continuous batching, `generate_batch(inputs, generation_config)` with the
   manager kept between a warm-up call and the timed ones where the version can (persistent_manager).
   Each baseline's failure is recorded with its error and the run goes on.

  python -m bench.bench_lm --preset qwen25-1.5b --out docs/results/lm_qwen15b_bf16_h200
  python -m bench.bench_lm --device cpu --preset tiny --streams 1,2 --decode 8 --rounds 1 --out /tmp/lm  (a check)

--work DIR keeps the checkpoint and the artifact and takes them from there when present (a second
call on a machine still warm skips the export's compile); --export-only stops after the export.
"""
from __future__ import annotations

import argparse
import gc
import inspect
import json
import multiprocessing as mp
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from bench.bench_slots import first_difference, make_prompts, pct, serve_archive, step_limits
from bench.results_meta import header, page_head, write_pages
from compiled_serving.local_server import ROOT

# the configurations' shapes (their config.json); the ids of </s> and <s> are the vocabulary's last two
PRESETS = {
    "qwen25-1.5b": ("Qwen2Config", 0.02, dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                              num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                                              max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                                              tie_word_embeddings=True)),
    "llama32-1b": ("LlamaConfig", 0.02, dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                             num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                                             vocab_size=128256, max_position_embeddings=131072, rope_theta=5e5,
                                             rms_norm_eps=1e-5, tie_word_embeddings=True)),
    "tiny": ("Qwen2Config", 0.1, dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                      max_position_embeddings=1024, rope_theta=1e6, rms_norm_eps=1e-6,
                                      tie_word_embeddings=True)),
}


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="qwen25-1.5b")
    p.add_argument("--device", default="cuda", help="cuda (the measurement); cpu only checks the script")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--decode", type=int, default=256)
    p.add_argument("--streams", default="1,8,32,64")
    p.add_argument("--slots", type=int, default=None, help="passed to cs-export-lm (default: its own choice; on "
                   "CUDA what the GPU's memory holds, at most 64)")
    p.add_argument("--max-seq", type=int, default=512, help="passed to cs-export-lm (0: its default, 2048 on a GPU): "
                   "512 holds the 384 positions of a stream; the cache is allocated when the artifact loads, not saved in it")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds of warm-up rounds before each point")
    p.add_argument("--rounds", type=int, default=3, help="measured rounds per point, ours and transformers'")
    p.add_argument("--no-limits", action="store_true", help="skip the package's own step limits")
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers baselines")
    p.add_argument("--batch-on-cpu", action="store_true", help="run transformers' generate_batch on the CPU too")
    p.add_argument("--work", help="keep the checkpoint and the artifact here, taken from here when present")
    p.add_argument("--export-only", action="store_true", help="stop after the export (with --work: a first call)")
    p.add_argument("--log", help="also write the worker's log (TorchServe's model_log.log) here")
    p.add_argument("--frontend-warmup", type=int, default=64,
                   help="one-token requests sent one after another before the points (TorchServe's JIT warm-up)")
    p.add_argument("--handler-option", action="append", default=[], metavar="KEY=VALUE",
                   help="passed to cs-archive (e.g. engine=on: the batch in the engine process, issue 64)")
    p.add_argument("--out", required=True, help="results path without suffix (.json, .md, .png)")
    return p


def byte_tokenizer(vocab: int):
    """A byte-level BPE of exactly `vocab` tokens: the 256 byte symbols, filler tokens, <s> and
    </s> last (the model's bos and eos ids)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    words = {ch: i for i, ch in enumerate(alphabet)}
    words.update({f"tok{i}": i for i in range(len(alphabet), vocab - 2)})
    tok = Tokenizer(models.BPE(vocab=words, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    assert tok.get_vocab_size(with_added_tokens=True) == vocab and tok.token_to_id("</s>") == vocab - 1
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def checkpoint(args, d: Path) -> dict:
    """The preset's checkpoint in `d` (kept where it is there already): its figures."""
    import transformers
    from transformers import AutoModelForCausalLM

    name, std, shapes = PRESETS[args.preset]
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    vocab = shapes["vocab_size"]
    cfg = getattr(transformers, name)(**shapes, bos_token_id=vocab - 2, eos_token_id=vocab - 1)
    if not (d / "config.json").exists():
        torch.manual_seed(0)
        with torch.device(args.device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0.0, std)
        model.save_pretrained(d)
        byte_tokenizer(vocab).save_pretrained(d)
        del model
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())  # tied: once
    return {"preset": args.preset, "family": cfg.model_type, "params": params, "dtype": str(dtype).split(".")[1],
            "vocab": vocab, "init_std": std, "config": shapes, "transformers": transformers.__version__}


def export(args, ckpt: Path, art: Path) -> dict:
    """cs-export-lm on the checkpoint (taken from `art` where it is there already): the command
    line, its seconds and printed lines, the slots and positions of the artifact."""
    from handlers.artifact.decoder import of as decoder_of
    from handlers.artifact.metadata import read_spec

    cmd = [sys.executable, "-m", "compiled_serving.export_lm", "--model", str(ckpt), "--out", str(art), "--package",
           "--device", args.device]
    if args.device == "cuda" and args.slots is None:  # the GPU this run serves on
        cmd += ["--gpu-memory-gib", f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.1f}"]
    cmd += ["--slots", str(args.slots)] if args.slots else []
    cmd += ["--max-seq", str(args.max_seq)] if args.max_seq else []
    record = art / "bench_export.json"
    if record.exists() and json.loads(record.read_text())["command"] == cmd[2:]:
        out = {**json.loads(record.read_text()), "reused": True}
    else:
        t0 = time.perf_counter()
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"cs-export-lm failed ({r.returncode}):\n{r.stdout}\n{r.stderr[-4000:]}")
        out = {"command": cmd[2:], "seconds": time.perf_counter() - t0, "printed": r.stdout.strip().splitlines()}
        record.write_text(json.dumps(out))
    print("\n".join(out["printed"]), flush=True)
    spec = read_spec(str(art))
    dec = decoder_of(spec)
    return {**out, "slots": dec.slots, "max_seq": dec.cache_length, "package": spec.artifact_path}


def limits(args, exported: dict, vocab: int, counts: list) -> dict:
    """bench_slots' step limits on the exported package, at the counts its slots hold."""
    n = [c for c in counts if c <= exported["slots"]]
    ns = SimpleNamespace(slots=exported["slots"], max_seq=exported["max_seq"], vocab=vocab, prompt=args.prompt,
                         decode=args.decode, device=args.device)
    try:
        return {"points": step_limits(ns, Path(exported["package"]), n)}
    except Exception as e:  # noqa: BLE001  (recorded: the rest of the run goes on)
        return {"error": f"{type(e).__name__}: {str(e)[:600]}"}


def hf_model(args, ckpt: Path):
    """The checkpoint in transformers on the bench's device, with no end-of-sequence id (every
    run generates --decode tokens, as the served streams ignore theirs)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype="auto").to(args.device).eval()
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None
    return model


def hf_one_stream(args, ckpt: Path, prompt: list) -> dict:
    """transformers' generate, one stream, static cache (compiled on CUDA): tokens/s (median of
    --rounds after two warm-up calls), TTFT and inter-token from a streamer's clock, its tokens."""
    from transformers import CompileConfig, GenerationConfig
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self):
            self.times = []

        def put(self, value):  # the prompt first, then each new token (read: the step is done)
            value.tolist()
            self.times.append(time.perf_counter())

        def end(self):
            pass

    model = hf_model(args, ckpt)
    cuda = args.device == "cuda"
    cfg = GenerationConfig(max_new_tokens=args.decode, do_sample=False, cache_implementation="static", pad_token_id=0,
                           compile_config=CompileConfig() if cuda else None, disable_compile=not cuda)
    ids = torch.tensor([prompt], device=args.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for _ in range(2):
            model.generate(ids, generation_config=cfg)
    warm_s = time.perf_counter() - t0
    rates, ttft, itl, tokens = [], [], [], None
    for _ in range(args.rounds):
        clock = Clock()
        with torch.inference_mode():
            start = time.perf_counter()
            out = model.generate(ids, generation_config=cfg, streamer=clock)
        t = clock.times[1:]
        rates.append((out.shape[1] - len(prompt)) / (t[-1] - start))
        ttft.append((t[0] - start) * 1e3)
        itl += [(b - a) * 1e3 for a, b in zip(t, t[1:])]
        tokens = tokens or out[0, len(prompt):].tolist()
    compiled = getattr(model, "_compiled_call", None) is not None
    del model
    return {"tok_s": statistics.median(rates), "rounds_tok_s": rates, "ttft_ms_p50": pct(ttft, 0.5),
            "ttft_ms_p99": pct(ttft, 0.99), "itl_ms_p50": pct(itl, 0.5), "itl_ms_p99": pct(itl, 0.99),
            "compiled": compiled, "warmup_s": warm_s, "tokens": tokens,
            "how": "generate(do_sample=False, cache_implementation='static'" +
                   (", compile_config=CompileConfig())" if cuda else ", disable_compile=True)")}


def hf_batch(args, ckpt: Path, prompts: list, n: int) -> dict:
    """transformers' continuous batching of n prompts: aggregate tokens/s (every generated token
    over the call's wall time, median of --rounds after a warm-up call)."""
    from transformers import GenerationConfig

    model = hf_model(args, ckpt)
    cfg = GenerationConfig(max_new_tokens=args.decode, do_sample=False, pad_token_id=0)
    keep = {"persistent_manager": True} if "persistent_manager" in inspect.signature(model.generate_batch).parameters else {}
    try:
        rates, made = [], []
        for i in range(args.rounds + 1):
            t0 = time.perf_counter()
            out = model.generate_batch(inputs=prompts[:n], generation_config=cfg, progress_bar=False, **keep)
            wall = time.perf_counter() - t0
            made = [len(o.generated_tokens) for o in out.values()]
            if len(made) != n:
                raise RuntimeError(f"{len(made)} of {n} requests answered")
            if i:  # the first call warms up (its CUDA graphs, the manager)
                rates.append(sum(made) / wall)
        return {"tok_s": statistics.median(rates), "rounds_tok_s": rates, "tokens_per_request": [min(made), max(made)],
                "manager_kept": bool(keep), "loaded_attn_implementation": model.config._attn_implementation}
    finally:
        if hasattr(model, "destroy_cached_continuous_batching_manager"):
            model.destroy_cached_continuous_batching_manager()
        del model


def guarded(name: str, fn, *a) -> dict:
    """fn(*a), or {"error": ...} naming what failed; the GPU's memory freed after either."""
    try:
        out = fn(*a)
    except Exception as e:  # noqa: BLE001  (recorded: the rest of the run goes on)
        out = {"error": f"{type(e).__name__}: {str(e)[:600]}"}
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    print(name, {k: v for k, v in out.items() if k != "tokens"}, flush=True)
    return out


def transformers_baselines(args, ckpt: Path, vocab: int, counts: list, each=lambda out: None) -> dict:
    """transformers on the same device after the server stopped: each larger count's continuous
    batching, then one stream (its compile is the longest part); `each(out)` after each, so a run
    cut short keeps what was measured."""
    import transformers

    prompts = make_prompts(vocab, args.prompt, max(counts))
    out = {"version": transformers.__version__, "one_stream": {"error": "not reached"}, "batch": {}}
    for n in (c for c in counts if c > 1):
        if args.device != "cuda" and not args.batch_on_cpu:
            out["batch"][str(n)] = {"skipped": "generate_batch on the CPU (pass --batch-on-cpu)"}
            continue
        out["batch"][str(n)] = guarded(f"transformers generate_batch {n}", hf_batch, args, ckpt, prompts, n)
        each(out)
    out["one_stream"] = guarded("transformers 1", hf_one_stream, args, ckpt, prompts[0])
    each(out)
    return out


def summary(points: list, hf: dict) -> dict:
    ours = {str(p["streams"]): p["aggregate_tok_s"] for p in points}
    theirs = {"1": hf.get("one_stream", {}).get("tok_s")} if hf else {}
    theirs.update({n: b.get("tok_s") for n, b in (hf or {}).get("batch", {}).items()})
    ratio = {n: ours[n] / t for n, t in theirs.items() if t and n in ours}
    x32 = ours["32"] / ours["1"] if "32" in ours and "1" in ours else None
    return {"tok_s": ours, "transformers_tok_s": theirs, "ours_over_transformers": ratio, "streams32_over_1": x32,
            "ttft_ms_p50_one_stream": points[0].get("ttft_ms_p50"),
            "worker_ttft_ms_one_stream": points[0].get("worker_ttft_ms_mean"),
            "targets": {"ahead_of_transformers_at_every_count": bool(ratio) and len(ratio) == len(ours)
                        and all(r > 1 for r in ratio.values()),
                        "streams32_over_1_at_least_12": None if x32 is None else x32 >= 12}}


def served_over_limits(points: list, lim: dict) -> dict:
    """Per stream count, the served tokens/s over the package's own: its decode step alone
    (`served_over_step_limit`) and its round's whole work, prompts included (`served_over_limit`,
    the figure issue 64's decoder target reads)."""
    by_n = {p["streams"]: p for p in lim.get("points", [])}
    step, whole = {}, {}
    for p in points:
        q = by_n.get(p["streams"])
        if q:
            step[str(p["streams"])] = p["aggregate_tok_s"] / q["tok_s"]
            if q.get("round_tok_s"):
                whole[str(p["streams"])] = p["aggregate_tok_s"] / q["round_tok_s"]
    return {"served_over_step_limit": step, "served_over_limit": whole}


def crowd_check(points: list) -> dict:
    """The greedy tokens of stream 0 alone against the same prompt among 32 (else the largest count)."""
    by_n = {p["streams"]: p for p in points}
    crowd = by_n.get(32, points[-1])
    alone = points[0]["tokens"][0]
    if len(crowd["tokens"]) < 2:
        return {"same_tokens": None, "crowd": crowd["streams"]}
    return {"same_tokens": alone == crowd["tokens"][1], "crowd": crowd["streams"],
            "first_difference": {"alone_vs_crowd": first_difference(alone, crowd["tokens"][1]),
                                 "crowd_0_vs_1": first_difference(crowd["tokens"][0], crowd["tokens"][1])}}


def page(r: dict) -> str:
    m, s, lim = r["model"], r["summary"], {p["streams"]: p for p in r["step_limits"].get("points", [])}
    lines = page_head(r, f"A {m['params'] / 1e9:.2f} B {m['preset']} LM through cs-export-lm and TorchServe, "
                         "against transformers")
    lines += [f"Model: {m['preset']} shapes ({m['family']}, {m['params'] / 1e9:.3f} B parameters, vocabulary "
              f"{m['vocab']}), random weights (std {m['init_std']}), {m['dtype']}; exported with {m['slots']} slots of "
              f"{m['max_seq']} positions in {m['export_s']:.0f} s (0: reused), archived in {m['archive_s']:.0f} s; "
              f"prompts {r['prompt']} tokens, {r['decode']} new tokens per stream, greedy. transformers "
              f"{r['transformers'].get('version', m['transformers'])}.", ""]
    if r.get("queued"):
        lines += [r["queued"], ""]
    lines += ["| streams | tokens/s | x one stream | TTFT p50 / p99 (ms) | inter-token p50 / p99 (ms) | transformers "
              "tokens/s | ours / transformers | step limit tokens/s | served / limit | round limit tokens/s | "
              "served / round limit |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [row(p, r["points"][0]["aggregate_tok_s"], s["transformers_tok_s"].get(str(p["streams"])),
                  lim.get(p["streams"])) for p in r["points"]]
    lines += ["", f"Targets: ahead of transformers at every count: {s['targets']['ahead_of_transformers_at_every_count']}; "
                  f"32 streams >= 12x one stream: {s['targets']['streams32_over_1_at_least_12']} "
                  f"({s['streams32_over_1']})." if s["streams32_over_1"] else "", ""]
    lines += ttft_lines(r)
    lines += transformers_lines(r) + ["", f"Greedy tokens alone and among {r['crowd']['crowd']}: "
                                          f"{r['crowd']['same_tokens']} ({r['crowd'].get('first_difference')}).", "",
                                      f"Export: `cs-export-lm {' '.join(m['export_command'][1:])}`", ""]
    lines += [f"    {ln}" for ln in m["export_printed"]]
    lines += ["", f"Archive: `cs-archive {' '.join(m['archive_command'][1:])}`", ""]
    lines += [f"    {ln}" for ln in r["archive"]] + ["", f"Worker's load line: {r['load_line']}", ""]
    return "\n".join(lines)


def ttft_lines(r: dict) -> list:
    """One stream's time to first token split: the package's own prefill (step limits), the
    worker's (its metrics: the request in the worker to the first token handed back), the client's."""
    pts = r["step_limits"].get("points") or [{}]
    one = r["points"][0]
    pre, worker = pts[0].get("prefill_ms"), one.get("worker_ttft_ms_mean")
    if pre is None and worker is None:
        return []
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    warm = r.get("frontend_warmup") or {}
    warmed = (f" Before the points, {warm['requests']} one-token requests warmed TorchServe's frontend (its JIT): "
              f"their TTFT p50 {fmt(warm.get('ttft_ms_p50_first10'))} ms for the first ten, "
              f"{fmt(warm.get('ttft_ms_p50_last10'))} ms for the last ten." if warm.get("requests") else "")
    return [f"Time to first token of one stream ({r['prompt']}-token prompt): the package's own prefill and "
            f"first token {fmt(pre)} ms; in the worker (mean) {fmt(worker)} ms; at the client p50 "
            f"{one['ttft_ms_p50']:.2f} ms.{warmed}", ""]


def row(p: dict, one: float, hf, limit) -> str:
    """A stream count's table row: ours, transformers' (hf: tokens/s or None), the step limit's."""
    tok = p["aggregate_tok_s"]
    lim = limit["tok_s"] if limit else None
    whole = (limit or {}).get("round_tok_s")
    return (f"| {p['streams']} | {tok:.0f} | {tok / one:.2f} | {p['ttft_ms_p50']:.1f} / {p['ttft_ms_p99']:.1f} | "
            f"{p['itl_ms_p50']:.2f} / {p['itl_ms_p99']:.2f} | {f'{hf:.0f}' if hf else '-'} | "
            f"{f'{tok / hf:.2f}' if hf else '-'} | {f'{lim:.0f}' if lim else '-'} | {f'{tok / lim:.2f}' if lim else '-'} | "
            f"{f'{whole:.0f}' if whole else '-'} | {f'{tok / whole:.2f}' if whole else '-'} |")


def transformers_lines(r: dict) -> list:
    hf = r["transformers"]
    if "skipped" in hf:
        return [f"transformers: skipped ({hf['skipped']})."]
    one = hf["one_stream"]
    lines = [f"transformers one stream: {one.get('how', '')}: " + (
        f"{one['tok_s']:.0f} tokens/s, TTFT p50 {one['ttft_ms_p50']:.1f} ms, inter-token p50 / p99 "
        f"{one['itl_ms_p50']:.2f} / {one['itl_ms_p99']:.2f} ms, compiled: {one['compiled']}; its greedy tokens against "
        f"one served stream's: first difference at {r.get('transformers_vs_ours_first_difference')}."
        if "tok_s" in one else one.get("error", ""))]
    for n, b in hf["batch"].items():
        lines.append(f"transformers generate_batch, {n} prompts: " + (
            f"{b['tok_s']:.0f} tokens/s (loaded with {b['loaded_attn_implementation']}, manager kept between calls: {b['manager_kept']})"
            if "tok_s" in b else b.get("error", b.get("skipped", ""))))
    return lines


def plot(r: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = [p["streams"] for p in r["points"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(n, [p["aggregate_tok_s"] for p in r["points"]], "o-", label="cs-export-lm + TorchServe")
    hf = r["summary"]["transformers_tok_s"]
    have = [k for k in n if hf.get(str(k))]
    ax.plot(have, [hf[str(k)] for k in have], "s-", label="transformers (generate / generate_batch)")
    lim = r["step_limits"].get("points", [])
    ax.plot([x["streams"] for x in lim], [x["tok_s"] for x in lim], ":", label="the package's step limit")
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("aggregate decode tokens/s")
    ax.legend(fontsize=8)
    ax.set_title(f"{r['model']['preset']} {r['model']['dtype']} on {r['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run(args, counts: list, pool, keep: Path, work: Path, save=lambda parts: None):
    """The checkpoint, the export, the limits, the served points and the baselines: the report's
    parts, saved (`save`) once the served points are in and after each baseline."""
    model = checkpoint(args, keep / "ckpt")
    exported = export(args, keep / "ckpt", keep / "artifact")
    if args.export_only:
        return None
    lim = {"skipped": "--no-limits"} if args.no_limits else limits(args, exported, model["vocab"], counts)
    ns = SimpleNamespace(vocab=model["vocab"], prompt=args.prompt, decode=args.decode, warmup=args.warmup,
                         rounds=args.rounds, log=args.log, frontend_warmup=args.frontend_warmup,
                         handler_option=args.handler_option)
    ours = serve_archive(ns, ["--artifact", str(keep / "artifact")], work, pool, counts)
    skipped = {"skipped": "--no-transformers" if args.no_transformers else
               "not reached (the run ended before the transformers baselines)"}
    save((model, exported, lim, ours, skipped))  # a run cut off by its time limit keeps what was measured
    if args.no_transformers:
        return model, exported, lim, ours, skipped
    hf = transformers_baselines(args, keep / "ckpt", model["vocab"], counts,
                                lambda out: save((model, exported, lim, ours, out)))
    return model, exported, lim, ours, hf


def report_of(args, argv, counts, parts) -> dict:
    model, exported, lim, ours, hf = parts
    pts = ours["points"]
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    model = {**model, "slots": exported["slots"], "max_seq": exported["max_seq"], "export_s": exported["seconds"],
             "archive_s": ours["archive_s"], "export_command": ["cs-export-lm", *exported["command"][1:]],
             "export_printed": exported["printed"], "archive_command": ["cs-archive", *ours["archive_command"][1:]]}
    r = {**header(device, argv), "model": model, "prompt": args.prompt, "decode": args.decode,
         "points": [{k: v for k, v in p.items() if k != "tokens"} for p in pts], "transformers": hf,
         "summary": {**summary(pts, hf if "skipped" not in hf else {}), **served_over_limits(pts, lim)},
         "step_limits": lim, "crowd": crowd_check(pts),
         "archive": ours["archive"], "load_line": ours["load_line"], "worker_gpu_mib": ours["gpu_mib"],
         "frontend_warmup": ours.get("frontend_warmup"), "tokens_alone": pts[0]["tokens"][0]}
    pre = (lim.get("points") or [{}])[0].get("prefill_ms")
    r["ttft_one_stream"] = {"prefill_ms": pre, "worker_mean_ms": pts[0].get("worker_ttft_ms_mean"),
                            "client_p50_ms": pts[0]["ttft_ms_p50"],
                            "client_p50_over_prefill_ms": None if pre is None else pts[0]["ttft_ms_p50"] - pre}
    if max(counts) > exported["slots"]:
        r["queued"] = (f"The export chose {exported['slots']} slots: past that many streams the rest queue "
                       f"(at {', '.join(str(c) for c in counts if c > exported['slots'])} streams).")
    one = hf.get("one_stream", {}) if "skipped" not in hf else {}
    if one.get("tokens"):
        r["transformers_vs_ours_first_difference"] = first_difference(one["tokens"], pts[0]["tokens"][0])
        r["transformers"] = {**hf, "one_stream": {k: v for k, v in one.items() if k != "tokens"}}
    return r


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    counts = [int(x) for x in args.streams.split(",")]
    # the stream clients forked before this process starts CUDA (bench_slots' main says why)
    with mp.get_context("fork").Pool(max(counts)) as pool, tempfile.TemporaryDirectory() as tmp:
        keep = Path(args.work).resolve() if args.work else Path(tmp)
        keep.mkdir(parents=True, exist_ok=True)
        parts = run(args, counts, pool, keep, Path(tmp), lambda parts: save(args, argv, counts, parts))
    if parts is None:
        print(f"exported into {args.work or 'a temporary directory'} (--export-only)")
        return 0
    report = save(args, argv, counts, parts)
    print(page(report))
    print(json.dumps(report["summary"]))
    return 0


def save(args, argv, counts: list, parts) -> dict:
    """The report of what was measured so far, written (.json, .md, .png)."""
    report = report_of(args, argv, counts, parts)
    write_pages(args.out + ".json", report, page(report))
    try:
        plot(report, args.out + ".png")
    except ImportError as e:
        print(f"no plot ({e})")
    return report


if __name__ == "__main__":
    raise SystemExit(main())
