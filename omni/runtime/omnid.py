"""omnid, the per-node daemon: catalog, instance supervision, inference and admin APIs.

- HTTP (TCP) inference endpoint: OpenAI-compatible, routed to the model's instance,
  and Prometheus `/metrics`.
- Admin API (HTTP/JSON on a Unix socket, 0660 root:omni, peers checked by SO_PEERCRED):
  list, load, unload, restart, swap in/out, drain and undrain; `omnictl` speaks it.
- GPU instances run under the CUDA shim; a residency pool per GPU keeps the
  instances resident on it within its memory budget (see residency.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import grp
import hashlib
import json
import logging
import math
import os
import shutil
import signal
import socket
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web

from omni import paths, sdnotify
from omni.api import oip_grpc
from omni.api.errors import ApiError, error_middleware, model_not_found, unavailable
from omni.api.oip_http import oip_errors
from omni.cudashim import ShimBuildError, library_path
from omni.engine.checkpoint import CheckpointError
from omni.isolation import hostfs, seccomp
from omni.isolation.cgroups import CgroupError, CgroupManager
from omni.isolation.isolated import IsolatedSandbox
from omni.isolation.record import Record
from omni.isolation.sandbox import ProcessSandbox, SandboxSpec
from omni.isolation.uids import UidAllocator
from omni.isolation.view import ViewConfig
from omni.logs import setup_logging

from . import dashboard
from .admin_routes import ADMIN_GROUP, AdminRoutes, peer_credentials
from .catalog import (
    DEFAULT_GPU_YIELD_S,
    SANDBOX_LIMITS,
    CatalogError,
    ModelEntry,
    NodeConfig,
    load_config,
)
from .cluster import ClusterMember
from .code import InstanceCode
from .defaults import MINILM_PACKAGE, SMOLLM_PACKAGE, default_entries, package_dir
from .entry_spec import SPEC_KEYS, entry_from_spec
from .inference_routes import InferenceRoutes, Ticket
from .instance import GpuPlacement, Instance, SandboxAdopter, SandboxFactory, fingerprint
from .metrics import Metrics
from .residency import GpuPool

if TYPE_CHECKING:
    from omni.cluster.telemetry import LoadAccumulator

log = logging.getLogger("omnid")

# sandbox uids, shared by every omnid of the host (not under a runtime dir, which systemd
# removes when its unit stops)
HOST_UID_TABLE = Path("/run/omni-uids/table.json")
MAX_UNIX_PATH = 107  # sun_path holds 108 bytes with the terminating NUL
PERMIT_QUEUE = 4  # requests that may wait for a permit, per permit
DEFAULT_GRPC_PORT = "8082"  # on loopback: the edge's (8001) is the public one


class Node:
    """The node's catalog, one supervised instance per model, and its GPUs' pools."""

    def __init__(
        self,
        runtime_dir: Path,
        ready_wait_s: float = 30.0,
        gpus: dict[int, int] | None = None,
        swap_timeout_s: float = 30.0,
        request_timeout_s: float = 60.0,
        state_dir: Path | None = None,
        gpu_yield_s: float = DEFAULT_GPU_YIELD_S,
    ):
        self.socket_dir = paths.instance_socket_dir(runtime_dir)
        self.ready_wait_s = ready_wait_s
        self.request_timeout_s = request_timeout_s
        self.instances: dict[str, Instance] = {}
        self.started = int(time.time())
        self.sandbox_factory: SandboxFactory = ProcessSandbox
        self.isolated = False  # instances get their own uids (sandboxed as root)
        self.sandbox = sandbox_report("process")  # what it enforces: sandbox_factory says
        self.draining = False
        # what a finished drain stopped, for undrain to start again (None: nothing stopped)
        self.drained: list[ModelEntry] | None = None
        self._drain: asyncio.Task | None = None
        self.catalog = CatalogStore(state_dir) if state_dir else None
        # instances' disk KV tiers (kv_disk_cache): on disk, unlike the runtime dir
        self.kv_disk_root = (state_dir or runtime_dir) / "kv-disk"
        self.wheelhouse: Path | None = None  # models' own packages from here (envs.py)
        self.metrics = Metrics(lambda: list(self.instances.values()), self.pools_list)
        self.load: LoadAccumulator | None = None  # load telemetry, when a cluster takes it
        self.pools = {
            index: GpuPool(
                index,
                budget,
                swap_timeout_s,
                observer=self.metrics.observe_swap,
                yield_max_s=gpu_yield_s,
            )
            for index, budget in (gpus or {}).items()
        }
        self._shim: Path | None = None
        self._uids: dict[str, int] = {}  # instance name -> its uid, leased host-wide
        self.uids = UidAllocator(HOST_UID_TABLE)
        self.uid_owner = str(runtime_dir.resolve())  # this daemon, in the uid table
        # live restore: sandboxes an earlier omnid left running, by name, until adopted
        self.running: dict[str, Record] = {}
        self.sandbox_adopter: SandboxAdopter | None = None
        self.sandbox_workdir = runtime_dir / "sandboxes"
        self.orphan_timeout_s = 60.0
        self.cgroups: CgroupManager | None = None

    def find_running(self) -> None:
        """The sandboxes an earlier omnid of this runtime dir left running (live restore),
        to be adopted as their models are added; the records of dead ones removed."""
        if not self.sandbox_workdir.is_dir() or self.sandbox_adopter is None:
            return
        for workdir in self.sandbox_workdir.iterdir():
            record = Record.load(workdir) if workdir.is_dir() else None
            if record is not None and record.alive():
                self.running[record.name] = record
            elif workdir.is_dir():
                shutil.rmtree(workdir, ignore_errors=True)

    def end(self, record: Record) -> None:
        """Stop a running sandbox no model of this catalog may adopt."""
        log.warning("instance %s left running by an earlier omnid: stopped", record.name)
        with contextlib.suppress(ProcessLookupError):
            if record.alive():
                os.kill(record.launcher_pid, signal.SIGKILL)
        if self.cgroups is not None:
            with contextlib.suppress(CgroupError, OSError):
                self.cgroups.existing(record.name).destroy()
        shutil.rmtree(self.sandbox_workdir / record.name, ignore_errors=True)
        for root in (self.socket_dir, self.kv_disk_root):
            hostfs.remove_tree(root / record.name)

    def end_unclaimed(self) -> None:
        """Those left running that no model of the catalog took over."""
        for name in list(self.running):
            self.end(self.running.pop(name))

    def clear_leftovers(self) -> None:
        """What instances of an earlier run left (their directories and mounts, disk KV
        tiers), but for those still running: every instance starts from nothing."""
        for root in (self.socket_dir, self.kv_disk_root):
            if root.is_dir():
                for child in root.iterdir():
                    if child.name not in self.running:
                        hostfs.remove_tree(child)

    def pools_list(self) -> list[GpuPool]:
        return list(self.pools.values())

    def sandbox_uid(self, name: str) -> int:
        """Each instance its own unprivileged uid, unique on the host (see uids.py): no
        shared files, signals or rlimits, with another instance of any omnid."""
        if name not in self._uids:
            self._uids[name] = self.uids.lease(self.uid_owner, name)
        return self._uids[name]

    def hidden_paths(self) -> tuple[Path, ...]:
        """Every model's files: each sandbox must see its own model only."""
        sources = [package_dir(SMOLLM_PACKAGE), package_dir(MINILM_PACKAGE)]
        return tuple(i.entry.path for i in self.instances.values()) + tuple(
            p for p in sources if p is not None
        )

    def shim_library(self) -> Path:
        """libomnicuda.so, built on first use (GPU instances only)."""
        if self._shim is None:
            try:
                self._shim = library_path()
            except ShimBuildError as exc:
                raise ApiError(500, f"cannot build the CUDA shim: {exc}") from None
        return self._shim

    def _gpu_placement(self, entry: ModelEntry) -> GpuPlacement | None:
        """The pools of the entry's GPUs (rank 0's first), each checked to take its quota."""
        if not entry.placement.gpus:
            return None
        pools = []
        for gpu in entry.placement.gpus:
            pool = self.pools.get(gpu)
            if pool is None:
                raise ApiError(400, f"GPU {gpu} has no budget on this node.", param="gpu")
            if (entry.placement.quota_bytes or 0) > pool.budget_bytes:
                raise ApiError(400, f"The quota exceeds GPU {gpu}'s budget.", param="quota")
            pools.append(pool)
        owner = self.sandbox_uid(entry.name) if self.isolated else None
        return GpuPlacement(tuple(pools), self.shim_library(), owner)

    def add(self, entry: ModelEntry) -> Instance:
        if self.sandbox["missing"]:  # the config's require_limits, not enforced here
            raise limits_unmet(self.sandbox["missing"])
        if entry.name in self.instances:
            raise ApiError(
                409, f"Model '{entry.name}' is already loaded.", param="name", code="model_exists"
            )
        socket_path = self.socket_dir / entry.name / "io" / "sock"  # Instance.socket_path
        if len(os.fsencode(socket_path)) > MAX_UNIX_PATH:
            raise ApiError(
                400,
                f"Socket path {socket_path} is longer than {MAX_UNIX_PATH} "
                "bytes; use a shorter runtime dir or model name.",
                param="name",
            )
        if self.isolated:
            check_readable_by_others(entry.path)
            if entry.placement.draft_path is not None:
                check_readable_by_others(entry.placement.draft_path)
        gpu = self._gpu_placement(entry)
        inst = Instance(
            entry,
            self.socket_dir,
            self.sandbox_factory,
            gpu=gpu,
            kv_disk_dir=self.kv_disk_root / entry.name,
            adopt=self._adoption(entry),
            data_dir=self.kv_disk_root.parent,  # (its packages' environments: envs.py)
            wheelhouse=self.wheelhouse,
        )
        for pool, member in zip(gpu.pools if gpu else (), inst.members, strict=True):
            pool.add(member)
        self.instances[entry.name] = inst
        inst.start()
        return inst

    def _adoption(self, entry: ModelEntry) -> tuple[Record, SandboxAdopter] | None:
        """The running sandbox left for this model, where it may be adopted: started as
        this entry with this code (its fingerprint), as the uid the host's table gives."""
        record = self.running.pop(entry.name, None)
        if record is None or self.sandbox_adopter is None:
            return None
        same = record.fingerprint == fingerprint(entry, InstanceCode.of_this_process())
        if same and record.alive() and record.uid == self.sandbox_uid(entry.name):
            return record, self.sandbox_adopter
        self.end(record)
        return None

    async def detach(self) -> None:
        """Leave every instance running for the next omnid (live restore)."""
        await asyncio.gather(*(inst.detach() for inst in self.instances.values()))
        self.instances.clear()

    async def remove(self, name: str) -> None:
        """Unload: its requests in flight finish (at most its drain time), new ones are
        refused with 503 meanwhile (another node may serve them), then it stops."""
        inst = self.instances.get(name)
        if inst is None:
            raise model_not_found(name)
        if inst.stopping:
            raise ApiError(409, f"Model '{name}' is being unloaded.", code="model_unloading")
        await inst.stop(drain=True)
        self.instances.pop(name, None)
        for pool in inst.gpu.pools if inst.gpu else ():
            await pool.remove(name)
        if self._uids.pop(name, None) is not None:  # its processes are gone: free its uid
            self.uids.release(self.uid_owner, name)

    async def shutdown(self) -> None:
        await asyncio.gather(*(inst.stop() for inst in self.instances.values()))
        self.instances.clear()

    def get(self, name: str) -> Instance:
        inst = self.instances.get(name)
        if inst is None:
            raise model_not_found(name)
        return inst

    async def wait_ready(self, inst: Instance) -> None:
        """Wait for the instance to be ready (up to `ready_wait_s`), else a 503 that says
        why."""
        if await inst.wait_ready(self.ready_wait_s):
            return
        if inst.failure is not None:
            raise unavailable(
                f"Model '{inst.name}' failed to start: {inst.failure}", inst.retry_after_s()
            )
        raise unavailable(
            f"Model '{inst.name}' is {inst.state}; retry shortly.", inst.retry_after_s()
        )

    @contextlib.asynccontextmanager
    async def admission(self, inst: Instance, deadline: float, ticket: Ticket | None = None):
        """One of the instance's permits, and (on a GPU) its memory resident, for a request;
        `ticket` gets how long it waited for the permit and how long it held it. Yields
        the permit's early release: a request whose GPU work is over (phased.py) hands
        it to the next one while it finishes."""
        ticket = ticket if ticket is not None else Ticket()
        if self.draining:
            raise unavailable("This node is draining; retry on another node.", 5)
        if inst.stopping:
            raise unavailable(f"Model '{inst.name}' is being unloaded from this node.", 1)
        if inst.permits.locked() and inst.waiting >= PERMIT_QUEUE * inst.entry.placement.permits:
            raise ApiError(
                429,
                f"Model '{inst.name}' is at capacity; retry shortly.",
                code="rate_limit_exceeded",
                retry_after=1,
            )
        inst.waiting += 1
        queued = time.monotonic()
        try:
            await asyncio.wait_for(inst.permits.acquire(), max(0.0, deadline - queued))
        except TimeoutError:
            raise unavailable(f"Model '{inst.name}' is busy; retry shortly.", 2) from None
        finally:
            inst.waiting -= 1
            ticket.queue_s = time.monotonic() - queued
        acquired = time.monotonic()
        inst.in_flight += 1
        inst.last_used = time.time()
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                inst.permits.release()
                ticket.held_s = time.monotonic() - acquired

        try:
            if inst.gpu is not None:
                async with inst.resident(deadline):
                    yield release
            else:
                yield release
        finally:
            inst.in_flight -= 1
            inst.last_used = time.time()
            release()

    def start_drain(self) -> None:
        """Drain in the background (`drain`), unless it is draining already."""
        if not self.draining:
            self.draining = True
            self._drain = asyncio.get_running_loop().create_task(self.drain())

    async def drain(self) -> None:
        """Stop routing, let in-flight requests finish, then stop every instance; their
        entries are kept for `undrain`."""
        self.draining = True
        while any(i.in_flight for i in self.instances.values()):
            await asyncio.sleep(0.1)
        self.drained = [*(self.drained or []), *(i.entry for i in self.instances.values())]
        await self.shutdown()
        log.info("node drained: %s stopped", ", ".join(e.name for e in self.drained) or "nothing")

    async def settle_drain(self) -> None:
        """End a drain under way: one still waiting for requests in flight is called off
        (it has stopped nothing), one stopping instances finishes (cut off half-way, it
        would leave their mounts and directories behind)."""
        task, self._drain = self._drain, None
        if task is None:
            return
        if not task.done() and self.drained is None:
            task.cancel()
        await asyncio.wait([task])

    async def undrain(self) -> list[str]:
        """Undo a drain: route again, and start again the instances it stopped (called off
        while it still waits for requests in flight, it has stopped nothing). Returns the
        names of those started again."""
        await self.settle_drain()
        self.draining = False
        entries, self.drained = self.drained or [], None
        started = []
        for entry in entries:
            if entry.name in self.instances:  # loaded again meanwhile: that one stays
                continue
            try:
                self.add(entry)
            except ApiError as exc:
                log.error("model %s not started again: %s", entry.name, exc.message)
                continue
            started.append(entry.name)
        log.info("node undrained: %s started again", ", ".join(started) or "nothing")
        return started

    def drained_names(self) -> list[str]:
        return [e.name for e in self.drained or []]

    def instance_json(self, inst: Instance) -> dict:
        """An instance as the admin API and the dashboard show it: "draining" while the
        node drains (it takes no new request), whatever its own state."""
        info = inst.to_json()
        if self.draining and info["state"] == "ready":
            info["state"] = "draining"
        return info


