"""The node's model catalog: which models it serves and where their checkpoints are."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from omni.api.live import parse_bind
from omni.api.toolcalls import PARSERS
from omni.engine.checkpoint import Checkpoint, CheckpointError
from omni.engine.spec_config import mtp_layers
from omni.isolation.sandbox import Limits
from omni.model_spec import HANDLER_KEYS, parse_size
from omni.runtime import config_schema, envs

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class CatalogError(ValueError):
    """A catalog entry or config that cannot be used; the message says which and why."""


DEFAULT_LIMITS = Limits(memory_bytes=8 << 30, pids=512)
PARALLEL_MODES = ("tp", "ep")  # each expert's width over the ranks, or whole experts
SPECULATIVE_KEYS = config_schema.keys("models.speculative")
RUNTIMES = {"omni", "python"}  # OMNI's engine; a handler (omni/instance/handler.py)
# what OMNI's engine alone reads: refused for a handler's model rather than ignored
ENGINE_KEYS = ("tool_parser", "tensor_parallel", "parallel", "quantization", "kv_cache_dtype")
ENGINE_KEYS += ("speculative", "kv_host_cache", "kv_disk_cache", "role", "serves")
HANDLER_RE = re.compile(r"^[A-Za-z0-9_./-]+:[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class HandlerConfig:
    """A `runtime = "python"` model: its handler, its own packages, and how it batches."""

    handler: str  # "file.py:Class" (in the model directory) or "package.module:Class"
    requirements: tuple[str, ...] = ()  # pinned, "name==version"
    max_batch_size: int | None = None  # None: the handler's own
    max_queue_delay_ms: float | None = None  # None: the handler's own
    infer_timeout_s: float = 60.0
    gpu_split: bool = True  # the handler's gpu_done() lets the next batch start

    def to_json(self) -> dict:
        return {
            "handler": self.handler,
            "requirements": list(self.requirements),
            "max_batch_size": self.max_batch_size,
            "max_queue_delay_ms": self.max_queue_delay_ms,
            "infer_timeout_s": self.infer_timeout_s,
            "gpu_split": self.gpu_split,
        }


@dataclass(frozen=True)
class Placement:
    """Where an instance runs and how much of it omnid lets in at once."""

    gpus: tuple[int, ...] = ()  # the GPUs its ranks run on, rank 0's first; (): the CPU path
    quota_bytes: int | None = None  # GPU memory on each of its GPUs, enforced by the shim
    permits: int = 64  # requests at the instance at once; more wait, then get 429
    cold: bool = False  # load, then swap out at once
    tensor_parallel: int = 1  # ranks (processes) the model is split over, in one sandbox
    parallel: str = "tp"  # a mixture of experts over ranks: "ep" shares out whole experts
    quantization: str | None = None  # "fp8": a bf16 checkpoint's projections, at load
    kv_cache_dtype: str | None = None  # "fp8": the KV cache in e4m3, twice the tokens
    speculative: tuple[tuple[str, object], ...] = ()  # speculative decoding's settings
    kv_host_bytes: int = 0  # a host-memory tier for evicted prefix blocks (kv_tiers.py)
    kv_disk_bytes: int = 0  # ... and a disk tier below it, in omnid's state dir
    # disaggregated serving: "prefill" | "decode", one side of the model named `serves`
    role: str | None = None
    serves: str | None = None
    # on unload or restart: seconds its requests in flight may take to finish, no new ones
    # admitted, before it is stopped (a long generation's length)
    drain_s: float = 60.0

    @property
    def draft_path(self) -> Path | None:
        """The checkpoint a draft model or EAGLE-3 head is read from (in its sandbox too)."""
        path = dict(self.speculative).get("path")
        return Path(path) if path else None

    @property
    def gpu(self) -> int | None:
        """Rank 0's GPU; None on the CPU path."""
        return self.gpus[0] if self.gpus else None


