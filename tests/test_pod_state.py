"""The pod's state poll (pod/state.py) in process: a management API that answers late does not
turn a model that was ready or failed into "loading" at once."""
from pod.state import FAILED, HOLD_S, LOADING, READY, UNANSWERED, held

LATE = (LOADING, f"{UNANSWERED}timed out")


def _properties(tmp_path, models: dict, extra: str = ""):
    """A pod's config.properties: TorchServe's loopback addresses and a model_snapshot of `models`
    (name -> its snapshot entry)."""
    import json
    path = tmp_path / "config.properties"
    head = "\n".join(f"{k}_address=http://127.0.0.1:{port}"
                     for k, port in (("inference", 1), ("management", 2), ("metrics", 3)))
    snap = {"models": {name: {"1.0": entry} for name, entry in models.items()}}
    caps = "vmargs=-Xmx384m -XX:MaxDirectMemorySize=100m\n"  # as cs-kserve writes them (pod.config needs the cap)
    path.write_text(f"{head}\n{caps}{extra}model_snapshot={json.dumps(snap)}\n")
    return str(path)


def test_a_late_answer_keeps_the_last_ready_or_failed_state_for_a_while():
    for last in ((READY, None, 100.0), (FAILED, "bad: its artifact does not match", 100.0)):
        assert held(last, LATE, True, 100.0 + HOLD_S - 1) == last[:2]
        assert held(last, LATE, True, 100.0 + HOLD_S + 1) == LATE  # silent for longer: not held


def test_only_an_unanswered_poll_of_a_live_frontend_is_held():
    last = (READY, None, 100.0)
    assert held(last, LATE, False, 101.0) == LATE  # the frontend does not answer /ping either
    assert held(last, (FAILED, "its worker failed"), True, 101.0) == (FAILED, "its worker failed")  # an answer
    assert held(last, (LOADING, "the handler is loading"), True, 101.0) == (LOADING, "the handler is loading")
    assert held(None, LATE, True, 101.0) == LATE  # never answered yet
    assert held((LOADING, "the handler is loading", 100.0), LATE, True, 101.0) == LATE



def test_a_step_of_the_wall_clock_neither_ages_a_held_state_nor_stales_the_bridge(monkeypatch, tmp_path):
    """Durations are read from time.monotonic(): a node's clock set an hour ahead (NTP) must not
    fail the liveness probe of a pod whose bridge answers, nor drop a held state."""
    import time
    from types import SimpleNamespace

    from pod import state, status
    model = SimpleNamespace(name="m", mar="m.mar", version="1")
    cfg = SimpleNamespace(models=[model], grpc_port=0, bridge_port=0, state_file=str(tmp_path / "state.json"),
                          stopping_file=str(tmp_path / "pod_stopping"), worker_lost_s=300,
                          url=lambda kind: "http://127.0.0.1:9")
    answers = iter([(READY, None), LATE])
    monkeypatch.setattr(state, "archive_io", lambda mar: {"inputs": [], "outputs": []})
    monkeypatch.setattr(state, "get_json", lambda url: {})  # /ping answers
    monkeypatch.setattr(state, "model_state", lambda *a: next(answers))
    monkeypatch.setattr(status, "bridge_live", lambda port: True)
    s = status.Status(cfg)
    assert s.live()[0] == 503, "a bridge never seen is stale"
    s.refresh()  # READY, the bridge answers
    assert s.live() == (200, {"live": True})
    wall = time.time() + 3600
    monkeypatch.setattr(time, "time", lambda: wall)  # the wall clock steps an hour ahead
    monkeypatch.setattr(status, "bridge_live", lambda port: False)
    assert s.live() == (200, {"live": True}), "the bridge answered a moment ago"
    assert s.poller.poll()["models"]["m"]["state"] == READY, "the management API is late a moment after ready"


def test_the_drain_after_sigterm_is_five_seconds_unless_set_and_a_bad_value_is_named(tmp_path):
    import pytest

    from pod import config
    props = _properties(tmp_path, {"m": {"marName": "m.mar"}})
    assert config.load(props, {}).stop_drain_s == 5
    assert config.load(props, {"STOP_DRAIN_S": "0"}).stop_drain_s == 0
    cfg = config.load(props, {"RUNTIME_DIR": str(tmp_path)})
    assert cfg.stopping_file.startswith(str(tmp_path))
    for bad, why in (("-1", "must be at least 0"), ("soon", "is not an integer")):
        with pytest.raises(config.PodConfigError, match=f"STOP_DRAIN_S.*{why}"):
            config.load(props, {"STOP_DRAIN_S": bad})


