"""The interface third-party model code implements to run as a `runtime = "python"` model.

A handler declares its tensors, loads once on a device, and answers a batch of requests
per `infer()` call. The worker around it (python_backend.py) batches concurrent requests,
checks every output against `outputs` before it reaches a client (handler code is treated
as hostile), and turns failures into errors for the requests concerned.

A handler whose answer ends with CPU work (encoding an image, resampling audio) calls
`gpu_done()` (or leaves a `with gpu_phase():` block) where its GPU work for the batch is
over: the worker tells omnid and the edge at once, and they give the GPU's permit to the
next request while the CPU work finishes (the seeds' CPU-GPU split). The worker also
times both phases, for the model's predicted ETA. A handler whose batch is many GPU
steps calls `gpu_step()` between them, so a hotter model of its GPU goes first there.

A request's answer never depends on its batch-mates: a handler refuses one request by
returning a HandlerError in that request's place (`each` and `together` do this), and a
failure of a whole `infer()` call of several requests makes the worker run each of them
again alone (batcher.py), so only the bad ones fail.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

# the Open Inference Protocol's tensor types
OIP_DATATYPES = (
    "BOOL",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "FP16",
    "FP32",
    "FP64",
    "BYTES",
)  # (BYTES: numpy object arrays whose elements are bytes)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str  # one of OIP_DATATYPES
    shape: tuple[int, ...]  # one request's tensor; -1 = any length on that axis

    def __post_init__(self) -> None:
        if self.datatype not in OIP_DATATYPES:
            raise ValueError(f"tensor {self.name!r}: datatype {self.datatype!r} is not an OIP type")
        if any(not isinstance(d, int) or d < -1 for d in self.shape):
            raise ValueError(f"tensor {self.name!r}: shape {self.shape!r} (sizes, or -1 for any)")

    def to_json(self) -> dict:
        """As the protocol's model metadata lists it."""
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


class HandlerError(Exception):
    """A bad request, as the handler sees it: the caller gets a 400 with this message.
    Returned in a request's place in infer()'s list, it fails that request alone; raised,
    it fails the whole call (whose requests are then each run again alone)."""


# what infer() returns: each request's outputs, or the HandlerError that refuses it
Answers = list[dict[str, np.ndarray] | HandlerError]
Item = TypeVar("Item")
Result = TypeVar("Result")


def each(
    items: Iterable[Item | HandlerError], step: Callable[[Item], Result]
) -> list[Result | HandlerError]:
    """`step` of every item, where the HandlerError `step` raises takes that item's place
    and an item that already is one is passed on: one bad request fails alone, and
    steps chain (`each(each(batch, decode), run)`)."""
    out: list[Result | HandlerError] = []
    for item in items:
        if isinstance(item, HandlerError):
            out.append(item)
            continue
        try:
            out.append(step(item))
        except HandlerError as refused:
            out.append(refused)
    return out


def together(
    items: list[Item | HandlerError], run: Callable[[list[Item]], Iterable[Result]]
) -> list[Result | HandlerError]:
    """`run` once on the items that are not refusals (one forward pass for them all), its
    results put back in their items' places, the refusals left in theirs."""
    kept = [item for item in items if not isinstance(item, HandlerError)]
    results = iter(run(kept) if kept else ())
    return [item if isinstance(item, HandlerError) else next(results) for item in items]


_phase = threading.local()  # the batch infer() runs in this thread: its callback and gate


def gpu_done() -> None:
    """From infer(): this batch's GPU work is over; what remains is CPU work. Once per
    call (later calls do nothing); outside a worker (a handler run bare), nothing."""
    callback = getattr(_phase, "callback", None)
    _phase.gate = None  # its CPU work does not wait for the GPU
    if callback is not None:
        _phase.callback = None
        callback()


def gpu_step() -> None:
    """From infer(), between the GPU steps of one batch (a denoising step, a decoder
    token): wait here while a hotter model of this GPU serves, for at most the bound
    omnid sets (gpuyield.py). A batch of long GPU work otherwise shares the GPU's time
    slices with the hot model's steps, and the hot model's latency grows. The worker
    also waits so before each batch; outside a worker, or after gpu_done(), nothing."""
    gate = getattr(_phase, "gate", None)
    if gate is not None:
        gate()


@contextlib.contextmanager
def gpu_phase() -> Iterator[None]:
    """`with gpu_phase(): ...` around a batch's GPU work: gpu_done() as the block ends
    (not where it raises: a failed batch has no CPU phase to overlap)."""
    yield
    gpu_done()


def set_gpu_done_callback(
    callback: Callable[[], None] | None, gate: Callable[[], None] | None = None
) -> None:
    """The worker's side (batcher.py): what gpu_done() and gpu_step() call in this thread."""
    _phase.callback, _phase.gate = callback, gate


class Handler:
    """Subclass this in a model directory's `handler.py` (or a module in omni/runtimes/)."""

    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()
    max_batch_size: int = 1  # the worker merges up to this many concurrent requests
    max_queue_delay_ms: float = 0.0  # how long the worker may hold a request to fill a batch

    def load(self, model_dir: Path, device: str) -> None:
        """Read weights from `model_dir` onto `device` ("cpu" or "cuda:N"); called once."""

    def infer(self, batch: list[dict[str, np.ndarray]]) -> Answers:
        """One dict of named arrays per request in, one per request out, in the same order;
        a request the handler refuses gets a HandlerError in its place."""
        raise NotImplementedError

    def unload(self) -> None:
        """Release what `load` took; called once as the instance stops."""

    def weights(self) -> Iterable[Any]:
        """The tensors this handler never writes once loaded: its models' parameters and
        buffers. On a GPU under omnid their host copy is kept across swaps, so a swap-out
        drops them instead of copying them back (else the longest part of a handler's
        swap-out). The default finds the torch modules among the handler's attributes
        (or in a list, tuple or dict there); override it to name others (a pipeline's
        parts), or return () for weights changed in place."""
        return module_tensors(vars(self).values())


def module_tensors(objects: Iterable[object]) -> list[Any]:
    """The parameters and buffers of the torch modules among `objects`, or in a list, tuple
    or dict among them (none if torch was never imported: then there are no modules)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    found: list[Any] = []
    for obj in objects:
        if isinstance(obj, dict):
            items: Iterable[object] = obj.values()
        else:
            items = obj if isinstance(obj, list | tuple) else (obj,)
        for item in items:
            if isinstance(item, torch.nn.Module):
                found += [*item.parameters(), *item.buffers()]
    return found
