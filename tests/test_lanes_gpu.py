"""The engine's lanes on the GPU (pytest -m gpu; skipped without CUDA; handlers/run/lanes.py):
a one-sequence decoder (examples/tiny_decoder.py, fp16, exported the TorchChat way) as its program
and as its AOTInductor package, four lanes on one copy of the weights, their step graphs captured
and verified, their calls on four CUDA streams.

Each lane's greedy tokens, four sequences at once (prompts whole, steps side by side on the
streams), are bit for bit the tokens of the same sequences run one at a time on one lane: the
streams' ordering (a lane waits for the batch's stream, the batch's stream for every lane) and
the lanes' own caches leave nothing of one sequence in another, and nothing read before it was
written. Also counted (not asserted): the tokens of a prompt put in by 32-token chunks against
the prompt in one call, the difference the engine's prompt budget can make in fp16.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("results_file")]
if not torch.cuda.is_available():
    pytest.skip("CUDA is not available on this machine: GPU tests run on the GPU machine",
                allow_module_level=True)

from compiled_serving.import_artifact import import_artifact  # noqa: E402
from bench.lanes_check import greedy  # noqa: E402
from examples import tiny_decoder  # noqa: E402
from handlers.artifact.decoder import of as decoder_of  # noqa: E402
from handlers.artifact.variants import choose_variant  # noqa: E402
from handlers.config import parse_config  # noqa: E402
from handlers.generation.engine import warm  # noqa: E402
from handlers.run.lanes import LaneRunner, load_lanes  # noqa: E402

RESULTS = {"lanes": []}
LANES, TOKENS, PROMPT = 4, 48, 96


@pytest.fixture(scope="module", params=["program", "package"])
def artifact(request, tmp_path_factory):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    d = tmp_path_factory.mktemp(f"lanes_{request.param}")
    cfg = tiny_decoder.Config(vocab_size=2048, dim=256, n_layers=4, n_heads=4, max_seq_length=256)
    model = tiny_decoder.build(cfg, std=0.02, device="cuda", dtype=torch.float16)
    with sdpa_kernel([SDPBackend.MATH]):  # as torchchat/export.py exports
        ep = tiny_decoder.export(model, "torchchat")
    program = d / "program.pt2"
    torch.export.save(ep, program)
    if request.param == "program":
        return request.param, import_artifact(str(program), str(d / "art"))
    from torch._inductor import aoti_compile_and_package

    pkg = aoti_compile_and_package(ep, package_path=str(d / "model.pt2"))
    return request.param, import_artifact(pkg, str(d / "art"), program=str(program))


def test_lanes_side_by_side_give_each_sequence_its_tokens_alone(artifact):
    form, art = artifact
    cfg = parse_config({"handler": {"cache_copies": LANES}})
    spec, placement, _ = choose_variant(art, 0, cfg, None)
    lanes, note = load_lanes(spec, decoder_of(spec), placement, cfg)
    runner = LaneRunner(lanes, cfg)
    warm(runner)
    graphs = runner.capture("on")
    assert len(lanes) == LANES and all(lane.graph is not None for lane in lanes), graphs
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 2048, (PROMPT,), generator=g).tolist() for _ in range(LANES)]
    together = greedy(runner, list(range(LANES)), prompts, TOKENS)
    alone = [greedy(runner, [0], [p], TOKENS)[0] for p in prompts]
    assert together == alone, [sum(a == b for a, b in zip(x, y)) for x, y in zip(together, alone)]
    chunked = greedy(runner, list(range(LANES)), prompts, TOKENS, chunk=32)
    same = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), TOKENS) for x, y in zip(chunked, alone)]
    RESULTS["lanes"].append({"form": form, "note": note, "graphs": graphs, "tokens": TOKENS,
                             "chunked_prompt_tokens_before_a_difference": same})
