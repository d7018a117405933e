"""cs-export-lm (compiled_serving/export_lm.py, compiled_serving/slot_lm.py): a transformers causal
LM directory (save_pretrained) into the slot form on transformers' own modeling code. For each
family (random weights from small configs of its real shape, fp32 on the CPU), the program that
the command writes, driven by the slot engine (handlers/generation/engine.py: prompts filled in
chunks into their slots, decode steps over every busy slot at once), gives the greedy tokens of
transformers' `generate(do_sample=False)`, alone and with six sequences of different lengths
sharing four slots; its directory goes through cs-archive with no options (tokenizer and
end-of-sequence ids taken from it) and is served by real TorchServe. The artifact carries no KV
cache (artifact.json records it, the loader allocates it: handlers/artifact/cache.py), so each run
here loads it as the handler does; an artifact written the old way, its cache inside, still loads."""
import json
import subprocess

import pytest
import torch
from conftest import ROOT, cs_command, server_env
from test_continuous import Harness, archive, ask

from compiled_serving import export_lm, slot_lm
from examples.transformers_decoder import tiny_tokenizer

VOCAB, SLOTS, MAX_SEQ = 320, 4, 64
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, eos_token_id=0, bos_token_id=1, pad_token_id=0)


def config(family: str):
    import transformers as t

    if family == "llama":
        return t.LlamaConfig(**SMALL)
    if family == "qwen2":
        return t.Qwen2Config(**SMALL)
    if family == "qwen3":
        return t.Qwen3Config(**SMALL, head_dim=32)
    if family == "mistral":  # a window shorter than the sequences: the sliding mask is exercised
        return t.MistralConfig(**SMALL, sliding_window=8)
    if family == "phi3":
        return t.Phi3Config(**SMALL)
    if family == "gemma2":  # sliding and full layers alternate (a dict of masks), soft-capped logits
        return t.Gemma2Config(**SMALL, head_dim=16, sliding_window=8, query_pre_attn_scalar=16)
    if family == "gpt2":
        return t.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256, eos_token_id=0,
                            bos_token_id=1)
    raise KeyError(family)


FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gpt2"]


