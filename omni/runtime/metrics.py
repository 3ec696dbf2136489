"""Prometheus metrics of omnid: what it serves, how fast, and where GPU memory is.

Request counters and histograms are updated as requests finish; everything
about instances (state, residency, memory per instance from the shim's control
blocks, per GPU from NVML) is read when Prometheus scrapes, so it is never stale.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
SPEC_GAUGES = {  # the engine's speculative counters (speculative.SpecStats)
    "spec_steps": "Speculative (verify) steps the instance ran",
    "spec_proposed_tokens": "Tokens proposed for verification",
    "spec_accepted_tokens": "Proposed tokens the model accepted",
    "spec_acceptance": "Accepted over proposed tokens",
    "spec_tokens_per_step": "Tokens a sequence gains per verify step",
}
KV_TIER_GAUGES = {  # the engine's KV tiers (kv_tiers.TierStats), cumulative
    f"kv_{tier}_{key}": text.format(where=where)
    for tier, where in (("host", "host memory"), ("disk", "the disk tier"))
    for key, text in (
        ("stored_blocks", "KV blocks evicted into {where}"),
        ("restored_blocks", "KV blocks a prefix hit brought back from {where}"),
        ("dropped_blocks", "KV blocks dropped past {where}'s budget"),
        ("bytes_out", "Bytes copied into {where}"),
        ("bytes_in", "Bytes copied back from {where}"),
        ("restore_seconds", "Seconds spent bringing blocks back from {where}"),
    )
} | {"kv_disk_write_errors": "KV blocks lost to a failed write to the disk tier"}
BATCH_GAUGES = {  # a handler's dynamic batching (omni/instance/batcher.py), cumulative
    "batch_runs": "infer() calls (batches) the handler ran",
    "batch_requests": "Requests those batches held",
    "batch_failed": "Requests that got an error from the handler or its outputs",
    "batch_cancelled": "Requests dropped before they ran, their clients gone",
    "batch_rerun": "Requests run again alone after their whole batch failed",
    "batch_gpu_released_early": "Requests whose GPU work ended before their answer",
    "batch_gpu_phase_ms": "An infer() call's GPU work (moving average, ms)",
    "batch_cpu_phase_ms": "An infer() call's work after its GPU work (moving average, ms)",
}
MEMORY_GAUGES = {  # what the instance's worker did for its swaps (omni/instance/trim.py)
    "memory_read_only_bytes": "Weights declared read-only: a swap-out keeps their host copy",
    "memory_trims": "Asks to free unused GPU memory before a swap-out, answered",
    "memory_trimmed_bytes": "GPU memory those asks freed (the allocator's cache)",
}
SWAP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class NodeCollector(Collector):
    """Gauges read from the node at scrape time."""

    def __init__(self, instances: Callable[[], Iterable], pools: Callable[[], Iterable]):
        self._instances, self._pools = instances, pools
        self._nvml = _Nvml()

    def collect(self):
        yield from self._instance_families()
        yield from self._pool_families()
        yield from self._device_families()

    def _instance_families(self):
        """Per instance: state, residency, GPU memory, requests, and the counters of its
        last health check (speculation, KV tiers, a handler's batching, its memory)."""
        state = GaugeMetricFamily(
            "omni_instance_state", "1 for the state the instance is in", labels=["model", "state"]
        )
        residency = GaugeMetricFamily(
            "omni_instance_residency",
            "1 for where the instance's GPU memory is",
            labels=["model", "residency"],
        )
        used = GaugeMetricFamily(
            "omni_instance_gpu_memory_used_bytes",
            "GPU memory the instance holds (its shim's count)",
            labels=["model", "gpu"],
        )
        quota = GaugeMetricFamily(
            "omni_instance_gpu_memory_quota_bytes", "GPU memory quota", labels=["model", "gpu"]
        )
        in_flight = GaugeMetricFamily(
            "omni_instance_requests_in_flight", "Requests at the instance", labels=["model"]
        )
        restarts = GaugeMetricFamily(
            "omni_instance_restarts", "Restarts since omnid started", labels=["model"]
        )
        # as of the instance's last health check (2 s old at most)
        spec, tier, batching, memory = (
            {
                key: GaugeMetricFamily(f"omni_{key}", help_text, labels=["model"])
                for key, help_text in gauges.items()
            }
            for gauges in (SPEC_GAUGES, KV_TIER_GAUGES, BATCH_GAUGES, MEMORY_GAUGES)
        )
        batch_sizes = GaugeMetricFamily(
            "omni_batch_size_batches", "Batches the handler ran, by size", labels=["model", "size"]
        )
        for inst in self._instances():
            info = inst.to_json()
            name = info["name"]
            state.add_metric([name, info["state"]], 1)
            in_flight.add_metric([name], info["in_flight"])
            restarts.add_metric([name], info["restarts"])
            kv = {**info.get("kv_host", {}), **info.get("kv_disk", {})}
            for families, values in (
                (spec, info.get("speculative")),
                (tier, kv),
                (batching, info.get("batching")),
                (memory, info.get("memory")),
            ):
                for key, value in (values or {}).items():
                    if key in families and value is not None:
                        families[key].add_metric([name], value)
            for size, count in (info.get("batching") or {}).get("batch_sizes", {}).items():
                batch_sizes.add_metric([name, size], count)
            if "residency" in info:
                residency.add_metric([name, info["residency"]], 1)
                for rank in info.get("ranks") or [info]:  # a multi-GPU instance: each GPU
                    used.add_metric([name, str(rank["gpu"])], rank["used_bytes"])
                    quota.add_metric([name, str(rank["gpu"])], rank["quota_bytes"])
        yield from (state, residency, used, quota, in_flight, restarts, *spec.values())
        yield from tier.values()
        yield from (*batching.values(), batch_sizes)
        yield from memory.values()

    def _pool_families(self):
        """Per GPU: its budget, what is charged against it, requests waiting for a swap-in."""
        budget = GaugeMetricFamily(
            "omni_gpu_budget_bytes", "GPU memory budget for instances", labels=["gpu"]
        )
        charged = GaugeMetricFamily(
            "omni_gpu_resident_quota_bytes",
            "Sum of the quotas of the instances resident on the GPU",
            labels=["gpu"],
        )
        waiting = GaugeMetricFamily(
            "omni_gpu_swap_waiting_requests", "Requests waiting for a swap-in", labels=["gpu"]
        )
        for pool in self._pools():
            gpu = str(pool.index)
            budget.add_metric([gpu], pool.budget_bytes)
            charged.add_metric([gpu], pool.charged_bytes)
            waiting.add_metric([gpu], pool.waiting)
        yield from (budget, charged, waiting)

    def _device_families(self):
        """Per GPU, as NVML sees the device: memory in use and in all."""
        device = GaugeMetricFamily(
            "omni_gpu_memory_used_bytes", "Device memory in use (NVML)", labels=["gpu"]
        )
        total = GaugeMetricFamily(
            "omni_gpu_memory_total_bytes", "Device memory (NVML)", labels=["gpu"]
        )
        for index, used_b, total_b in self._nvml.memory():
            device.add_metric([str(index)], used_b)
            total.add_metric([str(index)], total_b)
        yield from (device, total)


class _Nvml:
    """Per-GPU memory through nvidia-ml-py, when it and a driver are present."""

    def __init__(self):
        self._nvml = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
        except Exception as exc:  # no package, no driver, no GPU: no per-GPU gauges
            log.debug("NVML unavailable: %s", exc)

    def memory(self) -> list[tuple[int, int, int]]:
        if self._nvml is None:
            return []
        out = []
        try:
            for i in range(self._nvml.nvmlDeviceGetCount()):
                info = self._nvml.nvmlDeviceGetMemoryInfo(self._nvml.nvmlDeviceGetHandleByIndex(i))
                out.append((i, int(info.used), int(info.total)))
        except Exception as exc:
            log.warning("NVML query failed: %s", exc)
        return out


class Metrics:
    def __init__(self, instances: Callable[[], Iterable], pools: Callable[[], Iterable]):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "omni_requests",
            "Inference requests by outcome",
            ["model", "endpoint", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "omni_request_duration_seconds",
            "Time to the last byte of the response",
            ["model", "endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.admission = Histogram(
            "omni_request_admission_seconds",
            "Time a request waited for a permit and for its instance to be resident "
            "(swap-in included), before it reached the instance",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tokens = Counter(
            "omni_tokens",
            "Tokens processed, from the responses' usage",
            ["model", "kind"],
            registry=self.registry,
        )
        self.swaps = Counter(
            "omni_swaps", "Swaps by direction", ["model", "direction"], registry=self.registry
        )
        self.swap_seconds = Histogram(
            "omni_swap_duration_seconds",
            "Swap durations as the shim measured them",
            ["direction"],
            buckets=SWAP_BUCKETS,
            registry=self.registry,
        )
        self.swap_bytes = Counter(
            "omni_swapped_bytes", "Bytes moved by swaps", ["direction"], registry=self.registry
        )
        self.kv_transfer_bytes = Counter(
            "omni_kv_transfer_bytes",
            "Bytes of prompt K/V handed from prefill to decode instances (disaggregated)",
            ["model"],
            registry=self.registry,
        )
        self.kv_transfer_seconds = Histogram(
            "omni_kv_transfer_seconds",
            "Per request: the prefill side's compute and K/V export, and the handoff's move",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.sandbox_limits = Gauge(
            "omni_sandbox_limit_enforced",
            "1 where instances' sandboxes enforce the limit (memory, cpu, pids, tmp, "
            "io, seccomp), 0 where not",
            ["limit"],
            registry=self.registry,
        )
        self.registry.register(NodeCollector(instances, pools))

    def observe_request(self, model: str, endpoint: str, status: int, seconds: float) -> None:
        self.requests.labels(model, endpoint, str(status)).inc()
        self.latency.labels(model, endpoint).observe(seconds)

    def observe_admission(self, model: str, seconds: float) -> None:
        self.admission.labels(model).observe(seconds)

    def observe_usage(self, model: str, usage: dict | None) -> None:
        for kind in ("prompt_tokens", "completion_tokens"):
            if usage and isinstance(usage.get(kind), int):
                self.tokens.labels(model, kind.removesuffix("_tokens")).inc(usage[kind])

    def observe_kv_transfer(self, model: str, nbytes: int, seconds: float) -> None:
        self.kv_transfer_bytes.labels(model).inc(nbytes)
        self.kv_transfer_seconds.labels(model).observe(seconds)

    def observe_swap(self, model: str, direction: str, result) -> None:
        self.swaps.labels(model, direction).inc()
        self.swap_seconds.labels(direction).observe(result.seconds)
        self.swap_bytes.labels(direction).inc(result.bytes)

    def observe_sandbox(self, sandbox: dict) -> None:
        """omnid's sandbox report (omnid.sandbox_report): each limit, and seccomp."""
        for limit, held in {**sandbox["enforced"], "seccomp": sandbox["seccomp"]}.items():
            self.sandbox_limits.labels(limit).set(int(held))

    def render(self) -> bytes:
        return generate_latest(self.registry)
