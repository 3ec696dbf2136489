"""Answers whose GPU work ends before they do: the seeds' CPU-GPU split, on the wire.

A handler says where its GPU work ends (omni/instance/handler.py, `gpu_done`). A caller
that can use that asks with the request header `x-omni-phases: 1` (omnid asks its
instances, the edge asks omnid). An instance then answers with content type PHASED: the
line MARK, sent the moment the GPU work ends, then the real answer, framed as one JSON
line `{"status": ..., "headers": {...}}` and its body. A relay that reads MARK hands its
permit to the next request at once, while the CPU work (encoding, resizing) goes on;
then it passes the framed answer on to a caller that asked for phases (omnid to the
edge), or unwraps it for one that did not (a client). An answer with no CPU phase, or
an error before one, comes plainly, as ever.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Mapping

import aiohttp
import orjson
from aiohttp import web

from .errors import ApiError

log = logging.getLogger(__name__)

HEADER = "x-omni-phases"
CONTENT_TYPE = "application/x-omni-phased"
MARK = b"gpu-done\n"
MAX_HEAD = 64 << 10  # the framing line: a status and a few headers
# the answer's own headers that the framing carries (the rest are the relay's to set)
CARRIED = ("content-type", "inference-header-content-length")


class PhasedError(Exception):
    """A phased answer that is not one: the upstream broke off or sent garbage."""


def asked(headers: Mapping[str, str]) -> bool:
    return headers.get(HEADER) == "1"


async def answer(
    request: web.Request,
    work: Awaitable[web.Response],
    gpu_done: asyncio.Event,
) -> web.StreamResponse:
    """The instance's side: `work`'s response, sent phased when the caller asked and the
    GPU work ended (`gpu_done` set) before the answer was ready."""
    task = asyncio.ensure_future(work)
    try:
        if not asked(request.headers):
            return await task
        marked = asyncio.ensure_future(gpu_done.wait())
        try:
            await asyncio.wait([task, marked], return_when=asyncio.FIRST_COMPLETED)
        finally:
            marked.cancel()
        if task.done():
            return task.result()
        stream = web.StreamResponse(status=200, headers={"Content-Type": CONTENT_TYPE})
        await stream.prepare(request)
        await stream.write(MARK)
        try:
            try:
                resp = await task
            except ApiError as exc:  # omnid's own routes answer through here too
                resp = exc.response()
            carried = {str(k): v for k, v in resp.headers.items() if k.lower() in CARRIED}
            head = orjson.dumps({"status": resp.status, "headers": carried})
        except Exception:  # the status line is sent: the caller sees the framing break off
            log.exception("answer after the GPU work failed")
            return stream
    finally:
        task.cancel()  # the caller left: its request is dropped (a no-op once done)
    await stream.write(head + b"\n" + (resp.body or b""))
    await stream.write_eof()
    return stream


async def read_mark(upstream: aiohttp.ClientResponse) -> None:
    """The relay's side: wait for MARK (the GPU work's end). Raises PhasedError where
    the upstream broke off or sent something else."""
    try:
        mark = await upstream.content.readline()
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
        raise PhasedError(f"broke off: {exc}") from None
    if mark != MARK:
        raise PhasedError(f"expected the GPU-done mark, got {mark[:40]!r}")


async def read_answer(upstream: aiohttp.ClientResponse) -> tuple[bytes, int, dict, bytes]:
    """After MARK: the framing line as sent, the answer's status, headers and body."""
    try:
        line = await upstream.content.readline()
        body = await upstream.content.read()
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
        raise PhasedError(f"broke off: {exc}") from None
    if not line.endswith(b"\n") or len(line) > MAX_HEAD:
        raise PhasedError("no framing line")
    try:
        head = orjson.loads(line)
        status, headers = int(head["status"]), dict(head["headers"])
    except (ValueError, TypeError, KeyError) as exc:
        raise PhasedError(f"bad framing line: {exc}") from None
    if not 100 <= status <= 599:
        raise PhasedError(f"bad status {status}")
    carried = {str(k): str(v) for k, v in headers.items() if str(k).lower() in CARRIED}
    return line, status, carried, body
