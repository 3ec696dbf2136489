"""What omnid tells an instance: one typed document, the contract between the two sides.

omnid (omni/runtime/instance.py) writes it as JSON into one environment variable,
`OMNI_INSTANCE_SETTINGS`; the instance (worker.py) reads it back. A leaf module: both sides
import it, it imports neither. An unknown key is an error, so the two sides cannot drift
apart silently (an instance started by an older or newer omnid refuses to guess).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

ENV = "OMNI_INSTANCE_SETTINGS"
RUNTIMES = ("omni", "python")  # OMNI's own engine (text generation, embeddings); a handler
DEFAULT_MAX_OUTPUT_BYTES = 64 << 20  # what one request's outputs from a handler may take


class SettingsError(ValueError):
    """The settings document is missing or malformed; the message says which key."""


@dataclass(frozen=True)
class InstanceSettings:
    name: str
    model_dir: str
    socket: str  # the Unix socket the instance serves on; its directory is the instance's io/
    runtime: str = "omni"  # one of RUNTIMES
    device: str = "cpu"  # "cpu" or "cuda:N" (rank 0's GPU as the instance sees it)
    # runtime "python": the handler ("package.module:Class" or "file.py:Class"); its own
    # packages come on PYTHONPATH, from the sandbox (SandboxSpec.python_env)
    handler: str | None = None
    max_batch_size: int | None = None  # None: the handler's own
    max_queue_delay_ms: float | None = None  # None: the handler's own
    infer_timeout_s: float = 60.0  # one batch's infer(): past it, 504 and the instance ends
    gpu_split: bool = True  # False: the handler's gpu_done() frees nothing early
    max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES
    # runtime "omni": the engine's settings from the catalog
    tool_parser: str | None = None
    tensor_parallel: int = 1
    parallel: str = "tp"  # a mixture of experts over ranks: "tp" | "ep"
    quantization: str | None = None
    kv_cache_dtype: str | None = None
    kv_host_bytes: int = 0
    kv_disk_bytes: int = 0
    kv_disk_dir: str | None = None
    speculative: dict = field(default_factory=dict)
    memory_limit_bytes: int = 0  # the sandbox's memory limit (0: none), for the KV cache's size
    # on a GPU: each rank's shim control block (rank 0's first) and the yield flag's path
    rank_controls: tuple[str, ...] = ()
    yield_path: str | None = None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> InstanceSettings:
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise SettingsError(f"{ENV}: not JSON ({exc})") from None
        if not isinstance(data, dict):
            raise SettingsError(f"{ENV}: not a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SettingsError(f"{ENV}: unknown key {unknown[0]!r}")
        missing = [k for k in ("name", "model_dir", "socket") if not isinstance(data.get(k), str)]
        if missing:
            raise SettingsError(f"{ENV}: {missing[0]!r} must be a string")
        if data.get("runtime", "omni") not in RUNTIMES:
            raise SettingsError(f"{ENV}: runtime {data['runtime']!r} is not one of {RUNTIMES}")
        if data.get("runtime") == "python" and not data.get("handler"):
            raise SettingsError(f"{ENV}: runtime 'python' needs a handler")
        data["rank_controls"] = tuple(data.get("rank_controls", ()))
        return cls(**data)

    def to_env(self) -> dict[str, str]:
        return {ENV: self.to_json()}

    @classmethod
    def from_env(cls) -> InstanceSettings:
        text = os.environ.get(ENV)
        if not text:
            raise SettingsError(f"{ENV} is not set: omnid starts instances with it")
        return cls.from_json(text)
