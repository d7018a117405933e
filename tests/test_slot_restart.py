"""A slot-form worker (TorchServe's asyncCommunication, handlers/continuous.py) killed with
SIGKILL, as the OOM killer does, idle and busy with streams in flight, comes back READY and
answering within the one-sequence form's time; the streams in flight end with an error event,
and no request hangs (handlers/torchserve/guardian.py says why TorchServe 0.12 alone never
brings such a worker back)."""
import json
import os
import signal
import threading
import time

import pytest
import requests
import torch
from test_continuous import archive

from examples import slot_decoder
from examples.tiny_decoder import Config
from handlers.torchserve import guardian

pytestmark = [pytest.mark.server, pytest.mark.usefixtures("results_file")]
# with FAULT_RESULTS=PATH (tests/conftest.py results_file): seconds from the kill to a READY worker
# that answers, per case
RESULTS = {"slot_restart_s": {}}
# the one-sequence and stateless forms come back in 4.1-5.5 s on this CPU; a host short of CPU
# (tests beside this one) loads slower: the bound is then no more than this server's own start
# took, plus 10 s (seen: a load of 22 s where it takes 4 s alone)
BACK_S = 15
NO_HANG_S = 30  # far below TorchServe's 120 s response timeout, where a lost request ends


# A fault point in the server's workers (a sitecustomize on their PYTHONPATH, which TorchServe's
# EnvironmentUtils passes on from the frontend's): once a file named after a guardian record
# (`streaming`, `answering`) appears in the armed folder, the next worker that tells the guardian
# that record kills itself right after it (SIGKILL), before it writes the frame the record is
# about; the file's removal makes it one kill.
FAULT_POINT = """
import os, signal, sys

ARMED = os.environ.get("SLOT_RESTART_ARMED")


class _Finder:
    def find_spec(self, name, path=None, target=None):
        if name != "handlers.torchserve.guardian":
            return None
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            for point in ("streaming", "answering"):
                told = getattr(module, point)

                def at(*args, told=told, point=point):
                    told(*args)
                    if module._pipe is not None:
                        try:
                            os.remove(os.path.join(ARMED, point))
                        except OSError:
                            return
                        os.kill(os.getpid(), signal.SIGKILL)
                setattr(module, point, at)
        spec.loader.exec_module = exec_module
        return spec


if ARMED:
    sys.meta_path.insert(0, _Finder())
"""


@pytest.fixture(scope="module")
def slot_ts(serve, tmp_path_factory):
    d = tmp_path_factory.mktemp("slot_restart")
    path = d / "slots.pt2"
    torch.export.save(slot_decoder.export(slot_decoder.build(Config(max_seq_length=128), slots=8)), path)
    archive(path, "lm", d / "store")
    return served_with_fault_point(serve, d, d / "store" / "lm.mar", BACK_S)


def served_with_fault_point(serve, d, mar, back_s: float):
    """TorchServe serving `mar` as model lm, its workers under FAULT_POINT (armed in d / "armed"),
    with `back_s`, the bound on a restart: at least `back_s`, else this server's own start + 10 s."""
    (d / "hook").mkdir()
    (d / "hook" / "sitecustomize.py").write_text(FAULT_POINT)
    (d / "armed").mkdir()
    with pytest.MonkeyPatch.context() as mp:  # the frontend's environment, which its workers inherit
        mp.setenv("PYTHONPATH", os.pathsep.join([str(d / "hook"), os.environ.get("PYTHONPATH", "")]))
        mp.setenv("SLOT_RESTART_ARMED", str(d / "armed"))
        t0 = time.time()
        ts = serve({"lm": mar})
    ts.armed, ts.back_s = d / "armed", max(back_s, time.time() - t0 + 10)
    return ts


def pid_of(ts) -> int:
    (w,) = ts.workers("lm")
    return w["pid"]


def answered(ts, timeout=NO_HANG_S):
    """(status, lines) of a short streamed generation."""
    r = requests.post(f"{ts.base}/predictions/lm", json={"input_ids": [1, 2, 3], "parameters": {"max_tokens": 3}},
                      headers=ts.auth(), stream=True, timeout=timeout)
    return r.status_code, [x for x in r.iter_lines() if x]


