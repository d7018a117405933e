"""A program that writes its own state between calls (a KV cache in buffers, running statistics)
is never served as a stateless model (handlers/artifact/state.py): import, compile, archive and the
worker's load each find the buffers it writes, in both graph forms torch.export produces, and
serve it as a decoder (tests/test_generation.py) or refuse naming them. Through real TorchServe, the interleaving that once answered one client from
another's KV cache (issue 45: A's prompt, B's prompt, A's next token) gets no answer computed
from any state: every request is refused with the reason."""
import json
import shutil
import subprocess
import time

import pytest
import requests
import torch
from conftest import ROOT, build_mar, cs_command, server_env
from torch import nn

from examples import tiny_decoder
from handlers.artifact.kinds import kind_of
from handlers.artifact.metadata import ArtifactSpec, TensorSpec, sha256_file, write_spec
from handlers.artifact.state import program_state, require_checked
from handlers.errors import StatefulArtifact

CACHES = ["layers.0.attention.kv_cache.k_cache", "layers.0.attention.kv_cache.v_cache",
          "layers.1.attention.kv_cache.k_cache", "layers.1.attention.kv_cache.v_cache"]


@pytest.fixture(scope="module")
def decoder():
    return tiny_decoder.build()


@pytest.fixture(scope="module")
def programs(decoder, tmp_path_factory):
    d = tmp_path_factory.mktemp("decoder")
    out = {}
    for form in ("torchchat", "batch1"):
        ep = tiny_decoder.export(decoder, form)
        out[form] = d / f"{form}.pt2"
        torch.export.save(ep, out[form])
    return out


def test_torchchat_cache_written_in_place_is_found(decoder):
    state = program_state(tiny_decoder.export(decoder))
    assert list(state.mutated) == CACHES
    assert "index_put_" in state.how


def test_functional_form_after_decompositions_is_found(decoder):
    ep = tiny_decoder.export(decoder).run_decompositions()
    assert sorted(ep.graph_signature.buffers_to_mutate.values()) == sorted(CACHES)  # the other form
    state = program_state(ep)
    assert sorted(state.mutated) == sorted(CACHES) and "buffers_to_mutate" in state.how


def test_batch1_positions_wrapper_is_found(decoder):
    state = program_state(tiny_decoder.export(decoder, "batch1"))
    assert list(state.mutated) == ["model." + c for c in CACHES]


def test_transformers_static_cache_export_is_found():
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config = GenerationConfig(use_cache=True, cache_implementation="static", max_length=32,
                                               cache_config={"batch_size": 1, "max_cache_len": 32})
    ep = TorchExportableModuleForDecoderOnlyLM(model).export(input_ids=torch.tensor([[1, 2]]),
                                                             cache_position=torch.tensor([0, 1]))
    state = program_state(ep)
    assert {"key_cache_0", "value_cache_0", "key_cache_1", "value_cache_1"} <= set(state.mutated)


class TrainingBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(x)


def test_training_mode_running_statistics_are_state_and_eval_mode_is_not():
    x = (torch.randn(3, 4),)
    stateful = program_state(torch.export.export(TrainingBatchNorm().train(), x))
    assert {"bn.running_mean", "bn.running_var"} <= set(stateful.mutated)
    assert program_state(torch.export.export(TrainingBatchNorm().eval(), x)).stateless


