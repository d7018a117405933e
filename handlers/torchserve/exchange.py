"""One TorchServe batch in and out of a started worker (handlers/worker.py): each request's
headers read from the context (headers.py), the worker's answers set back on it (replies.py).
The entry (handlers/ts_entry.py) and the request-path warm-up (handlers/warmup.py) both go
through here, so the warm-up runs exactly the clients' path."""
from __future__ import annotations

from handlers.torchserve import headers, replies


def handle(worker, data: list, context) -> list:
    """The bodies of one batch's answers, their statuses and headers set on `context`."""
    each = [headers.read(context, i) for i in range(len(data))]  # once per request
    return replies.write(context, worker.serve(data, each, lambda idx, answer: replies.send_chunk(context, idx, answer)))
