"""omnid's admin API: HTTP/JSON on a Unix socket (0660 root:omni), each peer checked by
SO_PEERCRED (`peer_credentials`). List, load, unload, restart, swap in/out, drain and
undrain, which `omnictl` speaks, and the read-only dashboard (dashboard.py).
"""

from __future__ import annotations

import asyncio
import grp
import logging
import os
import socket
import struct
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web

from omni.api.errors import ApiError, json_response
from omni.engine.checkpoint import CheckpointError

from . import dashboard
from .catalog import CatalogError
from .entry_spec import entry_from_spec

if TYPE_CHECKING:
    from .omnid import Node

log = logging.getLogger("omnid")

ADMIN_GROUP = "omni"  # members may use the admin socket


def peer_allowed(uid: int, gid: int, pid: int) -> bool:
    """Root, omnid's own user, or a member of the `omni` group (SO_PEERCRED's identity);
    never omnid itself, which has no use for its own admin API: a connection from it was
    steered here (a link an instance planted where omnid expected its socket)."""
    if pid == os.getpid():
        return False
    if uid in (0, os.geteuid()):
        return True
    try:
        omni_gid = grp.getgrnam(ADMIN_GROUP).gr_gid
    except KeyError:
        return False
    if gid == omni_gid:
        return True
    try:  # supplementary groups of the connecting process
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Groups:"):
                return str(omni_gid) in line.split()[1:]
    except OSError:
        pass
    return False


@web.middleware
async def peer_credentials(request: web.Request, handler):
    """Only peers `peer_allowed` admits: the admin API changes what the node runs."""
    sock = request.transport.get_extra_info("socket") if request.transport else None
    if sock is None or sock.family != socket.AF_UNIX:
        raise ApiError(403, "The admin API is only served on its Unix socket.")
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    if not peer_allowed(uid, gid, pid):
        log.warning("admin request refused: uid %d gid %d pid %d", uid, gid, pid)
        raise ApiError(403, f"uid {uid} may not use omnid's admin API.", code="forbidden")
    return await handler(request)


class AdminRoutes:
    """The admin API's handlers, over the node whose catalog and instances they change."""

    def __init__(self, node: Node):
        self.node = node

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_post("/v1/models", self.load)
        app.router.add_delete("/v1/models/{name}", self.unload)
        app.router.add_get("/v1/instances", self.list_instances)
        app.router.add_post("/v1/instances/{name}/restart", self.restart)
        app.router.add_post("/v1/instances/{name}/{direction:swap-out|swap-in}", self.swap)
        app.router.add_get("/v1/node", self.node_status)
        app.router.add_post("/v1/node/drain", self.drain)
        app.router.add_post("/v1/node/undrain", self.undrain)
        dashboard.add_routes(app, self.node)  # read-only: GET /dashboard, /v1/dashboard[/events]

    async def list_models(self, _request: web.Request) -> web.Response:
        node = self.node
        # the catalog: what runs, and what a drain stopped (undrain starts it again)
        running = [
            {**i.entry.to_json(), "state": node.instance_json(i)["state"]}
            for i in node.instances.values()
        ]
        drained = [{**e.to_json(), "state": "drained"} for e in node.drained or []]
        return json_response({"models": running + drained})

    async def list_instances(self, _request: web.Request) -> web.Response:
        node = self.node
        return json_response(
            {
                "instances": [node.instance_json(i) for i in node.instances.values()],
                "draining": node.draining,
                "drained": node.drained_names(),
            }
        )

    async def node_status(self, _request: web.Request) -> web.Response:
        node = self.node
        return json_response(
            {
                "draining": node.draining,
                "drained": node.drained_names(),
                "instances": len(node.instances),
                "gpus": [p.to_json() for p in node.pools.values()],
                "sandbox": node.sandbox,
            }
        )

    async def load(self, request: web.Request) -> web.Response:
        """Add a model to the catalog (in the state dir too, when the node keeps one: it
        survives a restart) and start its instance."""
        node = self.node
        name, spec = await self._load_request(request)
        try:
            entry = await asyncio.to_thread(entry_from_spec, name, spec)
        except (CatalogError, CheckpointError) as exc:
            raise ApiError(
                400, str(exc), param="path" if isinstance(exc, CheckpointError) else None
            ) from None
        inst = node.add(entry)
        if node.catalog:
            node.catalog.loaded(name, spec)
        log.info("loaded %s from %s", name, entry.path)
        return json_response(node.instance_json(inst), 201)

    async def _load_request(self, request: web.Request) -> tuple[str, dict]:
        """A load's model name and its spec (the body's other fields), refused before
        anything is read from disk when malformed or when the name is taken."""
        try:
            body = await request.json()
        except ValueError:
            raise ApiError(400, "Request body is not valid JSON.") from None
        if not isinstance(body, dict):
            raise ApiError(400, "Request body must be a JSON object.")
        name, path = body.get("name"), body.get("path")
        for key, value in (("name", name), ("path", path)):
            if not isinstance(value, str) or not value:
                raise ApiError(400, f"Missing required parameter: '{key}'.", param=key)
        if name in self.node.instances or name in self.node.drained_names():
            raise ApiError(
                409, f"Model '{name}' is already loaded.", param="name", code="model_exists"
            )
        return name, {k: v for k, v in body.items() if k != "name"}

    async def unload(self, request: web.Request) -> web.Response:
        node = self.node
        name = request.match_info["name"]
        drained = {e.name: e for e in node.drained or []}
        if name in drained:  # stopped by a drain: out of the catalog, not started again
            node.drained = [e for e in node.drained or [] if e.name != name]
            origin = drained[name].origin
        else:
            origin = node.get(name).entry.origin
            await node.remove(name)
        if node.catalog:
            node.catalog.unloaded(name, origin)
        log.info("unloaded %s", name)
        return json_response({"name": name, "unloaded": True})

    async def restart(self, request: web.Request) -> web.Response:
        inst = self.node.get(request.match_info["name"])
        inst.restart("restarted by the operator", drain=True)
        return json_response(self.node.instance_json(inst), 202)

    async def swap(self, request: web.Request) -> web.Response:
        inst = self.node.get(request.match_info["name"])
        if inst.gpu is None or inst.member is None:
            raise ApiError(409, f"Model '{inst.name}' has no GPU memory to swap.")
        direction = request.match_info["direction"]
        await inst.force_swap("out" if direction == "swap-out" else "in")
        return json_response(self.node.instance_json(inst))

    async def drain(self, _request: web.Request) -> web.Response:
        self.node.start_drain()
        return json_response({"draining": True}, 202)

    async def undrain(self, _request: web.Request) -> web.Response:
        started = await self.node.undrain()
        return json_response({"draining": False, "started": started})