def check_readable_by_others(model_dir: Path) -> None:
    """A sandboxed instance runs as its own uid: it reads its model as 'other'."""
    for path in [model_dir, *model_dir.rglob("*")]:
        mode = path.stat().st_mode
        need = 0o005 if path.is_dir() else 0o004
        if mode & need != need:
            raise ApiError(
                400,
                f"{path} is not readable by sandboxed instances (mode {mode & 0o777:o}); "
                f"make it world-readable (chmod -R o+rX {model_dir}).",
                param="path",
            )


class CatalogStore:
    """Catalog changes made through the admin API, kept in the state dir across restarts."""

    def __init__(self, state_dir: Path):
        self.path = state_dir / "catalog.json"

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {"added": {}, "removed": []}
        except (OSError, ValueError) as exc:
            raise CatalogError(f"{self.path}: unreadable ({exc})") from None
        return {"added": dict(data.get("added", {})), "removed": list(data.get("removed", []))}

    def _write(self, data: dict) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, self.path)

    def apply(self, entries: list[ModelEntry]) -> list[ModelEntry]:
        """The configured entries, less those unloaded, plus those loaded through the API."""
        data = self._read()
        out = [e for e in entries if e.name not in data["removed"]]
        for name, spec in data["added"].items():
            if any(e.name == name for e in out):
                continue
            try:
                out.append(entry_from_spec(name, spec))
            except (CatalogError, CheckpointError) as exc:
                log.error("persisted model %s skipped: %s", name, exc)
        return out

    def loaded(self, name: str, spec: dict) -> None:
        data = self._read()
        data["added"][name] = spec
        data["removed"] = [n for n in data["removed"] if n != name]
        self._write(data)

    def unloaded(self, name: str, origin: str) -> None:
        data = self._read()
        data["added"].pop(name, None)
        if origin != "admin" and name not in data["removed"]:
            data["removed"].append(name)
        self._write(data)


