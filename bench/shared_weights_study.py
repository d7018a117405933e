"""One copy of the weights per GPU, shared by the workers: the experiment (issue 39, item 2).

  python -m bench.shared_weights_study --out OUT/shared_weights_h100
  python -m bench.shared_weights_study --device cpu --small --out /tmp/sw_cpu   (shakes out bugs)

Builds a stack of Linear layers (16 x 8192x8192 fp16 = 2 GiB of weights by default; batch
dimension dynamic 1..16), compiles it once with AOTInductor into two packages (weights in the
.so, the normal one; and `aot_inductor.package_constants_in_so=False`, code only), then measures
in fresh processes, each step under its own time limit and the whole study under --budget-s:

  one_unshared   one worker loading the normal package: its GPU memory, reference answers
  six_unshared   --workers such workers at once: memory, answers, throughput
  shared_nc      a holder process with the weights on the GPU, exported by CUDA IPC (torch's
                 multiprocessing reductions over a unix socket); workers load the code-only
                 package and take the holder's tensors as user-managed constants
                 (`load_constants(..., user_managed=True)`): memory, the peak of each load,
                 answers, throughput; then kill -9 of a worker, of the holder, a new worker with
                 no holder, a restarted holder and a worker attaching to it
  shared_swap    the normal package through `AOTIModelContainerRunnerCuda`: the holder's tensors
                 go into the inactive constant buffer (user-managed), swap, free the inactive
                 one (the package's own copy): its load peak and what is left after
  shared_keep    one worker: the normal package through the loader, `load_constants` into the
                 active buffer; the package's own copy is not freed by that API (measured)

GPU memory is nvidia-smi's device total (`memory.used`, sampled every ~0.2 s for peaks) and
per process (`--query-compute-apps`), and each worker's `torch.cuda.mem_get_info` before and
after its steps. The parent never touches CUDA, so its own context is not in the figures.
Writes OUT.json (first keys: results_meta.header) after every step, and OUT.md at the end.
On CPU (`--device cpu`) the same flow runs with torch's `file_system` sharing of CPU tensors in
place of CUDA IPC and no memory figures: it tests the orchestration, not the GPU facts.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # children run `-m` from here
KEY_ENV = "SHARED_WEIGHTS_KEY"  # the holder's authkey travels in the environment, not argv
CHECK_BATCHES = (1, 7, 16)  # the batch sizes each worker's answers are hashed at
BENCH_BATCH = 16


# ---------------------------------------------------------------- the model and its packages

def build_model(layers: int, width: int, device: str, dtype):
    """examples/models.py's BigMLP (Linear layers with ReLU between, scaled so fp16 answers are not
    all zeros, which would make the equality checks empty), seeded, on `device` in `dtype`."""
    import torch

    from examples.models import BigMLP

    torch.manual_seed(0)
    with torch.device(device):
        return BigMLP(layers, width).to(dtype).eval()


PACKAGES = {"normal": {}, "code_only": {"aot_inductor.package_constants_in_so": False}}


def role_compile(args) -> None:
    """Child: export, write the package `--package` names (normal or code_only) and, for the
    normal one, the weights file; prints one JSON line. The two run at once, each exporting the
    same seeded model."""
    proto = protocol_stdout()
    import torch

    dtype = torch.float16 if args.device == "cuda" else torch.float32
    out = {"dtype": str(dtype)}
    t = time.perf_counter()
    model = build_model(args.layers, args.width, args.device, dtype)
    x = torch.randn(4, args.width, device=args.device, dtype=dtype)
    batch = torch.export.Dim("batch", min=1, max=16)
    with torch.no_grad():
        ep = torch.export.export(model, (x,), dynamic_shapes=({0: batch},))
    out["export_s"] = round(time.perf_counter() - t, 2)
    if args.package == "normal":
        weights = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
        torch.save(weights, os.path.join(args.work, "weights.pt"))
        out["weights_bytes"] = sum(v.numel() * v.element_size() for v in weights.values())
        out["api"] = api_facts()
    del model
    t = time.perf_counter()
    path = os.path.join(args.work, f"{args.package}.pt2")
    torch._inductor.aoti_compile_and_package(ep, package_path=path, inductor_configs=PACKAGES[args.package])
    out["compile_s"] = round(time.perf_counter() - t, 2)
    out["package_bytes"] = os.path.getsize(path)
    say(proto, out)


def api_facts() -> dict:
    """What this torch offers for user-managed constants (the study runs on another torch than
    the one it was written on)."""
    import inspect

    import torch
    from torch._inductor.package.package import AOTICompiledModel

    runner = getattr(torch._C._aoti, "AOTIModelContainerRunnerCuda", torch._C._aoti.AOTIModelContainerRunnerCpu)
    return {"AOTICompiledModel.load_constants": str(inspect.signature(AOTICompiledModel.load_constants)),
            "runner": [m for m in ("update_constant_buffer", "swap_constant_buffer",
                                   "free_inactive_constant_buffer", "get_constant_names_to_original_fqns")
                       if hasattr(runner, m)],
            "runner.update_constant_buffer": (getattr(runner.update_constant_buffer, "__doc__", "") or "")[:400]}


def protocol_stdout():
    """The process's stdout for its JSON lines alone: fd 1 then points at stderr, so whatever
    else the libraries print cannot break a reply."""
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    return proto


def say(proto, obj) -> None:
    proto.write(json.dumps(obj) + "\n")
    proto.flush()


def fixed_inputs(width: int, device: str, dtype, sizes=CHECK_BATCHES):
    import torch

    g = torch.Generator().manual_seed(1)
    return [torch.randn(n, width, generator=g).to(device=device, dtype=dtype) for n in sizes]


def answer_hash(tensor) -> str:
    """SHA-256 of the answer's bytes: equal hashes = torch.equal answers (no NaN here)."""
    return hashlib.sha256(tensor.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


# ---------------------------------------------------------------- the holder

def role_holder(args) -> None:
    """Child: the weights on the device in one allocation (one IPC handle), then serve them to
    every connection on the unix socket until killed. Prints one JSON line when ready."""
    proto = protocol_stdout()
    from multiprocessing.connection import Listener

    import torch
    import torch.multiprocessing  # registers torch's tensor reductions with ForkingPickler

    if args.device == "cpu":
        # CPU tensors go by named shared memory files, which unrelated processes can open
        torch.multiprocessing.set_sharing_strategy("file_system")
    t = time.perf_counter()
    source = torch.load(os.path.join(args.work, "weights.pt"), mmap=True)
    dtype = next(iter(source.values())).dtype
    flat = torch.empty(sum(v.numel() for v in source.values()), dtype=dtype, device=args.device)
    weights, at = {}, 0
    for name, value in source.items():
        view = flat[at:at + value.numel()].view(value.shape)
        view.copy_(value)
        weights[name], at = view, at + value.numel()
    if args.device == "cuda":
        torch.cuda.synchronize()
    threading.Thread(target=lambda: (sys.stdin.read(), os._exit(0)), daemon=True).start()  # the parent's end
    if os.path.exists(args.socket):
        os.unlink(args.socket)  # a killed holder's socket file; one holder per socket is the parent's job
    with Listener(args.socket, family="AF_UNIX", authkey=os.environ[KEY_ENV].encode()) as listener:
        say(proto, {"ready": os.getpid(), "load_s": round(time.perf_counter() - t, 2),
                    "bytes": flat.numel() * flat.element_size()})
        while True:
            try:
                with listener.accept() as conn:
                    conn.send(weights)
            except Exception as e:  # noqa: BLE001  any client's failure (gone mid-handshake, wrong key): keep serving
                print(f"holder: {e!r}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the worker

class WorkerModel:
    """A worker's model in one of the load modes; `self.keep` holds what the model reads from
    (user-managed constants must outlive it)."""

    def __init__(self, args):
        self.args = args
        self.keep = None
        self.call = None

    def shared_weights(self):
        from multiprocessing.connection import Client

        import torch
        import torch.multiprocessing  # the receiving side of torch's tensor reductions

        if self.args.device == "cpu":
            torch.multiprocessing.set_sharing_strategy("file_system")
        try:
            conn = Client(self.args.socket, family="AF_UNIX", authkey=os.environ[KEY_ENV].encode())
        except OSError as e:
            raise RuntimeError(f"no weights holder at {self.args.socket}: {e!r}") from None
        with conn:
            return conn.recv()

    def load(self, mem) -> dict:
        import torch

        mode, info = self.args.mode, {}
        if mode == "own":
            model = torch._inductor.aoti_load_package(self.args.package)
            mem("loaded")
        elif mode in ("shared_nc", "shared_keep"):
            model = torch._inductor.aoti_load_package(self.args.package)
            mem("package_loaded")
            self.keep = self.shared_weights()
            mem("attached")
            # the caller keeps self.keep alive: the model stores these tensors' pointers
            model.load_constants(self.keep, check_full_update=True, user_managed=True)
            mem("loaded")
        elif mode == "shared_swap":
            return self.load_swap(mem)
        else:
            raise ValueError(f"unknown mode {mode}")
        self.call = lambda x: model(x)
        return info

    def load_swap(self, mem) -> dict:
        """The normal package through the container runner, which (unlike the package loader)
        exposes swap_constant_buffer and free_inactive_constant_buffer."""
        import torch

        unpacked = tempfile.mkdtemp(prefix="sw_pkg_")  # under TMPDIR, the study's work directory
        with zipfile.ZipFile(self.args.package) as z:
            z.extractall(unpacked)
        found = sorted((not f.endswith(".wrapper.so"), os.path.join(d, f))  # the model's .so first
                       for d, _, fs in os.walk(unpacked) for f in fs if f.endswith(".so"))
        so = found[0][1]
        if self.args.device == "cuda":
            runner = torch._C._aoti.AOTIModelContainerRunnerCuda(so, 1, "cuda", os.path.dirname(so))
        else:
            runner = torch._C._aoti.AOTIModelContainerRunnerCpu(so, 1)
        # the .so (2 GiB with its weights) is mapped now and may go; the rest of the directory
        # stays: the generated CUDA wrapper loads each kernel file on first use (loadKernel when
        # its handle is still nullptr, codegen/cpp_wrapper_gpu.py)
        os.remove(so)
        mem("package_loaded")
        shared = self.shared_weights()
        mem("attached")
        names = runner.get_constant_names_to_original_fqns()  # internal name -> state_dict key
        self.keep = {inner: shared[fqn] for inner, fqn in names.items()}
        runner.update_constant_buffer(self.keep, True, True, True)  # inactive, validate, user_managed
        runner.swap_constant_buffer()
        runner.free_inactive_constant_buffer()  # the package's own copy
        mem("loaded")
        self.call = lambda x: runner.run([x])[0]
        return {"constants": len(names)}


def role_worker(args) -> None:
    """Child: JSON commands on stdin, one JSON reply each on the original stdout (anything else
    the process prints goes to stderr)."""
    proto = protocol_stdout()
    import torch

    cuda = args.device == "cuda"
    dtype = torch.float16 if cuda else torch.float32
    if cuda:
        torch.cuda.init()
        torch.empty(1, device="cuda")  # the context exists before any figure is taken
    model = WorkerModel(args)
    stages = {}

    def mem(stage):
        if cuda:
            torch.cuda.synchronize()
            stages[stage] = torch.cuda.mem_get_info()[0] // 2**20  # device-wide free MiB
    mem("ready")
    say(proto, {"ready": os.getpid(), "free_mib": stages.get("ready")})
    for line in iter(sys.stdin.readline, ""):  # until the parent closes stdin
        cmd = json.loads(line)
        say(proto, {**worker_command(cmd, model, mem, stages, dtype), "id": cmd.get("id")})


def worker_command(cmd, model, mem, stages, dtype) -> dict:
    import torch

    try:
        if cmd["cmd"] == "load":
            stages.clear()
            mem("before")
            t = time.perf_counter()
            info = model.load(mem)
            used = {k: stages["before"] - v for k, v in stages.items()} if stages else None
            return {"load_s": round(time.perf_counter() - t, 2), "used_mib_since_before": used,
                    "free_mib": dict(stages), **info}
        if model.call is None:
            return {"error": "not loaded"}
        if cmd["cmd"] == "check":
            with torch.no_grad():
                return {"hashes": [answer_hash(model.call(x)) for x in
                                   fixed_inputs(model.args.width, model.args.device, dtype)]}
        if cmd["cmd"] == "bench":
            return bench(model, cmd["seconds"], dtype)
        if cmd["cmd"] == "mem":
            stages.clear()
            mem("now")
            return {"free_mib": stages.get("now")}
        return {"error": f"unknown command {cmd!r}"}
    except Exception as e:  # noqa: BLE001  whatever the model raises is this command's reply
        return {"error": repr(e)[:500]}


def bench(model, seconds, dtype) -> dict:
    import torch

    (x,) = fixed_inputs(model.args.width, model.args.device, dtype, (BENCH_BATCH,))
    sync = torch.cuda.synchronize if model.args.device == "cuda" else (lambda: None)
    with torch.no_grad():
        model.call(x)
        sync()
        calls, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            model.call(x)
            calls += 1
        sync()
    elapsed = time.perf_counter() - t0
    return {"calls": calls, "seconds": round(elapsed, 3), "calls_per_s": round(calls / elapsed, 1)}


# ---------------------------------------------------------------- the parent's tools

class Child:
    """A fresh `python -m bench.shared_weights_study --role ...` process; replies are JSON
    lines on its stdout, its stderr goes to a log file in the work directory."""

    def __init__(self, args, role, name, extra=()):
        cmd = [sys.executable, "-m", "bench.shared_weights_study", "--role", role,
               "--work", args.work, "--device", args.device, "--layers", str(args.layers),
               "--width", str(args.width), "--socket", args.socket, *extra]
        self.name = name
        self.log = os.path.join(args.work, f"{name}.log")
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log, env=args.child_env, cwd=ROOT)
        self.buf = b""
        self.sent = 0  # commands carry a number, replies echo it: a late reply is never taken for the next
        args.children.append(self)  # stopped by stop_all after the step

    @property
    def pid(self):
        return self.proc.pid

    def read(self, timeout):
        """The reply to the last command sent (the first line before any), or raises
        TimeoutError / EOFError (the process ended)."""
        deadline = time.monotonic() + timeout
        while True:
            reply = self._line(deadline, timeout)
            if reply.get("id", self.sent) == self.sent:
                return reply

    def _line(self, deadline, timeout):
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.name}: no reply in {timeout} s")
            if select.select([fd], [], [], left)[0]:
                chunk = os.read(fd, 65536)
                if not chunk:
                    time.sleep(0.5)  # its exit status, where it has one by then
                    raise EOFError(f"{self.name} ended, rc={self.proc.poll()}; log tail: {self.tail()}")
                self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def send(self, cmd):
        self.sent += 1
        self.proc.stdin.write((json.dumps({**cmd, "id": self.sent}) + "\n").encode())
        self.proc.stdin.flush()

    def ask(self, cmd, timeout):
        """A command's reply, or {"error": ...} when the process is gone or silent."""
        try:
            self.send(cmd)
            return self.read(timeout)
        except (OSError, TimeoutError, EOFError, ValueError) as e:
            return {"error": repr(e)[:800], "alive": self.proc.poll() is None}

    def tail(self, n=600):
        with open(self.log, "rb") as f:
            return f.read()[-n:].decode(errors="replace")

    def kill9(self):
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


