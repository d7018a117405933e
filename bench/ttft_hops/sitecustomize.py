"""TTFT probe: time stamps of a request's way into a TorchServe async worker (bench/ttft_hops/run.py).

Loaded by every Python process that has bench/ttft_hops on PYTHONPATH; does nothing unless TTFT_PROBE_DIR
is set. Then an import hook (a sys.meta_path finder) patches modules right after they execute,
without touching their files:

  ts.protocol.otf_message_handler  _retrieve_buffer: the moment a message's command byte b"I" is read
                                   (its first byte has arrived)                        -> hop "arrived"
  ts.async_service                 retrieve_msg (as receive_requests looks it up): returned "I" -> "retrieved"
                                   Queue (the in_queue): fetch_batches' get returned           -> "fetched"
                                   AsyncService.call_predict: started on the event loop       -> "loop"
                                   the service's _entry_point (our handler's handle): called  -> "entry"
  handlers.torchserve.replies      send_chunks returned (a frame written to the frontend)     -> "frame"

Each stamp is a JSON line {"pid", "hop", "t", "request_ids", "thread"} appended to
$TTFT_PROBE_DIR/worker-<pid>.jsonl (opened once, line-buffered); the first line of a file ("meta")
holds sys.getswitchinterval() and argv, and the first "retrieved" stamp the names of the threads.
Any other sitecustomize on sys.path (the distribution's) is still run after this one.
"""
import os
import sys

_DIR = os.environ.get("TTFT_PROBE_DIR")


import json
import threading
import time

_OUT = []  # the open stamps file, once the first stamp is written
_ARRIVED = threading.local()  # the receive thread's last b"I" command byte, stamped with its ids later


def stamp(hop, ids, t=None, **extra):
    t = time.time() if t is None else t
    if not _OUT:
        os.makedirs(_DIR, exist_ok=True)
        _OUT.append(open(os.path.join(_DIR, f"worker-{os.getpid()}.jsonl"), "a", buffering=1))
        _OUT[0].write(json.dumps({"pid": os.getpid(), "hop": "meta", "t": t, "request_ids": [],
                                  "switchinterval": sys.getswitchinterval(), "argv": sys.argv}) + "\n")
    rec = {"pid": os.getpid(), "hop": hop, "t": t, "request_ids": [str(i) for i in ids],
           "thread": threading.current_thread().name, **extra}
    _OUT[0].write(json.dumps(rec) + "\n")


def ids_of(msg):
    return [r["requestId"].decode() if isinstance(r.get("requestId"), (bytes, bytearray)) else r.get("requestId")
            for r in msg if isinstance(r, dict)]


def thread_cpu():
    """{thread name (Python's where known, else the kernel's comm) + tid: utime+stime jiffies}."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        out[f"{names.get(int(tid), comm)}:{tid}"] = int(fields[11]) + int(fields[12])
    return out


def patch_otf(mod):
    orig = mod._retrieve_buffer

    def _retrieve_buffer(conn, length):
        got = orig(conn, length)
        if length == 1 and got == b"I":
            _ARRIVED.t = time.time()
        return got

    mod._retrieve_buffer = _retrieve_buffer


def _stamping_retrieve(orig_retrieve):
    told = []

    def retrieve_msg(conn):
        _ARRIVED.t = None
        cmd, msg = orig_retrieve(conn)
        if cmd == b"I":
            t, ids = time.time(), ids_of(msg)
            if getattr(_ARRIVED, "t", None) is not None:
                stamp("arrived", ids, _ARRIVED.t, cpu=thread_cpu())
            extra = {}
            if not told:
                told.append(True)
                extra = {"threads": [th.name for th in threading.enumerate()], "switchinterval": sys.getswitchinterval()}
            stamp("retrieved", ids, t, **extra)
        return cmd, msg

    return retrieve_msg


def _stamping_call_predict(orig_call):
    async def call_predict(self, batch):
        stamp("loop", ids_of(batch))
        svc = self.service
        if not getattr(svc, "_ttft_entry", False):
            entry_point = svc._entry_point

            def entry(data, context):
                stamp("entry", list(context.request_ids.values()))
                return entry_point(data, context)

            svc._entry_point, svc._ttft_entry = entry, True
        await orig_call(self, batch)

    return call_predict


def patch_async(mod):
    import queue

    class StampQueue(queue.Queue):
        def get(self, block=True, timeout=None):
            item = super().get(block, timeout)
            if isinstance(item, list) and item and isinstance(item[0], dict) and "requestId" in item[0]:
                stamp("fetched", ids_of(item))
            return item

    mod.retrieve_msg, mod.Queue = _stamping_retrieve(mod.retrieve_msg), StampQueue
    mod.AsyncService.call_predict = _stamping_call_predict(mod.AsyncService.call_predict)


def patch_replies(mod):
    orig = mod.send_chunks

    def send_chunks(sock, lock, items):
        orig(sock, lock, items)
        stamp("frame", [rid for rid, _answer in items])

    mod.send_chunks = send_chunks


PATCHES = {"ts.protocol.otf_message_handler": patch_otf, "ts.async_service": patch_async,
           "handlers.torchserve.replies": patch_replies}


class Finder:
    """Finds a patched module with the other finders, then patches it right after it executes."""

    def find_spec(self, name, path=None, target=None):
        patch = PATCHES.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            try:
                patch(module)
            except Exception as e:  # noqa: BLE001  (a probe must never stop the worker)
                print(f"ttft probe: could not patch {name}: {e!r}", file=sys.stderr)

        spec.loader.exec_module = exec_and_patch
        return spec


def _setup():
    if os.environ.get("TTFT_SWITCH"):
        sys.setswitchinterval(float(os.environ["TTFT_SWITCH"]))
    sys.meta_path.insert(0, Finder())


def _chain():
    """The next sitecustomize on sys.path (this one shadows it), run as it would have been."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        try:
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
        except Exception:  # noqa: BLE001  (as site.py treats a failing sitecustomize: not fatal)
            pass


if _DIR:
    _setup()
_chain()