def node_record(args: argparse.Namespace, config: NodeConfig) -> dict:
    """What the cluster sees of this node: scheduler/service.py's cluster_nodes reads it."""
    return {
        "id": args.node_id,
        "location": args.location,
        "url": args.advertise_url or f"http://{args.host}:{args.port}",
        "gpus": [{"index": i, "budget_bytes": b} for i, b in sorted(config.gpus.items())],
    }


def placed_entry(model: str, spec: dict) -> ModelEntry:
    """A catalog entry (origin "cluster") for a model the scheduler placed on this node,
    from its placement's catalog keys."""
    fields = {k: v for k, v in spec.items() if k in SPEC_KEYS}
    return entry_from_spec(model, fields, "cluster")


def sandbox_report(
    mode: str,
    required: tuple[str, ...] = (),
    cgroup_version: int | None = None,
    seccomp_on: bool = False,
    enforced: dict[str, bool] | None = None,
) -> dict:
    """What instances' sandboxes enforce (GET /v1/node's "sandbox"): each limit of
    SANDBOX_LIMITS but seccomp, and which of the `required` ones (require_limits) do not
    hold here: while any is missing, no instance starts."""
    held = {k: bool((enforced or {}).get(k)) for k in SANDBOX_LIMITS} | {"seccomp": seccomp_on}
    return {
        "mode": mode,  # "isolated" | "process"
        "cgroup_version": cgroup_version,
        "seccomp": seccomp_on,
        "enforced": {k: v for k, v in held.items() if k != "seccomp"},
        "required": list(required),
        "missing": [k for k in required if not held[k]],
    }


