"""The engine when a request cannot be set up: that request fails with an error, and
nothing else does (never a request left waiting)."""

from __future__ import annotations

import queue

from omni.engine.engine import GenerationRequest
from omni.engine.grammar import GrammarSpec
from omni.engine.sampling import SamplingParams
from omni.testing.runs import run_requests


def test_a_request_that_cannot_start_fails_instead_of_hanging(engine, monkeypatch):
    """An error while the engine sets a request up (here, its grammar's constraint) ends
    that request with an error; the engine serves the next one."""
    one = engine

    def broken(_spec):
        raise RuntimeError("no grammar today")

    monkeypatch.setattr(one.grammars, "constraint", broken)
    params = SamplingParams(max_tokens=4, grammar=GrammarSpec.json_schema({"type": "object"}))
    q: queue.Queue = queue.Queue()
    one.submit(GenerationRequest([1, 2, 3], params, "alice"), q.put)
    out = q.get(timeout=30)
    assert out.finished and out.finish_reason == "error" and "no grammar today" in out.error
    monkeypatch.undo()
    (after,) = run_requests(one, [[1, 2, 3]], SamplingParams(max_tokens=4))
    assert after[-1].finish_reason == "length"
