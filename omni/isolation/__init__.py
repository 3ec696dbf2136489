"""Sandboxes for model instances; `sandbox.Sandbox` is the interface omnid uses."""
