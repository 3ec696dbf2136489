"""What omnid and the edge share of the Open Inference Protocol on HTTP (aiohttp).

Errors under /v2 in the protocol's form, `{"error": "..."}` (tritonclient reads that
string as the message), with the status and Retry-After every other route gives; the
server's metadata and liveness, which need no model.
"""

from __future__ import annotations

import logging
from importlib import metadata

from aiohttp import web

from .errors import ApiError
from .oip import JSON_TYPE, OipError, error_body

log = logging.getLogger(__name__)

PREFIX = "/v2"
SERVER_NAME = "omni"
EXTENSIONS = ("binary_tensor_data",)
# The models that speak the protocol: handler models. OMNI's own LLM and embedding
# models keep their OpenAI routes, and are absent from /v2 (a 404 that says so).
OIP_RUNTIMES = frozenset({"python"})
# A model version in the URL (/v2/models/{name}/versions/{version}/...) the node serves:
# its catalog version, or "1", the one version an instance lists
DEFAULT_VERSION = "1"


def oip_error(status: int, message: str, retry_after: float | None = None) -> web.Response:
    headers = {"Retry-After": str(max(1, round(retry_after)))} if retry_after else None
    return web.Response(
        body=error_body(message), status=status, content_type=JSON_TYPE, headers=headers
    )


@web.middleware
async def oip_errors(request: web.Request, handler):
    """Under /v2, every failure as an OIP error body; other paths pass through. Put it
    after error_middleware (inner: it sees the failure first)."""
    if not (request.path == PREFIX or request.path.startswith(PREFIX + "/")):
        return await handler(request)
    try:
        return await handler(request)
    except ApiError as exc:
        return oip_error(exc.status, exc.message, exc.retry_after)
    except OipError as exc:
        return oip_error(exc.status, exc.message)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        if exc.status == 404:
            return oip_error(404, f"Unknown path {request.path}")
        if exc.status == 405:
            return oip_error(405, f"Method {request.method} not allowed on {request.path}")
        return oip_error(exc.status, exc.reason)
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return oip_error(500, "Internal server error")


def server_version() -> str:
    try:
        return metadata.version("omni")
    except metadata.PackageNotFoundError:
        return "0"


async def server_metadata(_request: web.Request) -> web.Response:
    return web.json_response(
        {"name": SERVER_NAME, "version": server_version(), "extensions": list(EXTENSIONS)}
    )


async def live(_request: web.Request) -> web.Response:
    """The process answers: nothing else is asked of liveness."""
    return web.json_response({"live": True})


def check_version(request: web.Request, served: str) -> None:
    """A version named in the path (/v2/models/{name}/versions/{version}/...) must be
    one the node serves: "1", or the model's catalog version."""
    version = request.match_info.get("version")
    if version is not None and version not in {DEFAULT_VERSION, served}:
        name = request.match_info["name"]
        raise ApiError(404, f"Model '{name}' has no version '{version[:64]}' here.")


def add_model_routes(app: web.Application, metadata_handler, ready_handler, infer_handler):
    """A model's three routes, with and without a version in the path."""
    for base in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
        app.router.add_get(base, metadata_handler)
        app.router.add_get(base + "/ready", ready_handler)
        app.router.add_post(base + "/infer", infer_handler)
