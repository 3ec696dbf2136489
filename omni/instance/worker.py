"""The model instance process: loads one model and serves it on a Unix socket.

omnid starts one of these per catalog model inside a sandbox and is its only client:
`python -m omni.instance.worker`, with what to serve in `OMNI_INSTANCE_SETTINGS`
(settings.py). The model sits behind a backend (backends.py); this module adds the
`/health` omnid checks and runs the server.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from pathlib import Path

from aiohttp import web

from omni.api.errors import error_middleware, json_response
from omni.logs import setup_logging
from omni.runtime.code import PACKAGE_ENV, check_package

from .backends import Backend, open_backend
from .settings import InstanceSettings

log = logging.getLogger("omni.worker")
MAX_REQUEST_BYTES = 64 << 20


def build_app(settings: InstanceSettings, backend: Backend) -> web.Application:
    """The backend's routes and `/health`, which fails once the backend must be restarted."""
    app = web.Application(middlewares=[error_middleware], client_max_size=MAX_REQUEST_BYTES)
    backend.add_routes(app)
    started = time.time()
    trims = {"memory_trims": 0, "memory_trimmed_bytes": 0}  # omnid's asks before swap-outs

    async def health(_request: web.Request) -> web.Response:
        problem = backend.unhealthy()
        return json_response(
            {
                "status": "unhealthy" if problem else "ok",
                **({"reason": problem} if problem else {}),
                "model": settings.name,
                "kind": backend.kind,
                "uptime_s": time.time() - started,
                **backend.stats(),
                **trims,
            },
            status=503 if problem else 200,
        )

    async def trim(_request: web.Request) -> web.Response:
        """omnid is about to swap this idle instance out: free what it holds unused."""
        trims["memory_trims"] += 1
        trims["memory_trimmed_bytes"] += await asyncio.to_thread(backend.trim)
        return web.Response(status=204)

    app.router.add_get("/health", health)
    app.router.add_post("/trim", trim)
    app.on_shutdown.append(lambda _app: backend.close())
    return app


async def serve(settings: InstanceSettings) -> None:
    t0 = time.monotonic()
    socket_path = Path(settings.socket)
    backend = open_backend(settings)
    runner = web.AppRunner(build_app(settings, backend), handler_cancellation=True, access_log=None)
    await runner.setup()
    socket_path.unlink(missing_ok=True)
    site = web.UnixSite(runner, str(socket_path))
    await site.start()
    log.info(
        "instance %s (%s) ready in %.2fs on %s",
        settings.name,
        backend.kind,
        time.monotonic() - t0,
        socket_path,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
    if problem := backend.unhealthy():  # a thread stuck in model code would hold up the exit
        log.error("instance %s ends at once: %s", settings.name, problem)
        os._exit(1)


def main() -> None:
    settings = InstanceSettings.from_env()
    check_package(os.environ.get(PACKAGE_ENV))
    setup_logging(f"instance[{settings.name}]")
    if settings.memory_limit_bytes:  # the engine sizes its CPU KV cache from it
        os.environ["OMNI_MEMORY_LIMIT_BYTES"] = str(settings.memory_limit_bytes)
    threads = os.environ.get("OMNI_TORCH_THREADS")
    if threads:
        import torch

        torch.set_num_threads(int(threads))
    asyncio.run(serve(settings))


if __name__ == "__main__":
    main()