def limits_unmet(missing: list[str]) -> ApiError:
    return ApiError(
        503,
        f"This node does not enforce the sandbox limits its config requires: "
        f"{', '.join(missing)} (require_limits); no instance is started here.",
        code="sandbox_limits_unmet",
    )


def sandbox_factory(
    mode: str, runtime_dir: Path, node: Node, required: tuple[str, ...] = ()
) -> tuple[SandboxFactory, CgroupManager | None]:
    """How instances are started: isolated (root: cgroups + namespaces) or plain processes,
    and the cgroups to close at shutdown (isolated). `node.sandbox` says what that
    enforces, and which of the `required` limits it does not."""

    def report(sandbox: str, **found) -> None:
        node.sandbox = sandbox_report(sandbox, required, **found)
        node.metrics.observe_sandbox(node.sandbox)
        if node.sandbox["missing"]:
            log.error("%s", limits_unmet(node.sandbox["missing"]).message)

    if mode == "process" or (mode == "auto" and os.geteuid() != 0):
        if mode == "auto":
            log.warning("not root: instances run as plain processes, without a sandbox")
        report("process")
        return ProcessSandbox, None
    try:
        # One scope per runtime dir: several omnids may share a cgroup (tests), and a
        # restarted omnid finds its predecessor's leftovers to clean up.
        scope = hashlib.sha1(str(runtime_dir.resolve()).encode()).hexdigest()[:12]
        cgroups = CgroupManager.detect(scope)
        enforced = cgroups.enforced()
    except (CgroupError, OSError) as exc:
        if mode == "isolated":
            raise CatalogError(f"--sandbox isolated: cgroups unavailable ({exc})") from None
        log.warning("cgroups unavailable (%s): instances run as plain processes", exc)
        report("process")
        return ProcessSandbox, None
    workdir = runtime_dir / "sandboxes"
    workdir.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        bpf = seccomp.export_bpf(workdir / "seccomp.bpf")
    except (OSError, RuntimeError) as exc:  # libseccomp missing: still isolated, less so
        log.warning("no seccomp filter for instances: %s", exc)
        bpf = None
    log.info(
        "sandboxing instances (cgroup v%d, seccomp %s)", cgroups.version, "on" if bpf else "off"
    )
    node.isolated = True
    # tmpfs: the instance's /tmp and socket dir are size-limited in every isolated sandbox
    enforced |= {"tmp": True, "io": True}
    report(
        "isolated", cgroup_version=cgroups.version, seccomp_on=bpf is not None, enforced=enforced
    )

    def make(spec: SandboxSpec) -> IsolatedSandbox:
        uid = node.sandbox_uid(spec.name)
        return IsolatedSandbox(
            replace(spec, hide=node.hidden_paths()),
            cgroups,
            workdir,
            view=ViewConfig(uid=uid, gid=uid),
            seccomp_bpf=bpf,
            orphan_timeout_s=node.orphan_timeout_s,
        )

    async def adopt(spec: SandboxSpec, record: Record) -> IsolatedSandbox:
        uid = node.sandbox_uid(spec.name)
        view = ViewConfig(uid=uid, gid=uid)
        timeout = node.orphan_timeout_s
        return await IsolatedSandbox.adopt(spec, cgroups, workdir, record, view, timeout)

    node.sandbox_adopter, node.cgroups = adopt, cgroups

    return make, cgroups


