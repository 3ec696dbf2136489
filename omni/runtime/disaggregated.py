"""A model served disaggregated: its prompt computed on a prefill instance, its answer
decoded on a decode instance, the prompt's K/V handed between them (kv_transfer.py).

The catalog gives such a model two or more entries, each with a `role` and the name it
`serves`. A request for that name goes to the prefill instance with the fewest prompt
tokens queued, which writes the K/V of the prompt's full blocks into its own directory;
omnid copies the file into a new one in the decode instance's directory (each instance
writes only its own size-limited tmpfs) owned by that instance's uid, and relays the
request there, to the decode instance with the most free KV blocks. The decode instance
checks the handoff is this request's, computes the prompt's last block or two and
streams the answer. A handoff left behind by a failure is removed here.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
import uuid

import aiohttp
from aiohttp import web

from omni.api.errors import unavailable
from omni.api.proxy import relay, relay_headers, upstream_failed
from omni.engine import kv_transfer
from omni.isolation import hostfs

from .instance import Instance

log = logging.getLogger(__name__)


def sides(instances: dict[str, Instance], name: str) -> dict[str, list[Instance]]:
    """The instances serving `name` disaggregated, by role ({} for any other name)."""
    out: dict[str, list[Instance]] = {}
    for inst in instances.values():
        if inst.entry.placement.serves == name:
            out.setdefault(inst.entry.placement.role or "", []).append(inst)
    return out


def pick_prefill(instances: list[Instance]) -> Instance:
    """The one with the fewest prompt tokens waiting (then the fewest requests)."""
    return min(instances, key=lambda i: (i.load()["queued_prompt_tokens"], i.in_flight))


def pick_decode(instances: list[Instance]) -> Instance:
    """The one with the most of its KV cache free (then the fewest requests)."""
    return min(instances, key=lambda i: (i.load()["kv_occupancy"], i.in_flight))


def listing(instances: dict[str, Instance], name: str) -> dict:
    """The model's entry in /v1/models: the decode side's permits (each request holds one
    there while it streams), ready when both sides are, and the load a router weighs."""
    by_role = sides(instances, name)
    prefill, decode = by_role.get("prefill", []), by_role.get("decode", [])
    ready = all(str(i.state) == "ready" for i in prefill + decode)
    return {
        "permits": sum(i.entry.placement.permits for i in decode),
        "state": "ready" if ready else "starting",
        "disaggregated": {"prefill": [i.name for i in prefill], "decode": [i.name for i in decode]},
        "load": {
            "queued_prompt_tokens": sum(i.load()["queued_prompt_tokens"] for i in prefill),
            "kv_occupancy": min((i.load()["kv_occupancy"] for i in decode), default=0.0),
        },
    }


async def serve(node, request: web.Request, body: bytes, name: str, on_usage) -> web.StreamResponse:
    """One request for the disaggregated model `name` (`node`: omnid's Node)."""
    by_role = sides(node.instances, name)
    missing = [role for role in ("prefill", "decode") if not by_role.get(role)]
    if missing:  # a side unloaded through the admin API
        raise unavailable(f"Model '{name}' has no {missing[0]} instance on this node.", 5)
    prefill = pick_prefill(by_role["prefill"])
    decode = pick_decode(by_role["decode"])
    for inst in (prefill, decode):
        if not await inst.wait_ready(node.ready_wait_s):
            raise unavailable(
                f"Model '{name}' is {inst.state}; retry shortly.", inst.retry_after_s()
            )
    handoff_id = uuid.uuid4().hex
    src = kv_transfer.handoff_path(prefill.socket_path.parent, handoff_id)
    dst = kv_transfer.handoff_path(decode.socket_path.parent, handoff_id)
    ticket = request["omni_ticket"]
    deadline = time.monotonic() + node.request_timeout_s
    try:
        t0 = time.monotonic()
        async with node.admission(prefill, deadline):
            done = await _prefill(request, prefill, body, handoff_id)
        if isinstance(done, web.Response):  # the prompt refused (a 400): as it said
            return done
        extra = {}
        if done["blocks"]:
            await _hand_over(node, prefill, decode, src.name)
            extra = {kv_transfer.IMPORT_HEADER: handoff_id}
        node.metrics.observe_kv_transfer(name, done["bytes"], time.monotonic() - t0)
        async with node.admission(decode, deadline, ticket):
            return await relay(
                request,
                decode.session,
                decode.url(request.path),
                body,
                upstream_name=f"decode instance of '{name}'",
                retry_after_s=decode.retry_after_s(),
                drop_headers=kv_transfer.HEADERS,
                extra_headers=extra,
                on_usage=on_usage,
            )
    finally:
        for path in (src, dst):
            path.unlink(missing_ok=True)


async def _hand_over(node, prefill: Instance, decode: Instance, name: str) -> None:
    """The prefill instance's handoff file, copied into a new file of the decode instance's
    (each writes only its own size-limited directory): a file of the prefill instance's
    own, never a link, and a new name on the decode side, readable by that instance alone."""
    owners = (None, None)
    if node.isolated:
        owners = (node.sandbox_uid(prefill.name), node.sandbox_uid(decode.name))
    try:
        await asyncio.to_thread(
            hostfs.copy_file,
            prefill.socket_path.parent,
            name,
            owners[0],
            decode.socket_path.parent,
            owners[1],
        )
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            log.warning("handoff to %s: its directory is full", decode.name)
            raise unavailable(
                f"The decode instance '{decode.name}' has no room for it.", 2
            ) from None
        log.warning("handoff from %s to %s refused: %s", prefill.name, decode.name, exc)
        raise upstream_failed(f"The KV handoff of '{prefill.name}' failed.", 1) from None


async def _prefill(
    request: web.Request, inst: Instance, body: bytes, handoff_id: str
) -> dict | web.Response:
    """The prefill instance's summary of the handoff it wrote; its answer as is if it
    refused the request (a bad prompt: the client's error, not a failure)."""
    headers = relay_headers(request.headers, kv_transfer.HEADERS)
    headers[kv_transfer.EXPORT_HEADER] = handoff_id
    try:
        async with inst.session.post(inst.url(request.path), data=body, headers=headers) as resp:
            data = await resp.read()
            if resp.status != 200:
                if resp.status < 500:
                    return web.Response(
                        body=data, status=resp.status, content_type="application/json"
                    )
                log.warning("prefill instance %s answered %d", inst.name, resp.status)
                raise upstream_failed(f"The prefill instance '{inst.name}' failed.", 1)
            return await resp.json()
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
        log.warning("prefill instance %s failed: %s", inst.name, exc)
        raise upstream_failed(f"The prefill instance '{inst.name}' is unavailable.", 1) from None
