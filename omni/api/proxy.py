"""Relay a request upstream and its response back, streaming included.

Used by the edge (to omnid) and by omnid (to an instance). An upstream that
fails before answering becomes a 503 with Retry-After (UpstreamFailed: the
caller may try another); one that fails mid-stream ends the stream with an error
event, since the status line is already sent. How the answer ended is kept on the
request (OUTCOME) as it is written, for the caller to count.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import aiohttp
import orjson
from aiohttp import web

from . import phased
from .errors import ApiError, error_body, unavailable

log = logging.getLogger(__name__)

# Hop-by-hop and framing headers are not relayed; aiohttp sets its own.
_SKIP_HEADERS = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "content-length",
    "host",
    "content-encoding",
    "upgrade",
    "te",
    "trailer",
    "proxy-connection",
}


USAGE_TAIL = 8192
STREAM_END = b"data: [DONE]\n\n"  # an OpenAI-style stream's last event
CLIENT_CLOSED = 499  # nginx's "client closed request": the client left before the end
BROKEN_OFF = 502  # the upstream failed mid-stream: an error event ended the answer
# The status a relayed answer ends with, as far as it was written: its status line once
# the client has all of it (a stream: up to its last event, even when the client leaves
# before the upstream's own end), CLIENT_CLOSED while it has only part, BROKEN_OFF. A
# handler cancelled because its client left reads it to count what the client saw.
OUTCOME = web.RequestKey("omni_outcome", int)


class UpstreamFailed(ApiError):
    """The upstream failed before any of its answer reached our client (a 503): the
    request may go to another upstream."""


def upstream_failed(message: str, retry_after_s: float) -> UpstreamFailed:
    err = unavailable(message, retry_after_s)
    return UpstreamFailed(503, err.message, code=err.code, retry_after=err.retry_after)


def report_usage(body: bytes, on_usage: Callable[[dict], None]) -> None:
    with contextlib.suppress(ValueError, TypeError):
        usage = orjson.loads(body).get("usage")
        if isinstance(usage, dict):
            on_usage(usage)


async def drained(upstream: aiohttp.ClientResponse, on_done: Callable[[], None] | None):
    """The upstream's chunks. With `on_done`, the upstream is read as fast as it sends
    (a task buffers it) so `on_done` runs when it finishes, not when the client has
    read everything; without, reading follows the client's pace (backpressure)."""
    if on_done is None:
        async for chunk in upstream.content.iter_any():
            yield chunk
        return
    buffer: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue()

    async def pump() -> None:
        try:
            async for chunk in upstream.content.iter_any():
                buffer.put_nowait(chunk)
            on_done()
            buffer.put_nowait(None)
        except Exception as exc:  # handed to the writer, which reports it
            buffer.put_nowait(exc)

    task = asyncio.create_task(pump())
    try:
        while (item := await buffer.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        task.cancel()


def relay_headers(headers, drop: frozenset[str] = frozenset()) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in _SKIP_HEADERS | drop}


