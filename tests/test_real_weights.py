"""The engine's GPU path on the embedded SmolLM2's real weights against HF transformers
(bench/real_weights.py says why greedy identity is judged with fp32 weights)."""

from __future__ import annotations

import pytest

from bench.real_weights import PROMPTS, TOLERANCE_FACTOR, compare

pytestmark = pytest.mark.gpu


def test_triton_path_matches_transformers_on_real_weights(text_model_dir):
    result = compare(text_model_dir)
    differing = [
        (r["prompt"], r["ours_fp32_text"], r["hf_fp32_text"])
        for r in result["prompts"]
        if not r["fp32_identical"]
    ]
    assert result["fp32_greedy_identical"] == len(PROMPTS) >= 8, differing
    err = result["max_logit_err_vs_hf_fp32"]
    assert err["ours_bf16"] <= TOLERANCE_FACTOR * err["hf_bf16"], err
    assert result["verdict"] == "PASS"
