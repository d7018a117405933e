"""Torch-TensorRT path on a GPU with TensorRT. These tests exist so the path is exercised
wherever torch_tensorrt imports; on this project's machines they skip: NVIDIA TensorRT cannot
be installed there (the PyPI package is a stub that downloads from elsewhere)."""
import subprocess

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.tensorrt]

if not torch.cuda.is_available():
    pytest.skip("Torch-TensorRT tests need CUDA; none on this machine", allow_module_level=True)
try:
    import torch_tensorrt  # noqa: F401
except Exception as e:  # ImportError, or TensorRT libraries missing behind the package
    pytest.skip(f"torch_tensorrt does not import here ({type(e).__name__}: {e}); NVIDIA TensorRT is not "
                "installable on this project's machines", allow_module_level=True)

from conftest import PY, ROOT, cs_command  # noqa: E402

from handlers.artifact.device import Placement  # noqa: E402
from handlers.artifact.load import load_artifact  # noqa: E402
from handlers.artifact.metadata import read_spec  # noqa: E402
from handlers.config import parse_config  # noqa: E402
from handlers.run import runner_for  # noqa: E402


@pytest.fixture(scope="module", params=["fp32", "fp16"])
def trt_artifact(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"trt_{request.param}")
    r = subprocess.run([*cs_command("compile"), "--model", "examples/models.py:classifier",
                        "--input", "image:4x3x32x32:float32", "--dynamic-batch", "1:16", "--backend", "tensorrt",
                        "--device", "cuda", "--precision", request.param, "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return out, request.param


def _reference(x, half):
    from compiled_serving.compile import load_factory

    m = load_factory("examples/models.py:classifier")().cuda(0)
    if half:
        m = m.half()
    with torch.no_grad():
        return m(x.cuda(0)).float().cpu()


@pytest.mark.parametrize("index", list(range(min(2, torch.cuda.device_count()))))
def test_trt_artifact_served_on_each_gpu_on_worker_stream(trt_artifact, index):
    art, precision = trt_artifact
    spec = read_spec(str(art))
    assert spec.backend == "tensorrt" and spec.extra["tensorrt_version"]
    half = precision == "fp16"
    model = load_artifact(spec, Placement("cuda", index), parse_config({"handler": {"trt_multi_device_safe_mode": True}}))
    ex = runner_for(model, spec, torch.device(f"cuda:{index}"))
    for seed in range(8):
        x = torch.randn(5, 3, 32, 32, generator=torch.Generator().manual_seed(seed))
        x = x.half() if half else x
        out = ex.run([{"image": x}])[0]["output"].float()
        ref = _reference(x, half)
        assert out.abs().sum() > 0
        assert (out - ref).abs().max() <= (5e-2 if half else 1e-3) * max(1.0, ref.abs().max().item())
