"""The pod: TorchServe on loopback and, in front of it, nginx (REST), the gRPC bridge and the
status process; kept running until SIGTERM (kserve/entrypoint.sh runs this):

  python -m pod.start

Environment (the image sets the defaults): MODEL_ROOT (/mnt/models: the storage KServe mounts,
config/config.properties and model-store/ as `python -m compiled_serving.kserve` wrote them), RUNTIME_DIR
(/tmp/torchserve: every file the pod writes), HTTP_PORT (8080), GRPC_PORT (8081), METRICS_PORT
(8082), GRPC_BRIDGE_PROCESSES, NGINX_WORKERS, STOP_DRAIN_S, WORKER_LOST_S (pod/config.py says the defaults
and why).

On SIGTERM the readiness probe fails within a second (the status process's next poll) and the pod
serves on for STOP_DRAIN_S (5 s), the time the cluster takes to stop sending to it, then stops its
processes in order.

A process of the pod that exits is started again (at most RESTARTS times in RESTART_WINDOW_S,
then the pod exits and the kubelet restarts the container); the liveness route checks that
TorchServe and the bridge answer, so a hung one is restarted too.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

from handlers.generation import abandon
from pod import config as pod_config
from pod import nginx

SERVE_HOME = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESTARTS, RESTART_WINDOW_S = 5, 60.0
KEYS_WAIT_S = 120.0  # TorchServe writes key_file.json as its frontend starts, seconds after --start returns
UNIX_PATH_MAX = 107  # a Unix socket's path, its terminating NUL aside (Linux sockaddr_un.sun_path)


def log(msg: str) -> None:
    print(f"pod: {msg}", file=sys.stderr, flush=True)


def runtime_config(env) -> str:
    """RUNTIME_DIR/config.properties: the storage's, with /mnt/models replaced by MODEL_ROOT."""
    root, runtime = env.get("MODEL_ROOT", "/mnt/models"), env.get("RUNTIME_DIR", "/tmp/torchserve")
    src = os.path.join(root, "config", "config.properties")
    try:
        with open(src) as f:
            text = f.read()
    except OSError as e:
        raise SystemExit(f"pod: error: {src} cannot be read ({e}); upload the storage/ that "
                         "`python -m compiled_serving.kserve` wrote to the storageUri") from None
    os.makedirs(os.path.join(runtime, "tmp"), exist_ok=True)
    dest = os.path.join(runtime, "config.properties")
    with open(dest, "w") as f:
        f.write(with_tokens(text.replace("/mnt/models", root)))
    return dest


# Inside the pod TorchServe requires its keys: every process of the container shares its loopback
# (and so does every other container of the Kubernetes pod: the queue-proxy, a service mesh's
# sidecar), and a token-less management API there (REST and gRPC) could scale, unregister or
# re-register models. The storage's config.properties keeps token authorization off for
# KServe's built-in TorchServe runtime (`cs-kserve --builtin-runtime`), whose clients send no
# key; this pod's nginx sends the inference key, pod.status and the guardian the management key.
# TorchServe 0.12's keys expire after token_expiration_min (60 by default) and nginx holds its
# key for the pod's life: ten years.
TOKEN_SETTINGS = {"disable_token_authorization": "false", "token_expiration_min": str(10 * 365 * 24 * 60)}


def with_tokens(text: str) -> str:
    """config.properties' text with TOKEN_SETTINGS in place of its own lines for those keys."""
    lines = [ln for ln in text.splitlines() if ln.split("=", 1)[0].strip() not in TOKEN_SETTINGS]
    return "\n".join(lines + [f"{k}={v}" for k, v in TOKEN_SETTINGS.items()]) + "\n"


class Child:
    """One supervised process of the pod and how to start it again."""

    def __init__(self, name: str, argv: list, env: dict):
        self.name, self.argv, self.env = name, argv, env
        self.proc, self.starts = None, []

    def _recent_starts(self) -> list:
        """The starts within the last RESTART_WINDOW_S (monotonic: whatever the wall clock does)."""
        now = time.monotonic()
        return [t for t in self.starts if now - t < RESTART_WINDOW_S]

    def start(self) -> None:
        self.starts = self._recent_starts() + [time.monotonic()]
        self.proc = subprocess.Popen(self.argv, env=self.env, cwd=SERVE_HOME)

    def check(self) -> bool:
        """False once it died too often; restarts it otherwise."""
        code = self.proc.poll()
        if code is None:
            return True
        self.starts = self._recent_starts()  # starts long ago do not count against this exit
        if len(self.starts) >= RESTARTS:
            log(f"{self.name} exited ({code}) {RESTARTS} times in {RESTART_WINDOW_S:.0f} s; stopping the pod")
            return False
        log(f"{self.name} exited ({code}); starting it again")
        self.start()
        return True

    def stop(self, sig=signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)


