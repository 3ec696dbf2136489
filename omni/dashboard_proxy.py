"""`omnictl dashboard`: omnid's dashboard in a browser, through a loopback port.

The dashboard is served on omnid's admin socket, which a browser cannot reach; this
forwards the dashboard's GETs (the page, its files, the snapshot and the event stream,
chunk by chunk) from 127.0.0.1:PORT to it. It forwards nothing else, so the admin API's
actions stay on the socket, and only as the user who runs it may use that socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from pathlib import Path

import aiohttp
from aiohttp import web

from omni.api import live

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
PASSED_HEADERS = ("Content-Type", "Cache-Control", *live.SECURITY_HEADERS)
CLIENT = web.AppKey("client", aiohttp.ClientSession)


def proxy_app(socket: Path) -> web.Application:
    app = live.listener_app(HOST)

    async def start(app: web.Application) -> None:
        app[CLIENT] = aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=str(socket)),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
        )

    async def close(app: web.Application) -> None:
        await app[CLIENT].close()  # ends the streams being forwarded, too

    app.on_startup.append(start)
    app.on_shutdown.append(close)

    async def forward(request: web.Request) -> web.StreamResponse:
        try:
            upstream = await app[CLIENT].get(f"http://omnid{request.path}")
        except (aiohttp.ClientError, OSError) as exc:
            return web.Response(status=502, text=f"omnid's admin socket {socket}: {exc}\n")
        async with upstream:
            headers = {k: upstream.headers[k] for k in PASSED_HEADERS if k in upstream.headers}
            resp = web.StreamResponse(status=upstream.status, headers=headers)
            await resp.prepare(request)
            with contextlib.suppress(ConnectionError, aiohttp.ClientError):
                async for chunk in upstream.content.iter_any():  # the stream, as it comes
                    await resp.write(chunk)
                await resp.write_eof()
        return resp

    for path in (live.PAGE_PATH, live.PAGE_PATH + "/{name}", live.SNAPSHOT_PATH):
        app.router.add_get(path, forward)
    app.router.add_get(live.EVENTS_PATH, forward)
    return app


async def check(socket: Path) -> None:
    """Fail early, with the reason, when omnid's admin socket does not answer."""
    connector = aiohttp.UnixConnector(path=str(socket))
    try:
        async with (
            aiohttp.ClientSession(connector=connector) as client,
            client.get("http://omnid" + live.SNAPSHOT_PATH) as resp,
        ):
            status, body = resp.status, await resp.text()
    except (aiohttp.ClientError, OSError) as exc:
        raise RuntimeError(f"cannot reach omnid at {socket}: {exc}") from None
    if status != 200:
        raise RuntimeError(f"omnid at {socket} answered {status}: {body[:300]}")


async def serve(socket: Path, port: int, ready=None) -> None:
    """Forward until SIGINT or SIGTERM; `ready(url)` once listening."""
    await check(socket)
    runner = web.AppRunner(proxy_app(socket), access_log=None, shutdown_timeout=2)
    await runner.setup()
    site = web.TCPSite(runner, HOST, port)
    await site.start()
    bound = runner.addresses[0][1]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if ready is not None:
        ready(f"http://{HOST}:{bound}{live.PAGE_PATH}")
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
