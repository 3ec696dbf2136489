"""The model instance process: loads one checkpoint and serves it on a Unix socket.

omnid starts one of these per catalog model inside a sandbox and is its only
client. `python -m omni.runtime.worker --name N --model-dir D --socket S`.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import ctypes
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

from aiohttp import web

from omni.api.errors import error_middleware, json_response
from omni.engine.checkpoint import Checkpoint
from omni.logs import setup_logging

from .catalog import (
    KV_CACHE_DTYPE_ENV,
    KV_DISK_ENV,
    KV_HOST_ENV,
    PARALLEL_ENV,
    QUANTIZATION_ENV,
    RANK_CONTROLS_ENV,
    SPECULATIVE_ENV,
    TENSOR_PARALLEL_ENV,
    TOOL_PARSER_ENV,
)
from .code import PACKAGE_ENV, check_package
from .gpuyield import YieldGate

log = logging.getLogger("omni.worker")

MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
CONTROL_ENV = "OMNI_CUDA_CONTROL"  # the shim's control block (omni.cudashim.instance_env)


def build_app(name: str, ckpt: Checkpoint, handoff_dir: Path | None = None) -> web.Application:
    """Load the model behind the routes its kind serves (`handoff_dir`: where KV handoffs
    of disaggregated serving are written and read)."""
    app = web.Application(middlewares=[error_middleware], client_max_size=64 << 20)
    if ckpt.kind == "generate":
        import torch

        from omni.engine.engine import Engine
        from omni.engine.llama import LlamaForCausalLM
        from omni.engine.tokenizer import TextTokenizer

        from .textgen import TextGenRoutes

        on_gpu = torch.cuda.is_available()
        device, dtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)
        tp = int(os.environ.get(TENSOR_PARALLEL_ENV) or 1)
        experts = os.environ.get(PARALLEL_ENV) == "ep"
        if tp > 1:
            start_ranks(ckpt, tp, on_gpu, experts)
        gate = YieldGate.from_env()
        model = LlamaForCausalLM.load(
            ckpt,
            device,
            dtype,
            tp=tp,
            experts=experts,
            quantization=os.environ.get(QUANTIZATION_ENV) or None,
            kv_cache_dtype=os.environ.get(KV_CACHE_DTYPE_ENV) or None,
        )
        from omni.engine.proposers import load_draft
        from omni.engine.spec_config import SpecConfig

        spec = os.environ.get(SPECULATIVE_ENV)
        speculative = SpecConfig(**json.loads(spec)) if spec else None
        draft = load_draft(speculative, model, ckpt.path)
        if on_gpu and os.environ.get(CONTROL_ENV):  # swaps keep the weights' host copy
            from omni.cudashim.read_only import declare_read_only

            drafter = draft[0] if isinstance(draft, tuple) else draft  # (EAGLE-3: head, taps)
            weights = [*model.parameters(), *(drafter.parameters() if drafter else ())]
            log.info("%.2f GiB of weights declared read-only", declare_read_only(weights) / 2**30)
        engine = Engine(
            model,
            TextTokenizer(ckpt),
            before_step=gate,
            speculative=speculative,
            draft=draft,
            host_cache_bytes=int(os.environ.get(KV_HOST_ENV) or 0),
            **disk_tier(os.environ.get(KV_DISK_ENV)),
        )
        # Serve at once and compile between requests, unless omnid may swap this instance:
        # it moves only idle instances, and idle-time warm-up is GPU work, which on memory
        # gone to the host would page it back behind omnid's budget.
        engine.warm_up(when_idle=not (on_gpu and os.environ.get(CONTROL_ENV)))
        if not on_gpu and os.environ.get(CONTROL_ENV):
            account_on_shim(engine.memory_bytes())
        TextGenRoutes(engine, name, os.environ.get(TOOL_PARSER_ENV), handoff_dir).add_to(app)
        extra_health = (lambda: {**engine.stats(), **gate.stats()}) if gate else engine.stats
        app.on_shutdown.append(lambda _app: asyncio.to_thread(engine.shutdown))
    else:
        from omni.engine.bert import EmbeddingModel

        from .embeddings import EmbeddingRoutes

        EmbeddingRoutes(EmbeddingModel(ckpt), name).add_to(app)
        extra_health = dict

    started = time.time()

    async def health(_request: web.Request) -> web.Response:
        return json_response(
            {
                "status": "ok",
                "model": name,
                "kind": ckpt.kind,
                "uptime_s": time.time() - started,
                **extra_health(),
            }
        )

    app.router.add_get("/health", health)
    return app


def start_ranks(ckpt: Checkpoint, tp: int, on_gpu: bool, experts: bool = False) -> None:
    """This process is rank 0 of `tp`: start the other ranks as its own children (so they
    share its sandbox: cgroup, namespaces, view), join them in one process group, and
    end the whole instance if one of them dies (omnid then restarts it).

    On GPUs, rank r runs on the r-th GPU the instance sees, under the shim with its own
    control block (RANK_CONTROLS_ENV lists them, rank 0's first): each GPU's memory is
    accounted, limited and swapped apart."""
    import multiprocessing
    import multiprocessing.connection
    import tempfile

    from omni.engine.tensor_parallel import join

    init = f"file://{tempfile.mkdtemp(prefix='omni-tp-')}/rendezvous"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # a sandbox has loopback only
    # No NVLink multicast unless omnid's environment asks for it: an instance's all-reduces
    # are small, and on shared hosts multicast can put the GPUs out of service.
    for key, off in MULTICAST_OFF.items():
        os.environ.setdefault(key, off)
    controls = [c for c in os.environ.get(RANK_CONTROLS_ENV, "").split(",") if c]
    ctx = multiprocessing.get_context("spawn")
    ranks = []
    for rank in range(1, tp):
        proc = ctx.Process(
            target=follow_rank,
            args=(str(ckpt.path), rank, tp, init, on_gpu, experts),
            name=f"omni-rank-{rank}",
            daemon=True,
        )
        with _rank_env(controls[rank] if rank < len(controls) else None):
            proc.start()  # a fresh interpreter: its shim reads the environment it starts in
        ranks.append(proc)
    join(0, tp, init, on_gpu)
    ending = threading.Event()  # set as this process exits: its ranks are ended with it
    atexit.register(ending.set)  # (runs before multiprocessing terminates its children)

    def watch() -> None:
        sentinels = {proc.sentinel: proc for proc in ranks}
        ended = multiprocessing.connection.wait(list(sentinels))
        proc = sentinels[ended[0]]
        proc.join(5)
        if proc.exitcode == 0 or ending.is_set():  # told to stop, or ended by rank 0's exit
            return
        log.error("rank %s exited (%s): the instance ends", proc.name, proc.exitcode)
        os._exit(1)

    threading.Thread(target=watch, name="omni-rank-watch", daemon=True).start()


@contextlib.contextmanager
def _rank_env(control: str | None):
    """os.environ with a rank's own shim control block, while that rank starts."""
    saved = os.environ.get(CONTROL_ENV)
    if control is not None:
        os.environ[CONTROL_ENV] = control
    try:
        yield
    finally:
        if saved is not None:
            os.environ[CONTROL_ENV] = saved
        else:
            os.environ.pop(CONTROL_ENV, None)


def follow_rank(
    model_dir: str, rank: int, tp: int, init: str, on_gpu: bool, experts: bool = False
) -> None:
    """A rank > 0: load its shard and do what rank 0's runner does (tp_runner.follow)."""
    import torch

    from omni.engine.llama import LlamaForCausalLM
    from omni.engine.model_runner import ModelRunner
    from omni.engine.tensor_parallel import join
    from omni.engine.tp_runner import follow

    setup_logging(f"rank[{rank}]")
    join(rank, tp, init, on_gpu)
    device, dtype = (f"cuda:{rank}", torch.bfloat16) if on_gpu else ("cpu", torch.float32)
    ckpt = Checkpoint.open(Path(model_dir))
    kv_cache_dtype = os.environ.get(KV_CACHE_DTYPE_ENV) or None  # (rank 0's environment)
    model = LlamaForCausalLM.load(
        ckpt, device, dtype, tp, rank, experts, kv_cache_dtype=kv_cache_dtype
    )
    runner = ModelRunner(model)
    if not on_gpu and os.environ.get(CONTROL_ENV):
        account_on_shim(runner.memory_bytes())
    follow(runner)


_SHIM_STAND_IN: list[ctypes.c_void_p] = []  # kept alive for the process's lifetime


def disk_tier(setting: str | None) -> dict:
    """The Engine's disk-tier arguments from omnid's "<budget bytes>:<directory>"."""
    if not setting:
        return {}
    budget, _, directory = setting.partition(":")
    return {"disk_cache_bytes": int(budget), "disk_cache_dir": directory}


def account_on_shim(nbytes: int) -> None:
    """A CPU instance placed on a GPU budget (CI, over a fake CUDA): hold as much unified
    memory through the CUDA runtime as its weights and KV cache take, so the shim counts
    it and omnid's swaps move it exactly as they would a GPU instance's."""
    for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12"):
        try:
            cudart = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        raise RuntimeError("placed on a GPU, but there is neither a GPU nor a CUDA runtime")
    ptr = ctypes.c_void_p()
    rc = cudart.cudaMallocManaged(ctypes.byref(ptr), ctypes.c_size_t(nbytes), 1)
    if rc != 0:
        raise RuntimeError(f"cudaMallocManaged({nbytes}) failed with error {rc} (over quota?)")
    _SHIM_STAND_IN.append(ptr)
    log.info("CPU instance accounted on the CUDA shim: %.1f MiB", nbytes / (1 << 20))


async def serve(name: str, model_dir: Path, socket_path: Path) -> None:
    t0 = time.monotonic()
    ckpt = Checkpoint.open(model_dir)
    app = build_app(name, ckpt, socket_path.parent)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    socket_path.unlink(missing_ok=True)
    site = web.UnixSite(runner, str(socket_path))
    await site.start()
    log.info(
        "instance %s (%s) ready in %.2fs on %s", name, ckpt.kind, time.monotonic() - t0, socket_path
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--name", required=True)
    parser.add_argument("--model-dir", required=True, type=Path)
    parser.add_argument("--socket", required=True, type=Path)
    args = parser.parse_args()
    check_package(os.environ.get(PACKAGE_ENV))
    setup_logging(f"instance[{args.name}]")
    threads = os.environ.get("OMNI_TORCH_THREADS")
    if threads:
        import torch

        torch.set_num_threads(int(threads))
    asyncio.run(serve(args.name, args.model_dir, args.socket))


if __name__ == "__main__":
    main()