def mark_stopping(cfg) -> None:
    """From now the readiness probe fails: pod.status reports the pod stopping while this file exists."""
    with open(cfg.stopping_file, "w") as f:
        f.write("SIGTERM\n")
    log(f"SIGTERM: not ready from now; serving on for {cfg.stop_drain_s} s while the endpoints drop this pod")


def drain(cfg, procs: list) -> bool:
    """After SIGTERM (mark_stopping): every port keeps serving for cfg.stop_drain_s, the time the
    cluster takes to stop sending; False if a process died too often meanwhile."""
    deadline = time.monotonic() + cfg.stop_drain_s
    while time.monotonic() < deadline:
        if not all(c.check() for c in procs):
            return False
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
    return True


def children(cfg, conf: str, env: dict) -> list:
    """pod.status, the bridges and nginx, once TorchServe has written its keys (nginx's config
    carries the inference key)."""
    key = pod_config.torchserve_keys(cfg.runtime_dir, wait_s=KEYS_WAIT_S)["inference"]
    py = [sys.executable, "-m"]
    out = [Child("status", py + ["pod.status", "--config", conf], env)]
    out += [Child(f"grpc bridge {i}", py + ["pod.grpc_bridge", "--config", conf], env)
            for i in range(cfg.bridge_processes)]
    out.append(Child("nginx", [nginx.binary(), "-c", nginx.write(cfg, key), "-e", "stderr"], env))
    return out


def torchserve(args: list, env: dict, cfg) -> int:
    return subprocess.call(["torchserve", *args], env=env, cwd=cfg.runtime_dir)


def main() -> int:
    env = dict(os.environ)
    conf = runtime_config(env)
    cfg = pod_config.load(conf, env)
    nginx.binary()  # fail before starting anything when nginx is missing
    # TorchServe's pid file, worker sockets and logs/ go under the runtime directory (the
    # pod's root filesystem may be read-only)
    env["TMPDIR"] = os.path.join(cfg.runtime_dir, "tmp")
    # the frontend's java.io.tmpdir (TorchServe's launcher passes TEMP, not TMPDIR, on): where it
    # unpacks every archive into models/<uuid>, never removed, and puts the workers' sockets;
    # /tmp otherwise, which a read-only root filesystem refuses. The last start's copies go first.
    env["TEMP"] = env["TMPDIR"]
    if len(os.path.join(env["TEMP"], ".ts.sock.65535").encode()) > UNIX_PATH_MAX:
        raise SystemExit(f"pod: error: RUNTIME_DIR={cfg.runtime_dir} is too long: TorchServe's worker sockets "
                         f"(RUNTIME_DIR/tmp/.ts.sock.PORT) must fit a Unix socket path ({UNIX_PATH_MAX} bytes); "
                         "set a shorter RUNTIME_DIR (default /tmp/torchserve)")
    shutil.rmtree(os.path.join(env["TEMP"], "models"), ignore_errors=True)
    for stale in (cfg.stopping_file, os.path.join(cfg.runtime_dir, pod_config.KEY_FILE)):
        if os.path.exists(stale):  # an earlier start's (RUNTIME_DIR may outlive the container)
            os.remove(stale)
    # the marks of abandoned generations (pod/aborts.py writes them, pod-private): TorchServe's
    # workers inherit the frontend's environment (its EnvironmentUtils.getEnvString copies
    # System.getenv()), and read the directory's name from it (handlers/generation/abandon.py)
    os.makedirs(cfg.abort_dir, mode=0o700, exist_ok=True)
    env[abandon.ENV] = cfg.abort_dir
    if torchserve(["--start", "--ncs", f"--model-store={cfg.model_store}", f"--ts-config={conf}"], env, cfg):
        raise SystemExit("pod: error: torchserve --start failed; its logs are in RUNTIME_DIR/logs")
    procs = children(cfg, conf, env)
    for c in procs:
        c.start()
    stopping = []

    def stop(*_):  # the stopping file at once: pod.status's next poll (each second) reads it
        if not stopping:
            mark_stopping(cfg)
        stopping.append(True)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    ok = True
    while not stopping and ok:
        time.sleep(1.0)
        ok = all(c.check() for c in procs)
    if ok:
        ok = drain(cfg, procs)
    # in order: the fronts finish what they hold (nginx: SIGQUIT is its graceful stop), then
    # TorchServe stops its workers
    for c in procs:
        c.stop(signal.SIGQUIT if c.name == "nginx" else signal.SIGTERM)
    for c in procs:
        try:
            c.proc.wait(timeout=25)
        except subprocess.TimeoutExpired:
            c.proc.kill()
    torchserve(["--stop"], env, cfg)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
