"""Typed errors. Each carries the HTTP status it maps to, so the entry class never guesses.

RequestError and its subclasses are the client's fault (4xx) and fail only their own request
inside a batch. LoadError fails the worker's load, before it ever reports ready.
"""
from __future__ import annotations


class ServingError(Exception):
    status = 500
    error_type = "InternalError"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def to_dict(self) -> dict:
        return {"code": self.status, "type": self.error_type, "message": self.message}


class RequestError(ServingError):
    """The request is malformed or does not match the artifact's input contract."""

    status = 400
    error_type = "InvalidInput"


class PayloadTooLarge(RequestError):
    status = 413
    error_type = "PayloadTooLarge"


class ModelNotFound(RequestError):
    """The request names a model this worker does not serve."""

    status = 404
    error_type = "ModelNotFound"


class UnsupportedMediaType(RequestError):
    status = 415
    error_type = "UnsupportedMediaType"


class LoadError(ServingError):
    """The artifact cannot be served by this worker; the message says why and how to fix it."""

    status = 500
    error_type = "LoadError"
    # True: the same archive on the same machine fails the same way on every restart (the
    # worker then answers requests with it, ts_entry); False: worth a restart (a timeout).
    recurs = True


class ModelLoadFailed(ServingError):
    """Answer to every request of a worker whose load failed in a way that recurs (a LoadError):
    the load's message, so clients see why instead of waiting (ts_entry, README)."""

    status = 503
    error_type = "ModelLoadFailed"


class IncompatibleArtifact(LoadError):
    error_type = "IncompatibleArtifact"


class StatefulArtifact(LoadError):
    """The artifact's program writes state (buffers) between calls: served as stateless, one
    client would be answered from another's state (handlers/artifact/state.py)."""

    error_type = "StatefulArtifact"


class ConfigError(LoadError):
    error_type = "ConfigError"


class EngineUnavailable(ServingError):
    """The GPU engine (handlers/engine/) could not take or finish this request for a reason of the
    moment, not of the request: the same request sent again may succeed (503, retryable)."""

    status = 503
    error_type = "EngineUnavailable"
    retryable = True


class ArenaFull(EngineUnavailable):
    """A worker's shared-memory arena (handlers/engine/arena.py) has no free block this size now: the
    blocks of requests in flight come back as they are answered and released."""

    error_type = "ArenaFull"


class EngineDead(EngineUnavailable):
    """The engine process is gone (its socket closed) or reported a fault that ends it; every
    request in flight on it gets this, and the worker reconnects to the engine's successor."""

    error_type = "EngineDead"


class EngineTimeout(ServingError):
    """The engine did not answer within the request's deadline; the request was aborted."""

    status = 504
    error_type = "EngineTimeout"
    retryable = True


class ProtocolError(ServingError):
    """A frame on the engine's socket that is not a message of handlers/engine/protocol.py (a peer of
    another version, a corrupt or oversized frame): the connection is closed."""

    status = 500
    error_type = "ProtocolError"
