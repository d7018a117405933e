"""The shipped log4j2.xml keeps what it rolls: a log that reaches its size limit twice in one day
keeps both parts (the stock pattern, one file per day, overwrote the day's earlier part at each
roll: 400 requests kept 106 access lines with a 4 KB limit), and at most 10 rolled parts stay.
Real TorchServe from the shipped files, with only the size limit lowered to make it roll."""
import re
import time
import urllib.request

from compiled_serving.local_server import ROOT, LocalTorchServe
from compiled_serving.server_logs import read_log

KEPT = 10  # the shipped IfAccumulatedFileCount


def _ping(server, i: int) -> None:
    req = urllib.request.Request(f"{server.base}/ping?n={i}", headers=server.auth())
    assert urllib.request.urlopen(req, timeout=10).status == 200


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