def inference_app(node: Node) -> web.Application:
    app = web.Application(middlewares=[error_middleware, oip_errors], client_max_size=64 << 20)
    InferenceRoutes(node).add_to(app)
    return app


def admin_app(node: Node) -> web.Application:
    app = web.Application(middlewares=[error_middleware, peer_credentials])
    AdminRoutes(node).add_to(app)
    return app


def resolve(args: argparse.Namespace) -> tuple[argparse.Namespace, NodeConfig]:
    """Flags over the config file over defaults."""
    config = load_config(args.config) if args.config else NodeConfig()
    host, port = config.listen or ("127.0.0.1", 8081)
    env = os.environ.get
    args.host = args.host or env("OMNID_HOST") or host
    args.port = args.port or int(env("OMNID_PORT") or port)
    args.runtime_dir = args.runtime_dir or config.runtime_dir or paths.runtime_dir()
    args.data_dir = args.data_dir or config.state_dir or paths.data_dir()
    args.state_dir = args.state_dir or Path(env("OMNI_STATE_DIR") or args.data_dir)
    args.sandbox = args.sandbox or env("OMNI_SANDBOX") or config.sandbox or "auto"
    args.live_restore = args.live_restore or env("OMNI_LIVE_RESTORE") == "1" or config.live_restore
    return args, config


