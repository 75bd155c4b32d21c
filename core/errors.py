"""Errors that reach a client. Each carries an OpenAI-style type and code and the HTTP status a
front end should use, so a front end can answer without knowing where the error came from."""

from __future__ import annotations


class SuperfluidError(Exception):
    """Base for errors a client should see, with a status hint and an OpenAI error code."""

    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 status: int | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status
        self.headers = headers or {}

    def to_body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}


class InvalidRequest(SuperfluidError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class RequestTimeout(SuperfluidError):
    """A client too slow to send its request (its body, within the server's read timeout)."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class QueueFull(SuperfluidError):
    """A model's queue for a request's QoS class holds its limit (--max-queue): retry later."""

    status = 429
    type = "rate_limit_error"
    code = "queue_full"


class ModelNotFound(SuperfluidError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class ServiceUnavailable(SuperfluidError):
    status = 503
    type = "server_error"
    code = "service_unavailable"


class DeadlineExceeded(SuperfluidError):
    """A request with a start deadline was not admitted in time."""

    status = 503
    type = "server_error"
    code = "start_deadline_exceeded"


class EngineFailure(SuperfluidError):
    """The engine (or its worker process) failed while running a request."""

    status = 500
    type = "server_error"
    code = "engine_error"


class ConfigError(Exception):
    """A configuration key or value is wrong; the message names the key and where it came from."""


class EngineCrashed(EngineFailure):
    """The engine's process died; its KV is gone but the engine can be restarted."""
