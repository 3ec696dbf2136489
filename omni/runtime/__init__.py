"""omnid, the per-node daemon, and the instance process it supervises."""