def secure_admin_socket(path: Path) -> None:
    """0660 root:omni (the group when it exists): who may connect is checked again per peer."""
    os.chmod(path, 0o660)
    with contextlib.suppress(KeyError, PermissionError):
        os.chown(path, -1, grp.getgrnam(ADMIN_GROUP).gr_gid)


async def run(args: argparse.Namespace) -> None:
    args, config = resolve(args)
    runtime_dir, data_dir = args.runtime_dir, args.data_dir
    runtime_dir.mkdir(parents=True, exist_ok=True, mode=0o755)
    data_dir.mkdir(parents=True, exist_ok=True)
    args.state_dir.mkdir(parents=True, exist_ok=True)
    entries: list[ModelEntry] = []
    if args.defaults and config.default_models:
        entries += await asyncio.to_thread(default_entries, data_dir)
    for model in config.models:
        if any(e.name == model.name for e in entries):
            raise CatalogError(
                f"{args.config}: model name {model.name!r} is taken by a default model"
            )
        entries.append(
            ModelEntry.from_path(
                model.name,
                model.path,
                "config",
                model.limits,
                model.placement,
                tool_parser=model.tool_parser,
                handler=model.handler,
            )
        )

    node = Node(
        runtime_dir,
        ready_wait_s=args.ready_wait,
        gpus=config.gpus,
        swap_timeout_s=config.swap_timeout_s,
        gpu_yield_s=config.gpu_yield_s,
        request_timeout_s=config.request_timeout_s,
        state_dir=args.state_dir,
    )
    entries = node.catalog.apply(entries) if node.catalog else entries
    node.orphan_timeout_s = config.orphan_timeout_s
    node.wheelhouse = config.wheelhouse
    node.sandbox_factory, cgroups = sandbox_factory(
        args.sandbox, runtime_dir, node, config.require_limits
    )
    try:
        await serve_node(args, config, node, entries)
    finally:  # a failed start too: nothing of it is left behind
        await stop_node(node, args.live_restore, cgroups)


