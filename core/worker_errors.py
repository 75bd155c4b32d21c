"""A tick's error in a worker process, carried to the daemon as a typed value.

A traceback string loses the error's type, so every worker error used to reach its client as a
500. :class:`WorkerError` keeps what the client's answer needs (the HTTP status, the OpenAI type
and code, the message and param) and the worker's traceback for the daemon's log;
:meth:`WorkerError.rebuild` makes the error the daemon raises, so an ``InvalidRequest`` raised in
a worker reaches its client as the 400 it would be in the daemon's own process."""

from __future__ import annotations

import traceback as tb

import attrs

from . import errors
from .errors import EngineFailure, SuperfluidError

# core's client-facing errors by class name: the classes a worker's error is rebuilt as
_CORE_ERRORS = {name: cls for name, cls in vars(errors).items()
                if isinstance(cls, type) and issubclass(cls, SuperfluidError)}


@attrs.frozen
class WorkerError:
    kind: str           # the error's class name; "EngineFailure" for an exception that is no SuperfluidError
    status: int         # the HTTP status a front end answers with
    type: str           # the OpenAI error type
    code: str | None    # the OpenAI error code
    message: str
    param: str | None = None
    traceback: str = ""  # the worker's, for the daemon's log

    @classmethod
    def of(cls, exc: Exception) -> WorkerError:
        """The value that carries ``exc``. A SuperfluidError keeps its class name, status, type,
        code and message; any other exception is an engine failure whose message names it."""
        trace = "".join(tb.format_exception(exc))
        if isinstance(exc, SuperfluidError):
            return cls(type(exc).__name__, exc.status, exc.type, exc.code, exc.message, exc.param, trace)
        return cls("EngineFailure", EngineFailure.status, EngineFailure.type, EngineFailure.code,
                   f"{type(exc).__name__}: {exc}", None, trace)

    def rebuild(self, model: str) -> SuperfluidError:
        """The error the daemon raises for model ``model``: core's class of that name (a
        plugin's own class, which the daemon may not know, becomes a SuperfluidError), with the
        worker's status, type and code. An engine failure's message names the model."""
        cls = _CORE_ERRORS.get(self.kind, SuperfluidError)
        message = f"model {model!r}: {self.message}" if issubclass(cls, EngineFailure) else self.message
        error = cls(message, param=self.param, code=self.code, status=self.status)
        error.type = self.type
        return error
