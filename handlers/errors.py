"""Typed errors. Each carries the HTTP status it maps to, so the entry class never guesses.

RequestError and its subclasses are the client's fault (4xx) and fail only their own request
inside a batch. LoadError fails the worker's load, before it ever reports ready.
"""
from __future__ import annotations


class ServingError(Exception):
    status = 500
    kind = "InternalError"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def to_dict(self) -> dict:
        return {"code": self.status, "type": self.kind, "message": self.message}


class RequestError(ServingError):
    """The request is malformed or does not match the artifact's input contract."""

    status = 400
    kind = "InvalidInput"


class PayloadTooLarge(RequestError):
    status = 413
    kind = "PayloadTooLarge"


class UnsupportedMediaType(RequestError):
    status = 415
    kind = "UnsupportedMediaType"


class LoadError(ServingError):
    """The artifact cannot be served by this worker; the message says why and how to fix it."""

    status = 500
    kind = "LoadError"


class IncompatibleArtifact(LoadError):
    kind = "IncompatibleArtifact"


class ConfigError(LoadError):
    kind = "ConfigError"