@dataclass(frozen=True)
class ModelEntry:
    name: str
    path: Path
    kind: str  # "generate" | "embed"
    origin: str  # "default" | "config" | "admin"
    limits: Limits = DEFAULT_LIMITS
    placement: Placement = Placement()
    runtime: str = "omni"
    version: str = ""  # the rollout version a scheduler placed (telemetry is tagged with it)
    tool_parser: str | None = None  # how its tool calls are read; None: from the checkpoint
    handler: HandlerConfig | None = None  # runtime "python": what it runs

    @classmethod
    def from_path(
        cls,
        name: str,
        path: str | Path,
        origin: str,
        limits: Limits = DEFAULT_LIMITS,
        placement: Placement = Placement(),
        version: str = "",
        tool_parser: str | None = None,
        handler: HandlerConfig | None = None,
    ) -> ModelEntry:
        """Validate the name and the checkpoint now, so a bad entry never reaches an instance."""
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise CatalogError(
                f"model name {name!r} is invalid: use 1-64 letters, digits, '.', '_' or '-'"
            )
        if handler is not None:
            return cls._of_handler(name, Path(path), origin, limits, placement, version, handler)
        ckpt = Checkpoint.open(Path(path).resolve())  # CheckpointError names the file
        spec = dict(placement.speculative)
        if spec.get("method") == "draft":  # the draft must be a model too
            Checkpoint.open(spec["path"])
        elif spec.get("method") == "eagle3" and not Path(spec["path"], "config.json").is_file():
            raise CheckpointError(f"{Path(spec['path'], 'config.json')}: missing (an EAGLE-3 head)")
        elif spec.get("method") == "mtp" and not mtp_layers(ckpt.config):
            raise CheckpointError(
                f"{ckpt.path}: speculative.method 'mtp' needs a multi-token-prediction layer "
                "(num_nextn_predict_layers), and this checkpoint has none"
            )
        return cls(
            name,
            ckpt.path,
            ckpt.kind,
            origin,
            limits,
            placement,
            version=version,
            tool_parser=tool_parser,
        )

    @classmethod
    def _of_handler(
        cls,
        name: str,
        path: Path,
        origin: str,
        limits: Limits,
        placement: Placement,
        version: str,
        handler: HandlerConfig,
    ) -> ModelEntry:
        """A handler's model: a directory, holding its handler file where it names one."""
        path = path.resolve()
        if not path.is_dir():
            raise CatalogError(f"{path}: not a directory (a python-runtime model's)")
        where, _, _ = handler.handler.partition(":")
        if where.endswith(".py") and not (path / where).is_file():
            raise CatalogError(f"{path / where}: missing (the model's handler file)")
        return cls(
            name,
            path,
            kind="python",
            origin=origin,
            limits=limits,
            placement=placement,
            runtime="python",
            version=version,
            handler=handler,
        )

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "path": str(self.path),
            "kind": self.kind,
            "origin": self.origin,
            "runtime": self.runtime,
            "memory_bytes": self.limits.memory_bytes,
            "cpus": self.limits.cpu_cores,
            "pids": self.limits.pids,
            "gpu": self.placement.gpu,
            "gpus": list(self.placement.gpus),
            "quota_bytes": self.placement.quota_bytes,
            "permits": self.placement.permits,
            "cold": self.placement.cold,
            "tensor_parallel": self.placement.tensor_parallel,
            "parallel": self.placement.parallel,
            "quantization": self.placement.quantization,
            "kv_cache_dtype": self.placement.kv_cache_dtype,
            "speculative": dict(self.placement.speculative) or None,
            "kv_host_cache_bytes": self.placement.kv_host_bytes,
            "kv_disk_cache_bytes": self.placement.kv_disk_bytes,
            "role": self.placement.role,
            "serves": self.placement.serves,
            "drain_s": self.placement.drain_s,
            "version": self.version,
            "tool_parser": self.tool_parser,
            "handler": self.handler.to_json() if self.handler else None,
        }


