"""The engine's GPU path on the embedded SmolLM2's real weights against HF transformers."""

from __future__ import annotations

import pytest

from bench.real_weights import PROMPTS, compare

pytestmark = pytest.mark.gpu


def test_triton_path_matches_transformers_on_real_weights(text_model_dir):
    result = compare(text_model_dir)
    differing = [(r["prompt"], r["ours_text"], r["hf_text"]) for r in result["prompts"]]
    differing = [d for d, r in zip(differing, result["prompts"], strict=True) if not r["identical"]]
    assert result["greedy_identical"] == len(PROMPTS) >= 8, differing
    assert result["ours_max_logit_err"] <= 2.0 * result["hf_bf16_max_logit_err"], result
    assert result["verdict"] == "PASS"
