"""The dashboards' page served with its first snapshot inlined, so that it draws at once
instead of after its event stream's first message.

The snapshot goes into the page's `<script id="snapshot" type="application/json">` data
block (never run as script, so the pages' CSP stays without 'unsafe-inline'). What it
holds comes from configs, instances and nodes (a failed instance's last output lines, a
node's model names), so it is escaped as hostile: every `<`, `>` and `&` becomes its
JSON `\\u` escape, and nothing in it can end the block or open a comment.
"""

from __future__ import annotations

import orjson
from aiohttp import web

from omni.api import live

PAGE = "index.html"
PLACEHOLDER = b'<script id="snapshot" type="application/json">null</script>'
ESCAPES = ((b"<", b"\\u003c"), (b">", b"\\u003e"), (b"&", b"\\u0026"))


def data_block(snapshot: dict | None) -> bytes:
    """The page's data block holding `snapshot` (null: none), safe inside HTML."""
    data = orjson.dumps(snapshot)
    for raw, escaped in ESCAPES:
        data = data.replace(raw, escaped)
    return PLACEHOLDER.replace(b">null<", b">" + data + b"<")


class PageAssets(live.Assets):
    """The dashboard's files, its page with the latest snapshot in it (none, when that
    snapshot fails: the page then waits for the stream, as before)."""

    def __init__(self, snapshots: live.Snapshots, *dirs):
        super().__init__(*dirs)
        self.snapshots = snapshots

    def response(self, name: str) -> web.Response:
        resp = super().response(name)
        if name != PAGE:
            return resp
        resp.body = resp.body.replace(PLACEHOLDER, data_block(self.snapshots.get()), 1)
        return resp