def during(ts, n: int = 6) -> list:
    """Threads that each send a short generation over the next seconds (the outage), with their
    outcomes: (status or the exception, seconds taken, time sent)."""
    outcomes = []

    def one(i):
        time.sleep(0.4 * i)
        t0 = time.time()
        try:
            outcomes.append((answered(ts)[0], time.time() - t0, round(t0, 3)))
        except Exception as e:  # noqa: BLE001  (a hang ends as a read timeout)
            outcomes.append((repr(e), time.time() - t0, round(t0, 3)))
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads, outcomes


def served_or_refused(ts, threads, outcomes) -> None:
    """Each request sent during the outage was answered, or refused with a 503, well before any
    timeout; else fails with the outcomes and TorchServe's log (the xfail below says what fails)."""
    for t in threads:
        t.join(NO_HANG_S + 5)
    said = [x for x in ts.log("logs/ts_log.log").splitlines()[-80:] if "MetricCollector" not in x]
    said += [x for x in ts.log("logs/model_log.log").splitlines() if "guardian" in x]
    print(outcomes, *said[-6:], sep="\n")
    if not (len(outcomes) == len(threads) and all(s in (200, 503) and took < NO_HANG_S for s, took, _sent in outcomes)):
        pytest.fail("\n".join([repr(outcomes), *said]))


def back_within(ts, old_pid: int, limit_s: float) -> float:
    """Seconds until the model has one READY worker (not `old_pid`) that answers a generation;
    fails after `limit_s`, each try bounded so that none hangs."""
    t0 = time.time()
    while time.time() - t0 < limit_s:
        ws = ts.workers("lm", timeout=5)
        if len(ws) == 1 and ws[0]["status"] == "READY" and ws[0]["pid"] != old_pid:
            status, lines = answered(ts)
            if status == 200 and len(lines) == 4:
                return time.time() - t0
        time.sleep(0.3)
    pytest.fail(f"not back {limit_s}s after the kill: workers {ts.workers('lm')}\n{ts.log('logs/ts_log.log')[-3000:]}")


def test_an_idle_slot_worker_killed_comes_back(slot_ts):
    assert answered(slot_ts)[0] == 200
    pid = pid_of(slot_ts)
    os.kill(pid, signal.SIGKILL)
    took = back_within(slot_ts, pid, slot_ts.back_s)
    RESULTS["slot_restart_s"]["idle"] = round(took, 2)
    print(f"idle kill: back in {took:.1f}s")


def test_a_busy_slot_worker_killed_ends_its_streams_and_comes_back(slot_ts):
    body = {"input_ids": [1, 2, 3], "parameters": {"max_tokens": 120, "ignore_eos": True}}
    outcomes, started = [], threading.Semaphore(0)

    def stream():
        t0, raw, status = time.time(), [], None
        try:
            with requests.post(f"{slot_ts.base}/predictions/lm", json=body, headers=slot_ts.auth(), stream=True,
                               timeout=NO_HANG_S) as r:
                lines, status = [], r.status_code
                if status == 507:  # TorchServe's own answer, its JSON over several lines (see below)
                    outcomes.append((status, [r.json()], time.time() - t0))
                    started.release()
                    return
                for line in r.iter_lines():
                    if line:
                        raw.append(line)
                        lines.append(json.loads(line))
                        if len(lines) == 1:
                            started.release()
                outcomes.append((r.status_code, lines, time.time() - t0))
        except Exception as e:  # noqa: BLE001  (a hang ends as a read timeout here)
            started.release()
            outcomes.append((None, f"{e!r}: status {status}, after {raw[-3:]}", time.time() - t0))
    assert answered(slot_ts)[0] == 200  # served: the streams below reach a READY worker
    pid = pid_of(slot_ts)
    threads = [threading.Thread(target=stream) for _ in range(4)]
    for t in threads:
        t.start()
    assert started.acquire(timeout=NO_HANG_S)  # the kill comes once a stream has its first token
    os.kill(pid, signal.SIGKILL)
    for t in threads:
        t.join(NO_HANG_S + 5)
    assert len(outcomes) == 4, outcomes
    cut = 0
    for status, lines, took in outcomes:  # each ended with an error event, or whole before the kill,
        assert status in (200, 503, 507) and took < NO_HANG_S, (status, lines, took)
        if status == 507:  # TorchServe 0.12's own race, documented in handlers/torchserve/guardian.py (and
            # the xfail below): a request its worker thread takes while the scale-down clears the dead
            # worker's channel is answered 507 "Worker died." by the frontend, never reaching a handler
            assert lines[0].get("message") == "Worker died.", lines
            continue
        if status == 503:  # or, not begun when the worker died, refused: retry
            assert lines == [{"code": 503, "type": "ServiceUnavailable", "message": guardian.DIED.message}], lines
            continue
        errored = "error" in lines[-1] and "token_ids" not in lines[-1]
        assert errored or lines[-1].get("completion_tokens") == 120, lines[-3:]
        cut += errored
    assert cut >= 1, [lines[-1] for _s, lines, _t in outcomes]
    took = back_within(slot_ts, pid, slot_ts.back_s)
    RESULTS["slot_restart_s"]["busy"] = round(took, 2)
    print(f"busy kill: back in {took:.1f}s")


