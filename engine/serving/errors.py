"""OpenAI-shaped errors: every non-2xx answer is {"error": {"message", "type", "param", "code"}}.

Clients (the `openai` package, benchmark tools) parse this shape to raise typed exceptions, so FastAPI's
own `{"detail": ...}` answers for malformed JSON, unknown routes and wrong methods are replaced too, and
the OpenAPI schema says so: validation errors are 400 (not FastAPI's 422) with this shape, and routes list
the errors they answer with `error_responses`. An error never repeats a huge input: echoed values are
clipped (`clip`) and so is every message.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.core.llm_engine import EngineDeadError, RequestError
from engine.serving.async_engine import QueueFullError

logger = logging.getLogger("headroom.server")

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"
ECHO_LIMIT = 100  # characters of a client's value an error message repeats
MESSAGE_LIMIT = 1000  # characters of any error message (messages built elsewhere may quote input too)


def shorten(text: str, limit: int = ECHO_LIMIT) -> str:
    """`text` cut to `limit` characters, saying how long it was, so that a 10 MB value gives a small body."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def clip(value: object) -> str:
    """A client's value as an error message quotes it: repr for strings, shortened."""
    return shorten(repr(value) if isinstance(value, str) else str(value))


class APIError(Exception):
    """Raised anywhere in a handler; rendered as an OpenAI error with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.type, self.param, self.code, self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, INVALID_REQUEST, param, code)


def engine_error(e: BaseException) -> APIError:
    """Map what AsyncEngine.add, a request handle or a query raises to an HTTP answer; anything else is a bug."""
    if isinstance(e, RequestError):
        return bad_request(str(e), e.param, e.code)
    if isinstance(e, QueueFullError):
        return APIError(429, str(e), "rate_limit_error", None, "queue_full", {"Retry-After": str(e.retry_after)})
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), SERVER_ERROR, None, "engine_dead")
    raise e


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    param = None if param is None else shorten(param)
    return {"error": {"message": shorten(message, MESSAGE_LIMIT), "type": type, "param": param, "code": code}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """The schema of every error answer, for /openapi.json."""

    error: ErrorDetail


ERROR_MEANING = {
    400: "Invalid request: malformed JSON, a value out of range, an unsupported field",
    401: "Missing or wrong API key",
    403: "The controller's write endpoint is reachable beyond loopback and no admin key is set",
    404: "Not found: an unknown model, or a feature this server runs without",
    409: "The gains are each valid but together break a rule of the controller's config",
    429: "Too many requests waiting: retry after the Retry-After header's seconds",
    503: "The engine cannot serve (shutting down, stopped, or failed after an out-of-memory error)",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for a route that answers these error statuses in the OpenAI shape."""
    return {s: {"model": ErrorResponse, "description": ERROR_MEANING[s]} for s in statuses}


def error_response(
    status: int,
    message: str,
    type: str = INVALID_REQUEST,
    param: str | None = None,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(message, type, param, code), status_code=status, headers=dict(headers or {}))


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable line from pydantic's error list, and the offending top-level field as `param`."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    where, msg = shorten(".".join(loc)), shorten(str(first.get("msg")))
    message = f"{where}: {msg}" if where else msg
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return message, loc[0] if loc else None


def _openapi_with_400(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, with its 422 validation answers replaced by the 400s this server really sends;
    every operation may also answer a 500 (a server bug)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path in schema["paths"].values():
            for operation in path.values():
                responses = operation["responses"]
                if responses.pop("422", None) is not None:
                    responses.setdefault("400", _error_schema_ref(ERROR_MEANING[400]))
                responses.setdefault("500", _error_schema_ref("Internal server error (a bug)"))
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        error_schema = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(error_schema.pop("$defs"), ErrorResponse=error_schema)
        app.openapi_schema = schema
    return app.openapi_schema


def _error_schema_ref(description: str) -> dict[str, Any]:
    schema = {"$ref": "#/components/schemas/ErrorResponse"}
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def install_error_handlers(app: FastAPI) -> None:
    app.openapi = lambda: _openapi_with_400(app)  # type: ignore[method-assign]

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, INVALID_REQUEST, param, "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message, code = f"no route {request.method} {request.url.path}", "not_found"
        elif exc.status_code == 405:
            message, code = f"method {request.method} is not allowed on {request.url.path}", "method_not_allowed"
        else:
            message, code = str(exc.detail), None
        kind = INVALID_REQUEST if exc.status_code < 500 else SERVER_ERROR
        return error_response(exc.status_code, message, kind, None, code, exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Only a server bug gets here: bad input is rejected by the handlers above with a 4xx.
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal server error: {type(exc).__name__}", SERVER_ERROR)