async def serve_node(
    args: argparse.Namespace, config: NodeConfig, node: Node, entries: list[ModelEntry]
) -> None:
    """Start the catalog's instances (adopting those an earlier omnid left running) and
    serve until SIGTERM or SIGINT."""
    runtime_dir = args.runtime_dir
    await asyncio.to_thread(node.find_running)  # an earlier omnid's, to adopt
    await asyncio.to_thread(node.clear_leftovers)
    log.info("instances run %s", InstanceCode.of_this_process().describe())
    for entry in entries:
        try:
            node.add(entry)
        except ApiError as exc:
            if exc.code != "sandbox_limits_unmet":  # (omnid serves on: /v1/node says why)
                raise CatalogError(f"model {entry.name!r}: {exc.message}") from None
            log.error("model %s not started: %s", entry.name, exc.message)
        except ValueError as exc:
            raise CatalogError(f"model {entry.name!r}: {exc}") from None
    await asyncio.to_thread(node.end_unclaimed)

    grpc_bind, grpc_required = grpc_listener(args)
    http_url = oip_grpc.loopback_url(args.host, args.port)  # gRPC calls take the HTTP path
    grpc_front = await oip_grpc.start_front(grpc_bind, http_url, grpc_required)
    runners = []
    inference = web.AppRunner(inference_app(node), handler_cancellation=True, access_log=None)
    await inference.setup()
    await web.TCPSite(inference, args.host, args.port).start()
    runners.append(inference)
    admin_path = paths.admin_socket(runtime_dir)
    admin_path.unlink(missing_ok=True)
    admin = web.AppRunner(admin_app(node), access_log=None)
    await admin.setup()
    await web.UnixSite(admin, str(admin_path)).start()
    secure_admin_socket(admin_path)
    runners.append(admin)
    runners += await dashboard.serve(node, config.dashboard)  # the config's own listener
    log.info(
        "omnid listening on http://%s:%d, admin socket %s; models: %s",
        args.host,
        args.port,
        admin_path,
        ", ".join(e.name for e in entries) or "none",
    )
    cluster = ClusterMember(node, args, node_record(args, config), placed_entry)
    await cluster.start()
    sdnotify.notify("READY=1", f"STATUS=serving {len(entries)} models")
    watchdog = asyncio.create_task(sdnotify.watchdog(lambda: True))

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("omnid stopping")
    sdnotify.notify("STOPPING=1")
    watchdog.cancel()
    await cluster.stop()  # routed around at once, not a lease TTL later
    if grpc_front is not None:
        await grpc_front.stop()
    for runner in runners:
        await runner.cleanup()
    admin_path.unlink(missing_ok=True)


async def stop_node(node: Node, live_restore: bool, cgroups: CgroupManager | None) -> None:
    """Leave the instances running for the next omnid (live restore, where any run), or
    stop them and remove what they and omnid made: the instances' and sandboxes'
    directories in the runtime dir, and omnid's cgroups."""
    await node.settle_drain()  # what a drain stops, it stops to the end
    if live_restore and node.isolated and (node.instances or node.running):
        log.info("live restore: leaving %d instances running", len(node.instances))
        await node.detach()
        return
    await node.shutdown()
    await asyncio.to_thread(node.end_unclaimed)  # a start that failed before adopting them
    if cgroups is not None:  # its instances' groups are gone: now its own directories
        await asyncio.to_thread(cgroups.close)
    for path in (node.socket_dir, node.sandbox_workdir):
        await asyncio.to_thread(hostfs.remove_tree, path)
    with contextlib.suppress(OSError):  # each instance removed its own; shared, if not
        node.kv_disk_root.rmdir()


