"""The cluster's control plane: placement, autoscaling, telemetry and the latency map.

Cluster state lives in etcd (state.py); nodes announce themselves and run what is placed
on them (membership.py). The omni-scheduler service (service.py, __main__.py) elects a
leader that places the models (placement.py) at the replicas its autoscaler asks for
(autoscale.py, forecast.py), from the load the nodes stream to it (telemetry.py, kept in
history.py), and publishes the latency map of the nodes' round-trip probes (latency.py).
"""

import os

# gRPC (aetcd's transport and the telemetry stream) registers fork handlers that may crash
# a child forked while gRPC's threads are busy (SIGSEGV before it execs): omnid forks every
# model instance while it streams telemetry. Children here only exec, so they need none.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