def test_a_frontend_answering_ping_500_unhealthy_is_live_and_its_models_say_the_rest(monkeypatch):
    """TorchServe 0.12 answers /ping 500 "Unhealthy" once one model lacks healthy workers: the
    frontend is up (liveness holds, so the kubelet does not restart the models that serve); a
    refused connection is not."""
    import io
    import urllib.error

    from pod import state

    def unhealthy(url):
        raise urllib.error.HTTPError(url, 500, "Internal Server Error", {}, io.BytesIO(b'{"status": "Unhealthy"}'))

    def refused(url):
        raise urllib.error.URLError(ConnectionRefusedError(111, "Connection refused"))

    monkeypatch.setattr(state, "get_json", unhealthy)
    assert state.frontend_answers("http://127.0.0.1:9/ping") is True
    monkeypatch.setattr(state, "get_json", refused)
    assert state.frontend_answers("http://127.0.0.1:9/ping") is False
    monkeypatch.setattr(state, "get_json", lambda url: {"status": "Healthy"})
    assert state.frontend_answers("http://127.0.0.1:9/ping") is True


def test_a_process_restarted_often_long_ago_is_restarted_again(monkeypatch):
    """pod.start gives up on a process only after RESTARTS exits within RESTART_WINDOW_S: four
    quick restarts at start, then an exit a day later, is restarted (it stopped the pod before)."""
    import subprocess
    from types import SimpleNamespace

    from pod import start
    clock = [1000.0]
    monkeypatch.setattr(start.time, "monotonic", lambda: clock[0])
    exits = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: SimpleNamespace(poll=lambda: exits[-1] if exits else None))
    child = start.Child("bridge", ["true"], {})
    child.start()
    for _ in range(start.RESTARTS - 1):  # exits at once, restarted each time
        exits.append(1)
        assert child.check()
    exits.append(None)
    assert child.check()  # up
    clock[0] += 86400.0
    exits.append(0)
    assert child.check(), "one exit a day after its early restarts must be restarted"
    for _ in range(start.RESTARTS - 1):
        exits.append(1)
        child.check()
    assert not child.check(), "RESTARTS exits within the window stop the pod"


def test_the_fronts_wait_as_long_as_the_slowest_models_response_timeout(tmp_path):
    from pod import config
    fast, slow = {"marName": "fast.mar", "responseTimeout": 30}, {"marName": "slow.mar", "responseTimeout": 600}
    timeout = "default_response_timeout=120\n"
    assert config.load(_properties(tmp_path, {"fast": fast, "slow": slow}, timeout), {}).response_timeout_s == 600
    assert config.load(_properties(tmp_path, {"fast": fast}, timeout), {}).response_timeout_s == 120


