"""A one-sequence decoder's worker (TorchServe's ordinary sync worker, handlers/generating.py)
killed with SIGKILL while it streams: the stream in flight ends with an error event and the end
of its answer, not a connection closed mid-answer (issue 63 item 9: TorchServe 0.12 alone writes
a whole new HTTP response onto the chunked answer under way, which Netty refuses); queued
requests are served by the worker TorchServe starts in its place, or refused with a 503; none
hangs. The guardian (handlers/torchserve/guardian.py, mode "sync") writes the stream's last frames
from its duplicate of the worker's connection, then lets go of it. The same holds where the
engine serves the decoder and the worker streams in the sync form through handlers/continuous.py
(handle_sync tells the guardian each batch's end, as handlers/torchserve/exchange.py does)."""
import json
import os
import signal
import threading
import time

import pytest
import requests
import torch
from conftest import build_mar, rewrite_model_config
from test_slot_restart import (NO_HANG_S, answered, back_within, cut_before_its_first_chunk, pid_of,
                               served_with_fault_point)

from examples import tiny_decoder

pytestmark = [pytest.mark.server, pytest.mark.usefixtures("results_file")]
# with FAULT_RESULTS=PATH (tests/conftest.py results_file): seconds from the kill to a READY worker
# that answers, and how the cut stream ended (the worker's; the engine-served worker's with _engine)
RESULTS = {"sequence_restart_s": {}, "sequence_cut_stream": {}, "sequence_cut_stream_engine": {}}
BACK_S = 15  # as test_slot_restart's: the sync form came back in 4.1-5.5 s on this CPU


@pytest.fixture(scope="module", params=["worker", "engine"])
def seq_ts(serve, tmp_path_factory, request):
    """The decoder run by its worker (on the CPU), and by the engine (engine: on, its lanes, as on a
    GPU with an archive made without asyncCommunication: the worker streams in TorchServe's sync form)."""
    d = tmp_path_factory.mktemp(f"sequence_restart_{request.param}")
    path = d / "lm.pt2"
    # a cache of 1024 positions: a stream long enough (a second or more here) to be killed mid-way
    torch.export.save(tiny_decoder.export(tiny_decoder.build(tiny_decoder.Config(max_seq_length=1024)), "torchchat"), path)
    opts = ("--handler-option", "engine=on", "--handler-option", "cache_copies=2") if request.param == "engine" else ()
    mar = build_mar(path, "lm", d / "store", *opts)
    if request.param == "engine":  # sync, as an archive of a program exported on the CPU is on a GPU:
        # without asyncCommunication (cs-archive gives it to a decoder it knows the engine serves)
        rewrite_model_config(mar, lambda cfg: cfg.pop("asyncCommunication", None))
    ts = served_with_fault_point(serve, d, mar, BACK_S)
    ts.mode = request.param
    return ts


def stream(ts, body, outcomes, started=None) -> None:
    """One streamed generation: (status, its lines, whether the answer ended whole, seconds)."""
    t0, lines, status = time.time(), [], None
    try:
        with requests.post(f"{ts.base}/predictions/lm", json=body, headers=ts.auth(), stream=True,
                           timeout=NO_HANG_S) as r:
            status = r.status_code
            if status != 200:
                lines.append(r.json())
            for line in (r.iter_lines() if status == 200 else ()):
                if line:
                    lines.append(json.loads(line))
                    if len(lines) == 1 and started is not None:
                        started.set()
        outcomes.append((status, lines, True, time.time() - t0))
    except Exception as e:  # noqa: BLE001  (a connection closed mid-answer, or a hang's read timeout)
        outcomes.append((status, lines + [repr(e)], False, time.time() - t0))
    finally:
        if started is not None:
            started.set()


def test_a_stream_under_way_ends_with_an_error_event_when_its_worker_is_killed(seq_ts):
    assert answered(seq_ts)[0] == 200
    pid = pid_of(seq_ts)
    long = {"input_ids": [1, 2, 3], "parameters": {"max_tokens": 1000, "ignore_eos": True}}
    outcomes, started = [], threading.Event()
    first = threading.Thread(target=stream, args=(seq_ts, long, outcomes, started))
    first.start()
    assert started.wait(NO_HANG_S)
    queued = [threading.Thread(target=stream, args=(seq_ts, {"input_ids": [4, 5], "parameters": {"max_tokens": 3}},
                                                    outcomes)) for _ in range(2)]
    for t in queued:
        t.start()
    time.sleep(0.05)  # the two wait in TorchServe's queue behind the first
    os.kill(pid, signal.SIGKILL)
    killed = time.time()
    for t in [first, *queued]:
        t.join(NO_HANG_S + 5)
    assert len(outcomes) == 3, outcomes
    cut = [o for o in outcomes if o[1] and isinstance(o[1][0], dict) and "token_ids" in o[1][0] and len(o[1]) > 4]
    assert len(cut) == 1, [o[:1] + (o[1][-2:],) + o[2:] for o in outcomes]
    status, lines, whole, took = cut[0]
    last = lines[-1]
    # the answer ended whole (chunked end), its last line the error event: retry
    assert status == 200 and whole and took < NO_HANG_S, (status, lines[-3:], whole)
    assert isinstance(last, dict) and "token_ids" not in last and "died" in json.dumps(last), lines[-3:]
    queued = [o for o in outcomes if o is not cut[0]]
    for status, lines, whole, took in queued:  # served whole by the new worker, or refused: retry
        assert whole and took < NO_HANG_S and status in (200, 503, 507), (status, lines, whole, took)
        assert status != 200 or len(lines) == 4, lines
        assert status != 507 or lines == [{"code": 507, "type": "InternalServerException", "message": "Worker died."}]
    # the old WorkerThread takes at most the one request after the stream's end (guardian_main.end_streams)
    assert sum(o[0] == 200 for o in queued) >= 1, queued
    back_within(seq_ts, pid, seq_ts.back_s)
    suffix = "" if seq_ts.mode == "worker" else "_engine"
    RESULTS["sequence_restart_s"]["busy" + suffix] = took_s = round(time.time() - killed, 2)
    # the cut stream's own (the loop above reused status, lines and whole for the queued ones)
    status, lines, whole, _took = cut[0]
    RESULTS["sequence_cut_stream" + suffix] = {"status": status, "ended_whole": whole, "last_event_error": True,
                                               "tokens_before_the_error": len(lines) - 1,
                                               "queued_statuses": sorted(o[0] for o in queued)}
    print(f"back {took_s:.1f}s after the kill")


def test_a_stream_cut_before_its_first_chunk_went_out_ends_with_an_error(seq_ts):
    cut_before_its_first_chunk(seq_ts)


def test_an_idle_worker_killed_comes_back_as_soon_as_without_a_guardian(seq_ts):
    """With no stream under way the guardian lets go of the connection at once: the frontend
    sees the death and restarts the worker in the sync form's time."""
    assert answered(seq_ts)[0] == 200
    pid = pid_of(seq_ts)
    os.kill(pid, signal.SIGKILL)
    took = back_within(seq_ts, pid, seq_ts.back_s)
    RESULTS["sequence_restart_s"]["idle" if seq_ts.mode == "worker" else "idle_engine"] = round(took, 2)
    print(f"idle kill: back in {took:.1f}s")