@dataclass(frozen=True)
class ModelConfig:
    name: str
    path: str
    limits: Limits = DEFAULT_LIMITS
    placement: Placement = Placement()
    tool_parser: str | None = None
    handler: HandlerConfig | None = None


# While a hot model serves, the colder instances of its GPU together take about one
# step per this window (gpuyield.py): a cold step of a few ms per 100 ms costs the hot
# model a few percent at most, and a cold model still advances under sustained hot load.
# On the H100 bench 50 ms left the hot p99 1.26x its single-node figure, 100 ms did not.
DEFAULT_GPU_YIELD_S = 0.1
# what a sandbox may enforce, by the names `require_limits` takes (omnid reports each)
SANDBOX_LIMITS = ("memory", "cpu", "pids", "tmp", "io", "seccomp")


@dataclass(frozen=True)
class NodeConfig:
    default_models: bool = True
    models: list[ModelConfig] = field(default_factory=list)
    gpus: dict[int, int] = field(default_factory=dict)  # index -> memory budget in bytes
    listen: tuple[str, int] | None = None
    state_dir: Path | None = None
    runtime_dir: Path | None = None
    sandbox: str | None = None
    swap_timeout_s: float = 30.0
    request_timeout_s: float = 60.0
    gpu_yield_s: float = DEFAULT_GPU_YIELD_S
    dashboard: tuple[str, int] | None = None  # the dashboard's own (loopback) listener
    require_limits: tuple[str, ...] = ()  # SANDBOX_LIMITS without which no instance starts
    # live restore: on SIGTERM, leave sandboxed instances running for the next omnid to
    # adopt; an instance no omnid owns for orphan_timeout_s ends itself
    live_restore: bool = False
    orphan_timeout_s: float = 60.0
    wheelhouse: Path | None = None  # models' requirements from here alone (envs.py)


# the keys each table may hold: declared, with what they do, in config_schema.py
NODE_KEYS = config_schema.keys("node")
MODEL_KEYS = config_schema.keys("models")
ROLES = ("prefill", "decode")
GPU_KEYS = config_schema.keys("gpus")