def test_a_held_state_ages_while_the_management_api_stays_silent(monkeypatch, tmp_path):
    """The hold lasts HOLD_S from the last answer, however many silent polls come between: a held
    state is no answer and does not renew itself (it did: a ready model stayed ready for ever)."""
    from types import SimpleNamespace

    from pod import state
    model = SimpleNamespace(name="m", mar="m.mar", version="1")
    cfg = SimpleNamespace(models=[model], state_file=str(tmp_path / "state.json"),
                          stopping_file=str(tmp_path / "pod_stopping"), url=lambda kind: "http://127.0.0.1:9")
    clock, answers = [100.0], iter([(READY, None)] + [LATE] * 10)
    monkeypatch.setattr(state.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(state, "archive_io", lambda mar: {"inputs": [], "outputs": []})
    monkeypatch.setattr(state, "get_json", lambda url: {})
    monkeypatch.setattr(state, "model_state", lambda *a: next(answers))
    poller = state.Poller(cfg)
    seen = []
    for _ in range(5):  # one answer, then silent polls every HOLD_S / 3
        seen.append(poller.poll()["models"]["m"]["state"])
        clock[0] += HOLD_S / 3
    assert seen == [READY, READY, READY, LOADING, LOADING], seen


NO_WORKER = (LOADING, "no worker is READY yet")


def _status(monkeypatch, tmp_path, answers, lost_s=300):
    """pod.status's Status over one model whose management API answers are `answers` (an
    iterable of (state, reason)), with a clock the test moves (a list of one float), the bridge
    live."""
    from types import SimpleNamespace

    from pod import state, status
    model = SimpleNamespace(name="m", mar="m.mar", version="1")
    cfg = SimpleNamespace(models=[model], grpc_port=0, bridge_port=0, state_file=str(tmp_path / "state.json"),
                          stopping_file=str(tmp_path / "pod_stopping"), worker_lost_s=lost_s,
                          url=lambda kind: "http://127.0.0.1:9")
    clock, answers = [100.0], iter(answers)
    monkeypatch.setattr(state.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(state, "archive_io", lambda mar: {"inputs": [], "outputs": []})
    monkeypatch.setattr(state, "get_json", lambda url: {})  # /ping answers
    monkeypatch.setattr(state, "model_state", lambda *a: next(answers))
    monkeypatch.setattr(status, "bridge_live", lambda port: True)
    return status.Status(cfg), clock


def test_a_model_with_no_ready_worker_is_not_ready_at_once(tmp_path):
    from pod.state import handler_state, server_problem
    entry = {"workers": [{"status": "UNLOADING"}], "customizedMetadata": '{"ready": true}'}
    assert handler_state(entry) == NO_WORKER  # the handler's last word is no worker's
    assert handler_state({"workers": []}) == NO_WORKER
    snapshot = {"torchserve_live": True, "models": {"m": {"state": NO_WORKER[0], "reason": NO_WORKER[1]}}}
    assert "m: loading: no worker is READY yet" in server_problem(snapshot)


def test_a_model_whose_engine_is_gone_is_not_ready_with_the_reason():
    """handlers/worker.py describe: a worker served by the engine says engine_down while it
    reaches the engine's successor; the pod is not ready meanwhile, and it is no failure."""
    import json

    from pod.state import handler_state
    down = {"ready": False, "state": "ready", "engine_down": "the engine is gone (killed); its successor is being reached"}
    entry = {"workers": [{"status": "READY"}], "customizedMetadata": json.dumps(down)}
    assert handler_state(entry) == (LOADING, down["engine_down"])
    up = dict(down, ready=True, engine_down=None, engine={"pid": 7, "connected": True, "reason": None})
    assert handler_state(dict(entry, customizedMetadata=json.dumps(up))) == (READY, None)


def test_a_model_that_served_and_lost_its_worker_fails_liveness_after_the_bound(monkeypatch, tmp_path):
    """Readiness fails at the first poll with no READY worker; liveness only once the model has
    not served for WORKER_LOST_S (the kubelet then restarts the container); a worker back in
    time clears it, and the next loss starts a new count."""
    s, clock = _status(monkeypatch, tmp_path, [(READY, None)] + [NO_WORKER] * 4 + [(READY, None), NO_WORKER], 300)
    s.refresh()
    assert s.live() == (200, {"live": True}) and s.ready()[0] == 200
    s.refresh()  # the worker died
    assert s.ready()[0] == 503 and s.live()[0] == 200
    clock[0] += 200
    s.refresh()
    assert s.live()[0] == 200, "within the bound: TorchServe or the guardian may bring it back"
    clock[0] += 101
    s.refresh()
    code, body = s.live()
    assert code == 503 and "model m has not served for 301 s" in body["reason"] and "no worker is READY" in body["reason"], body
    open(s.cfg.stopping_file, "w").close()
    s.refresh()
    assert s.live()[0] == 200, "a stopping pod drains: its liveness holds"
    import os
    os.remove(s.cfg.stopping_file)
    s.refresh()  # back
    assert s.live()[0] == 200 and s.ready()[0] == 200
    clock[0] += 1000
    s.refresh()  # lost again: a new count from now
    assert s.ready()[0] == 503 and s.live()[0] == 200


def test_a_model_that_never_served_or_whose_worker_is_only_silent_keeps_the_pod_live(monkeypatch, tmp_path):
    """A model still loading, or whose load failed, never served: a restart would not help, it
    only stays out of the endpoints. A management API that stops answering (a worker in a long
    batch) neither starts the count nor ends one."""
    s, clock = _status(monkeypatch, tmp_path, [NO_WORKER, (FAILED, "its artifact does not match")] * 3)
    for _ in range(6):
        clock[0] += 1000
        s.refresh()
        assert s.live()[0] == 200 and s.ready()[0] == 503
    s, clock = _status(monkeypatch, tmp_path, [(READY, None)] + [LATE] * 3 + [NO_WORKER, LATE, LATE], 300)
    for _ in range(4):  # ready, then silent for 3000 s: held, then loading, never lost
        clock[0] += 1000
        s.refresh()
        assert s.live()[0] == 200
    s.refresh()  # no READY worker: the count starts
    clock[0] += 1000
    s.refresh()  # silent: the count goes on
    assert s.live()[0] == 503 and "has not served for 1000 s" in s.live()[1]["reason"]
