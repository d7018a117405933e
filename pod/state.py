"""What the pod knows about its models: read from the archives once and from TorchServe's loopback
management API on every poll; written to one JSON file (PodConfig.state_file) that the gRPC
bridge and the probes read, so every route of the pod answers health and metadata alike.

Facts relied on (TorchServe 0.12):
- `GET /models/NAME?customized=true` on the management API lists the model's workers with their
  status and the handler's describe_handle() JSON as `customizedMetadata` (handlers/ts_entry.py:
  `ready`, `load_error`, `device_fault`). A worker whose load failed is still listed READY (it
  answers 503 with the reason), so the handler's own `ready` decides.
- A model whose archive TorchServe could not register is answered 404 there, for ever.
- `GET /ping` on the inference API answers while the frontend runs.
"""
from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
import zipfile

from pod.config import PodConfigError, torchserve_keys

READY, LOADING, FAILED = "ready", "loading", "failed"
UNANSWERED = "management API: "  # the reason's start when the management API gave no answer
SERVER_NAME = "compiled-torchserve"  # the OIP server metadata's name (REST and gRPC)
PLATFORM = "pytorch_torchserve"  # the OIP model metadata's platform
TIMEOUT_S = 3.0
# How long a model keeps its last answered state (ready or failed) while the management API does
# not answer in time: `?customized=true` goes through the model's worker, which answers late
# when it runs a long batch or its host is short of CPU (seen: every poll of two models timed out
# for a while in a CI run with a load test beside it). A model whose worker stays silent longer
# reads "loading", with the timeout as its reason.
HOLD_S = 30.0


def v2_datatype(dtype: str) -> str:
    """artifact.json's torch dtype name -> the OIP datatype ('float32' -> 'FP32')."""
    if dtype == "bfloat16":
        return "BF16"
    return "FP" + dtype[len("float"):] if dtype.startswith("float") else dtype.upper()


def read_artifact(mar: str) -> dict:
    """The archive's (first) artifact.json; raises ValueError naming the archive and what is wrong."""
    shown = os.path.basename(mar)  # the archive's name: a reply never shows the pod's paths
    try:
        with zipfile.ZipFile(mar) as z:
            name = next((n for n in z.namelist() if n == "artifact.json" or n.endswith("/artifact.json")), None)
            if name is None:
                raise ValueError(f"archive {shown} holds no artifact.json: build it with `python -m compiled_serving.archive`")
            return json.loads(z.read(name))
    except (OSError, zipfile.BadZipFile, KeyError, json.JSONDecodeError) as e:
        raise ValueError(f"archive {shown} is not a readable .mar ({type(e).__name__}: {str(e).replace(mar, shown)}); upload it again "
                         "(a truncated copy?) or rebuild it with `python -m compiled_serving.archive`") from None


def archive_io(mar: str) -> dict:
    """{"inputs": [...], "outputs": [...]} as OIP metadata, from the archive's (first)
    artifact.json; raises ValueError naming the archive and what is wrong with it."""
    art = read_artifact(mar)
    return {k: [{"name": t["name"], "datatype": v2_datatype(t["dtype"]),
                 "shape": [-1 if not isinstance(d, int) else d for d in t["shape"]]} for t in art[k]]
            for k in ("inputs", "outputs")}


def get_json(url: str, key: str | None = None):
    """GET url's JSON; `key`: TorchServe's key for it, sent as its token authorization wants."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=TIMEOUT_S) as r:
        return json.loads(r.read())


def frontend_answers(ping_url: str) -> bool:
    """Whether TorchServe's frontend answers /ping, whatever it says: TorchServe 0.12 answers 500
    "Unhealthy" once any model has fewer healthy workers than its minimum
    (InferenceRequestHandler, ApiUtils.isModelHealthy), and one model that cannot start must not
    fail the pod's liveness and restart the models that serve; each model's own state says
    whether it serves."""
    try:
        get_json(ping_url)
    except urllib.error.HTTPError:
        return True  # an answer, with a status: the frontend is up
    except (urllib.error.URLError, OSError, ValueError):
        return False
    return True


def handler_state(entry: dict) -> tuple:
    """(state, reason) of one management API entry."""
    if not any(w.get("status") == "READY" for w in entry.get("workers", [])):
        return LOADING, "no worker is READY yet"
    raw = entry.get("customizedMetadata")
    try:
        info = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        info = None
    if not isinstance(info, dict):
        return LOADING, "the handler reported no state yet"
    if info.get("ready"):
        return READY, None
    reason = info.get("load_error") or info.get("device_fault")
    if reason:
        return FAILED, reason
    if info.get("engine_down"):  # its engine restarts (handlers/worker.py describe): back in seconds
        return LOADING, info["engine_down"]
    return LOADING, "the handler is loading"


def model_state(cfg, model, io_error, live: bool) -> tuple:
    if io_error:
        return FAILED, io_error
    if not live:
        return LOADING, "TorchServe is not answering /ping"
    try:
        key = torchserve_keys(cfg.runtime_dir)["management"]  # re-read: a new TorchServe writes new keys
        entries = get_json(f"{cfg.url('management')}/models/{model.name}?customized=true", key)
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return LOADING, "TorchServe has not registered it (yet); its ts_log.log says why if it never does"
        return LOADING, f"management API answered {e.code}"
    except (urllib.error.URLError, OSError, ValueError, PodConfigError) as e:  # PodConfigError: no key file
        return LOADING, f"{UNANSWERED}{e}"
    states = [handler_state(e) for e in entries] or [(LOADING, "not registered")]
    return next((s for s in states if s[0] != READY), states[0])


class Poller:
    """Reads the archives once, then TorchServe on each poll(); writes the state file."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.io, self.io_error = {}, {}
        self.answered = {}  # model -> (state, reason, monotonic time) of its last poll that TorchServe answered
        self.served = set()  # models whose state has been ready
        self.unserved_since = {}  # model -> monotonic time of the first answered poll not ready after it served
        for m in cfg.models:
            try:
                self.io[m.name] = archive_io(m.mar)
            except ValueError as e:
                self.io[m.name], self.io_error[m.name] = {"inputs": [], "outputs": []}, str(e)

    def poll(self) -> dict:
        live = frontend_answers(f"{self.cfg.url('inference')}/ping")
        models, now = {}, time.monotonic()  # for the hold's age: a step of the wall clock (NTP) does not age it
        for m in self.cfg.models:
            answer = model_state(self.cfg, m, self.io_error.get(m.name), live)
            state, reason = held(self.answered.get(m.name), answer, live, now)
            if not unanswered(answer):  # a held state is no answer: it must not renew its own age
                self.answered[m.name] = (*answer, now)
            since = unserved_since(self.unserved_since.get(m.name), m.name in self.served, answer, now)
            self.unserved_since[m.name] = since
            if state == READY:
                self.served.add(m.name)
            models[m.name] = {"state": state, "reason": reason, "version": m.version, **self.io[m.name],
                              "unserved_s": None if since is None else round(now - since, 1)}
        snapshot = {"time": time.time(), "torchserve_live": live, "models": models,
                    "stopping": os.path.exists(self.cfg.stopping_file)}
        write_state(self.cfg.state_file, snapshot)
        return snapshot


