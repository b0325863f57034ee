"""Every failure as an OpenAI error body: `{"error": {"message", "type", "param", "code"}}`.

| cause | status | type |
| --- | --- | --- |
| body not JSON, wrong types, unknown fields (pydantic) | 400 | invalid_request_error |
| `InvalidRequestError` from asyncllm (ranges, prompt too long, ...) | 400 | invalid_request_error |
| unknown model name | 400 | invalid_request_error (code model_not_found) |
| missing or wrong API key | 401 | authentication_error |
| unknown route, or a method the route does not take | 404 / 405 | invalid_request_error (OpenAI's "Invalid URL") |
| the engine is dead or shutting down | 503 | service_unavailable |
| anything else (a bug) | 500 | internal_error (logged with its traceback) |
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from asyncllm.errors import EngineDeadError, InvalidRequestError

logger = logging.getLogger(__name__)

_SAMPLING_FIELD = re.compile(r"SamplingParams\.(\w+)=")


class APIError(Exception):
    """An error with its HTTP status and OpenAI error fields; raise it from a route."""

    def __init__(
        self,
        message: str,
        status: HTTPStatus = HTTPStatus.BAD_REQUEST,
        param: str | None = None,
        code: str | None = None,
        err_type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.err_type = err_type


def error_body(message: str, err_type: str, param: str | None = None, code: str | int | None = None) -> dict[str, Any]:
    """The OpenAI error object."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def to_api_error(error: BaseException, field_names: dict[str, str] | None = None) -> APIError:
    """Map an exception raised while serving a request to an `APIError`.

    Args:
        field_names: engine field -> request field, e.g. {"max_tokens": "max_completion_tokens",
            "prompt": "messages"}, so `param` names what the client sent.
    """
    names = field_names or {}
    if isinstance(error, APIError):
        return error
    if isinstance(error, InvalidRequestError):
        param = _param_of(str(error))
        param = names.get(param, param) if param is not None else None
        return APIError(str(error), param=param)
    if isinstance(error, EngineDeadError):
        return APIError(str(error), HTTPStatus.SERVICE_UNAVAILABLE, err_type="service_unavailable")
    logger.error("unexpected error while serving a request", exc_info=error)
    return APIError(f"internal error: {error!r}", HTTPStatus.INTERNAL_SERVER_ERROR, err_type="internal_error")


def _param_of(message: str) -> str | None:
    """The request field an asyncllm `InvalidRequestError` message is about, if it says."""
    match = _SAMPLING_FIELD.search(message)
    if match:
        return match.group(1)
    if "prompt" in message or message.startswith("token id"):
        return "prompt"
    return None


def validation_error_to_api_error(exc: RequestValidationError) -> APIError:
    """The first pydantic error as a 400 naming its field (dotted path inside the body)."""
    errors: Sequence[Any] = exc.errors()
    if not errors:
        return APIError("invalid request body")
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return APIError(f"the body is not valid JSON: {first.get('msg')}", code="json_invalid")
    param = ".".join(loc) or None
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    message = f"{param or 'body'}: {first.get('msg')} (got {_short(first.get('input'))}){more}"
    return APIError(message, param=param, code=first.get("type"))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def api_error_response(error: APIError) -> JSONResponse:
    """A JSON response with the error's status and OpenAI body."""
    body = error_body(error.message, error.err_type, error.param, error.code)
    return JSONResponse(body, status_code=int(error.status))


def install_error_handlers(app: FastAPI) -> None:
    """Route validation errors, asyncllm errors and unexpected exceptions to OpenAI error bodies."""

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return api_error_response(validation_error_to_api_error(exc))

    async def on_error(request: Request, exc: Exception) -> JSONResponse:
        return api_error_response(to_api_error(exc))

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        message = f"Invalid URL ({request.method} {request.url.path})" if exc.status_code in (404, 405) else exc.detail
        error = APIError(str(message), HTTPStatus(exc.status_code))
        return api_error_response(error)

    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(APIError, on_error)
    app.add_exception_handler(InvalidRequestError, on_error)
    app.add_exception_handler(EngineDeadError, on_error)
    app.add_exception_handler(Exception, on_error)
