"""omnid's dashboard as it looked during a benchmark run, rendered from the snapshots the
run recorded (bench/overcommit_bench.py writes overcommit-<name>-dashboard.json: what
omnid's /v1/dashboard served once a second through the measured window).

The GPU machines have no browser, so the page is rendered here: a local server replays the
snapshots through the page's own event stream (their own timestamps, so the plots' time
axes are the run's), and Debian's Chromium, driven by Playwright, takes the screenshot
once the last one is shown. Writes the PNG beside the snapshots' file.

    python bench/diagnostics/dashboard_shot.py bench/results/overcommit-h100-s1-dashboard.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from aiohttp import web  # noqa: E402

from omni.api import live  # noqa: E402

CHROMIUM = "/usr/bin/chromium"


class Replay:
    """The recorded snapshots, one per call, then the last one again."""

    def __init__(self, snapshots: list[dict]):
        self.snapshots, self.shown = snapshots, 0

    def get(self) -> dict:
        snap = self.snapshots[min(self.shown, len(self.snapshots) - 1)]
        self.shown += 1
        return snap


def serve(replay: Replay, port: int, ready: threading.Event) -> None:
    """The page and its assets as omnid serves them; its events from `replay`, fast."""

    async def main() -> None:
        app, assets, stop = web.Application(), live.Assets(live.STATIC), asyncio.Event()

        async def page(_request: web.Request) -> web.Response:
            return assets.response("index.html")

        async def asset(request: web.Request) -> web.Response:
            return assets.response(request.match_info["name"])

        async def events(request: web.Request) -> web.StreamResponse:
            return await live.stream(request, replay, stop, interval_s=0.02)

        app.router.add_get(live.PAGE_PATH, page)
        app.router.add_get(live.PAGE_PATH + "/{name}", asset)
        app.router.add_get(live.EVENTS_PATH, events)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        ready.set()
        await asyncio.Event().wait()

    asyncio.run(main())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("snapshots", type=Path)
    ap.add_argument("--port", type=int, default=9189)
    args = ap.parse_args()
    data = json.loads(args.snapshots.read_text())
    replay = Replay(data["snapshots"])
    ready = threading.Event()
    threading.Thread(target=serve, args=(replay, args.port, ready), daemon=True).start()
    ready.wait(10)
    from playwright.sync_api import sync_playwright

    out = args.snapshots.with_suffix(".png")
    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        page = browser.new_page(viewport={"width": 1400, "height": 1100})
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(f"http://127.0.0.1:{args.port}{live.PAGE_PATH}")
        while replay.shown < len(replay.snapshots) + 5:
            page.wait_for_timeout(200)
        page.wait_for_timeout(500)
        page.screenshot(path=str(out), full_page=True)
        browser.close()
    print(
        f"{len(replay.snapshots)} snapshots from {data.get('device', {}).get('gpus')}, "
        f"commit {data.get('commit')}, {data.get('date')}; page errors: {errors or 'none'}"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
