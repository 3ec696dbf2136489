"""One way in for every kind of model: what the instance process serves sits behind a
Backend, chosen from the settings omnid passed.

- runtime "omni", a text-generation checkpoint: OMNI's engine (`TextGenBackend`);
- runtime "omni", an encoder checkpoint: embeddings (`EmbeddingBackend`);
- runtime "python": a third-party handler (python_backend.py).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Protocol

from aiohttp import web

from omni.cudashim.read_only import declare_read_only
from omni.engine.checkpoint import Checkpoint

from .settings import InstanceSettings
from .trim import free_cached

log = logging.getLogger("omni.worker")


class Backend(Protocol):
    kind: str  # what /health reports: "generate", "embed", "python"

    def add_routes(self, app: web.Application) -> None: ...

    def stats(self) -> dict:
        """Counters for /health (omnid keeps those its metrics name)."""
        ...

    def unhealthy(self) -> str | None:
        """Why the instance must be restarted; None while it serves."""
        ...

    def trim(self) -> int:
        """Free the GPU memory held unused, before omnid swaps the instance out (trim.py);
        the bytes freed."""
        ...

    async def close(self) -> None: ...


class TextGenBackend:
    """OMNI's engine behind the OpenAI chat and completion routes."""

    kind = "generate"

    def __init__(self, settings: InstanceSettings, ckpt: Checkpoint):
        from .engine_loader import load_engine

        self.engine, self.gate, self.read_only_bytes = load_engine(settings, ckpt)
        self.settings = settings

    def add_routes(self, app: web.Application) -> None:
        from .textgen import TextGenRoutes

        handoff_dir = Path(self.settings.socket).parent
        TextGenRoutes(
            self.engine, self.settings.name, self.settings.tool_parser, handoff_dir
        ).add_to(app)

    def stats(self) -> dict:
        gated = self.gate.stats() if self.gate else {}
        return {**self.engine.stats(), **gated, "memory_read_only_bytes": self.read_only_bytes}

    def unhealthy(self) -> str | None:
        return None

    def trim(self) -> int:
        """Nothing: the swap-out itself releases the KV pool, the engine's largest part
        besides its weights, and its CUDA graphs keep their memory pools."""
        return 0

    async def close(self) -> None:
        await asyncio.to_thread(self.engine.shutdown)


class EmbeddingBackend:
    """A BERT encoder behind the OpenAI embeddings route."""

    kind = "embed"

    def __init__(self, settings: InstanceSettings, ckpt: Checkpoint):
        from omni.engine.bert import EmbeddingModel

        self.model = EmbeddingModel(ckpt, settings.device)  # "cpu" or its GPU
        self.name = settings.name
        # on a GPU under the shim, swaps keep the weights' host copy (0 elsewhere)
        self.read_only_bytes = declare_read_only(self.model.model.parameters())
        self.device = settings.device

    def add_routes(self, app: web.Application) -> None:
        from .embeddings import EmbeddingRoutes

        EmbeddingRoutes(self.model, self.name).add_to(app)

    def stats(self) -> dict:
        return {"memory_read_only_bytes": self.read_only_bytes}

    def unhealthy(self) -> str | None:
        return None

    def trim(self) -> int:
        return free_cached(self.device)

    async def close(self) -> None:
        pass


def open_backend(settings: InstanceSettings) -> Backend:
    """Load the model the settings name, behind the backend its runtime and kind call for."""
    if settings.runtime == "python":
        from .python_backend import PythonBackend

        return PythonBackend(settings)
    ckpt = Checkpoint.open(Path(settings.model_dir))
    if ckpt.kind == "generate":
        return TextGenBackend(settings, ckpt)
    return EmbeddingBackend(settings, ckpt)
