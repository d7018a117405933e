"""What reading one batch from the frontend costs a worker: TorchServe's reader against ours.

TorchServe's frontend sends a worker each batch as one message over a Unix socket (the frame
format is in handlers/torchserve/frontend_frames.py). This writes such messages, as the frontend's encoder
lays them out, from a thread into a socket pair and times the worker's side: the CPU time (this
thread's clock) of `ts.protocol.otf_message_handler.retrieve_msg` and of
`handlers.torchserve.frontend_frames.retrieve_msg` per message, interleaved round by round, and checks that
both return the same message.

    python -m bench.bench_frames [--batch-sizes 1,8] [--body-bytes 301160] [--out docs/results/frames_TAG.json]
    python -m bench.bench_frames --replot docs/results/frames_TAG.json   # the PNG again
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import struct
import threading
import time
from pathlib import Path

from bench.results_meta import header, page_head

# The headers a client such as python-requests sends with a binary request, plus the token.
CLIENT_HEADERS = (("Host", "127.0.0.1:8080"), ("User-Agent", "python-requests/2.32.3"),
                  ("Accept-Encoding", "gzip, deflate"), ("Accept", "*/*"), ("Connection", "keep-alive"),
                  ("Content-Type", "application/x-safetensors"), ("Content-Length", "301160"),
                  ("Authorization", "Bearer 0123456789abcdef0123456789abcdef"))


def _sized(value) -> bytes:
    value = value.encode() if isinstance(value, str) else bytes(value)
    return struct.pack("!i", len(value)) + value


def encode_inference(requests) -> bytes:
    """An inference message: requests are (request id, [(header, value)], [(name, content type,
    value)]); a length given as an int instead of a value is written as that bare length."""
    out = bytearray(b"I")
    for request_id, headers, parameters in requests:
        out += _sized(request_id)
        for name, value in headers:
            out += _sized(name) + (struct.pack("!i", value) if isinstance(value, int) else _sized(value))
        out += struct.pack("!i", -1)
        for name, content_type, value in parameters:
            out += _sized(name) + _sized(content_type) + _sized(value)
        out += struct.pack("!i", -1)
    return bytes(out + struct.pack("!i", -1))


def encode_load(name="m", path="/tmp/m", batch_size=8, handler="h.py", gpu=-1, envelope="", limit=False) -> bytes:
    return bytes(b"L" + _sized(name) + _sized(path) + struct.pack("!i", batch_size) + _sized(handler)
                 + struct.pack("!i", gpu) + _sized(envelope) + struct.pack("!?", limit))


def batch_message(n: int, body_bytes: int) -> bytes:
    body = bytes(range(256)) * (body_bytes // 256) + bytes(body_bytes % 256)
    return encode_inference([(f"{i:08x}-0000-4000-8000-{i:012x}", CLIENT_HEADERS,
                              [("body", "application/x-safetensors", body)]) for i in range(n)])


def cpu_ms_per_message(reader, message: bytes, count: int):
    """(ms of this thread's CPU per read, the last message read) over `count` messages."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)

    def frontend():  # one message, then the answer, as TorchServe's worker thread does
        for _ in range(count):
            a.sendall(message)
            a.recv(1)

    writer = threading.Thread(target=frontend, daemon=True)
    writer.start()
    cpu, msg = 0.0, None
    try:
        for _ in range(count):
            t0 = time.thread_time()
            _, msg = reader(b)
            cpu += time.thread_time() - t0
            b.sendall(b"k")
    finally:
        writer.join()
        a.close()
        b.close()
    return cpu / count * 1e3, msg


def measure(batch_sizes, body_bytes: int, count: int, rounds: int) -> list:
    from ts.protocol import otf_message_handler

    from handlers.torchserve import frontend_frames

    readers = {"torchserve": otf_message_handler.retrieve_msg, "buffered": frontend_frames.retrieve_msg}
    rows = []
    for n in batch_sizes:
        message = batch_message(n, body_bytes)
        ms = {k: [] for k in readers}
        for r in range(rounds):
            order = list(readers) if r % 2 == 0 else list(readers)[::-1]
            got = {}
            for name in order:
                t, got[name] = cpu_ms_per_message(readers[name], message, count)
                ms[name].append(t)
            if got["torchserve"] != got["buffered"]:
                raise RuntimeError(f"the readers disagree on a batch of {n}")
        stock, ours = statistics.median(ms["torchserve"]), statistics.median(ms["buffered"])
        rows.append({"batch": n, "message_bytes": len(message), "torchserve_ms": round(stock, 4),
                     "buffered_ms": round(ours, 4), "ratio": round(ours / stock, 3)})
    return rows


def plot(result: dict, path: Path) -> None:
    """Bars of CPU ms per batch, TorchServe's reader beside the buffered one, per batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["torchserve_ms"] for r in rows], 0.4, label="TorchServe's reader")
    ax.bar([x + 0.2 for x in xs], [r["buffered_ms"] for r in rows], 0.4, label="buffered (handlers/torchserve/frontend_frames.py)")
    ax.set_xticks(list(xs), [f"{r['batch']} x {result['body_bytes']} B" for r in rows])
    ax.set_xlabel("requests per batch x body bytes")
    ax.set_ylabel("worker CPU ms per batch")
    ax.set_title(f"Reading a batch from the frontend ({result['device']})", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--body-bytes", type=int, default=301160, help="one 1x3x224x224 fp32 safetensors body")
    p.add_argument("--messages", type=int, default=200, help="messages per reader per round")
    p.add_argument("--rounds", type=int, default=5, help="the median of this many rounds is reported")
    p.add_argument("--out", help="results path (.json; the Markdown and the plot go beside it)")
    p.add_argument("--replot", help="draw the plot of an existing results JSON again, and stop")
    a = p.parse_args(argv)
    if a.replot:
        plot(json.loads(Path(a.replot).read_text()), Path(a.replot).with_suffix(".png"))
        return
    rows = measure([int(x) for x in a.batch_sizes.split(",")], a.body_bytes, a.messages, a.rounds)
    lines = ["| requests per batch | message bytes | TorchServe's reader, CPU ms | buffered, CPU ms | ratio |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['message_bytes']} | {r['torchserve_ms']} | {r['buffered_ms']} | {r['ratio']} |"
              for r in rows]
    print("\n".join(lines))
    if a.out:
        out = Path(a.out).with_suffix(".json")
        result = {**header(f"CPU ({os.cpu_count()} cores)", argv),
                  "body_bytes": a.body_bytes, "headers_per_request": len(CLIENT_HEADERS),
                  "messages": a.messages, "rounds": a.rounds, "rows": rows}
        out.write_text(json.dumps(result, indent=1) + "\n")
        out.with_suffix(".md").write_text("\n".join(page_head(result, "Reading a batch from the frontend")
                                                    + lines) + "\n")
        plot(result, out.with_suffix(".png"))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
