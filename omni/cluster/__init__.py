"""The cluster's shared contracts and node-side clients, imported by omnid, the edge,
omnictl and the scheduler.

- state.py: cluster state in etcd, its keys and the store (nodes under leases, desired
  and observed placements, the leader, where telemetry goes).
- membership.py: how omnid and the edge take part in the cluster: a node's announcement,
  following the announced nodes, the placements and single keys.
- latency.py: the latency map's probes (a node's row) and the map's published form.
- reports.py: the load telemetry's records, messages (telemetry.proto) and constants;
  telemetry.py: the node's side of it, the accumulator and the reporter.
- rollout.py: the rollout an operator asks for (omnictl) and the leader carries out.

Nothing here imports the control plane (`scheduler/`) or the node's runtime
(`omni.runtime`).
"""

import os

# gRPC (aetcd's transport and the telemetry stream) registers fork handlers that may crash
# a child forked while gRPC's threads are busy (SIGSEGV before it execs): omnid forks every
# model instance while it streams telemetry. Children here only exec, so they need none.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