def held(last, now_state: tuple, live: bool, now: float) -> tuple:
    """(state, reason): `now_state`, unless the management API gave no answer while the frontend
    is live and the model's last answered state (`last`: state, reason, time) was ready or
    failed less than HOLD_S ago: then that one."""
    if live and unanswered(now_state) and last is not None and last[0] in (READY, FAILED) and now - last[2] < HOLD_S:
        return last[0], last[1]
    return now_state


def unserved_since(since, served: bool, answer: tuple, now: float):
    """The monotonic time since which a model that served has not (None: it serves, or never
    served): started by the first answered poll not ready after it served (no READY worker: its
    worker died and has not come back; or its reload failed), kept by later ones, and by polls
    the management API did not answer (a worker busy with a long batch neither starts nor ends
    it), ended by a ready one. A model that never served (still loading, or its load failed)
    has none: it keeps the pod out of the endpoints (readiness), and a restart would not help."""
    if answer[0] == READY or not served:
        return None
    if unanswered(answer):
        return since
    return now if since is None else since


def lost_models(snapshot, bound_s: float) -> list:
    """Why the pod must be restarted (the liveness probe fails): each model that served and has
    not served again for longer than `bound_s` (PodConfig.worker_lost_s), with its reason;
    none while the pod is stopping."""
    if not snapshot or snapshot.get("stopping"):
        return []
    return [f"model {n} has not served for {m['unserved_s']:.0f} s (more than {bound_s:.0f} s since it served; "
            f"{m['reason']}): a restart of the container brings it back"
            for n, m in snapshot.get("models", {}).items()
            if m.get("unserved_s") is not None and m["unserved_s"] > bound_s]


def unanswered(state: tuple) -> bool:
    """Whether (state, reason) says the management API gave no answer."""
    return state[0] == LOADING and state[1].startswith(UNANSWERED)


def write_state(path: str, snapshot: dict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(snapshot, f)
    os.replace(tmp, path)  # readers see the old or the new file, never half of one


def find_model(snapshot, name, version) -> tuple:
    """(the model's state dict, None) or (None, why not: not served, with what is) for a
    request naming `name` and, where given, `version`; the status routes and the gRPC bridge
    answer alike."""
    models = (snapshot or {}).get("models", {})
    m = models.get(name or "")
    if m is not None and (not version or version == m["version"]):
        return m, None
    served = ", ".join(f"{n} (version {v['version']})" for n, v in models.items()) or "nothing yet"
    return None, f"model {name!r}{f' version {version!r}' if version else ''} is not served here; this pod serves {served}"


def unservable(name: str, m: dict) -> str | None:
    """Why a model's metadata is not answered (its load failed), or None."""
    return f"model {name!r} cannot be served: {m['reason']}" if m["state"] == FAILED else None


def server_problem(snapshot) -> str | None:
    """None when every model serves; else why the pod is not ready."""
    if snapshot is None:
        return "the pod's status process has not written its first state yet"
    if snapshot.get("stopping"):
        return "the pod is stopping (SIGTERM): it serves what still reaches it, and takes no new traffic"
    if not snapshot.get("torchserve_live"):
        return "TorchServe is not answering /ping"
    bad = [f"{n}: {m['state']}: {m['reason']}" for n, m in snapshot["models"].items() if m["state"] != READY]
    return "; ".join(bad) or None


class StateFile:
    """The state file as another process reads it: re-read when it changed (cheap: one stat)."""

    def __init__(self, path: str):
        self.path, self.mtime, self.snapshot = path, None, None

    def read(self):
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except OSError:
            return self.snapshot
        if mtime != self.mtime:
            try:
                with open(self.path) as f:
                    self.snapshot, self.mtime = json.load(f), mtime
            except (OSError, ValueError):
                pass  # replaced while read: the next call reads the new one
        return self.snapshot