def cut_before_its_first_chunk(ts) -> None:
    """The worker dies after telling the guardian a stream began, before its first token chunk
    went out (the fault point `streaming`): the guardian's frames open the answer (200) with the
    error event and end it; the worker comes back."""
    assert answered(ts)[0] == 200
    pid = pid_of(ts)
    (ts.armed / "streaming").touch()
    t0 = time.time()
    status, lines = answered(ts)
    assert status == 200 and time.time() - t0 < NO_HANG_S, (status, lines)
    assert len(lines) == 1 and "error" in json.loads(lines[0]) and "token_ids" not in json.loads(lines[0]), lines
    assert not (ts.armed / "streaming").exists()  # the fault point was reached
    back_within(ts, pid, ts.back_s)


def test_a_stream_cut_before_its_first_chunk_went_out_ends_with_an_error(slot_ts):
    cut_before_its_first_chunk(slot_ts)


def test_an_answer_cut_before_it_went_out_is_a_retryable_503(slot_ts):
    """The worker dies after telling the guardian a whole answer is going out, before it did."""
    assert answered(slot_ts)[0] == 200
    pid = pid_of(slot_ts)
    (slot_ts.armed / "answering").touch()
    t0 = time.time()
    r = requests.post(f"{slot_ts.base}/predictions/lm", headers=slot_ts.auth(), timeout=NO_HANG_S,
                      json={"input_ids": [1, 2, 3], "parameters": {"max_tokens": 3, "stream": False}})
    assert r.status_code == 503 and time.time() - t0 < NO_HANG_S, (r.status_code, r.text)
    assert "died" in r.json()["message"], r.text
    assert not (slot_ts.armed / "answering").exists()
    back_within(slot_ts, pid, slot_ts.back_s)


@pytest.mark.xfail(reason="TorchServe 0.12's scale-down races itself (handlers/torchserve/guardian.py): when "
                          "AsyncWorkerThread's closeFuture listener takes the thread before WorkerThread.shutdown "
                          "does, AsyncBatchAggregator.sendError(null) is skipped and what the old thread wrote to "
                          "the dead worker is lost; a request it takes while backendChannel is cleared gets 507. "
                          "The guardian answers 503 what it holds and reads before the scale-down, so only a "
                          "request written in the milliseconds before the shutdown remains exposed (before: 8 of "
                          "12 runs failed; since: 7 of 7 passed)", strict=False)
def test_requests_sent_while_the_slot_worker_is_down_are_served_or_refused(slot_ts):
    assert answered(slot_ts)[0] == 200
    pid = pid_of(slot_ts)
    print(f"kill at {time.time():.3f}")
    os.kill(pid, signal.SIGKILL)
    asked = during(slot_ts)
    back_within(slot_ts, pid, slot_ts.back_s)
    served_or_refused(slot_ts, *asked)

