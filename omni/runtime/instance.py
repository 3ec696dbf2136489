"""Supervision of one model instance: start it in a sandbox, health-check it, restart it.

A crashed or hung instance is restarted with exponential backoff; the backoff
resets once an instance has stayed up for a while, so a rare crash costs one
short pause. An instance that fails CRASH_LOOP_FAILURES starts in a row without
ever becoming ready is marked failed with its exit and last output lines, and
left so until `omnictl restart` (requests for it get 503 with that reason at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import hashlib
import json
import logging
import os
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import aiohttp
from aiohttp.client_exceptions import UnixClientConnectorError

from omni.api.errors import ApiError
from omni.cudashim import ControlBlock, Mode
from omni.cudashim import instance_env as shim_env
from omni.instance.settings import InstanceSettings
from omni.isolation import hostfs
from omni.isolation.record import Record
from omni.isolation.sandbox import ExitStatus, Sandbox, SandboxSpec

from .catalog import ModelEntry
from .code import InstanceCode
from .gpuyield import YieldFlag
from .residency import GpuPool, PoolMember, Residency

log = logging.getLogger(__name__)

SandboxFactory = Callable[[SandboxSpec], Sandbox]
# a running sandbox an earlier omnid left, taken over (live restore)
SandboxAdopter = Callable[[SandboxSpec, Record], Awaitable[Sandbox]]


# PYTHONPATH is not passed: omnid sets the instance's own (InstanceCode).
ENV_PASSED = {"PATH", "LANG", "LC_ALL", "TZ", "LD_LIBRARY_PATH"}
ENV_PREFIXES_PASSED = ("OMNI_", "CUDA_", "NVIDIA_", "TRITON_", "TORCH_", "OMP_", "HF_")
ENV_PREFIXES_PASSED += ("NCCL_", "NVSHMEM_")  # a host's collective settings reach its ranks
CRASH_LOOP_FAILURES = 3  # starts in a row that never became ready: the instance has failed
OUTPUT_LINES = 20  # of an instance's output, kept for the reason it failed
DISK_SLACK_BYTES = 16 << 20  # past its disk KV budget (and a tenth): files being replaced


def instance_env() -> dict[str, str]:
    """What an instance inherits from omnid's environment: runtime settings, no secrets."""
    env = {
        k: v for k, v in os.environ.items() if k in ENV_PASSED or k.startswith(ENV_PREFIXES_PASSED)
    }
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    env.update(PYTHONDONTWRITEBYTECODE="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    return env


@dataclass(frozen=True)
class GpuPlacement:
    """What a GPU instance needs beyond a CPU one: its GPUs' pools (one per rank, rank 0's
    first) and the shim."""

    pools: tuple[GpuPool, ...]
    shim_library: Path
    owner_uid: int | None  # the sandbox uid, which writes its half of the control block

    @property
    def pool(self) -> GpuPool:
        """Rank 0's GPU: the one whose hotter instances this one yields its steps to."""
        return self.pools[0]


def fingerprint(entry: ModelEntry, code: InstanceCode) -> str:
    """What an instance is started as: its catalog entry and the code that runs it. A
    restarted omnid adopts a running instance only where this is unchanged."""
    text = json.dumps([entry.to_json(), code.describe(), code_identity()], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


@functools.cache
def code_identity() -> str:
    """The omni package's code, by content: an upgrade changes it, a touch does not."""
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


class InstanceConnector(aiohttp.UnixConnector):
    """Connections to an instance's socket that never follow a link planted in its place
    and reach only a listener `allowed` names (hostfs.connect_checked)."""

    def __init__(self, path: Path, allowed: hostfs.PeerCheck):
        super().__init__(path=str(path))
        self._allowed = allowed

    async def _create_connection(self, req, traces, timeout):
        try:
            async with asyncio.timeout(timeout.sock_connect):
                sock = await hostfs.connect_checked(Path(self.path), self._allowed)
            _, proto = await self._loop.create_unix_connection(self._factory, sock=sock)
        except OSError as exc:
            if exc.errno is None and isinstance(exc, TimeoutError):
                raise
            if isinstance(exc, hostfs.UnsafePath):
                log.warning("instance socket %s refused: %s", self.path, exc.strerror)
            raise UnixClientConnectorError(self.path, req.connection_key, exc) from exc
        return proto


class State(enum.StrEnum):
    STARTING = "starting"
    READY = "ready"
    BACKOFF = "backoff"  # died; waiting before the next start
    FAILED = "failed"  # crash loop: not restarted until asked to
    DRAINING = "draining"  # unload or restart: its requests in flight finish, no new ones
    STOPPING = "stopping"
    STOPPED = "stopped"


class Backoff:
    def __init__(self, initial_s: float = 0.5, max_s: float = 30.0, stable_s: float = 60.0):
        self.initial_s, self.max_s, self.stable_s = initial_s, max_s, stable_s
        self.failures = 0

    def next_delay(self, uptime_s: float) -> float:
        if uptime_s >= self.stable_s:
            self.failures = 0
        delay = min(self.max_s, self.initial_s * 2**self.failures)
        self.failures += 1
        return delay


# what omnid keeps of an instance's health answers: speculation's counters, the KV tiers',
# the load a router weighs (queued prompt tokens, KV blocks in use), a handler's batching,
# the waits for hotter models of its GPU, and its memory (the weights whose host copy
# swaps keep, what trims before swap-outs freed)
ENGINE_STATS = (
    "spec_",
    "kv_host_",
    "kv_disk_",
    "kv_blocks_",
    "queued_prompt_tokens",
    "batch_",
    "yield_",
    "memory_",
)


class Instance:
    """One catalog model's running process and what omnid knows about it."""

    HEALTH_INTERVAL_S = 2.0
    HEALTH_TIMEOUT_S = 5.0
    HEALTH_FAILURES = 3  # consecutive failures before the instance is killed
    START_TIMEOUT_S = 300.0

    def __init__(
        self,
        entry: ModelEntry,
        socket_dir: Path,
        sandbox_factory: SandboxFactory,
        backoff: Backoff | None = None,
        gpu: GpuPlacement | None = None,
        code: InstanceCode | None = None,
        kv_disk_dir: Path | None = None,
        adopt: tuple[Record, SandboxAdopter] | None = None,
        data_dir: Path | None = None,
        wheelhouse: Path | None = None,
    ):
        """`kv_disk_dir`: its disk KV tier's directory (where its entry asks for one);
        `data_dir`: where the environments of models' own packages are built, from
        `wheelhouse` where given."""
        self.entry = entry
        self.kv_disk_dir = kv_disk_dir if entry.placement.kv_disk_bytes else None
        # omnid's directory for it (root's: the instance may write the files omnid puts
        # there, never add or replace one), holding its own size-limited writable `io`
        self.dir = socket_dir / entry.name
        self.socket_path = self.dir / "io" / "sock"
        self.yield_path = self.dir / "gpu.yield"  # visible in its sandbox
        self.gpu = gpu
        self.data_dir = data_dir
        self.wheelhouse = wheelhouse
        self.packages_dir: Path | None = None  # its own packages' environment, once built
        # of omnid's site-packages, what a third-party handler sees (envs.shared_base_entries)
        self.python_base: tuple[Path, ...] | None = None
        # one standing per GPU (rank): each GPU's memory is accounted and swapped apart, and
        # a swap-out of one rank takes the others out with it (they serve only together)
        self.members = [
            PoolMember(entry.name, entry.placement.quota_bytes or 0, self.restart)
            for _ in (gpu.pools if gpu is not None else ())
        ]
        for member in self.members:
            member.before_swap_out = self.trim
        if len(self.members) > 1:
            for pool, member in zip(gpu.pools, self.members, strict=True):
                member.after_swap_out = partial(self._swap_out_others, pool)
        self.permits = asyncio.Semaphore(entry.placement.permits)
        self.in_flight = 0
        self.waiting = 0  # requests waiting for a permit
        self.last_used: float | None = None  # unix time a request last began or ended here
        self._factory = sandbox_factory
        self.code = code or InstanceCode.of_this_process()
        self.fingerprint = fingerprint(entry, self.code)
        self._adopt = adopt  # its sandbox, left running by an earlier omnid: taken over
        self.failure: str | None = None  # why it is FAILED: its exit and last output
        self.output: deque[str] = deque(maxlen=OUTPUT_LINES)  # its last lines, this start
        self._failed = asyncio.Event()
        self._stopped = asyncio.Event()  # stopped for good (stop()): nothing will be ready
        self._became_ready = False
        self._backoff = backoff or Backoff()
        self.state = State.STOPPED
        self.started_at: float | None = None  # when it last became ready
        self.restarts = 0
        self.engine_stats: dict = {}  # ENGINE_STATS from its health checks
        self.last_exit: str | None = None
        self.retry_at: float | None = None  # monotonic time of the next start, in backoff
        self._ready = asyncio.Event()
        self._stopping = False
        self._drain_first = False  # let its requests in flight finish before it is stopped
        self._sandbox: Sandbox | None = None
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self._restart_reason: str | None = None
        self._unhealthy = "unhealthy"  # why the health checks ended it
        self._adopted_gpu = False  # its pools took it as it was: no fresh start's accounting
        self._releases: set[asyncio.Task] = set()
        self.session = aiohttp.ClientSession(
            connector=InstanceConnector(self.socket_path, self._listener_is_ours),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
        )

    @property
    def member(self) -> PoolMember | None:
        """Rank 0's standing (the only one of a one-GPU instance); None on the CPU path."""
        return self.members[0] if self.members else None

    @property
    def pid(self) -> int | None:
        """The model process's host pid, while it runs."""
        return self._sandbox.pid if self._sandbox is not None else None

    @property
    def name(self) -> str:
        return self.entry.name

    def url(self, path: str) -> str:
        return f"http://instance{path}"

    def control_path(self, rank: int) -> Path:
        """Rank `rank`'s shim control block, as its processes open it: a sealed memfd that
        the sandbox's init holds (its pid 1) where the instance has its own uid, else a
        file in omnid's directory for it."""
        block = self.members[rank].block
        if block is not None and block.fd is not None:
            return Path(f"/proc/1/fd/{block.fd}")
        name = "cuda.ctl" if rank == 0 else f"cuda.{rank}.ctl"
        return self.dir / name

    async def trim(self) -> None:
        """Ask the idle process to free the GPU memory it holds unused (its allocator's
        cache), before a swap-out moves its memory (the pool bounds the wait)."""
        async with self.session.post(self.url("/trim")) as resp:
            await resp.read()

    def _listener_is_ours(self, pid: int, uid: int) -> bool:
        """Whether the process listening on its socket is this instance's own."""
        return self._sandbox is not None and self._sandbox.owns(pid, uid)

    @contextlib.asynccontextmanager
    async def resident(self, deadline: float) -> AsyncIterator[None]:
        """Every rank's memory on its GPU for one request (swapped in where it is not),
        GPUs taken in index order so that two instances never wait on each other."""
        assert self.gpu is not None
        pairs = sorted(zip(self.gpu.pools, self.members, strict=True), key=lambda p: p[0].index)
        async with contextlib.AsyncExitStack() as stack:
            for pool, member in pairs:
                await stack.enter_async_context(pool.use(member, deadline))
            yield

    async def force_swap(self, direction: str) -> None:
        """omnictl's swap-out or swap-in ("out" | "in"), of every rank: rank 0's pool
        refuses what it cannot do (409), the other ranks follow it."""
        assert self.gpu is not None
        pairs = list(zip(self.gpu.pools, self.members, strict=True))
        if direction == "out":
            await pairs[0][0].force(pairs[0][1], "out")
            for pool, member in pairs[1:]:
                await pool.release(member)
            return
        swapped = [(p, t) for p, t in pairs if t.state is Residency.SWAPPED] or pairs[:1]
        for pool, member in swapped:
            await pool.force(member, "in")

    def _swap_out_others(self, swapped: GpuPool) -> None:
        """One rank was swapped out to make room on its GPU: the others cannot serve
        without it, so their GPUs get their room back too (each pool in its own turn)."""
        assert self.gpu is not None
        for pool, member in zip(self.gpu.pools, self.members, strict=True):
            if pool is not swapped:
                task = asyncio.get_running_loop().create_task(pool.release(member))
                self._releases.add(task)
                task.add_done_callback(self._releases.discard)

    def start(self) -> None:
        self._task = asyncio.create_task(self._supervise(), name=f"instance:{self.name}")

    @property
    def stopping(self) -> bool:
        """Being unloaded (or omnid stopping): admit nothing more to it."""
        return self._stopping

    async def stop(self, drain: bool = False) -> None:
        """Stop it for good; `drain`: once its requests in flight have finished (at most
        its model's drain time), new ones refused meanwhile."""
        self._stopping = True
        self._stopped.set()
        self._drain_first = drain
        self._wake.set()
        if self._task:
            await self._task
        await self.session.close()
        await asyncio.to_thread(hostfs.remove_tree, self.dir)
        if self.kv_disk_dir is not None:  # its disk tier's blocks: of no use to anyone now
            await asyncio.to_thread(hostfs.remove_tree, self.kv_disk_dir)

    def restart(self, reason: str | None = None, drain: bool = False) -> None:
        """Kill the process (or leave the failed state); supervision starts a fresh one.
        `drain` (an operator's restart): its requests in flight finish first, at most its
        model's drain time, and new ones wait for the new process."""
        self._backoff.failures = 0
        self._restart_reason = reason
        self._drain_first = drain
        if drain:
            self._ready.clear()  # new requests wait (wait_ready) for the new process
        self._wake.set()

    async def wait_ready(self, timeout_s: float) -> bool:
        """Ready within `timeout_s`; False at once for a failed instance or one stopping
        for good (a request caught as a version switch stops it is answered now, not
        after the whole wait)."""
        if self.state == State.FAILED or self._stopped.is_set():
            return False
        if self._ready.is_set():  # the common case, without three tasks a request
            return True
        events = (self._ready, self._failed, self._stopped)
        waits = {asyncio.ensure_future(e.wait()) for e in events}
        _done, pending = await asyncio.wait(
            waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        for task in pending:
            task.cancel()
        return self._ready.is_set() and not self._stopped.is_set()

    def retry_after_s(self) -> float:
        if self.state == State.FAILED:
            return 30.0  # nothing changes until an operator acts
        if self.state == State.BACKOFF and self.retry_at is not None:
            return max(1.0, self.retry_at - time.monotonic())
        return 1.0

    def to_json(self) -> dict:
        uptime = time.time() - self.started_at if self.started_at and self._ready.is_set() else 0
        return {
            "name": self.name,
            "kind": self.entry.kind,
            "state": str(self.state),
            "pid": self.pid,
            "uptime_s": round(uptime, 1),
            "restarts": self.restarts,
            "last_exit": self.last_exit,
            "failure": self.failure,
            "gpu": self.entry.placement.gpu,
            "gpus": list(self.entry.placement.gpus),
            "permits": self.entry.placement.permits,
            "in_flight": self.in_flight,
            "version": self.entry.version or None,
            "path": str(self.entry.path),
            **(self.member.to_json() if self.member else {}),
            "last_used": self.last_used,  # every instance's, the CPU path's too
            **({"ranks": self._ranks_json()} if len(self.members) > 1 else {}),
            **self._engine_json(),
        }

    def load(self) -> dict:
        """What a token-aware router weighs, as of the last health check: prompt tokens
        waiting to be computed (prefill) and the share of KV blocks in use (decode); for
        a handler's model, how long its calls take on the GPU and after (its ETA)."""
        stats = self.engine_stats
        total = stats.get("kv_blocks_total") or 0
        used = total - stats.get("kv_blocks_free", total)
        load = {
            "queued_prompt_tokens": int(stats.get("queued_prompt_tokens", 0)),
            "kv_occupancy": round(used / total, 4) if total else 0.0,
        }
        if stats.get("batch_gpu_phase_ms") is not None:  # a handler's: its predicted ETA
            load["eta_ms"] = {
                "gpu": stats["batch_gpu_phase_ms"],
                "cpu": stats.get("batch_cpu_phase_ms") or 0.0,
            }
        return load

    def _engine_json(self) -> dict:
        """The engine's counters in /v1/instances, by what they are about."""
        out = {}
        for group, prefix in (
            ("speculative", "spec_"),
            ("kv_host", "kv_host_"),
            ("kv_disk", "kv_disk_"),
            ("batching", "batch_"),  # a handler's dynamic batching (omni/instance/batcher.py)
            ("gpu_yield", "yield_"),  # its waits for hotter models of its GPU (gpuyield.py)
            ("memory", "memory_"),  # weights kept on the host, trims before swap-outs
        ):
            part = {k: v for k, v in self.engine_stats.items() if k.startswith(prefix)}
            if part:
                out[group] = part
        return out

    def _ranks_json(self) -> list[dict]:
        assert self.gpu is not None
        return [
            {"rank": r, "gpu": pool.index, **member.to_json()}
            for r, (pool, member) in enumerate(zip(self.gpu.pools, self.members, strict=True))
        ]

    def settings(self) -> InstanceSettings:
        """What the instance is told to serve, and how (its one settings document)."""
        entry, placement, handler = self.entry, self.entry.placement, self.entry.handler
        gpus = len(self.gpu.pools) if self.gpu is not None else 0
        yields = self.member is not None and self.member.yield_flag is not None
        return InstanceSettings(
            name=self.name,
            model_dir=str(entry.path),
            socket=str(self.socket_path),
            runtime=entry.runtime,
            device="cuda:0" if gpus else "cpu",
            handler=handler.handler if handler else None,
            max_batch_size=handler.max_batch_size if handler else None,
            max_queue_delay_ms=handler.max_queue_delay_ms if handler else None,
            infer_timeout_s=handler.infer_timeout_s if handler else 60.0,
            gpu_split=handler.gpu_split if handler else True,
            tool_parser=entry.tool_parser,
            tensor_parallel=placement.tensor_parallel,
            parallel=placement.parallel,
            quantization=placement.quantization,
            kv_cache_dtype=placement.kv_cache_dtype,
            kv_host_bytes=placement.kv_host_bytes,
            kv_disk_bytes=placement.kv_disk_bytes if self.kv_disk_dir else 0,
            kv_disk_dir=str(self.kv_disk_dir) if self.kv_disk_dir else None,
            speculative=dict(placement.speculative),
            memory_limit_bytes=entry.limits.memory_bytes or 0,
            rank_controls=tuple(str(self.control_path(r)) for r in range(gpus)) if gpus > 1 else (),
            yield_path=str(self.yield_path) if yields else None,
        )

    async def _build_packages(self) -> None:
        """The environment of the model's own packages (built once, then reused), and, for
        third-party code, the shared base it may see of omnid's packages. The runtimes
        OMNI ships (omni.runtimes) use omnid's environment, whose packages are theirs."""
        handler = self.entry.handler
        if handler is None:
            return
        from .envs import environment, shared_base_entries

        if self.python_base is None and not handler.handler.startswith("omni.runtimes."):
            self.python_base = await asyncio.to_thread(shared_base_entries)
        if not handler.requirements or self.packages_dir is not None:
            return

        data_dir = self.data_dir or self.dir.parent
        self.packages_dir = await asyncio.to_thread(
            environment, list(handler.requirements), data_dir, self.wheelhouse
        )

    def _spec(self) -> SandboxSpec:
        argv = self.code.argv("omni.instance.worker")
        env = {**instance_env(), **self.code.env(), **self.settings().to_env()}
        extra_rw = (self.kv_disk_dir,) if self.kv_disk_dir is not None else ()
        gpus, extra_ro = None, ()
        if self.gpu is not None:
            gpus = tuple(pool.index for pool in self.gpu.pools)
            env.update(shim_env(self.control_path(0), self.gpu.shim_library))
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))  # rank r: the r-th
            libs = [Path(p) for p in env.get("LD_LIBRARY_PATH", "").split(":") if p]
            extra_ro = (self.gpu.shim_library.parent, *(p for p in libs if p.is_dir()))
        if self.entry.placement.draft_path is not None:  # a draft model's, an EAGLE head's
            extra_ro = (*extra_ro, self.entry.placement.draft_path)
        return SandboxSpec(
            self.name,
            argv,
            env,
            self.entry.path,
            self.socket_path.parent,
            self.entry.limits,
            gpus=gpus,
            extra_ro=extra_ro,
            extra_rw=extra_rw,
            shared_dir=self.dir,
            fingerprint=self.fingerprint,
            python_env=self.packages_dir,
            python_base=self.python_base,
            pass_fds=tuple(t.block.fd for t in self.members if t.block and t.block.fd is not None),
        )

    async def _claim_gpu(self) -> None:
        """Fresh control blocks for the new processes (one a rank), and room for them on
        their GPUs."""
        assert self.gpu is not None and self.member is not None
        if self.gpu.pool.yield_max_s > 0:
            self.member.yield_flag = YieldFlag(self.yield_path, self.gpu.pool.yield_max_s)
        owner = self.gpu.owner_uid
        for rank, (pool, member) in enumerate(zip(self.gpu.pools, self.members, strict=True)):
            if owner is None:  # a plain process, omnid's own uid: a file will do
                path = self.dir / ("cuda.ctl" if rank == 0 else f"cuda.{rank}.ctl")
                block = ControlBlock.create(path, member.quota_bytes, Mode.MANAGED)
            else:  # it may write the block, never resize it under omnid's mapping
                name = f"omni-{self.name}-rank{rank}"
                block = ControlBlock.create_sealed(name, member.quota_bytes, Mode.MANAGED, owner)
            await pool.starting(member, block)

    async def _take_over(self, record: Record, adopter: SandboxAdopter) -> None:
        """Adopt the sandbox an earlier omnid left running (live restore): its process,
        directories and control blocks as they are; its GPU memory where the shim says."""
        self._adopt = None
        self._sandbox = await adopter(self._spec(), record)
        log.info("instance %s adopted (pid %s)", self.name, self.pid)
        if self.gpu is None:
            return
        if self.gpu.pool.yield_max_s > 0:
            self.member.yield_flag = YieldFlag(
                self.yield_path, self.gpu.pool.yield_max_s, new=False
            )
        for rank, (pool, member) in enumerate(zip(self.gpu.pools, self.members, strict=True)):
            # the sealed memfd its sandbox's init holds, opened again through the host's /proc
            fd = os.open(f"/proc/{record.init_pid}/fd/{record.held_fds[rank]}", os.O_RDWR)
            block = ControlBlock(Path(f"/proc/self/fd/{fd}"), fd)
            await pool.adopted(member, block)
        self._adopted_gpu = True

    async def detach(self) -> None:
        """Stop supervising, leave the process running for the next omnid (live restore)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._sandbox is not None and hasattr(self._sandbox, "detach"):
            self._sandbox.detach()
        await self.session.close()

    async def _supervise(self) -> None:
        failed_starts = 0  # in a row, none of which became ready
        while not self._stopping:
            self.state = State.STARTING
            self._wake.clear()
            self._became_ready = False
            self.output.clear()
            relay: asyncio.Task | None = None
            t0 = time.monotonic()
            try:
                if self._adopt is not None:
                    await self._take_over(*self._adopt)
                else:
                    self.dir.parent.mkdir(parents=True, exist_ok=True)
                    await asyncio.to_thread(hostfs.fresh_dir, self.dir)  # none of its last run
                    if self.gpu is not None:
                        await self._claim_gpu()
                    await self._build_packages()
                    self._sandbox = self._factory(self._spec())
                    await self._sandbox.start()
                if self._sandbox.output is not None:
                    relay = asyncio.create_task(self._relay_output(self._sandbox.output))
            except Exception as exc:  # could not even start: back off like a crash
                log.exception("instance %s failed to start", self.name)
                exit_status = ExitStatus(None, f"setup-failed: {exc}")
            else:
                try:
                    exit_status = await self._run_until_exit()
                except Exception as exc:  # teardown failed: never stop supervising
                    log.exception("instance %s: stopping its sandbox failed", self.name)
                    exit_status = ExitStatus(None, f"teardown-failed: {exc}")
            if relay is not None:  # the rest of its output, up to its exit
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(relay), 2)
                relay.cancel()
            self._ready.clear()
            self._sandbox = None
            if self.gpu is not None:
                for pool, member in zip(self.gpu.pools, self.members, strict=True):
                    await pool.stopped(member)
            if self._stopping:
                break
            self.restarts += 1
            self.last_exit = exit_status.describe()
            failed_starts = 0 if self._became_ready else failed_starts + 1
            if failed_starts >= CRASH_LOOP_FAILURES:
                await self._fail(failed_starts)
                failed_starts = 0
                continue
            delay = self._backoff.next_delay(time.monotonic() - t0)
            log.warning("instance %s %s; restarting in %.1fs", self.name, self.last_exit, delay)
            self.state = State.BACKOFF
            self.retry_at = time.monotonic() + delay
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), delay)
        self.state = State.STOPPED

    async def _fail(self, starts: int) -> None:
        """Stop restarting a crash loop: say why, answer requests at once, and wait for
        `restart()` (or `stop()`)."""
        lines = [line for line in self.output if line.strip()][-5:]
        said = f"; last output: {' / '.join(lines)}" if lines else ""
        self.failure = f"{self.last_exit} on {starts} starts in a row{said}"
        self.state = State.FAILED
        self.retry_at = None
        self._failed.set()
        log.error("instance %s failed: %s", self.name, self.failure)
        await self._wake.wait()
        self.failure = None
        self._failed.clear()

    async def _relay_output(self, reader: asyncio.StreamReader) -> None:
        """The instance's output to omnid's stderr (the journal), its last lines kept."""
        while True:
            try:
                line = await reader.readline()
            except ValueError:  # a line past the reader's limit: take what is there
                line = await reader.read(1 << 16)
            if not line:
                return
            self.output.append(line.decode(errors="replace").rstrip())
            sys.stderr.buffer.write(line)
            sys.stderr.buffer.flush()

    async def _run_until_exit(self) -> ExitStatus:
        """Wait for the process to exit, killing it on stop, restart or failed health."""
        assert self._sandbox is not None
        exited = asyncio.ensure_future(self._sandbox.exited())
        checker = asyncio.ensure_future(self._check_health())
        woken = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait({exited, checker, woken}, return_when=asyncio.FIRST_COMPLETED)
            asked = not exited.done() and not checker.done()  # stop, or restart: not a fault
            if asked and self._drain_first:
                await self._drain(exited)
            self._ready.clear()  # route nothing more to it
            # not ready from here on, whichever way it ends: the sandbox's teardown, its
            # last output and the GPU's release come before the backoff (a status read in
            # between said "ready" with no process behind it)
            self.state = State.STOPPING
            if exited.done():
                return await self._sandbox.wait()
            checker.cancel()  # a stopping process fails its health checks: not the reason
            status = await self._sandbox.stop()
            reason = (self._restart_reason or "restarted") if asked else self._unhealthy
            self._restart_reason = None
            return ExitStatus(status.returncode, reason)
        finally:
            for fut in (exited, checker, woken):
                fut.cancel()

    async def _drain(self, exited: asyncio.Future) -> None:
        """Until its requests in flight, and those waiting for a permit, are done (or the
        process exits), at most its model's drain time."""
        self.state = State.DRAINING
        self._drain_first = False
        deadline = time.monotonic() + self.entry.placement.drain_s
        while (self.in_flight or self.waiting) and not exited.done():
            if time.monotonic() > deadline:
                log.warning(
                    "instance %s: %d requests still in flight after %.0fs of draining",
                    self.name,
                    self.in_flight,
                    self.entry.placement.drain_s,
                )
                return
            await asyncio.sleep(0.05)

    async def _probe(self) -> bool:
        try:
            async with self.session.get(
                self.url("/health"), timeout=aiohttp.ClientTimeout(total=self.HEALTH_TIMEOUT_S)
            ) as resp:
                if resp.status != 200:
                    return False
                body = await resp.json()
                self.engine_stats = {k: v for k, v in body.items() if k.startswith(ENGINE_STATS)}
                return True
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
            return False

    async def _check_health(self) -> None:
        """Returns when the instance must be killed: it never came up, or stopped answering."""
        self._unhealthy = "unhealthy"
        deadline = time.monotonic() + self.START_TIMEOUT_S
        while not await self._probe():
            if time.monotonic() > deadline:
                log.error("instance %s not healthy after %.0fs", self.name, self.START_TIMEOUT_S)
                return
            await asyncio.sleep(0.1)
        if self.gpu is not None:
            try:
                for pool, member in zip(self.gpu.pools, self.members, strict=True):
                    if not self._adopted_gpu:  # (adopted: resident or out as it was)
                        await pool.ready(member, self.entry.placement.cold)
                self._adopted_gpu = False
            except ApiError:  # the cold swap-out failed: the pool asked for a restart
                return
        self.state = State.READY
        self._became_ready = True
        self.started_at = time.time()
        self._ready.set()
        log.info("instance %s ready (pid %s)", self.name, self.pid)
        failures = 0
        while failures < self.HEALTH_FAILURES:
            await asyncio.sleep(self.HEALTH_INTERVAL_S)
            if await asyncio.to_thread(self._disk_over_limit):
                return
            failures = 0 if await self._probe() else failures + 1
        log.error("instance %s failed %d health checks", self.name, failures)

    def _disk_over_limit(self) -> bool:
        """Its disk KV tier is on disk, not a size-limited tmpfs: what it holds there is
        counted at every health check, and an instance past its budget is restarted
        (which empties the directory)."""
        if self.kv_disk_dir is None:
            return False
        used = hostfs.usage_bytes(self.kv_disk_dir)
        limit = self.entry.placement.kv_disk_bytes
        if used <= limit + limit // 10 + DISK_SLACK_BYTES:
            return False
        self._unhealthy = "kv-disk-over-limit"
        log.error(
            "instance %s holds %d bytes in its KV disk tier (limit %d)", self.name, used, limit
        )
        return True
