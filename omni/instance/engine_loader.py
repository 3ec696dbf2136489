"""Loading OMNI's engine in an instance: the model (split over ranks where asked), its
draft, its KV tiers, and what the CUDA shim must know about it."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import os
import threading
from pathlib import Path

from omni.cudashim.read_only import declare_read_only
from omni.engine.checkpoint import Checkpoint
from omni.logs import setup_logging
from omni.runtime.gpuyield import YieldGate

from .settings import InstanceSettings

log = logging.getLogger("omni.worker")

MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
CONTROL_ENV = "OMNI_CUDA_CONTROL"  # the shim's control block (omni.cudashim.instance_env)


def load_engine(settings: InstanceSettings, ckpt: Checkpoint):
    """The engine serving `ckpt`, the gate it yields its steps through (None: none), and
    the bytes of its weights declared read-only to the shim (0 off it)."""
    import torch

    from omni.engine.engine import Engine
    from omni.engine.models import load_model
    from omni.engine.proposers import load_draft
    from omni.engine.spec_config import SpecConfig
    from omni.engine.tokenizer import TextTokenizer

    on_gpu = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)
    tp, experts = settings.tensor_parallel, settings.parallel == "ep"
    if tp > 1:
        start_ranks(ckpt, tp, on_gpu, experts, settings.rank_controls, settings.kv_cache_dtype)
    gate = YieldGate(Path(settings.yield_path)) if settings.yield_path else None
    model = load_model(
        ckpt,
        device,
        dtype,
        tp=tp,
        experts=experts,
        quantization=settings.quantization,
        kv_cache_dtype=settings.kv_cache_dtype,
    )
    speculative = SpecConfig(**settings.speculative) if settings.speculative else None
    draft = load_draft(speculative, model, ckpt.path)
    on_shim = bool(os.environ.get(CONTROL_ENV))
    read_only = 0
    if on_gpu and on_shim:  # swaps keep the weights' host copy
        drafter = draft[0] if isinstance(draft, tuple) else draft  # (EAGLE-3: head, taps)
        weights = [*model.parameters(), *(drafter.parameters() if drafter else ())]
        read_only = declare_read_only(weights)
    engine = Engine(
        model,
        TextTokenizer(ckpt),
        before_step=gate,
        speculative=speculative,
        draft=draft,
        host_cache_bytes=settings.kv_host_bytes,
        **disk_tier(settings),
    )
    # Serve at once and compile between requests, unless omnid may swap this instance:
    # it moves only idle instances, and idle-time warm-up is GPU work, which on memory
    # gone to the host would page it back behind omnid's budget.
    engine.warm_up(when_idle=not (on_gpu and on_shim))
    if not on_gpu and on_shim:
        account_on_shim(engine.memory_bytes())
    return engine, gate, read_only


def start_ranks(
    ckpt: Checkpoint,
    tp: int,
    on_gpu: bool,
    experts: bool = False,
    controls: tuple[str, ...] = (),
    kv_cache_dtype: str | None = None,
) -> None:
    """This process is rank 0 of `tp`: start the other ranks as its own children (so they
    share its sandbox: cgroup, namespaces, view), join them in one process group, and
    end the whole instance if one of them dies (omnid then restarts it).

    On GPUs, rank r runs on the r-th GPU the instance sees, under the shim with its own
    control block (`controls`, rank 0's first): each GPU's memory is
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
    ctx = multiprocessing.get_context("spawn")
    ranks = []
    for rank in range(1, tp):
        proc = ctx.Process(
            target=follow_rank,
            args=(str(ckpt.path), rank, tp, init, on_gpu, experts, kv_cache_dtype),
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
    model_dir: str,
    rank: int,
    tp: int,
    init: str,
    on_gpu: bool,
    experts: bool = False,
    kv_cache_dtype: str | None = None,
) -> None:
    """A rank > 0: load its shard and do what rank 0's runner does (tp_runner.follow)."""
    import torch

    from omni.engine.model_runner import ModelRunner
    from omni.engine.models import load_model
    from omni.engine.tensor_parallel import join
    from omni.engine.tp_runner import follow

    setup_logging(f"rank[{rank}]")
    join(rank, tp, init, on_gpu)
    device, dtype = (f"cuda:{rank}", torch.bfloat16) if on_gpu else ("cpu", torch.float32)
    ckpt = Checkpoint.open(Path(model_dir))
    model = load_model(ckpt, device, dtype, tp, rank, experts, kv_cache_dtype=kv_cache_dtype)
    runner = ModelRunner(model)
    if not on_gpu and os.environ.get(CONTROL_ENV):
        account_on_shim(runner.memory_bytes())
    follow(runner)


_SHIM_STAND_IN: list[ctypes.c_void_p] = []  # kept alive for the process's lifetime


def disk_tier(settings: InstanceSettings) -> dict:
    """The Engine's disk-tier arguments, where omnid gave the instance one."""
    if not settings.kv_disk_dir:
        return {}
    return {"disk_cache_bytes": settings.kv_disk_bytes, "disk_cache_dir": settings.kv_disk_dir}


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