class InPlaceOnTemporaries(nn.Module):
    """In-place ops on intermediate values and on the request's own input keep no state."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 2.0))

    def forward(self, x):
        x.mul_(1.0)
        h = torch.relu_(self.lin(x))
        h[:, 0] = 0.0
        return h * self.scale


def test_in_place_ops_on_temporaries_and_inputs_are_not_state():
    ep = torch.export.export(InPlaceOnTemporaries().eval(), (torch.randn(2, 4),))
    assert program_state(ep).stateless


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(1))

    def forward(self, x):
        self.calls.add_(1)
        return x * self.calls


@pytest.mark.server
def test_archive_refuses_state_that_is_no_kv_cache_naming_it(tmp_path):
    """A decoder is archived as one (tests/test_generation.py); any other program that writes its
    own state is refused with the state named and why it is no decoder."""
    path = tmp_path / "counter.pt2"
    torch.export.save(torch.export.export(Counter(), (torch.randn(2, 3),)), path)
    r = subprocess.run([*cs_command("archive"), "--artifact", str(path), "--name", "ctr",
                        "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, env=server_env())
    assert r.returncode != 0 and not (tmp_path / "ctr.mar").exists()
    msg = r.stderr.strip().splitlines()[-1]  # after any warning torch prints while loading
    assert msg.startswith("cs-archive: error: the program keeps state between calls"), r.stderr
    assert "calls" in msg and "not served as a decoder either" in msg, msg


def stateful_dir_as_an_old_import_wrote_it(program, d):
    """The batch1 program with the artifact.json an import wrote before the state check existed
    (no extra.state): what an archive built then, or by hand, holds."""
    d.mkdir()
    shutil.copy(program, d / "model.pt2")
    seq = {"D1": (1, tiny_decoder.Config.max_seq_length)}
    write_spec(ArtifactSpec(
        backend="export", artifact="model.pt2", sha256=sha256_file(str(d / "model.pt2")), device="cpu",
        inputs=(TensorSpec("tokens", "int64", (1, "D1"), {"min": 0, "max": 255, "source": "embedding"}),
                TensorSpec("input_pos", "int64", (1, "D1"))),
        outputs=(TensorSpec("output", "float32", (1, "D1", tiny_decoder.Config.vocab_size)),),
        output_structure="tensor", batch_min=1, batch_max=1, torch_version=torch.__version__, dims=seq), str(d))
    return d


def test_native_artifact_without_a_state_record_is_refused_and_a_recorded_cache_is_named(tmp_path):
    base = dict(artifact="model.pt2", sha256="", device="cpu", inputs=(), outputs=(), output_structure="tensor",
                batch_min=1, batch_max=1, torch_version=torch.__version__)
    old = ArtifactSpec(backend="aoti", **base)
    with pytest.raises(StatefulArtifact, match="does not record whether the program behind this aoti"):
        require_checked(old, kind_of(old))
    cached = ArtifactSpec(backend="aoti", extra={"state": {"mutated": CACHES}}, **base)
    with pytest.raises(StatefulArtifact, match="layers.0.attention.kv_cache.k_cache"):
        require_checked(cached, kind_of(cached))
    checked = ArtifactSpec(backend="aoti", extra={"state": {"mutated": [], "checked": "graph"}}, **base)
    require_checked(checked, kind_of(checked))
    export = ArtifactSpec(backend="export", **base)  # its load reads the graph itself
    require_checked(export, kind_of(export))


@pytest.mark.server
def test_compile_records_the_check(artifacts):
    spec = json.loads((artifacts.get("two_export") / "artifact.json").read_text())
    assert spec["extra"]["state"] == {"mutated": [], "checked": "torch.export program graph"}


@pytest.mark.server
def test_interleaved_clients_never_get_an_answer_from_another_clients_cache(programs, serve, tmp_path):
    art = stateful_dir_as_an_old_import_wrote_it(programs["batch1"], tmp_path / "dec")
    mar = build_mar(art, "dec_state", tmp_path / "store")  # export kind: archived, checked at load
    ts = serve({"dec_state": mar}, ready=False)

    def ask(tokens, positions):
        body = {"inputs": {"tokens": [tokens], "input_pos": [positions]}}
        try:
            return ts.predict("dec_state", body, timeout=60)
        except requests.RequestException:
            return None

    deadline = time.time() + 180  # until the worker has tried its load and answers
    while ((first := ask([5], [0])) is None or first.status_code == 404) and time.time() < deadline:
        time.sleep(1)
    assert first is not None, f"no answer within 180 s: {ts.log()[-3000:]}"
    a, b = [5, 17, 33, 2, 9], [7, 1, 200, 45, 3, 3, 90, 11, 4]
    answers = [first, ask(a, list(range(5))), ask(b, list(range(9))), ask([12], [5])]
    for r in answers:
        assert r.status_code == 503, r.text  # never a 200 computed from whatever the cache holds
        message = r.json()["message"]
        assert "keeps state between calls" in message and "model.layers.1.attention.kv_cache.v_cache" in message
