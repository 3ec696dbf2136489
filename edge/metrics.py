"""Prometheus metrics of the edge: who waits, who is shed, where requests go, how long.

Counters and histograms are updated as requests pass; queue depths, permits and
node state are read from the edge's own structures when Prometheus scrapes.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .admission import Admission
from .nodes import NodeSet

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class EdgeCollector(Collector):
    def __init__(self, admission: Admission, nodes: NodeSet):
        self.admission, self.nodes = admission, nodes

    def collect(self):
        depth = GaugeMetricFamily(
            "omni_edge_queue_depth", "Requests waiting for a permit", labels=["model", "tenant"]
        )
        in_use = GaugeMetricFamily(
            "omni_edge_permits_in_use", "Permits held by requests", labels=["model"]
        )
        permits = GaugeMetricFamily(
            "omni_edge_permits", "Permits of the model's healthy nodes", labels=["model"]
        )
        eta = GaugeMetricFamily(
            "omni_edge_model_eta_seconds",
            "A handler model's predicted time a call, on the GPU and after (its nodes' mean)",
            labels=["model", "phase"],
        )
        for model, queue in self.admission.queues.items():
            in_use.add_metric([model], queue.in_use)
            permits.add_metric([model], queue.permits)
            if (predicted := self.nodes.eta(model)) is not None:
                eta.add_metric([model, "gpu"], predicted[0])
                eta.add_metric([model, "cpu"], predicted[1])
            for tenant, n in queue.queued_by_tenant().items():
                depth.add_metric([model, tenant], n)
        healthy = GaugeMetricFamily("omni_edge_node_healthy", "1 unless ejected", labels=["node"])
        latency = GaugeMetricFamily(
            "omni_edge_node_latency_seconds", "Moving average round trip", labels=["node"]
        )
        busy = GaugeMetricFamily(
            "omni_edge_node_in_flight", "Requests at the node", labels=["node", "model"]
        )
        for node in self.nodes.nodes:
            healthy.add_metric([node.url], int(node.healthy))
            latency.add_metric([node.url], node.latency_s)
            for model, n in node.in_flight.items():
                busy.add_metric([node.url, model], n)
        decisions = CounterMetricFamily(
            "omni_edge_routing_decisions", "How nodes were picked", labels=["how"]
        )
        for how, n in self.nodes.decisions.items():
            decisions.add_metric([how], n)
        yield from (depth, in_use, permits, eta, healthy, latency, busy, decisions)


class EdgeMetrics:
    def __init__(self, admission: Admission, nodes: NodeSet):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "omni_edge_requests", "Requests answered", ["tenant", "model", "status"], registry=r
        )
        self.queue_wait = Histogram(
            "omni_edge_queue_wait_seconds",
            "Wait for a permit",
            ["tenant"],
            buckets=WAIT_BUCKETS,
            registry=r,
        )
        self.upstream = Histogram(
            "omni_edge_upstream_seconds",
            "From forwarding to the node's last byte",
            ["node"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.shed = Counter(
            "omni_edge_shed", "Requests refused by admission", ["tenant", "reason"], registry=r
        )
        self.retries = Counter("omni_edge_retries", "Requests sent to another node", registry=r)
        r.register(EdgeCollector(admission, nodes))

    def render(self) -> bytes:
        return generate_latest(self.registry)