def grpc_listener(args: argparse.Namespace) -> tuple[str | None, bool]:
    """Where omnid's gRPC front listens (None: off), and whether it was asked for (a
    taken port then stops omnid; the default's is given up with a warning)."""
    value = getattr(args, "grpc_port", None)
    try:
        return oip_grpc.parse_port(value or DEFAULT_GRPC_PORT, "127.0.0.1"), value is not None
    except ValueError as exc:
        raise CatalogError(str(exc)) from None


def positive_seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not (seconds > 0 and math.isfinite(seconds)):
        raise argparse.ArgumentTypeError(f"{value!r}: expected a number of seconds > 0")
    return seconds


def host_port(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{value!r}: expected HOST:PORT")
    return value


def arg_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    parser = argparse.ArgumentParser(prog="omnid", description=__doc__)
    parser.add_argument("--host", help="inference address (config 'listen'; 127.0.0.1)")
    parser.add_argument("--port", type=int, help="inference port (config 'listen'; 8081)")
    parser.add_argument("--runtime-dir", type=Path, help="admin socket, instance sockets")
    parser.add_argument(
        "--data-dir", type=Path, help="state: persisted catalog, imported default models"
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        help="where the catalog is persisted, when not the data dir ($OMNI_STATE_DIR)",
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=env("OMNID_CONFIG"),
        help="TOML config (e.g. /etc/omni/omnid.toml)",
    )
    parser.add_argument(
        "--no-defaults",
        dest="defaults",
        action="store_false",
        help="do not serve the embedded default models",
    )
    parser.add_argument(
        "--sandbox",
        choices=["auto", "isolated", "process"],
        help="isolated: cgroups + namespaces (needs root); auto (default): isolated when root",
    )
    parser.add_argument(
        "--live-restore",
        action="store_true",
        help="on SIGTERM, leave sandboxed instances running for the next omnid to adopt "
        "(config 'live_restore')",
    )
    parser.add_argument(
        "--etcd",
        default=env("OMNI_ETCD"),
        help="HOST:PORT of etcd: announce this node there for the cluster's edges",
    )
    parser.add_argument(
        "--node-id",
        default=env("OMNI_NODE_ID") or socket.gethostname(),
        help="this node's name in the cluster ($OMNI_NODE_ID; the host name)",
    )
    parser.add_argument(
        "--location",
        default=env("OMNI_LOCATION", "default"),
        help="where this node is, for latency-aware placement ($OMNI_LOCATION; default)",
    )
    parser.add_argument(
        "--advertise-url", help="inference URL other hosts reach (default: http://HOST:PORT)"
    )
    parser.add_argument(
        "--lease-ttl", type=int, default=10, help="seconds a dead node stays announced"
    )
    parser.add_argument(
        "--probe-interval",
        type=positive_seconds,
        default=env("OMNI_PROBE_INTERVAL", "10"),
        help="seconds between RTT probes of the other nodes, with --etcd "
        "($OMNI_PROBE_INTERVAL; 10)",
    )
    parser.add_argument(
        "--telemetry",
        type=host_port,
        default=env("OMNI_TELEMETRY") or None,
        help="HOST:PORT of the scheduler's telemetry: report load there "
        "($OMNI_TELEMETRY; default: where etcd's /omni/telemetry says, with --etcd)",
    )
    parser.add_argument(
        "--telemetry-interval",
        type=positive_seconds,
        default=env("OMNI_TELEMETRY_INTERVAL", "10"),
        help="seconds per load report ($OMNI_TELEMETRY_INTERVAL; 10)",
    )
    parser.add_argument(
        "--grpc-port",
        default=env("OMNID_GRPC_PORT"),
        help="the Open Inference Protocol over gRPC: PORT (on loopback), HOST:PORT or 'off' "
        f"($OMNID_GRPC_PORT; {DEFAULT_GRPC_PORT}, given up with a warning if it is taken)",
    )
    parser.add_argument(
        "--ready-wait",
        type=float,
        default=30.0,
        help="seconds a request waits for a starting instance before a 503",
    )
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return arg_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging("omnid")
    try:
        asyncio.run(run(args))
    except (CatalogError, CheckpointError, oip_grpc.ListenError) as exc:
        log.error("%s", exc)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
