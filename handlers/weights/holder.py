"""The weights holder: one process per (artifact, device, TorchServe frontend), started by the
first worker that needs it (attach.py), that keeps the artifact's read-only weights on the device
and hands them to every worker that connects.

    python -m handlers.weights.holder VARIANT_DIR DEVICE_KIND DEVICE_INDEX SOCKET FRONTEND_PID

The authkey comes in the environment (KEY_ENV), never on the command line. Facts it relies on:
- torch's multiprocessing reductions (registered with multiprocessing's ForkingPickler when
  `torch.multiprocessing` is imported) send a CUDA tensor as the IPC handle of its allocation
  plus an offset, so every view of one allocation travels as the same handle and no bytes are
  copied; on the CPU they send named shared memory with the `file_system` strategy, which an
  unrelated process can open (the default passes file descriptors, which needs a parent);
- torch requires the sender to keep the tensors alive while receivers use them: the holder
  never frees them, and a worker that sees the holder's connection close stops serving
  (attach.py), so no worker reads memory whose owner is gone.

Lifetime: one connection per worker stays open for the worker's life. The holder exits when its
frontend is gone (`torchserve --stop` ends the frontend, whose pid the worker passes: TorchServe's
frontend starts every worker, so it is the worker's parent), or when no worker has been
connected for IDLE_EXIT_S (a model scaled to zero or unregistered). A worker killed and restarted
by TorchServe reconnects well within that.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time

from handlers import process

KEY_ENV = "CS_WEIGHTS_KEY"
IDLE_EXIT_S = 15.0  # longer than TorchServe's restart of a killed worker (about a second) plus its start
POLL_S = 0.5
# each tensor starts a multiple of 256 bytes into its allocation (CUDA's caching allocator hands
# out blocks aligned to 512 bytes), as aligned as the library's own constants, which its kernels'
# vectorised loads may assume
ALIGN_BYTES = 256
LIBRARY = "library"  # the subdirectory of the holder's TMPDIR with what shared_library unpacked
PID_FILE = "holder.pid"  # in the holder's TMPDIR, written by the worker that started it (attach.py)


def span(t) -> int:
    """Elements from a tensor's first to its last, by its strides (its size in memory)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


