"""OMNI: a sandboxed multi-model inference runtime for GPU hosts."""
