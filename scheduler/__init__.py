"""The cluster's control plane: placement, autoscaling, telemetry and the latency map.

Cluster state lives in etcd (omni/cluster/state.py); nodes announce themselves and run
what is placed on them (omni/cluster/membership.py). The omni-scheduler service
(service.py, __main__.py) elects a leader that places the models (placement.py) at the
replicas its autoscaler asks for (autoscale.py, forecast.py), from the load the nodes
stream to it (telemetry.py, kept in history.py), and publishes the latency map of the
nodes' round-trip probes (latency.py). What the nodes, the edge and omnictl share with
it is in omni/cluster/.
"""

import os

# As omni/cluster/__init__.py does, and for the same reason: set before anything here
# imports gRPC (scheduler/telemetry.py imports it before omni.cluster).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
