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