def checkpoint(family: str, d, seed: int = 0):
    """A save_pretrained directory of `family` with seeded random weights and a byte-level BPE
    tokenizer of its vocabulary; the model."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(family)).eval()
    with torch.no_grad():  # larger weights than the init's: logits far apart, no near ties
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.1)
    model.save_pretrained(d)
    PreTrainedTokenizerFast(tokenizer_object=tiny_tokenizer(VOCAB - 20), eos_token="</s>").save_pretrained(d)
    return model


@pytest.fixture(scope="module", params=FAMILIES)
def exported(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    model = checkpoint(request.param, d / "ckpt")
    assert export_lm.main(["--model", str(d / "ckpt"), "--out", str(d / "out"), "--slots", str(SLOTS),
                           "--max-seq", str(MAX_SEQ)]) == 0
    return request.param, model, d / "out"


def generate(model, prompt, n):
    """transformers' own greedy tokens (no stop at the end-of-sequence id: the engine's runs ignore it)."""
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=n, do_sample=False, pad_token_id=0)
    model.generation_config.eos_token_id = None  # else merged into cfg from the checkpoint's
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), generation_config=cfg, attention_mask=torch.ones(1, len(prompt),
                                                                                                       dtype=torch.long))
    assert out.shape[1] == len(prompt) + n
    return out[0, len(prompt):].tolist()


PROMPTS = {0: ([5, 9, 13, 2, 7, 7, 1], 12), 1: ([(7 * k + 3) % VOCAB for k in range(23)], 9),
           2: ([42], 16), 3: ([(11 * k) % VOCAB for k in range(37)], 6), 4: ([3, 4, 5], 20),
           5: ([(5 * k + 1) % VOCAB for k in range(18)], 30)}


def served(out):
    """The artifact directory `out` as the handler loads it on the CPU (handlers/artifact/load.py)."""
    from handlers.artifact.device import Placement
    from handlers.artifact.load import load_artifact
    from handlers.artifact.metadata import read_spec

    return load_artifact(read_spec(str(out)), Placement("cpu", None))


def harness(out, program="model.pt2"):
    """The slot engine over the artifact in `out` as the handler loads it (`program`: the file the
    decoder is read from; the package's is program.pt2 beside it)."""
    h = Harness(torch.export.load(str(out / program)))
    h.runner.model = served(out)
    return h


def test_greedy_tokens_equal_generate_alone_and_sharing_the_cache(exported):
    family, model, out = exported
    want = {i: generate(model, p, n) for i, (p, n) in PROMPTS.items()}
    assert len({t for w in want.values() for t in w}) >= 8, want  # not a model that repeats one token
    h = harness(out)
    for i in (0, 3):
        h.submit(("alone", i), *PROMPTS[i])
        assert h.wait([("alone", i)])[("alone", i)] == want[i], (family, i)
    # sixteen streams on the slots at once, joining and leaving as each ends (its own length)
    crowd = [(f"crowd{k}", k % len(PROMPTS)) for k in range(16)]
    for tag, i in crowd:
        h.submit(tag, *PROMPTS[i])
    got = h.wait([tag for tag, _ in crowd])
    assert all(got[tag] == want[i] for tag, i in crowd), family


def test_seeded_sampling_is_the_same_alone_and_in_a_crowd_of_the_family(exported):
    """A sampled stream with a seed gives the same tokens alone and among greedy and other seeded
    streams on the same slots (its generator is its own); another seed gives others."""
    family, _, out = exported
    h = harness(out)
    prompt, n = PROMPTS[1]
    h.submit("alone", prompt, n, temperature=0.9, top_k=20, seed=7)
    alone = h.wait(["alone"])["alone"]
    for k in range(8):
        h.submit(k, prompt, n, **({"temperature": 0.9, "top_k": 20, "seed": 7 if k % 2 else 8 + k}
                                  if k % 4 != 2 else {}))
    got = h.wait(list(range(8)))
    assert all(got[k] == alone for k in (1, 3, 5, 7)), family
    assert any(got[k] != alone for k in (0, 4)), family


def test_the_directory_holds_the_tokenizer_and_the_eos_ids(exported):
    family, model, out = exported
    spec = json.loads((out / "artifact.json").read_text())
    assert spec["extra"]["generation"]["eos_token_ids"] == [0]
    dec = spec["extra"]["state"]["decoder"]
    assert (dec["slots"], dec["cache_length"], dec["vocab"], dec["slot_input"]) == (SLOTS, MAX_SEQ, VOCAB, "slots")
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    # the cache is recorded, not carried: each tensor the decoder writes, (slots, heads, positions, dim)
    recorded = spec["extra"]["cache"]["tensors"]
    assert sorted(t["name"] for t in recorded) == sorted(dec["mutated"]) and spec["format"] == 4
    assert all(t["shape"][0] == SLOTS and t["shape"][2] == MAX_SEQ and t["dtype"] == "float32" for t in recorded)


def test_a_model_the_slot_form_cannot_hold_is_refused_naming_the_family_and_why(tmp_path, monkeypatch):
    checkpoint("llama", tmp_path / "ckpt")

    def no_rows(model):
        raise slot_lm.Unsupported("its cache layer LinearAttentionLayer holds no (batch, heads, length, dim) keys")

    monkeypatch.setattr(slot_lm, "layer_shapes", no_rows)
    with pytest.raises(SystemExit, match=r"llama \(LlamaForCausalLM\) cannot go into the slot form this way: its cache"):
        export_lm.main(["--model", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"), "--max-seq", "32"])
    assert not (tmp_path / "out" / "artifact.json").exists()


def test_logits_that_differ_from_the_models_own_are_refused(tmp_path, monkeypatch):
    checkpoint("llama", tmp_path / "ckpt")
    real = slot_lm.SlotLM.mask

    def wrong(self, input_pos, window, dtype):  # a mask that lets a position see the next one
        return real(self, input_pos + 1, window, dtype)

    monkeypatch.setattr(slot_lm.SlotLM, "mask", wrong)
    with pytest.raises(SystemExit, match="differ from the model's own forward"):
        export_lm.main(["--model", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"), "--max-seq", "32"])


def test_a_cache_longer_than_the_models_positions_and_a_missing_tokenizer_are_refused(tmp_path):
    model = checkpoint("gpt2", tmp_path / "ckpt")
    with pytest.raises(SystemExit, match="--max-seq 300 is more than the 256 positions"):
        export_lm.main(["--model", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"), "--max-seq", "300"])
    model.save_pretrained(tmp_path / "bare")
    with pytest.raises(SystemExit, match="no usable tokenizer|tokenizer holds"):
        export_lm.main(["--model", str(tmp_path / "bare"), "--out", str(tmp_path / "out2"), "--max-seq", "32"])


def test_the_cache_is_sized_for_the_gpu_with_its_arithmetic():
    """lm_sizing: slots = what (GPU x 0.9 - weights - overhead) holds of max_seq x bytes per
    position, at most 64; a given count is kept where it fits and refused with the fix where it
    does not; no GPU: the CPU's 8 x 512."""
    from compiled_serving import lm_sizing, worker_sizing

    shapes = [(8, 64, 64)] * 16  # a Llama-3.2-1B-shaped cache: 16 layers of 8 kv heads of 64
    per_pos = lm_sizing.position_bytes(shapes, 2)
    assert per_pos == 16 * 8 * 128 * 2 == 32768
    gpu = worker_sizing.GpuMemory(24 * 1024, "test")
    weights = 2_471_000_000
    usable = (int(24 * 1024 * 0.9) - worker_sizing.OVERHEAD_MIB) * 2**20 - weights
    assert lm_sizing.size(shapes, 2, weights, 131072, gpu).slots == 64  # 271 fit: capped
    small = worker_sizing.GpuMemory(6 * 1024, "test")
    s = lm_sizing.size(shapes, 2, weights, 131072, small)
    small_usable = (int(6 * 1024 * 0.9) - worker_sizing.OVERHEAD_MIB) * 2**20 - weights
    assert s.max_seq == 2048 and s.slots == small_usable // (2048 * per_pos) < 64 and "fit" in s.line
    assert lm_sizing.size(shapes, 2, weights, 1024, gpu).max_seq == 1024  # the model's positions
    assert lm_sizing.size(shapes, 2, weights, 131072, gpu, slots=32).slots == 32
    with pytest.raises(lm_sizing.LmSizingError, match=r"--slots 500 --max-seq 2048 do not fit: .* Fix: --slots \d+"):
        lm_sizing.size(shapes, 2, weights, 131072, gpu, slots=500)
    assert usable // (2048 * per_pos) < 500
    with pytest.raises(lm_sizing.LmSizingError, match="not even 2 slots"):
        lm_sizing.size(shapes, 2, weights, 131072, worker_sizing.GpuMemory(4 * 1024, "test"))
    cpu = lm_sizing.size(shapes, 4, weights, 256, None)
    assert (cpu.slots, cpu.max_seq) == (8, 256) and "--gpu-memory-gib" in cpu.line


def test_cs_export_lm_sizes_the_slots_for_the_gpu_named(tmp_path, capsys):
    """--gpu-memory-gib with no --slots: the exported cache holds the slots the arithmetic printed."""
    from handlers.artifact.decoder import of as decoder_of
    from handlers.artifact.metadata import read_spec

    checkpoint("gpt2", tmp_path / "ckpt")
    assert export_lm.main(["--model", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"),
                           "--gpu-memory-gib", "1.6", "--max-seq", "256"]) == 0
    said = capsys.readouterr().out
    line = next(ln for ln in said.splitlines() if ln.startswith("cs-export-lm: ") and "slots x 256 positions" in ln)
    slots = int(line.split()[1])
    assert 2 <= slots <= 64 and "GPU memory 1638 MiB (--gpu-memory-gib 1.6)" in line, said
    assert decoder_of(read_spec(str(tmp_path / "out"))).slots == slots != 8


@pytest.mark.server
def test_cs_export_lm_then_cs_archive_with_no_options_served_by_torchserve(tmp_path_factory, serve):
    d = tmp_path_factory.mktemp("e2e")
    model = checkpoint("qwen2", d / "ckpt")
    r = subprocess.run([*cs_command("export_lm"), "--model", str(d / "ckpt"), "--out", str(d / "out"),
                        "--slots", "4", "--max-seq", "64"], cwd=ROOT, capture_output=True, text=True, env=server_env())
    assert r.returncode == 0, r.stdout + r.stderr
    r = archive(d / "out", "lmx", d / "store")
    assert "the artifact directory's own" in r.stdout and "end-of-sequence ids: [0]" in r.stdout, r.stdout
    assert "recognised as a decoder: vocabulary 320, 4 sequence slots of 64 positions" in r.stdout, r.stdout
    ts = serve({"lmx": d / "store" / "lmx.mar"})
    prompts = [PROMPTS[0][0], PROMPTS[1][0], PROMPTS[4][0]]
    for p in prompts:
        resp, lines = ask(ts, "lmx", {"input_ids": p, "parameters": {"max_tokens": 10, "ignore_eos": True}})
        assert resp.status_code == 200, resp.text
        assert lines[-1]["token_ids"] == generate(model, p, 10)
    resp, lines = ask(ts, "lmx", {"text_input": "the quick brown fox", "parameters": {"max_tokens": 4}})
    assert resp.status_code == 200 and lines[-1]["finish_reason"] in ("length", "eos_token"), resp.text


def cache_bytes(out) -> int:
    from handlers.artifact import cache
    from handlers.artifact.metadata import read_spec

    return cache.nbytes(read_spec(str(out)))


def test_the_artifact_does_not_grow_with_the_cache(tmp_path):
    """The program of 4 slots x 16 positions and of 64 x 256 (an 8 MiB cache, 256 times the other's)
    differ by less than 4 KiB (the graph's recorded bounds), each cache tensor a one-element entry."""
    import zipfile

    checkpoint("llama", tmp_path / "ckpt")
    sizes = {}
    for slots, seq in ((4, 16), (64, 256)):
        out = tmp_path / f"out{slots}"
        assert export_lm.main(["--model", str(tmp_path / "ckpt"), "--out", str(out), "--slots", str(slots),
                               "--max-seq", str(seq)]) == 0
        sizes[slots] = (out / "model.pt2").stat().st_size
        with zipfile.ZipFile(out / "model.pt2") as z:  # {fqn: {path_name, ...}} of torch 2.13's archive
            names = z.namelist()
            config = json.loads(z.read(next(n for n in names if n.endswith("/model_constants_config.json"))))
            files = {fqn: meta["path_name"] for fqn, meta in config["config"].items() if "cache" in fqn}
            assert len(files) == 4 and all(z.getinfo(next(n for n in names if n.endswith("/data/constants/" + f)))
                                           .file_size == 4 for f in files.values()), files
    assert cache_bytes(tmp_path / "out64") == 64 * 256 * 2 * 2 * (16 + 16) * 4 == 8 << 20
    assert abs(sizes[64] - sizes[4]) < 4096, sizes


def test_an_artifact_written_with_its_cache_inside_still_loads(tmp_path):
    """The old way (the cache saved as zeros in the program, no record in artifact.json, layout 2):
    imported, loaded by the handler and run by the engine, it gives generate's greedy tokens."""
    import zipfile

    from compiled_serving import slot_lm
    from compiled_serving.import_artifact import import_artifact

    model = checkpoint("qwen2", tmp_path / "ckpt")
    ep = slot_lm.export(slot_lm.SlotLM(model, SLOTS, MAX_SEQ).eval(), SLOTS)
    torch.export.save(ep, tmp_path / "old.pt2")
    import_artifact(str(tmp_path / "old.pt2"), str(tmp_path / "out"), find_pad=False)
    spec = json.loads((tmp_path / "out" / "artifact.json").read_text())
    assert "cache" not in spec["extra"] and spec["format"] == 2
    with zipfile.ZipFile(tmp_path / "out" / "model.pt2") as z:  # the zeros are in it: 4 x (4, 2, 64, 16) float32
        assert sum(i.file_size == SLOTS * 2 * MAX_SEQ * 16 * 4 for i in z.infolist() if "/data/constants/" in i.filename) == 4
    h = harness(tmp_path / "out")
    for i in (0, 3):
        h.submit(i, *PROMPTS[i])
    assert h.wait([0, 3]) == {i: generate(model, *PROMPTS[i]) for i in (0, 3)}


@pytest.mark.parametrize("exported", ["llama"], indirect=True)
def test_a_missing_or_inconsistent_cache_record_fails_the_load_naming_the_fix(exported):
    """Without extra.cache the program's one-element placeholders would take every sequence's keys
    (index_put_ into an expanded tensor only warns): refused, as is a record of another shape or a
    malformed one; a handler that reads layouts up to 3 refuses the file (layout 4) itself."""
    import dataclasses

    from handlers.artifact import metadata
    from handlers.artifact.device import Placement
    from handlers.artifact.kinds import kind_of
    from handlers.artifact.metadata import read_spec, spec_from_dict
    from handlers.errors import LoadError

    _, _, out = exported
    spec = read_spec(str(out))
    cpu = Placement("cpu", None)

    def load(extra):
        return kind_of(spec).load(dataclasses.replace(spec, extra=extra), cpu)

    bare = {k: v for k, v in spec.extra.items() if k != "cache"}
    with pytest.raises(LoadError, match=r"holds no values for k_cache_0, .*records no cache to allocate.*cs-export-lm"):
        load(bare)
    wrong = json.loads(json.dumps(spec.extra["cache"]))
    wrong["tensors"][0]["shape"][2] *= 2
    with pytest.raises(LoadError, match=r"records k_cache_0 float32\[4, 2, 128, .*holds float32\[4, 2, 64, "):
        load({**spec.extra, "cache": wrong})
    with pytest.raises(LoadError, match=r"extra.cache is malformed"):
        load({**spec.extra, "cache": {"tensors": [{"name": "k_cache_0"}]}})
    raw = json.loads((out / "artifact.json").read_text())
    assert spec_from_dict(raw).extra["cache"] == spec.extra["cache"]
    with pytest.MonkeyPatch.context() as m:
        m.setattr(metadata, "READS", (1, 2, 3))
        with pytest.raises(LoadError, match="has layout version .* 4; this handler reads 1, 2, 3"):
            spec_from_dict(raw)


def test_the_aotinductor_package_gives_the_same_tokens(tmp_path):
    """--package: the slot form of a Qwen2 checkpoint (whose one-sequence static-cache export could
    not be packaged, issue 65) compiles with AOTInductor, its constants outside its library and the
    cache not among them, is imported as the served artifact with program.pt2 beside it, and the
    package loaded by the handler (weights read, cache allocated) and run by the engine gives
    generate's greedy tokens. Its 8 MiB cache is in neither file; a package without its cache
    record fails the load naming it instead of crashing on its first run."""
    import dataclasses
    import zipfile

    from handlers.artifact.device import Placement
    from handlers.artifact.kinds import kind_of
    from handlers.artifact.metadata import read_spec
    from handlers.errors import LoadError

    model = checkpoint("qwen2", tmp_path / "ckpt")
    out = tmp_path / "out"
    assert export_lm.main(["--model", str(tmp_path / "ckpt"), "--out", str(out), "--slots", "64",
                           "--max-seq", "256", "--package"]) == 0
    spec = json.loads((out / "artifact.json").read_text())
    assert spec["backend"] == "aoti" and (out / "program.pt2").is_file() and spec["format"] == 4
    assert cache_bytes(out) == 8 << 20 > 2 * (out / "model.pt2").stat().st_size
    with zipfile.ZipFile(out / "model.pt2") as z:
        config = json.loads(next(z.read(n) for n in z.namelist() if n.endswith("/weights_config.json")))
    assert "k_cache_0" not in config and "model.lm_head.weight" in config
    h = harness(out, "program.pt2")
    assert "cache allocated at load" in h.runner.model.loader
    for i, (p, n) in PROMPTS.items():
        h.submit(i, p, n)
    got = h.wait(list(PROMPTS))
    assert {i: got[i] for i in PROMPTS} == {i: generate(model, p, n) for i, (p, n) in PROMPTS.items()}
    loaded = read_spec(str(out))
    bare = dataclasses.replace(loaded, extra={k: v for k, v in loaded.extra.items() if k != "cache"})
    with pytest.raises(LoadError, match=r"neither its weights .* nor artifact.json's cache record .* give 4 .*k_cache_0"):
        kind_of(loaded).load(bare, Placement("cpu", None))


@pytest.mark.server
def test_a_package_written_with_its_cache_inside_still_loads(tmp_path, monkeypatch, capsys):
    """The old way, as cs-export-lm writes it with a torch that cannot keep a package's constants
    outside its library (split_package says why): aoti_compile_and_package of the program with its
    cache (the constants in the library), the program beside it whole, no cache record; loaded by
    the handler, the engine gives generate's tokens."""
    from handlers.artifact.kinds import aoti_constants

    monkeypatch.setattr(export_lm, "split_package", lambda: "this torch lacks torch.export.pt2_archive")
    model = checkpoint("qwen2", tmp_path / "ckpt")
    out = tmp_path / "out"
    assert export_lm.main(["--model", str(tmp_path / "ckpt"), "--out", str(out), "--slots", str(SLOTS),
                           "--max-seq", str(MAX_SEQ), "--package"]) == 0
    assert "keeps its cache inside it (this torch lacks torch.export.pt2_archive)" in capsys.readouterr().out
    assert "cache" not in json.loads((out / "artifact.json").read_text())["extra"]
    assert not aoti_constants.outside(str(out / "model.pt2"))
    h = Harness(torch.export.load(str(out / "program.pt2")))
    h.runner.model = served(out)
    for i in (0, 3):
        h.submit(i, *PROMPTS[i])
    assert h.wait([0, 3]) == {i: generate(model, *PROMPTS[i]) for i in (0, 3)}


def test_exported_on_a_gpu_the_cache_is_sized_for_its_memory(monkeypatch):
    """--device cuda and no --gpu-memory-gib: the export device's whole memory
    (torch.cuda.mem_get_info's total, faked here: this machine has no GPU) is what lm_sizing divides,
    its arithmetic printed; --gpu-memory-gib still wins; the CPU keeps 8 slots (of at most 512 positions)."""
    from types import SimpleNamespace

    from compiled_serving import lm_sizing

    model = random_model("llama")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (5 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    args = SimpleNamespace(device="cuda", gpu_memory_gib=None, slots=None, max_seq=None)
    s = export_lm.size_cache(model, args)
    assert (s.slots, s.max_seq) == (lm_sizing.MAX_SLOTS, 256)  # the model's 256 positions, 64 slots fit easily
    assert "GPU memory 81920 MiB (cuda:0, Fake GPU, the export device)" in s.line and "not in it" in s.line, s.line
    assert export_lm.target_gpu(SimpleNamespace(device="cuda:0", gpu_memory_gib=1.5)).mib == 1536
    assert export_lm.target_gpu(SimpleNamespace(device="cpu", gpu_memory_gib=None)) is None
    cpu = export_lm.size_cache(model, SimpleNamespace(device="cpu", gpu_memory_gib=None, slots=None, max_seq=None))
    assert (cpu.slots, cpu.max_seq) == (8, 256)


def random_model(family: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config(family)).eval()


def test_a_device_this_machine_lacks_is_refused_naming_it(tmp_path):
    """--device: where the model is exported and compiled; one that is not there is refused, named."""
    checkpoint("gpt2", tmp_path / "ckpt")
    with pytest.raises(SystemExit, match="--device cuda:99: "):
        export_lm.main(["--model", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"), "--device", "cuda:99"])
