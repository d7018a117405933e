"""The shipped log4j2.xml keeps what it rolls: a log that reaches its size limit twice in one day
keeps both parts (the stock pattern, one file per day, overwrote the day's earlier part at each
roll: 400 requests kept 106 access lines with a 4 KB limit), and at most 10 rolled parts stay.
Real TorchServe from the shipped files, with only the size limit lowered to make it roll, shows it
for the access log; every other log is rolled by the same rules (read from the file)."""
import gzip
import re
import time
import urllib.request
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from compiled_serving.local_server import ROOT, LocalTorchServe
from compiled_serving.server_logs import read_log

KEPT = 10  # the shipped IfAccumulatedFileCount


def _ping(server, i: int) -> None:
    req = urllib.request.Request(f"{server.base}/ping?n={i}", headers=server.auth())
    assert urllib.request.urlopen(req, timeout=10).status == 200


LOGS = {"access_log": "LOG_LOCATION", "model_log": "LOG_LOCATION", "ts_log": "LOG_LOCATION",
        "model_metrics": "METRICS_LOCATION", "ts_metrics": "METRICS_LOCATION"}


def test_every_log_rolls_as_the_access_log_does(tmp_path):
    """Each of the five logs: its parts named NAME.YYYY-MM-DD-N.log.gz, numbered upward (nomax),
    the newest 10 kept by a Delete of its own parts, and a part of that name read by the reader."""
    root = ET.fromstring((ROOT / "log4j2.xml").read_text())
    rolling = {a.get("name"): a for a in root.iter("RollingFile")}
    assert set(rolling) == set(LOGS)
    for name, env in LOGS.items():
        a, base = rolling[name], "${env:%s:-logs}" % env
        assert a.get("fileName") == f"{base}/{name}.log", name
        assert a.get("filePattern") == f"{base}/{name}.%d{{yyyy-MM-dd}}-%i.log.gz", name
        strategy = a.find("DefaultRolloverStrategy")
        assert strategy is not None and strategy.get("fileIndex") == "nomax", name
        delete = strategy.find("Delete")
        assert delete.get("basePath") == base and delete.find("IfFileName").get("glob") == f"{name}.*.log.gz", name
        assert delete.find("IfFileName/IfAccumulatedFileCount").get("exceeds") == str(KEPT), name
        part = a.get("filePattern").replace(base, str(tmp_path)).replace("%d{yyyy-MM-dd}", "2026-11-28")
        Path(part.replace("%i", "3")).write_bytes(gzip.compress(f"{name} rolled\n".encode()))
        assert read_log(tmp_path / f"{name}.log") == f"{name} rolled\n", name


@pytest.mark.server
def test_every_roll_is_kept_and_ten_rolled_parts_at_most(tmp_path):
    shipped = (ROOT / "log4j2.xml").read_text()
    assert shipped.count('size="100 MB"') == 5, "the test lowers the shipped size limit of each log"
    server = LocalTorchServe(tmp_path / "run", tmp_path, {}, log_config=shipped.replace('size="100 MB"', 'size="4 KB"'))
    logs = tmp_path / "run" / "logs"
    try:
        _wait_up(server)
        for i in range(300):  # about 20 KB of access lines: about 5 rolls
            _ping(server, i)
        seen = re.findall(r"GET /ping\?n=(\d+) ", read_log(logs / "access_log.log"))
        assert [int(x) for x in seen] == list(range(300)), f"{len(seen)} of 300 access lines kept"
        for i in range(300, 1200):  # 25 and more rolls in all: only the newest 10 parts stay
            _ping(server, i)
        parts = sorted(logs.glob("access_log.*.log.gz"))
        seen = [int(x) for x in re.findall(r"GET /ping\?n=(\d+) ", read_log(logs / "access_log.log"))]
        assert len(parts) <= KEPT + 1, [p.name for p in parts]  # the Delete runs beside the roll
        assert seen[-1] == 1199 and seen == list(range(seen[0], 1200)), "the newest lines, in order, none lost"
        assert seen[0] > 0, "nothing was deleted: the limit did not hold"
    finally:
        server.stop()


def _wait_up(server) -> None:
    for _ in range(120):
        try:
            _ping(server, -1)
            return
        except OSError:
            time.sleep(1)
    raise TimeoutError(server.log("stdout.log")[-3000:])
