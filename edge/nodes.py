"""The nodes behind the edge: what each hosts, how loaded and how far it is, and which to use.

Each node's models and permits come from polling its /v1/models, with each model's
load where the node reports it: prompt tokens queued for prefill and the share of
its KV cache in use. Its latency is a moving average of measured round trips. The
edge also counts its own requests and their prompt tokens in flight there (a poll
is up to REFRESH_S old), so picking needs no network call. A pick is power of two
random choices (two healthy candidates with a free permit, the cheaper one more
likely to win): no herd on the single best node, no hotspot. Cost is token-aware:
the round trip plus the prefill of the prompt tokens queued there and this
request's (in seconds), scaled up by the requests it runs per permit left and by
how full its KV cache is (decode slows, then preempts, as it fills). A session
key instead goes to its own node by rendezvous hashing (the node that holds its
KV/prefix cache), and to the next node of its order when that one has no free
permit, its KV cache is past KV_HIGH_WATER, or it is down. Consecutive failures
eject a node for a backoff that doubles.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp

log = logging.getLogger(__name__)

REFRESH_S = 2.0
EJECT_AFTER = 3  # consecutive failures
EJECT_BASE_S = 1.0
EJECT_MAX_S = 30.0
LATENCY_ALPHA = 0.2  # weight of a new sample in the moving average
DEFAULT_PERMITS = 64
PREFILL_TOKENS_PER_S = 10_000.0  # a node's prefill rate, roughly: queued tokens -> seconds
MIN_KV_HEADROOM = 0.02  # KV cost divides by the free share, at most 1/this (a full cache)
KV_HIGH_WATER = 0.95  # a session leaves its node while that node's KV cache is this full
NO_LOAD = (0, 0.0)  # what a node that reports no load (an older omnid) counts as


@dataclass(eq=False)
class Node:
    url: str
    models: dict[str, int] = field(default_factory=dict)  # model -> permits
    # model -> (queued prompt tokens, KV occupancy 0..1), as the node last reported
    load: dict[str, tuple[int, float]] = field(default_factory=dict)
    # model -> (GPU seconds, CPU seconds) of a handler's infer() call, as last reported
    eta: dict[str, tuple[float, float]] = field(default_factory=dict)
    in_flight: dict[str, int] = field(default_factory=dict)
    in_flight_tokens: dict[str, int] = field(default_factory=dict)  # their prompt tokens
    latency_s: float = 0.001
    failures: int = 0
    ejections: int = 0
    ejected_until: float = 0.0

    @property
    def healthy(self) -> bool:
        return time.monotonic() >= self.ejected_until

    def free(self, model: str) -> int:
        return self.models.get(model, 0) - self.in_flight.get(model, 0)

    def kv_occupancy(self, model: str) -> float:
        return self.load.get(model, NO_LOAD)[1]

    def queued_tokens(self, model: str) -> int:
        """Prompt tokens ahead of a new request there: what the node reported, plus what
        the edge has in flight there (sent since that report, or still running)."""
        return self.load.get(model, NO_LOAD)[0] + self.in_flight_tokens.get(model, 0)

    def cost(self, model: str, prompt_tokens: int = 0) -> float:
        """How bad a choice this node is now, in seconds to a first token: its round trip
        plus the prefill of what is queued there and of this prompt; times the requests it
        already runs over the permits it has left; over the KV cache it has left (a nearly
        full cache stalls or preempts decodes, and this request's KV must fit too)."""
        prefill_s = (self.queued_tokens(model) + prompt_tokens) / PREFILL_TOKENS_PER_S
        busy = (1 + self.in_flight.get(model, 0)) / max(1, self.free(model))
        headroom = max(MIN_KV_HEADROOM, 1 - self.kv_occupancy(model))
        return (self.latency_s + prefill_s) * busy / headroom

    def to_json(self) -> dict:
        return {
            "url": self.url,
            "healthy": self.healthy,
            "models": self.models,
            "in_flight": {m: n for m, n in self.in_flight.items() if n},
            "in_flight_tokens": {m: n for m, n in self.in_flight_tokens.items() if n},
            "load": {
                m: {"queued_prompt_tokens": q, "kv_occupancy": kv}
                for m, (q, kv) in self.load.items()
            },
            "eta_ms": {m: {"gpu": g * 1e3, "cpu": c * 1e3} for m, (g, c) in self.eta.items()},
            "latency_ms": round(self.latency_s * 1e3, 3),
            "ejections": self.ejections,
        }


def _rank(key: str, node: Node) -> bytes:
    return hashlib.blake2b(f"{key}\0{node.url}".encode(), digest_size=8).digest()


def _reported_load(entry: dict) -> tuple[int, float]:
    """A model's load from its /v1/models entry; what is missing or not a sane number
    counts as zero (a node too old to report it must still be polled and picked)."""
    load = entry.get("load")
    if not isinstance(load, dict):
        return NO_LOAD
    queued, kv = load.get("queued_prompt_tokens"), load.get("kv_occupancy")
    real = (int, float)  # by type: a bool is no number here
    queued = int(queued) if type(queued) in real and 0 < queued < math.inf else 0
    kv = min(1.0, float(kv)) if type(kv) in real and kv > 0 else 0.0  # NaN > 0 is False
    return queued, kv


def _reported_eta(entry: dict) -> tuple[float, float] | None:
    """A handler model's (GPU, CPU) seconds a call, from its /v1/models entry's load;
    None where it reports none or nothing sane."""
    load = entry.get("load")
    eta = load.get("eta_ms") if isinstance(load, dict) else None
    if not isinstance(eta, dict):
        return None
    phases = (eta.get("gpu"), eta.get("cpu"))
    # by type: a bool is no number here; under an hour a call (NaN fails the range too)
    if not all(type(ms) in (int, float) and 0 <= ms < 3.6e6 for ms in phases):
        return None
    return phases[0] / 1e3, phases[1] / 1e3


class NodeSet:
    """Every node the edge routes to."""

    def __init__(self, urls: list[str], rng: random.Random | None = None):
        self.nodes = [Node(url.rstrip("/")) for url in urls]
        self.rng = rng or random.Random()
        self.decisions: Counter[str] = Counter()  # how picks were made, for the metrics
        # location -> round trip from this edge's location (the cluster's latency map)
        self.rtt_from_here: dict[str, float] = {}

    def set_urls(self, urls: list[str], locations: dict[str, str] | None = None) -> None:
        """The nodes changed (cluster membership): keep what the edge knows of the ones
        that stay, forget the ones gone. A new node starts at the round trip the latency
        map gives for its location (`locations`: url -> location), until polled: a far
        node does not look near and draw the first requests."""
        known = {n.url: n for n in self.nodes}
        nodes = []
        for url in dict.fromkeys(u.rstrip("/") for u in urls):
            node = known.get(url)
            if node is None:
                node = Node(url)
                rtt = self.rtt_from_here.get((locations or {}).get(url, ""))
                if rtt is not None:
                    node.latency_s = rtt
            nodes.append(node)
        self.nodes = nodes

    # ------------------------------------------------------------ the view

    def models(self) -> dict[str, int]:
        """Each model served by a healthy node, with its permits summed over them."""
        out: dict[str, int] = {}
        for node in self.nodes:
            if node.healthy:
                for model, permits in node.models.items():
                    out[model] = out.get(model, 0) + permits
        return out

    def eta(self, model: str) -> tuple[float, float] | None:
        """A handler model's predicted (GPU, CPU) seconds a call: the mean over the
        healthy nodes that report it; None where none does."""
        reported = [n.eta[model] for n in self.nodes if n.healthy and model in n.eta]
        if not reported:
            return None
        return (
            sum(g for g, _ in reported) / len(reported),
            sum(c for _, c in reported) / len(reported),
        )

    def hosts(self, model: str) -> list[Node]:
        return [n for n in self.nodes if n.healthy and model in n.models]

    # ------------------------------------------------------------- picking

    def pick(
        self, model: str, session_key: str | None = None, exclude=(), prompt_tokens: int = 0
    ) -> Node | None:
        """The node for one request of about `prompt_tokens` prompt tokens: the session's
        own node while it has room (a permit, and KV below the high-water mark), else the
        next of its order that has; without a session, the better of two random ones with
        room, else the least loaded host."""
        hosts = [n for n in self.hosts(model) if n not in exclude]
        if not hosts:
            self.decisions["no_node"] += 1
            return None
        if session_key:
            ordered = sorted(hosts, key=lambda n: _rank(session_key, n), reverse=True)
            roomy = (
                n for n in ordered if n.free(model) > 0 and n.kv_occupancy(model) < KV_HIGH_WATER
            )
            node = next(roomy, ordered[0])
            self.decisions["affinity" if node is ordered[0] else "affinity_fallback"] += 1
            return node
        roomy = [n for n in hosts if n.free(model) > 0] or hosts
        if len(roomy) == 1:
            self.decisions["single"] += 1
            return roomy[0]
        # Of two random nodes, each wins in inverse proportion to its cost: a clearly
        # better node nearly always, two alike about evenly (a strict comparison would
        # send everything to whichever measured a microsecond faster).
        a, b = self.rng.sample(roomy, 2)
        self.decisions["two_choices"] += 1
        cost_a, cost_b = a.cost(model, prompt_tokens), b.cost(model, prompt_tokens)
        return a if self.rng.random() * (cost_a + cost_b) < cost_b else b

    def started(self, node: Node, model: str, prompt_tokens: int = 0) -> None:
        node.in_flight[model] = node.in_flight.get(model, 0) + 1
        node.in_flight_tokens[model] = node.in_flight_tokens.get(model, 0) + prompt_tokens

    def finished(self, node: Node, model: str, ok: bool, prompt_tokens: int = 0) -> None:
        """One request done there; a failure counts towards ejection. (The latency is
        the polls' round trip: a request's own time says more about its size.)"""
        node.in_flight[model] = max(0, node.in_flight.get(model, 0) - 1)
        node.in_flight_tokens[model] = max(0, node.in_flight_tokens.get(model, 0) - prompt_tokens)
        if ok:
            node.failures = 0
        else:
            self.failed(node)

    def failed(self, node: Node) -> None:
        node.failures += 1
        if node.failures >= EJECT_AFTER and node.healthy:
            backoff = min(EJECT_MAX_S, EJECT_BASE_S * 2**node.ejections)
            node.ejections += 1
            node.ejected_until = time.monotonic() + backoff
            log.warning(
                "node %s ejected for %.0fs after %d failures", node.url, backoff, node.failures
            )

    # ------------------------------------------------------------ polling

    async def refresh(self, session: aiohttp.ClientSession) -> None:
        await asyncio.gather(*(self._poll(session, n) for n in self.nodes))

    async def _poll(self, session: aiohttp.ClientSession, node: Node) -> None:
        """The node's models, permits and load; a node that cannot answer counts a failure
        (an ejected node is polled too: its first good answer brings it back)."""
        t0 = time.monotonic()
        try:
            async with session.get(
                f"{node.url}/v1/models", timeout=aiohttp.ClientTimeout(total=2)
            ) as resp:
                data = (await resp.json())["data"]
            models = {m["id"]: int(m.get("permits") or DEFAULT_PERMITS) for m in data}
            load = {m["id"]: _reported_load(m) for m in data}
            eta = {m["id"]: e for m in data if (e := _reported_eta(m)) is not None}
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError, KeyError, TypeError) as exc:
            log.debug("node %s: model list unavailable: %s", node.url, exc)
            self.failed(node)
            return
        node.models, node.load, node.eta = models, load, eta
        node.failures = 0
        if not node.healthy:
            node.ejected_until = 0.0
            log.info("node %s is back", node.url)
        else:
            node.ejections = 0
        rtt = time.monotonic() - t0
        node.latency_s += LATENCY_ALPHA * (rtt - node.latency_s)


class Attempt:
    """One try of a request on one node: in flight there, with its prompt tokens, until
    it ends, once."""

    def __init__(self, nodes: NodeSet, node: Node, model: str, prompt_tokens: int = 0):
        self.nodes, self.node, self.model, self.open = nodes, node, model, True
        self.prompt_tokens = prompt_tokens
        self.started = time.monotonic()
        nodes.started(node, model, prompt_tokens)

    def end(self, ok: bool) -> None:
        if self.open:
            self.open = False
            self.nodes.finished(self.node, self.model, ok, self.prompt_tokens)
