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