def _positive_int(item: dict, key: str, where: str, minimum: int = 1) -> int:
    value = item[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise CatalogError(f"{where}.{key}: must be an integer of at least {minimum}")
    return value


def _size(item: dict, key: str, where: str) -> int:
    try:
        return parse_size(item[key])
    except ValueError as exc:
        raise CatalogError(f"{where}.{key}: {exc}") from None


def _seconds(data: dict, key: str, where: str, default: float) -> float:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise CatalogError(f"{where}: '{key}' must be a positive number of seconds")
    return float(value)


def limits_from(item: dict, where: str) -> Limits:
    memory, cpus, pids = DEFAULT_LIMITS.memory_bytes, None, DEFAULT_LIMITS.pids
    if "memory" in item:
        memory = _size(item, "memory", where)
    if "cpus" in item:
        cpus = item["cpus"]
        if isinstance(cpus, bool) or not isinstance(cpus, int | float) or cpus <= 0:
            raise CatalogError(f"{where}.cpus: must be a positive number of cores")
        cpus = float(cpus)
    if "pids" in item:
        pids = _positive_int(item, "pids", where, minimum=8)
    sizes = {}  # its tmpfs mounts: /tmp, and the socket directory (KV handoffs too)
    for key, field_name in (("tmp", "tmp_bytes"), ("io", "io_bytes")):
        if key in item:
            sizes[field_name] = _size(item, key, where)
    return Limits(memory_bytes=memory, cpu_cores=cpus, pids=pids, **sizes)


def tool_parser_from(item: dict, where: str) -> str | None:
    """A model's tool-call format, named where its checkpoint does not tell it."""
    value = item.get("tool_parser")
    if value is not None and value not in PARSERS:
        raise CatalogError(f"{where}.tool_parser: {value!r} is not one of {sorted(PARSERS)}")
    return value


def handler_from(item: dict, where: str) -> HandlerConfig | None:
    """A python-runtime model's handler settings; None for OMNI's engine."""
    runtime = item.get("runtime", "omni")
    if runtime not in RUNTIMES:
        raise CatalogError(f"{where}.runtime: {runtime!r} is not one of {sorted(RUNTIMES)}")
    if runtime != "python":
        stray = [k for k in HANDLER_KEYS if k in item]
        if stray:
            raise CatalogError(f'{where}.{stray[0]}: only for runtime = "python"')
        return None
    engine_only = [k for k in ENGINE_KEYS if k in item]
    if engine_only:
        raise CatalogError(f'{where}.{engine_only[0]}: only for runtime = "omni"')
    handler = item.get("handler")
    if not isinstance(handler, str) or not HANDLER_RE.match(handler) or ".." in handler:
        raise CatalogError(
            f"{where}.handler: required with runtime = \"python\": 'file.py:Class' "
            "(in the model directory) or 'package.module:Class'"
        )
    requirements = item.get("requirements", [])
    if not isinstance(requirements, list):
        raise CatalogError(f"{where}.requirements: a list of pinned packages, 'name==version'")
    try:
        envs.validate(requirements)
    except envs.EnvBuildError as exc:
        raise CatalogError(f"{where}.{exc}") from None
    delay = item.get("max_queue_delay_ms")
    if delay is not None and (isinstance(delay, bool) or not isinstance(delay, int | float)):
        raise CatalogError(f"{where}.max_queue_delay_ms: must be a number of milliseconds")
    if delay is not None and not 0 <= delay <= 60_000:
        raise CatalogError(f"{where}.max_queue_delay_ms: must be from 0 to 60000")
    split = item.get("gpu_split", True)
    if not isinstance(split, bool):
        raise CatalogError(f"{where}.gpu_split: must be true or false")
    return HandlerConfig(
        handler,
        tuple(requirements),
        _positive_int(item, "max_batch_size", where) if "max_batch_size" in item else None,
        None if delay is None else float(delay),
        _seconds(item, "infer_timeout", where, 60.0),
        split,
    )


def placement_from(item: dict, where: str, gpus: dict[int, int] | None) -> Placement:
    """`gpus`: the configured budgets to check against (None: checked by the node).

    `gpu` is one GPU's index, or a list of them for a model split over several GPUs
    (`tensor_parallel` then defaults to, and must equal, their number); `quota` is what
    the instance may hold on each of them."""
    chosen: tuple[int, ...] = ()
    quota = None
    if "gpu" in item:
        chosen = _gpu_indexes(item["gpu"], where)
        missing = [g for g in chosen if gpus is not None and g not in gpus]
        if missing:
            raise CatalogError(f"{where}.gpu: GPU {missing[0]} has no [[gpus]] entry with a budget")
        if "quota" not in item:
            raise CatalogError(f"{where}.quota: required with 'gpu'")
    if "quota" in item:
        if not chosen:
            raise CatalogError(f"{where}.quota: only with 'gpu'")
        quota = _size(item, "quota", where)
        small = [g for g in chosen if gpus is not None and quota > gpus[g]]
        if small:
            raise CatalogError(f"{where}.quota: larger than the budget of GPU {small[0]}")
    permits = _positive_int(item, "permits", where) if "permits" in item else Placement.permits
    cold = item.get("cold", False)
    if not isinstance(cold, bool):
        raise CatalogError(f"{where}.cold: must be true or false")
    if cold and not chosen:
        raise CatalogError(f"{where}.cold: only with 'gpu' (a CPU instance cannot swap)")
    tp = len(chosen) or 1
    if "tensor_parallel" in item:
        tp = _positive_int(item, "tensor_parallel", where)
        if chosen and tp != len(chosen):
            raise CatalogError(
                f"{where}.tensor_parallel: {tp} ranks on {len(chosen)} GPU(s): one rank a GPU, "
                "list as many GPUs in 'gpu'"
            )
    parallel = item.get("parallel", "tp")
    if parallel not in PARALLEL_MODES:
        raise CatalogError(f"{where}.parallel: {parallel!r} is not one of {list(PARALLEL_MODES)}")
    if parallel == "ep" and tp == 1:
        raise CatalogError(
            f"{where}.parallel: 'ep' needs several ranks (a list of GPUs, or tensor_parallel)"
        )
    quantization = _fp8_only(item, "quantization", where, "FP8 needs a GPU", chosen)
    kv_cache_dtype = _fp8_only(item, "kv_cache_dtype", where, "an FP8 cache needs a GPU", chosen)
    speculative = _speculative(item.get("speculative"), where)
    kv_host = _size(item, "kv_host_cache", where) if "kv_host_cache" in item else 0
    if kv_host and tp > 1:
        raise CatalogError(f"{where}.kv_host_cache: for a model on one GPU (or the CPU) so far")
    kv_disk = _size(item, "kv_disk_cache", where) if "kv_disk_cache" in item else 0
    if kv_disk and not kv_host:
        raise CatalogError(f"{where}.kv_disk_cache: needs a kv_host_cache above it")
    role, serves = _role(item, where, tp)
    drain_s = _seconds(item, "drain", where, Placement.drain_s)
    return Placement(
        chosen,
        quota,
        permits,
        cold,
        tp,
        parallel,
        quantization,
        kv_cache_dtype,
        speculative,
        kv_host,
        kv_disk,
        role,
        serves,
        drain_s,
    )


def _role(item: dict, where: str, tp: int) -> tuple[str | None, str | None]:
    """`role` and `serves`: one side of a disaggregated model, named by what it serves."""
    role, serves = item.get("role"), item.get("serves")
    if role is None and serves is None:
        return None, None
    if role not in ROLES:
        raise CatalogError(f"{where}.role: one of {list(ROLES)}, with 'serves'")
    if not isinstance(serves, str) or not NAME_RE.match(serves):
        raise CatalogError(f"{where}.serves: the model name the {role} side serves")
    if tp > 1:
        raise CatalogError(f"{where}.role: for a model on one GPU (or the CPU) so far")
    return role, serves


def check_disaggregated(entries: list, where: str) -> None:
    """Each disaggregated model has both sides, of one checkpoint and one KV cache layout,
    and its name is no other entry's."""
    groups: dict[str, list] = {}
    for e in entries:
        if e.placement.serves is not None:
            groups.setdefault(e.placement.serves, []).append(e)
    names = {e.name for e in entries}
    for served, sides in groups.items():
        if served in names:
            raise CatalogError(f"{where}: {served!r} is served disaggregated and is an entry too")
        roles = {e.placement.role for e in sides}
        if roles != set(ROLES):
            raise CatalogError(
                f"{where}: {served!r} needs a prefill and a decode entry (has {sorted(roles)})"
            )
        layouts = {(str(Path(e.path).resolve()), e.placement.kv_cache_dtype) for e in sides}
        if len(layouts) > 1:
            raise CatalogError(
                f"{where}: the sides of {served!r} must share one checkpoint and kv_cache_dtype"
            )


def _fp8_only(item: dict, key: str, where: str, no_gpu: str, gpus: tuple) -> str | None:
    """A key whose one value is "fp8", which only a GPU model may ask for."""
    value = item.get(key)
    if value is not None:
        if value != "fp8":
            raise CatalogError(f"{where}.{key}: {value!r} is not 'fp8'")
        if not gpus:
            raise CatalogError(f"{where}.{key}: {no_gpu} ('gpu')")
    return value


def _speculative(value: object, where: str) -> tuple[tuple[str, object], ...]:
    """A model's `speculative` table, checked as the engine will read it."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise CatalogError(f"{where}.speculative: a table, e.g. {{method = 'ngram', k = 4}}")
    extra = set(value) - SPECULATIVE_KEYS
    if extra:
        raise CatalogError(f"{where}.speculative: unknown key {sorted(extra)[0]!r}")
    from omni.engine.spec_config import SpecConfig  # (no torch)

    settings = dict(value)
    if "model" in settings:  # a draft named by its [[models]] entry: resolve_drafts
        if not isinstance(settings["model"], str) or "path" in settings:
            raise CatalogError(f"{where}.speculative.model: a model's name, instead of 'path'")
        if settings.get("method") != "draft":
            raise CatalogError(f"{where}.speculative.model: only with method = 'draft'")
        settings["path"] = "/"  # (stands in for the entry's path while checking the rest)
    try:
        SpecConfig(**{k: v for k, v in settings.items() if k != "model"})
    except (TypeError, ValueError) as exc:
        raise CatalogError(f"{where}.{exc}") from None
    return tuple(sorted(value.items()))


def resolve_drafts(models: list[ModelConfig], where: str) -> list[ModelConfig]:
    """Models whose draft is named (`speculative.model`) given that entry's path."""
    paths = {m.name: m.path for m in models}
    out = []
    for m in models:
        spec = dict(m.placement.speculative)
        if "model" in spec:
            name = spec.pop("model")
            if name not in paths:
                raise CatalogError(
                    f"{where}: model {m.name!r}: speculative.model {name!r} is no [[models]] entry"
                )
            if name == m.name:
                raise CatalogError(f"{where}: model {m.name!r} cannot be its own draft")
            spec["path"] = str(Path(paths[name]).resolve())
            placement = dataclasses.replace(m.placement, speculative=tuple(sorted(spec.items())))
            m = dataclasses.replace(m, placement=placement)
        out.append(m)
    return out


def _gpu_indexes(value: object, where: str) -> tuple[int, ...]:
    values = value if isinstance(value, list) else [value]
    if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
        raise CatalogError(f"{where}.gpu: a GPU index (from 0), or a list of them")
    if len(set(values)) != len(values):
        raise CatalogError(f"{where}.gpu: GPU {values} lists a GPU twice")
    return tuple(values)


def _tables(data: dict, key: str, path: Path, allowed: set[str]) -> Iterator[tuple[str, dict]]:
    """The [[key]] tables with where each one is, each checked to hold only `allowed` keys."""
    items = data.get(key, [])
    if not isinstance(items, list):
        raise CatalogError(f"{path}: '{key}' must be an array of tables ([[{key}]])")
    for i, item in enumerate(items):
        where = f"{path}: {key}[{i}]"
        if not isinstance(item, dict):
            raise CatalogError(f"{where}: must be a table")
        extra = set(item) - allowed
        if extra:
            raise CatalogError(f"{where}: unknown key {sorted(extra)[0]!r}")
        yield where, item


def _gpus(data: dict, path: Path) -> dict[int, int]:
    gpus: dict[int, int] = {}
    for where, item in _tables(data, "gpus", path, GPU_KEYS):
        for key in GPU_KEYS:
            if key not in item:
                raise CatalogError(f"{where}.{key}: required")
        index = _positive_int(item, "index", where, minimum=0)
        if index in gpus:
            raise CatalogError(f"{where}.index: GPU {index} is already listed")
        gpus[index] = _size(item, "budget", where)
    return gpus


def _listen(value, path: Path) -> tuple[str, int]:
    host, _, port = value.rpartition(":") if isinstance(value, str) else ("", "", "")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise CatalogError(f"{path}: 'listen' must be 'host:port', e.g. '127.0.0.1:8081'")
    return host.strip("[]"), int(port)


def load_config(path: Path) -> NodeConfig:
    """Read omnid's TOML config; errors name the key and the problem."""
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise CatalogError(f"{path}: not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise CatalogError(f"{path}: invalid TOML ({exc})") from None
    unknown = set(data) - NODE_KEYS
    if unknown:
        raise CatalogError(f"{path}: unknown key {sorted(unknown)[0]!r}")
    defaults = data.get("default_models", True)
    if not isinstance(defaults, bool):
        raise CatalogError(f"{path}: 'default_models' must be true or false")
    for key in ("state_dir", "runtime_dir", "wheelhouse"):
        if key in data and not (isinstance(data[key], str) and data[key].startswith("/")):
            raise CatalogError(f"{path}: '{key}' must be an absolute path")
    sandbox = data.get("sandbox")
    if sandbox is not None and sandbox not in ("auto", "isolated", "process"):
        raise CatalogError(f"{path}: 'sandbox' must be 'auto', 'isolated' or 'process'")
    gpus = _gpus(data, path)
    out: list[ModelConfig] = []
    for where, item in _tables(data, "models", path, MODEL_KEYS):
        for key in ("name", "path"):
            if not isinstance(item.get(key), str):
                raise CatalogError(f"{where}.{key}: required string")
        if any(m.name == item["name"] for m in out):
            raise CatalogError(f"{where}.name: {item['name']!r} is already listed")
        out.append(
            ModelConfig(
                item["name"],
                item["path"],
                limits_from(item, where),
                placement_from(item, where, gpus),
                tool_parser_from(item, where),
                handler_from(item, where),
            )
        )
    check_disaggregated(out, str(path))
    return NodeConfig(
        default_models=defaults,
        models=resolve_drafts(out, str(path)),
        gpus=gpus,
        listen=_listen(data["listen"], path) if "listen" in data else None,
        state_dir=Path(data["state_dir"]) if "state_dir" in data else None,
        runtime_dir=Path(data["runtime_dir"]) if "runtime_dir" in data else None,
        sandbox=sandbox,
        swap_timeout_s=_seconds(data, "swap_timeout", str(path), 30.0),
        request_timeout_s=_seconds(data, "request_timeout", str(path), 60.0),
        gpu_yield_s=_gpu_yield(data, path),
        dashboard=_dashboard(data, path),
        require_limits=_require_limits(data, path),
        live_restore=_flag(data, "live_restore", path),
        orphan_timeout_s=_seconds(data, "orphan_timeout", str(path), 60.0),
        wheelhouse=Path(data["wheelhouse"]) if "wheelhouse" in data else None,
    )


def _flag(data: dict, key: str, path: Path) -> bool:
    value = data.get(key, False)
    if not isinstance(value, bool):
        raise CatalogError(f"{path}: '{key}' must be true or false")
    return value


def _require_limits(data: dict, path: Path) -> tuple[str, ...]:
    """`require_limits = ["memory", "cpu"]`: names from SANDBOX_LIMITS, each once."""
    value = data.get("require_limits", [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise CatalogError(f"{path}: 'require_limits' must be a list of names")
    unknown = [v for v in value if v not in SANDBOX_LIMITS]
    if unknown:
        raise CatalogError(
            f"{path}: 'require_limits': {unknown[0]!r} is not one of {list(SANDBOX_LIMITS)}"
        )
    return tuple(dict.fromkeys(value))


def _dashboard(data: dict, path: Path) -> tuple[str, int] | None:
    """`dashboard = "127.0.0.1:9181"` (or a port): loopback unless an address is written out."""
    if "dashboard" not in data:
        return None
    try:
        return parse_bind(data["dashboard"], f"{path}: 'dashboard'")
    except ValueError as exc:
        raise CatalogError(str(exc)) from None


def _gpu_yield(data: dict, path: Path) -> float:
    value = data.get("gpu_yield", DEFAULT_GPU_YIELD_S)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise CatalogError(f"{path}: 'gpu_yield' must be seconds from 0 (off) to 1")
    return float(value)
