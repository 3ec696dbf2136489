"""Fixtures shared by the tests and the benchmarks: tiny checkpoints written at run time
(checkpoints.py), engine runs of a list of requests (runs.py) and a stand-in node that
speaks omnid's HTTP and admin protocol without models (standin.py). Benchmarks import
these from the product package, never from tests/."""
