"""The log reader used by the tests and benchmarks reads a log across log4j2's rollovers."""
import gzip
import os

from compiled_serving.server_logs import read_log


def _write(p, text, mtime, gz=False):
    p.write_bytes(gzip.compress(text.encode()) if gz else text.encode())
    os.utime(p, (mtime, mtime))


def test_a_log_rolled_at_midnight_is_read_whole_oldest_part_first(tmp_path):
    _write(tmp_path / "model_log.26-Nov.log.gz", "a\n", 100, gz=True)
    _write(tmp_path / "model_log.27-Nov.log.gz", "b\n", 200, gz=True)
    _write(tmp_path / "model_log.log", "c\n", 300)
    _write(tmp_path / "ts_log.27-Nov.log.gz", "other log\n", 250, gz=True)
    assert read_log(tmp_path / "model_log.log") == "a\nb\nc\n"
    assert read_log(tmp_path / "ts_log.log") == "other log\n"


def test_a_part_being_compressed_is_read_once_and_a_missing_log_is_empty(tmp_path):
    _write(tmp_path / "model_log.27-Nov.log", "load line\n", 100)
    (tmp_path / "model_log.27-Nov.log.gz").write_bytes(gzip.compress(b"load line\n")[:5])  # half written
    _write(tmp_path / "model_log.log", "request line\n", 200)
    assert read_log(tmp_path / "model_log.log") == "load line\nrequest line\n"
    assert read_log(tmp_path / "absent.log") == ""


def test_parts_are_read_by_age_not_by_name(tmp_path):
    """log4j2's fileIndex nomax numbers a day's parts -1, -2, ... -10, -11: by name -10 comes
    before -2; the parts are read oldest first."""
    for i in (1, 2, 3, 10, 11):
        _write(tmp_path / f"model_log.2026-11-28-{i}.log.gz", f"part {i}\n", 1000 + i, gz=True)
    _write(tmp_path / "model_log.log", "current\n", 2000)
    names = sorted(p.name for p in tmp_path.glob("model_log.*.log.gz"))
    assert names[1] == "model_log.2026-11-28-10.log.gz"  # the order a name sort gives
    assert read_log(tmp_path / "model_log.log") == "part 1\npart 2\npart 3\npart 10\npart 11\ncurrent\n"


def test_a_part_removed_between_the_glob_and_the_sort_is_skipped(tmp_path, monkeypatch):
    """log4j2's Delete (or its compression, which removes the uncompressed part) can remove a part
    the reader has just listed: the reader reads the others, in order, and does not raise."""
    from pathlib import Path

    for i in (1, 2, 3):
        _write(tmp_path / f"model_log.2026-11-28-{i}.log.gz", f"part {i}\n", 1000 + i, gz=True)
    _write(tmp_path / "model_log.log", "current\n", 2000)
    real_glob, removed = Path.glob, []

    def glob_then_delete(self, pattern, **kw):
        found = sorted(real_glob(self, pattern, **kw))
        yield from found
        removed.append(found[0].name)
        found[0].unlink()  # gone once listed, before the reader asks its age
    monkeypatch.setattr(Path, "glob", glob_then_delete)
    assert read_log(tmp_path / "model_log.log") == "part 2\npart 3\ncurrent\n"
    assert removed == ["model_log.2026-11-28-1.log.gz"]
