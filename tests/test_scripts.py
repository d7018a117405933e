"""The command-line tools' contracts: clear errors for bad arguments, archive warnings."""
import subprocess

from conftest import PY, ROOT


def run(*args):
    return subprocess.run([PY, *args], cwd=ROOT, capture_output=True, text=True)


def test_compile_rejects_bad_arguments(tmp_path):
    base = ["scripts/compile.py", "--model", "examples/models.py:classifier", "--backend", "export",
            "--device", "cpu", "--out", str(tmp_path / "x")]
    r = run(*base, "--input", "image:4x3x32:float32x")
    assert r.returncode != 0 and "dtype must be one of" in r.stderr
    r = run(*base, "--input", "pixels:4x3x32x32:float32")
    assert r.returncode != 0 and "must match forward()'s parameters ['image']" in r.stderr
    r = run(*base, "--input", "image:4x3x32x32:float32", "--dynamic-batch", "8:16")
    assert r.returncode != 0 and "outside --dynamic-batch 8:16" in r.stderr
    r = run(*base[:-6], "--backend", "tensorrt", "--device", "cpu", "--out", str(tmp_path / "t"),
            "--input", "image:4x3x32x32:float32")
    assert r.returncode != 0 and "torch_tensorrt" in r.stderr


def test_archive_warns_when_batch_exceeds_artifact(artifacts, tmp_path):
    r = run("scripts/archive.py", "--artifact", str(artifacts.get("two_export_2to4")), "--name", "w",
            "--out", str(tmp_path), "--batch-size", "8")
    assert r.returncode == 0, r.stderr
    assert "batchSize 8 exceeds what model.pt2 accepts per call (2..4)" in r.stderr
    r = run("scripts/archive.py", "--artifact", str(artifacts.get("two_export_2to4")), "--name", "w",
            "--out", str(tmp_path), "--handler-option", "strem_priority=1")
    assert r.returncode != 0 and "unknown handler option(s) strem_priority" in r.stderr