async def relay(
    request: web.Request,
    session: aiohttp.ClientSession,
    url: str,
    body: bytes | None,
    *,
    upstream_name: str,
    retry_after_s: float = 1.0,
    drop_headers: frozenset[str] = frozenset(),
    extra_headers: dict[str, str] | None = None,
    on_usage: Callable[[dict], None] | None = None,
    on_upstream_done: Callable[[], None] | None = None,
    pass_phases: bool = False,
) -> web.StreamResponse:
    """`drop_headers`: request headers (lower case) not to pass on; `extra_headers`: headers
    to add; `on_usage`: called with the response's `usage` object when it reports one;
    `on_upstream_done`: called once the upstream has sent everything (its GPU work is
    over), before a slow client has read it all: the answer is then buffered here; for
    an answer in phases (phased.py), at its GPU work's end. `pass_phases`: pass such an
    answer on as it is (our caller asked for phases), not unwrapped."""
    headers = {**relay_headers(request.headers, drop_headers), **(extra_headers or {})}
    try:
        upstream = await session.request(request.method, url, data=body, headers=headers)
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        log.warning("%s unreachable: %s", upstream_name, exc)
        message = f"{upstream_name} is unavailable; retry shortly."
        raise upstream_failed(message, retry_after_s) from None
    async with upstream:
        headers = relay_headers(upstream.headers)
        if upstream.content_type == phased.CONTENT_TYPE:
            return await relay_phased(
                request, upstream, upstream_name, retry_after_s, on_upstream_done, pass_phases
            )
        if upstream.content_type != "text/event-stream":
            try:
                data = await upstream.read()
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                log.warning("%s failed mid-response: %s", upstream_name, exc)
                message = f"{upstream_name} failed while answering; retry shortly."
                raise upstream_failed(message, retry_after_s) from None
            if on_upstream_done:
                on_upstream_done()
            if on_usage and upstream.status == 200:
                report_usage(data, on_usage)
            request[OUTCOME] = upstream.status
            return web.Response(body=data, status=upstream.status, headers=headers)
        resp = web.StreamResponse(status=upstream.status, headers=headers)
        request[OUTCOME] = CLIENT_CLOSED  # until the client has the stream's end
        await resp.prepare(request)
        tail = b""  # the usage chunk, when asked for, is the last event before [DONE]
        try:
            async for chunk in drained(upstream, on_upstream_done):
                await resp.write(chunk)
                tail = (tail + chunk)[-USAGE_TAIL:]
                if tail.endswith(STREAM_END):
                    stream_ended(request, upstream.status, tail, on_usage)
            stream_ended(request, upstream.status, tail, on_usage)
        except ConnectionResetError:
            pass  # our client left; leaving the `async with` drops the upstream too
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            if request[OUTCOME] == CLIENT_CLOSED:  # else the client had the end already
                log.warning("%s failed mid-stream: %s", upstream_name, exc)
                request[OUTCOME] = BROKEN_OFF
                err = error_body(f"{upstream_name} failed mid-stream", 503, code="unavailable")
                with contextlib.suppress(ConnectionResetError):
                    await resp.write(b"data: " + orjson.dumps(err) + b"\n\n")
        return resp


async def relay_phased(
    request: web.Request,
    upstream: aiohttp.ClientResponse,
    upstream_name: str,
    retry_after_s: float,
    on_upstream_done: Callable[[], None] | None,
    passing: bool,
) -> web.StreamResponse:
    """An answer in phases (phased.py): `on_upstream_done` (the permit handed on) at the
    GPU work's end; then the answer, passed on framed to a caller that asked for phases
    (at once marked, so it hands its permit on too), or unwrapped for one that did not."""
    try:
        await phased.read_mark(upstream)
    except phased.PhasedError as exc:
        log.warning("%s: %s", upstream_name, exc)
        message = f"{upstream_name} failed while answering; retry shortly."
        raise upstream_failed(message, retry_after_s) from None
    if on_upstream_done is not None:
        on_upstream_done()
    if passing:
        resp = web.StreamResponse(status=200, headers={"Content-Type": phased.CONTENT_TYPE})
        request[OUTCOME] = BROKEN_OFF  # until the answer follows its mark
        await resp.prepare(request)
        await resp.write(phased.MARK)
    try:
        line, status, headers, body = await phased.read_answer(upstream)
    except phased.PhasedError as exc:
        log.warning("%s failed after its GPU work: %s", upstream_name, exc)
        if passing:  # the caller reads the broken framing and fails it itself
            return resp
        raise upstream_failed(
            f"{upstream_name} failed while answering; retry shortly.", retry_after_s
        ) from None
    request[OUTCOME] = status
    if passing:
        with contextlib.suppress(ConnectionResetError):
            await resp.write(line + body)
            await resp.write_eof()
        return resp
    return web.Response(body=body, status=status, headers=headers)


def stream_ended(request: web.Request, status: int, tail: bytes, on_usage) -> None:
    """The client has the whole stream: its status counts, and its usage (once)."""
    if request[OUTCOME] != CLIENT_CLOSED:
        return
    request[OUTCOME] = status
    if on_usage:
        for line in reversed(tail.split(b"\n")):
            if line.startswith(b"data: {") and b'"usage"' in line:
                report_usage(line[6:], on_usage)
                break
