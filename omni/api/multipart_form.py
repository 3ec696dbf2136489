"""Reading an upload (`multipart/form-data`) within a size limit, on omnid and the edge.

The body is read whole, but never past its limit (a 413 as soon as it passes), then
parsed from memory with aiohttp's own multipart reader: the edge needs the form's
fields to route the request and must still relay the body unchanged, and omnid reads
the same bytes the same way, so both refuse a malformed upload alike.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from aiohttp import BodyPartReader, MultipartReader, web
from aiohttp.base_protocol import BaseProtocol
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestPayloadError

from .errors import ApiError

FORM_TYPE = "multipart/form-data"
MAX_PARTS = 64  # parts of one form: the rest of the body is not looked at


@dataclass(frozen=True)
class Part:
    """One field of a form: its value (a file's bytes, as sent)."""

    data: bytes

    def text(self, name: str) -> str:
        try:
            return self.data.decode()
        except UnicodeDecodeError:
            raise ApiError(400, f"'{name}' is not UTF-8 text.", param=name) from None


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"Request body exceeds the {limit}-byte limit.", code="request_too_large")


async def read_bounded(request: web.Request, limit: int) -> bytes:
    """The request body, or a 413 as soon as it passes `limit` bytes (before, where its
    Content-Length says so)."""
    if request.content_length is not None and request.content_length > limit:
        raise too_large(limit)
    body = bytearray()
    try:
        async for chunk in request.content.iter_any():
            body += chunk
            if len(body) > limit:
                raise too_large(limit)
    except RequestPayloadError:
        message = "Request body could not be read (bad Content-Encoding or framing)."
        raise ApiError(400, message, code="invalid_body") from None
    return bytes(body)


async def parse_form(body: bytes, content_type: str | None) -> dict[str, Part]:
    """A form's fields by name (the first of a repeated name), from its whole body."""
    if not (content_type or "").lower().startswith(FORM_TYPE):
        given = (content_type or "empty")[:100]
        message = f"The request must be {FORM_TYPE} (an upload), not {given}."
        raise ApiError(400, message, code="invalid_content_type")
    loop = asyncio.get_running_loop()
    # fed whole: a limit past the body's size never pauses a transport (there is none)
    stream = StreamReader(BaseProtocol(loop), limit=2 * len(body) + 2, loop=loop)
    stream.feed_data(body)
    stream.feed_eof()
    try:
        return await read_parts(MultipartReader({"Content-Type": content_type}, stream))
    except (ValueError, AssertionError, RuntimeError, HttpProcessingError) as exc:
        message = f"The {FORM_TYPE} body is malformed ({str(exc).strip()[:200]})."
        raise ApiError(400, message, code="invalid_body") from None


async def read_parts(reader: MultipartReader) -> dict[str, Part]:
    fields: dict[str, Part] = {}
    for _ in range(MAX_PARTS):
        part = await reader.next()
        if part is None:
            break
        if not isinstance(part, BodyPartReader):
            raise ValueError("a nested multipart part")
        data = bytes(await part.read())
        if part.name and part.name not in fields:
            fields[part.name] = Part(data)
    return fields
