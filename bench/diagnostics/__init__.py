"""Diagnostics: where the time goes and tuning sweeps, not benchmarks with a target."""
