"""The pieces every operation of the OpenAPI document is built from: the errors a route may
answer and :func:`op`, one operation; shared by the route table (:mod:`.openapi`) and any
front end that describes its own routes."""

from __future__ import annotations

from superfluid.core import qos as qos_classes

from .openapi_schema import ref, string

ERRORS = {400: "invalid request: the message and param name the field",
           401: "no or unknown API key", 403: "the key (or server) does not allow this",
           404: "unknown model, session or route", 405: "method not allowed on this route",
           409: "the session is closed or busy", 413: "body over 64 MiB",
           422: "well formed, but the engine could not carry it out (a LoRA file that is no adapter of the model)",
           429: "rate limited; Retry-After says when to retry",
           500: "the engine failed while running the request",
           503: "model unloaded or loading, server shutting down, or start deadline exceeded; "
                "Retry-After says when to retry"}
EVERY = (401, 403, 404, 405, 429, 503)  # any route: auth, limits, unknown paths, draining
BODY = (400, 413)
GENERATE = (*BODY, 500)
SESSION_ERRORS = (*BODY, 409)

QOS_HEADER = {"name": "x-superfluid-qos", "in": "header", "required": False,
               "description": "QoS class or alias (case-insensitive); ignored under --no-http-qos-header",
               "schema": string(enum=sorted(qos_classes.ALIASES))}
INVARIANT_HEADER = {"name": "x-superfluid-batch-invariant", "in": "header", "required": False,
                     "description": "a lane that ticks alone; 403 unless --http-allow-batch-invariant",
                     "schema": string(enum=["true", "false", "1", "0", "yes", "no", "on", "off", ""],
                                      description="case-insensitive; empty: false")}
SID = {"name": "sid", "in": "path", "required": True, "schema": string()}
NAME = {"name": "name", "in": "path", "required": True, "schema": string()}


def op(summary: str, ok: dict, *, errors: tuple = (), body: dict | None = None,
        body_required: bool = True, parameters: list | None = None, ok_status: int = 200,
        op_id: str) -> dict:
    responses = {str(ok_status): ok}
    for status in sorted(set(errors) | set(EVERY)):
        headers = {"Retry-After": {"schema": string()}} if status in (429, 503) else {}
        responses[str(status)] = {"$ref": f"#/components/responses/E{status}"} if not headers else {
            "description": ERRORS[status], "headers": headers,
            "content": {"application/json": {"schema": ref("Error")}}}
    out = {"operationId": op_id, "summary": summary, "responses": responses}
    if body is not None:
        out["requestBody"] = {"required": body_required, "content": {"application/json": {"schema": body}}}
    if parameters:
        out["parameters"] = parameters
    return out


def errors_shaped(operation: dict, schema: dict) -> dict:
    """``operation`` (built by :func:`op`, whose errors are OpenAI's) with every error answer's
    body in another API's shape ``schema`` (Anthropic's, Ollama's), its headers kept."""
    for status, answer in operation["responses"].items():
        if int(status) >= 400:
            headers = answer.get("headers") if isinstance(answer, dict) else None
            fixed = {"description": ERRORS.get(int(status), "error"),
                     "content": {"application/json": {"schema": schema}}}
            if headers:
                fixed["headers"] = headers
            operation["responses"][status] = fixed
    return operation
