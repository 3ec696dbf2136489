"""Python side of libomnicuda.so, the LD_PRELOAD CUDA allocation shim (to come).

Its seam today: `SandboxSpec.env` is where an instance's LD_PRELOAD and
control-block path will be set, and `Limits` where its GPU quota will live.
"""
