"""One TorchServe batch in and out of a started worker (handlers/worker.py): each request's
headers read from the context (headers.py), the worker's answers set back on it (replies.py).
The entry (handlers/ts_entry.py) and the request-path warm-up (handlers/warmup.py) both go
through here, so the warm-up runs exactly the clients' path."""
from __future__ import annotations

from handlers.torchserve import guardian, headers, replies


def handle(worker, data: list, context) -> list:
    """The bodies of one batch's answers, their statuses and headers set on `context`."""
    each = [headers.read(context, i) for i in range(len(data))]  # once per request
    try:
        return replies.write(context, worker.serve(data, each, lambda idx, answer, ending=None: _chunk(
            context, idx, answer, ending)))
    finally:
        # told before TorchServe writes the batch's last frames (ts/model_service_worker.py, after
        # this returns): a death after it leaves those answers to the frontend, never a second end
        if guardian.active():
            guardian.ended(tuple(context.request_ids.values()))


def _chunk(context, idx: int, answer, ending=None) -> None:
    """One chunk of request idx's streamed answer; `ending` (with a stream's first chunk) makes
    the error event that ends the stream: the guardian holds it in case the worker dies."""
    if ending is not None and guardian.active():
        guardian.streaming(context.request_ids[idx], ending(guardian.DIED), answer.media_type)
    replies.send_chunk(context, idx, answer)