def pack(tensors: dict, device) -> dict:
    """Copies of `tensors` on `device` with their shapes and strides, as views of one allocation
    per dtype (one IPC handle each)."""
    import torch

    by_dtype: dict = {}
    for name, t in tensors.items():
        by_dtype.setdefault(t.dtype, []).append(name)
    out = {}
    for dtype, names in by_dtype.items():
        step = max(1, ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())
        offsets, total = {}, 0
        for name in names:
            offsets[name] = total
            total += -(-span(tensors[name]) // step) * step
        flat = torch.empty(max(total, 1), dtype=dtype, device=device)
        with torch.no_grad():  # a parameter's copy would otherwise track grad, which no pickle crosses
            for name in names:
                t = tensors[name]
                view = flat.as_strided(t.shape, t.stride(), offsets[name])
                view.copy_(t)
                out[name] = view
    return out


class Clients:
    """How many workers are connected, and since when none is."""

    def __init__(self):
        self._n, self._lock, self._idle_since = 0, threading.Lock(), time.monotonic()

    def add(self, d: int) -> None:
        with self._lock:
            self._n += d
            if self._n == 0:
                self._idle_since = time.monotonic()

    def idle_s(self) -> float:
        with self._lock:
            return 0.0 if self._n else time.monotonic() - self._idle_since


def serve_one(conn, sent: dict, clients: Clients) -> None:
    """Sends the weights and the reference answer, then waits for the worker's end of the
    connection to close."""
    clients.add(1)
    try:
        conn.send(sent)
        while True:
            conn.recv_bytes()  # workers send nothing; this returns only by EOFError or OSError
    except (EOFError, OSError):
        pass
    finally:
        conn.close()
        clients.add(-1)


def accept_forever(listener, sent: dict, clients: Clients) -> None:
    from multiprocessing import AuthenticationError

    while True:
        try:
            conn = listener.accept()
        except (AuthenticationError, OSError, EOFError) as e:  # a client with the wrong key, or gone mid-handshake
            print(f"weights holder: refused a connection: {e!r}", file=sys.stderr, flush=True)
            continue
        threading.Thread(target=serve_one, args=(conn, sent, clients), daemon=True).start()


def check_request(spec) -> dict:
    """The artifact's example request (host tensors) at its smallest batch with its float inputs
    drawn (seeded) instead of zeros, so an answer depends on every weight: what each worker's held
    load is checked on (attach.verify)."""
    import torch

    from handlers.artifact.metadata import is_mask

    g = torch.Generator().manual_seed(0)
    out = {}
    for name, t in spec.example(spec.batch_min).items():
        if t.is_floating_point() and not is_mask(name):
            t = torch.randn(t.shape, generator=g).to(t.dtype)
        out[name] = t
    return out


def reference(spec, placement) -> bytes:
    """{"inputs", "outputs"} (host tensors) saved with torch.save: the artifact's answer from its
    own copy, loaded as an unshared worker loads it and freed before the weights are packed.
    Bytes, not tensors: torch's reductions send a host tensor as a file descriptor unless the
    sharing strategy is file_system, and a descriptor needs a process tree the holder and its
    workers do not share."""
    import io

    import torch

    from handlers.artifact.load import load_artifact

    inputs = check_request(spec)
    model = load_artifact(spec, placement)
    with torch.inference_mode():
        outputs = {k: v.cpu() for k, v in model(*(t.to(placement.torch_device) for t in inputs.values())).items()}
    del model
    if placement.kind == "cuda":
        torch.cuda.empty_cache()
    buf = io.BytesIO()
    torch.save({"inputs": inputs, "outputs": outputs}, buf)
    return buf.getvalue()


def load(variant_dir: str, kind: str, index: int) -> tuple:
    """(what every worker is sent: the packed weights, the reference answer and the library its
    load reads (ArtifactKind.shared_library, or None), the weights' bytes) of the artifact in
    `variant_dir` on the device."""
    import torch
    import torch.multiprocessing

    from handlers.artifact.device import Placement, use_device
    from handlers.artifact.kinds import kind_of, recognise
    from handlers.artifact.metadata import read_spec

    if kind == "cpu":
        torch.multiprocessing.set_sharing_strategy("file_system")
    spec = recognise(read_spec(variant_dir))  # its SHA-256 was checked by the worker that started us
    placement = Placement(kind, index if index >= 0 else None)
    use_device(placement)
    check = reference(spec, placement)
    artifact_kind = kind_of(spec)
    # unpacked once here, read by every worker's load (the holder's TMPDIR is private to this user)
    library = artifact_kind.shared_library(spec, os.path.join(os.environ.get("TMPDIR", "."), LIBRARY))
    weights = artifact_kind.held_weights(spec, placement, lambda source: pack(source, placement.torch_device), library)
    if kind == "cuda":
        torch.cuda.synchronize()
    sent = {"pid": os.getpid(), "weights": weights, "check": check, "library": library}
    return sent, sum(t.numel() * t.element_size() for t in weights.values())


def main(argv=None) -> None:
    from multiprocessing.connection import Listener

    variant_dir, kind, index, path, frontend = (argv or sys.argv[1:])[:5]
    key = os.environ.pop(KEY_ENV).encode()
    frontend = int(frontend)
    # from the first moment, not only once loaded: a load that hangs must not outlive TorchServe
    threading.Thread(target=exit_with, args=(frontend, path), daemon=True).start()
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever the libraries print goes to the log, not into the ready line
    t0 = time.perf_counter()
    try:
        sent, nbytes = load(variant_dir, kind, int(index))
        empty(os.environ.get("TMPDIR", ""), keep=(LIBRARY, PID_FILE))  # what the loads extracted, but these
        if os.path.exists(path):
            os.unlink(path)  # a holder of this frontend that died: its socket file stays behind
        listener = Listener(path, family="AF_UNIX", authkey=key)
    except Exception as e:  # noqa: BLE001  (the worker that started us reports it and loads its own copy)
        reply.write(json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")
        reply.close()
        sys.exit(1)
    clients = Clients()
    threading.Thread(target=accept_forever, args=(listener, sent, clients), daemon=True).start()
    reply.write(json.dumps({"pid": os.getpid(), "tensors": len(sent["weights"]), "bytes": nbytes,
                            "load_s": round(time.perf_counter() - t0, 2)}) + "\n")
    reply.close()
    while clients.idle_s() <= IDLE_EXIT_S:
        time.sleep(POLL_S)
    leave(f"no worker connected for {IDLE_EXIT_S:.0f}s", path)


def empty(directory: str, keep: tuple = ()) -> None:
    """Removes what `directory` holds but the names in `keep`, keeping the directory (its own
    TMPDIR: attach.py)."""
    for name in os.listdir(directory) if os.path.isdir(directory) else ():
        if name in keep:
            continue
        p = os.path.join(directory, name)
        shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) and not os.path.islink(p) else os.unlink(p)


def exit_with(frontend: int, path: str) -> None:
    """Ends the process once its TorchServe frontend is gone (pid 1 or less: not watched)."""
    while frontend <= 1 or process.alive(frontend):
        time.sleep(POLL_S)
    leave("its TorchServe frontend is gone", path)


def leave(why: str, path: str) -> None:
    print(f"weights holder {os.getpid()} exits: {why}", file=sys.stderr, flush=True)
    try:
        os.unlink(path)
    except OSError:  # not made yet (a load cut short), or gone
        pass
    shutil.rmtree(os.environ.get("TMPDIR", ""), ignore_errors=True)  # its own (attach.py), never a worker's
    os._exit(0)  # not sys.exit: the accept thread and torch's IPC bookkeeping need no cleanup


if __name__ == "__main__":
    main()
