"""The crash-safe trial load runs once per artifact, placement, torch build and machine: a
restarted worker (or a sibling starting beside it) reuses the verdict kept in this user's
private scratch root; a verdict file that is not a private file of this user with exactly the
expected content is ignored and the trial load runs again."""
import json
import os

import pytest

from handlers.artifact import probe
from handlers.artifact.device import Placement
from handlers.artifact.variants import open_variant
from handlers.config import HandlerConfig

pytestmark = pytest.mark.server


@pytest.fixture
def private_root(tmp_path):
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    return root


def test_verdict_is_reused_and_a_tampered_one_is_ignored(artifacts, private_root):
    spec = open_variant(str(artifacts.get("cls_export")))
    place, cfg = Placement("cpu", None), HandlerConfig()
    secs, note = probe.probe_once(spec, place, cfg, verdict_root=str(private_root))
    assert secs > 0 and note.startswith("trial load ")
    again = probe.probe_once(spec, place, cfg, verdict_root=str(private_root))
    assert again[0] == 0.0 and "verdict reused" in again[1]
    (path,) = [p for p in (private_root / probe.VERDICTS).iterdir() if p.suffix == ".ok"]
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    os.chmod(path, 0o666)  # writable by others: not trusted
    assert probe.probe_once(spec, place, cfg, verdict_root=str(private_root))[1].startswith("trial load ")
    assert oct(path.stat().st_mode & 0o777) == "0o600"  # replaced by a private one
    key = json.loads(path.read_text())
    path.write_text(json.dumps({**key, "sha256": "0" * 64}))  # not the verdict for this artifact
    assert probe.probe_once(spec, place, cfg, verdict_root=str(private_root))[1].startswith("trial load ")
    other = HandlerConfig(cuda_graphs="off")
    assert probe.probe_once(spec, place, other, verdict_root=str(private_root))[1].startswith("trial load ")  # another key


def test_without_a_private_root_every_load_runs_its_trial(artifacts):
    spec = open_variant(str(artifacts.get("cls_export")))
    for _ in range(2):
        assert probe.probe_once(spec, Placement("cpu", None), HandlerConfig())[1].startswith("trial load ")


def test_a_matched_digest_is_kept_until_the_file_is_written_again(artifacts, private_root, tmp_path, monkeypatch):
    """integrity.verify_integrity with a verdict root: the artifact is hashed once, a restart
    with the file unchanged reads none of it, and a write that keeps its size and puts its mtime
    back (its ctime still moves) is hashed again and refused."""
    import shutil

    from handlers.artifact import integrity
    from handlers.errors import LoadError

    d = tmp_path / "variant"
    shutil.copytree(artifacts.get("cls_export"), d)
    hashed = []
    real = integrity.sha256_file
    monkeypatch.setattr(integrity, "sha256_file", lambda p: (hashed.append(p), real(p))[1])
    open_variant(str(d), str(private_root))
    open_variant(str(d), str(private_root))
    assert len(hashed) == 1
    open_variant(str(d))  # no verdict root: hashed every time
    assert len(hashed) == 2
    model = d / "model.pt2"
    st = os.stat(model)
    time_before = st.st_ctime_ns
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte of the zip's contents, size unchanged
    while os.stat(model).st_ctime_ns == time_before:  # a coarse clock: the write must move ctime
        model.write_bytes(bytes(data))
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(model).st_mtime_ns == st.st_mtime_ns and os.stat(model).st_size == st.st_size
    with pytest.raises(LoadError, match="SHA-256"):
        open_variant(str(d), str(private_root))
    assert len(hashed) == 3
