"""The `runtime = "python"` backend: a third-party handler served over the Open Inference
Protocol on the instance's socket.

`handler = "package.module:Class"` names a module on the path (the runtimes shipped in
omni/runtimes/, or the model's own packages); `handler = "file.py:Class"` a file in the
model directory, imported by path. Requests are checked against the handler's declared
inputs, batched (batcher.py), and its outputs checked before they are encoded.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import logging
import sys
from functools import partial
from pathlib import Path

from aiohttp import web

from omni.api import oip, phased
from omni.cudashim.read_only import declare_read_only
from omni.runtime.gpuyield import YieldGate

from .batcher import Batcher, InferError
from .handler import Handler, TensorSpec
from .settings import InstanceSettings
from .trim import free_cached
from .validate import TensorError, check_inputs, check_outputs

log = logging.getLogger("omni.python_backend")
PLATFORM = "omni-python"


class HandlerLoadError(RuntimeError):
    """The handler named in the catalog cannot be imported or is not a Handler."""


def load_handler_class(spec: str, model_dir: Path) -> type[Handler]:
    """The class `spec` names: "package.module:Class" or "file.py:Class" (in model_dir)."""
    where, _, class_name = spec.partition(":")
    if not where or not class_name:
        raise HandlerLoadError(f"handler {spec!r}: expected 'module:Class' or 'file.py:Class'")
    if where.endswith(".py"):
        module = _import_file(model_dir, where)
    else:
        module = importlib.import_module(where)
    cls = getattr(module, class_name, None)
    if cls is None:
        raise HandlerLoadError(f"handler {spec!r}: {where} has no {class_name!r}")
    if not (isinstance(cls, type) and issubclass(cls, Handler)):
        raise HandlerLoadError(f"handler {spec!r}: {class_name} is not a Handler subclass")
    return cls


def _import_file(model_dir: Path, relative: str):
    path = (model_dir / relative).resolve()
    if not path.is_relative_to(model_dir.resolve()) or not path.is_file():
        raise HandlerLoadError(f"handler file {relative!r} is not a file in {model_dir}")
    name = f"omni_handler_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def declared(specs: object) -> tuple[TensorSpec, ...]:
    """A handler's `inputs` or `outputs`, which must be TensorSpecs with distinct names."""
    specs = tuple(specs) if isinstance(specs, tuple | list) else None
    if specs is None or not all(isinstance(s, TensorSpec) for s in specs):
        raise HandlerLoadError("a handler's inputs and outputs are tuples of TensorSpec")
    if len({s.name for s in specs}) != len(specs):
        raise HandlerLoadError("a handler declares two tensors of one name")
    return specs


def declare_weights(handler: Handler, device: str) -> int:
    """On a GPU under the shim, the handler's weights declared read-only (swaps keep their
    host copy); the bytes declared. Its `weights()` is handler code: if it fails, the
    weights move on every swap like any memory, and the model serves as before."""
    if not device.startswith("cuda"):
        return 0
    try:
        return declare_read_only(handler.weights())
    except Exception:
        log.exception("the handler's weights() failed: its weights are copied at each swap-out")
        return 0


def error(status: int, message: str) -> web.Response:
    """The protocol's error body."""
    return web.Response(body=oip.error_body(message), status=status, content_type=oip.JSON_TYPE)


class PythonBackend:
    kind = "python"

    def __init__(self, settings: InstanceSettings):
        self.name = settings.name
        model_dir = Path(settings.model_dir)
        # its own modules; its own packages are on PYTHONPATH (the sandbox's python_env)
        sys.path.insert(0, str(model_dir))
        assert settings.handler is not None
        self.handler = load_handler_class(settings.handler, model_dir)()
        self.handler.load(model_dir, settings.device)
        self.read_only_bytes = declare_weights(self.handler, settings.device)
        self.device = settings.device
        self.inputs, self.outputs = declared(self.handler.inputs), declared(self.handler.outputs)
        delay_ms = settings.max_queue_delay_ms
        self.gate = YieldGate(Path(settings.yield_path)) if settings.yield_path else None
        self.batcher = Batcher(
            self.handler.infer,
            partial(check_outputs, specs=self.outputs, max_bytes=settings.max_output_bytes),
            settings.max_batch_size or self.handler.max_batch_size,
            (self.handler.max_queue_delay_ms if delay_ms is None else delay_ms) / 1000,
            settings.infer_timeout_s,
            split=settings.gpu_split,
            gate=self.gate,
        )

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v2/models/{model}/infer", self.infer)
        app.router.add_get("/v2/models/{model}", self.metadata)
        app.router.add_get("/v2/models/{model}/ready", self.ready)

    def unhealthy(self) -> str | None:
        return self.batcher.hung

    def stats(self) -> dict:
        gated = self.gate.stats() if self.gate is not None else {}
        return {**self.batcher.stats(), **gated, "memory_read_only_bytes": self.read_only_bytes}

    def trim(self) -> int:
        return free_cached(self.device)

    async def close(self) -> None:
        await self.batcher.close()
        if not self.batcher.hung:  # (a hung thread may still be inside the handler)
            await asyncio.to_thread(self.handler.unload)

    def _model(self, request: web.Request) -> web.Response | None:
        """A 404 for any model but this one."""
        if request.match_info["model"] != self.name:
            return error(404, f"unknown model {request.match_info['model'][:64]!r}")
        return None

    async def metadata(self, request: web.Request) -> web.Response:
        if (missing := self._model(request)) is not None:
            return missing
        return web.json_response(
            {
                "name": self.name,
                "versions": ["1"],
                "platform": PLATFORM,
                "inputs": [s.to_json() for s in self.inputs],
                "outputs": [s.to_json() for s in self.outputs],
            }
        )

    async def ready(self, request: web.Request) -> web.Response:
        if (missing := self._model(request)) is not None:
            return missing
        if self.batcher.hung:
            return error(503, f"the model is being restarted: {self.batcher.hung}")
        return web.Response(status=200)

    async def infer(self, request: web.Request) -> web.StreamResponse:
        """Answered in phases (omni/api/phased.py) where the caller asks and the handler
        marks its GPU work's end before its answer: its permit goes on meanwhile."""
        if (missing := self._model(request)) is not None:
            return missing
        gpu_done = asyncio.Event()
        return await phased.answer(request, self._infer(request, gpu_done.set), gpu_done)

    async def _infer(self, request: web.Request, on_gpu_done) -> web.Response:
        try:
            req = oip.decode_request(await request.read(), request.headers)
            check_inputs(req.inputs, self.inputs)
            outputs = await self.batcher.submit(req.inputs, on_gpu_done)
        except oip.OipError as exc:
            return error(exc.status, exc.message)
        except TensorError as exc:
            return error(400, str(exc))
        except InferError as exc:
            return error(exc.status, exc.message)
        if req.outputs is not None:
            unknown = [n for n in req.outputs if n not in outputs]
            if unknown:
                return error(400, f"unknown output {unknown[0][:64]!r}")
            outputs = {n: outputs[n] for n in req.outputs}
        binary = {name for name in outputs if req.wants_binary(name)}
        body, headers = oip.encode_response(self.name, outputs, req.id, binary)
        return web.Response(body=body, headers=headers)
