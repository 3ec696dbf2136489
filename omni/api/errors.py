"""OpenAI-style error bodies, and a middleware that turns every failure into one.

Clients of an OpenAI-compatible API parse `{"error": {...}}`; a plain-text 404
or an HTML 500 breaks them. Every server in OMNI answers errors through here.
"""

from __future__ import annotations

import logging

import orjson
from aiohttp import web

log = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


def error_body(message: str, status: int, param: str | None = None, code: str | None = None):
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "server_error"),
            "param": param,
            "code": code,
        }
    }


class ApiError(Exception):
    """Raise anywhere in a handler; the middleware answers it."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after

    def response(self) -> web.Response:
        headers = {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, round(self.retry_after)))
        return json_response(
            error_body(self.message, self.status, self.param, self.code), self.status, headers
        )


def json_response(data, status: int = 200, headers: dict | None = None) -> web.Response:
    return web.Response(
        body=orjson.dumps(data), status=status, content_type="application/json", headers=headers
    )


def json_object(body: bytes, not_object: str = "Request body must be a JSON object.") -> dict:
    """A request body that must be a JSON object, or the 400 that says why it is not."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise ApiError(400, "Request body is not valid JSON.", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, not_object, code="invalid_value")
    return data


def unavailable(message: str, retry_after: float = 1.0) -> ApiError:
    return ApiError(503, message, code="unavailable", retry_after=retry_after)


def model_not_found(name: str) -> ApiError:
    return ApiError(
        404,
        f"The model '{name}' does not exist or is not loaded.",
        param="model",
        code="model_not_found",
    )


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = {404: f"Unknown path {request.path}", 405: f"Method {request.method} not allowed"}
        body = error_body(message.get(exc.status, exc.reason), exc.status)
        return json_response(
            body, exc.status, {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
        )
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return json_response(error_body("Internal server error", 500), 500)