def stop_all(children, grace=10.0) -> None:
    """Every child's stdin closed at once (workers and holders exit on its end), then a shared
    grace period, then kill -9 for whatever is left."""
    for c in children:
        try:
            c.proc.stdin.close()
        except OSError:
            pass
    deadline = time.monotonic() + grace
    for c in children:
        try:
            c.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.kill9()
    children.clear()


class GpuMeter:
    """nvidia-smi's device memory.used (MiB), sampled in a thread for peaks; None on CPU."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.samples = []
        self.error = None
        self._stop = threading.Event()
        if enabled:
            threading.Thread(target=self._sample, daemon=True).start()

    def used(self):
        """MiB in use on GPU 0, or None (the failure kept in self.error; the study goes on)."""
        if not self.enabled:
            return None
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                  "-i", "0"], check=False, capture_output=True, text=True, timeout=20).stdout
            return int(out.split()[0])
        except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
            self.error = repr(e)
            return None

    def _sample(self):
        while not self._stop.is_set():
            used = self.used()
            if used is not None:
                self.samples.append((time.monotonic(), used))
            time.sleep(0.2)

    def peak_since(self, t0):
        values = [u for t, u in self.samples if t >= t0]
        return max(values) if values else None

    def apps(self):
        """{pid: used MiB} per compute process (pids as nvidia-smi sees them)."""
        if not self.enabled:
            return None
        try:
            out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                                  "--format=csv,noheader,nounits"], check=False, capture_output=True, text=True,
                                 timeout=20).stdout
        except (OSError, subprocess.SubprocessError) as e:
            self.error = repr(e)
            return None
        rows = [line.split(",") for line in out.strip().splitlines() if "," in line]
        return {int(p): int(m) for p, m in rows if m.strip().isdigit()}

    def close(self):
        self._stop.set()


def start_workers(args, mode, package, n, prefix):
    workers = [Child(args, "worker", f"{prefix}{i}", ("--mode", mode, "--package", package))
               for i in range(n)]
    ready = [w.read(args.step_timeout) for w in workers]
    return workers, ready


def ask_all(workers, cmd, timeout):
    """The command to every worker at once, then every reply (a worker's failure is its reply)."""
    for w in workers:
        try:
            w.send(cmd)
        except OSError:
            pass
    out = []
    for w in workers:
        try:
            out.append(w.read(timeout))
        except (TimeoutError, EOFError, ValueError) as e:
            out.append({"error": repr(e)[:800], "alive": w.proc.poll() is None})
    return out


def same_answers(replies, reference):
    return [r.get("hashes") == reference if "hashes" in r else r.get("error") for r in replies]


def throughput(replies):
    ok = [r for r in replies if "calls_per_s" in r]
    return {"total_calls_per_s": round(sum(r["calls_per_s"] for r in ok), 1),
            "per_worker": [r.get("calls_per_s", r.get("error")) for r in replies]}


def pid_memory(meter, children):
    apps = meter.apps()
    if apps is None:
        return None
    return {"by_child": {c.name: apps.get(c.pid) for c in children}, "all": apps}


def diff(a, b):
    return None if a is None or b is None else a - b


# ---------------------------------------------------------------- the steps

class Study:
    """What the steps share: arguments, the meter, the deadline, the reference answers."""

    def __init__(self, args, meter):
        self.args, self.meter = args, meter
        self.deadline = time.monotonic() + args.budget_s
        self.reference = None
        self.normal = os.path.join(args.work, "normal.pt2")
        self.code_only = os.path.join(args.work, "code_only.pt2")

    def t(self, seconds):
        """A wait of `seconds`, cut to what is left of the study's budget (at least 5 s)."""
        return max(5.0, min(seconds, self.deadline - time.monotonic()))

    def answers(self, workers, timeout=60):
        return same_answers(ask_all(workers, {"cmd": "check"}, self.t(timeout)), self.reference)

    def load_one_by_one(self, workers, base):
        """Each worker's load alone, so its device figures are its own: nvidia-smi before,
        after and the sampled peak, with the worker's mem_get_info at each stage."""
        loads = []
        for w in workers:
            before, t0 = self.meter.used(), time.monotonic()
            r = w.ask({"cmd": "load"}, self.t(self.args.step_timeout))
            r["device_mib"] = {"before": diff(before, base), "after": diff(self.meter.used(), base),
                               "sampled_peak": diff(self.meter.peak_since(t0), base)}
            loads.append(r)
        return loads

    def holder(self, name):
        h = Child(self.args, "holder", name)
        return h, h.read(self.t(self.args.step_timeout))


def step_compile(s):
    children = {name: Child(s.args, "compile", f"compile_{name}", ("--package", name)) for name in PACKAGES}
    out = {}
    for name, c in children.items():
        try:
            out[name] = c.read(s.t(s.args.compile_timeout))
        except (TimeoutError, EOFError, ValueError) as e:
            out[name] = {"error": repr(e)[:1500]}
    if "error" in out["normal"]:
        out["error"] = "the normal package was not built: nothing else can run"
    return out


def step_unshared(s, n, prefix):
    base = s.meter.used()
    workers, _ = start_workers(s.args, "own", s.normal, n, prefix)
    ctx, t0 = s.meter.used(), time.monotonic()
    loads = ask_all(workers, {"cmd": "load"}, s.t(s.args.step_timeout))
    loaded, peak = s.meter.used(), s.meter.peak_since(t0)
    checks = ask_all(workers, {"cmd": "check"}, s.t(60))
    if s.reference is None and "hashes" in checks[0]:
        s.reference = checks[0]["hashes"]
    bench_r = ask_all(workers, {"cmd": "bench", "seconds": s.args.bench_s}, s.t(s.args.bench_s + 60))
    return {"workers": n, "baseline_mib": base, "contexts_mib": diff(ctx, base),
            "after_load_mib": diff(loaded, base), "sampled_peak_load_mib": diff(peak, base),
            "after_bench_mib": diff(s.meter.used(), base), "per_process_mib": pid_memory(s.meter, workers),
            "loads": loads, "answers_equal_reference": same_answers(checks, s.reference),
            "hashes": checks[0].get("hashes"), "bench": throughput(bench_r)}


def step_shared(s, mode, package, n, prefix, faults=False, bench_it=True):
    base = s.meter.used()
    holder, holder_ready = s.holder(f"{prefix}holder")
    after_holder = s.meter.used()
    workers, _ = start_workers(s.args, mode, package, n, prefix)
    ctx = s.meter.used()
    out = {"workers": n, "mode": mode, "baseline_mib": base, "holder": holder_ready,
           "holder_mib": diff(after_holder, base), "holder_and_contexts_mib": diff(ctx, base),
           "loads": s.load_one_by_one(workers, base)}
    out["after_load_mib"] = diff(s.meter.used(), base)
    out["answers_equal_reference"] = s.answers(workers)
    if bench_it:
        r = ask_all(workers, {"cmd": "bench", "seconds": s.args.bench_s}, s.t(s.args.bench_s + 60))
        out["bench"] = throughput(r)
        out["after_bench_mib"] = diff(s.meter.used(), base)
    out["per_process_mib"] = pid_memory(s.meter, [holder, *workers])
    if faults:
        out["faults"] = shared_faults(s, holder, workers, mode, package, base)
    return out


def shared_faults(s, holder, workers, mode, package, base):
    """kill -9 of a worker, then of the holder; a new worker with no holder; a restarted
    holder and a worker attaching to it. Each outcome as the workers report it."""
    out = {}
    workers[0].kill9()
    rest = workers[1:]
    out["kill9_worker"] = {"others_answers_equal": s.answers(rest, 20)}
    holder.kill9()
    time.sleep(1.0)
    out["kill9_holder"] = {
        "others_answers_equal": s.answers(rest, 20),
        "others_alive": [w.proc.poll() is None for w in rest],
        "device_mib_after": diff(s.meter.used(), base),
        "others_bench_1s": throughput(ask_all(rest, {"cmd": "bench", "seconds": 1}, s.t(20))),
        "others_answers_equal_after_bench": s.answers(rest, 20)}
    orphans, _ = start_workers(s.args, mode, package, 1, "nohold")
    out["new_worker_without_holder"] = {"load": orphans[0].ask({"cmd": "load"}, s.t(30)),
                                        "check": orphans[0].ask({"cmd": "check"}, s.t(20))}
    _, ready2 = s.holder("holder2")
    fresh, _ = start_workers(s.args, mode, package, 1, "fresh")
    out["restarted_holder"] = {
        "holder": ready2, "new_worker_load": fresh[0].ask({"cmd": "load"}, s.t(s.args.step_timeout)),
        "new_worker_answers_equal": s.answers(fresh, 20), "old_workers_answers_equal": s.answers(rest, 20),
        "device_mib_after": diff(s.meter.used(), base)}
    return out


STEPS = (  # name, the least seconds of budget it needs to start, what it runs; the key one early
    ("compile", 0, step_compile),
    ("one_unshared", 20, lambda s: step_unshared(s, 1, "one")),  # the reference answers
    ("shared_nc", 60, lambda s: step_shared(s, "shared_nc", s.code_only, s.args.workers, "nc", faults=True)),
    ("six_unshared", 30, lambda s: step_unshared(s, s.args.workers, "own")),
    ("shared_swap", 40, lambda s: step_shared(s, "shared_swap", s.normal, s.args.workers, "swap")),
    ("shared_keep", 15, lambda s: step_shared(s, "shared_keep", s.normal, 1, "keep", bench_it=False)),
)


def summary(steps: dict) -> dict:
    """The issue's criteria from the steps' figures (None where a figure is missing)."""
    one, six, nc = (steps.get(k) or {} for k in ("one_unshared", "six_unshared", "shared_nc"))
    w1, u6, s6 = one.get("after_load_mib"), six.get("after_load_mib"), nc.get("after_load_mib")
    ctx = one.get("contexts_mib")
    n = nc.get("workers") or 0
    ratio = lambda a, b: round(a / b, 3) if a is not None and b else None
    net = lambda total, procs: None if total is None or ctx is None else total - procs * ctx
    answers = [a for k in ("six_unshared", "shared_nc", "shared_swap", "shared_keep")
               for a in (steps.get(k) or {}).get("answers_equal_reference", [False])]
    tu = (six.get("bench") or {}).get("total_calls_per_s")
    ts = (nc.get("bench") or {}).get("total_calls_per_s")
    return {"one_worker_mib": w1, "six_unshared_mib": u6, "six_shared_with_holder_mib": s6,
            "context_mib_per_process": ctx,
            "ratio_six_shared_to_one": ratio(s6, w1),
            "ratio_six_shared_to_one_beyond_contexts": ratio(net(s6, n + 1), net(w1, 1)),
            "ratio_six_unshared_to_one": ratio(u6, w1),
            "answers_all_identical": bool(answers) and all(a is True for a in answers),
            "throughput_shared_over_unshared": ratio(ts, tu)}


def write_md(report: dict, path: str) -> None:
    from bench.results_meta import page_head

    lines = page_head(report, "Shared weights: one copy per GPU (issue 39, item 2)",
                      "MiB are nvidia-smi's device memory.used minus the step's baseline.")
    lines += [("| step | workers | holder | after load MiB | sampled load peak MiB | after bench MiB |"
               " calls/s (all) | answers = unshared | time s | error |"), "|---" * 10 + "|"]
    for name, r in report["steps"].items():
        bench_r = (r.get("bench") or {}).get("total_calls_per_s")
        peak = r.get("sampled_peak_load_mib", max((l.get("device_mib", {}).get("sampled_peak") or 0
                                                   for l in r.get("loads", [])), default=None))
        lines.append(f"| {name} | {r.get('workers', '')} | {r.get('holder_mib', '')} | "
                     f"{r.get('after_load_mib', '')} | {peak} | {r.get('after_bench_mib', '')} | "
                     f"{bench_r} | {r.get('answers_equal_reference', '')} | {r.get('step_s')} | "
                     f"{str(r.get('error', ''))[:120]} |")
    lines += ["", "## Summary", "", "```json", json.dumps(report.get("summary"), indent=1), "```"]
    lines += load_stage_rows(report["steps"])
    faults = (report["steps"].get("shared_nc") or {}).get("faults")
    lines += ["", "## kill -9 (shared_nc)", "", "```json", json.dumps(faults, indent=1), "```", ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def load_stage_rows(steps: dict) -> list:
    """Each shared worker's load, by its own mem_get_info: the device MiB taken since its load
    began, after the package loaded (the peak for a normal package), after attaching to the
    holder, and at the end (after the free, for shared_swap)."""
    rows = ["", "## Each shared worker's load (device MiB taken since the load began)", "",
            "| step | worker | package loaded | attached | loaded | load s | error |", "|---|---|---|---|---|---|---|"]
    for name in ("shared_nc", "shared_swap", "shared_keep"):
        for i, load in enumerate((steps.get(name) or {}).get("loads", [])):
            used = load.get("used_mib_since_before") or {}
            rows.append(f"| {name} | {i} | {used.get('package_loaded')} | {used.get('attached')} | "
                        f"{used.get('loaded')} | {load.get('load_s')} | {str(load.get('error', ''))[:120]} |")
    return rows


def device_name(device: str) -> str:
    if device == "cpu":
        return "cpu"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
                             check=False, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        out = f"cuda (nvidia-smi failed: {e!r})"
    return out or "cuda (nvidia-smi gave no name)"


def run_study(args) -> dict:
    import traceback

    from bench.results_meta import header

    report = {**header(device_name(args.device)),
              "config": {k: getattr(args, k) for k in ("layers", "width", "workers", "bench_s", "budget_s", "small")},
              "steps": {}}
    meter = GpuMeter(args.device == "cuda")
    report["device_mib_at_start"] = meter.used()
    study = Study(args, meter)
    try:
        for name, needs, run in STEPS:
            if study.deadline - time.monotonic() < needs:
                report["steps"][name] = {"error": f"skipped: less than {needs} s of --budget-s left"}
                continue
            t0 = time.monotonic()
            try:
                report["steps"][name] = run(study)
            except SystemExit:
                report["steps"][name] = {"error": "stopped by SIGTERM during this step"}
                raise
            except Exception:  # noqa: BLE001  a failed step is a result; the next one runs
                report["steps"][name] = {"error": traceback.format_exc()[-1500:]}
            stop_all(args.children)
            report["steps"][name]["step_s"] = round(time.monotonic() - t0, 1)
            report["steps"][name]["device_mib_after_stop"] = meter.used()  # all of this step's processes gone
            if name == "compile" and "error" in report["steps"][name]:
                break  # nothing else can run without the packages
            write_json(report, args.out + ".json")
    finally:  # also on SIGTERM (main turns it into SystemExit): what was measured is written
        stop_all(args.children)
        meter.close()
        report["summary"] = summary(report["steps"])
        report["nvidia_smi_error"] = meter.error
        write_json(report, args.out + ".json")
        write_md(report, args.out + ".md")
    return report


def write_json(report, path):
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(path + ".tmp", path)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="shared_weights", help="writes OUT.json and OUT.md")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--small", action="store_true", help="a tiny model (4 x 256x256)")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--width", type=int, default=8192)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--bench-s", type=float, default=5.0)
    p.add_argument("--budget-s", type=float, default=300.0, help="steps not started after this")
    p.add_argument("--step-timeout", type=float, default=120.0)
    p.add_argument("--compile-timeout", type=float, default=240.0)
    # internal: the children
    p.add_argument("--role", choices=("study", "compile", "holder", "worker"), default="study")
    p.add_argument("--work")
    p.add_argument("--socket")
    p.add_argument("--mode")
    p.add_argument("--package")
    args = p.parse_args(argv)
    if args.small and args.role == "study":
        args.layers, args.width = 4, 256
    return args


def on_sigterm(*_):
    """The first SIGTERM ends the study through its finally blocks (results written); later ones
    are ignored: `timeout` signals its child and then the whole group, the child twice."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(143)


def main(argv=None) -> None:
    args = parse(argv)
    if args.role != "study":
        {"compile": role_compile, "holder": role_holder, "worker": role_worker}[args.role](args)
        return
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    args.work = tempfile.mkdtemp(prefix="shared_weights_")
    args.socket = os.path.join(args.work, "holder.sock")
    signal.signal(signal.SIGTERM, on_sigterm)
    args.children = []
    # TMPDIR: the package loader's and the workers' extractions land in the work directory,
    # which is removed at the end
    args.child_env = {**os.environ, KEY_ENV: secrets.token_hex(16), "TMPDIR": args.work}
    try:
        report = run_study(args)
        print(json.dumps(report["summary"], indent=1))
    finally:
        logs = args.out + "_logs"
        os.makedirs(logs, exist_ok=True)
        for f in os.listdir(args.work):
            if f.endswith(".log"):
                shutil.copy(os.path.join(args.work, f), logs)
        shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
