"""The seq2seq runtime on a tiny random T5 saved with transformers' own classes, with the
tokenizer of the MiniLM OMNI embeds (no download).

Random weights write no real translation, so the tests check what the runtime owes: the
model's own greedy generate() run bare gives the same text, a text's result does not
depend on its batch-mates, and bad texts are refused alone.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, GenerationConfig, T5Config, T5ForConditionalGeneration

from omni.instance.handler import HandlerError
from omni.runtime.defaults import MINILM_DIR, MINILM_PACKAGE, package_dir
from omni.runtimes.model_config import CONFIG_NAME
from omni.runtimes.seq2seq import Seq2Seq, model_dtype

from .conftest import as_request, served, yield_points

PREFIX = "summarize: "
MAX_NEW_TOKENS = 8
TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "a b c d e f g h i j"]


def save_tiny_t5(out: Path) -> None:
    minilm = package_dir(MINILM_PACKAGE)
    if minilm is None:
        pytest.skip("the embedded MiniLM package is missing")
    tokenizer = AutoTokenizer.from_pretrained(minilm / MINILM_DIR)
    ids = {
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.sep_token_id,
        "decoder_start_token_id": tokenizer.pad_token_id,
    }
    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=1,
        num_heads=4,
        initializer_factor=30.0,  # wide weights: outputs that differ from text to text
        **ids,
    )
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(config)
    model.generation_config = GenerationConfig(**ids)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    settings = f'prefix = "{PREFIX}"\nmax_new_tokens = {MAX_NEW_TOKENS}\nmax_input_tokens = 32\n'
    (out / CONFIG_NAME).write_text(settings)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-t5")
    save_tiny_t5(out)
    return out


@pytest.fixture(scope="module")
def seq2seq(model_dir: Path) -> Seq2Seq:
    handler = Seq2Seq()
    handler.load(model_dir, "cpu")
    return handler


def request(text: str) -> dict[str, np.ndarray]:
    return as_request(text=text.encode())


def texts(results: list[dict]) -> list[str]:
    return [r["text"][0].decode() for r in results]


def bare(model_dir: Path, texts: list[str]) -> list[str]:
    """The checkpoint's own greedy generate() of each text, with no runtime around it."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = T5ForConditionalGeneration.from_pretrained(model_dir).eval()
    return [one(model, tokenizer, text) for text in texts]


def one(model: T5ForConditionalGeneration, tokenizer, text: str) -> str:
    encoded = tokenizer(PREFIX + text, return_tensors="pt", return_token_type_ids=False)
    with torch.inference_mode():
        tokens = model.generate(**encoded, max_new_tokens=MAX_NEW_TOKENS, num_beams=1)
    return tokenizer.decode(tokens[0], skip_special_tokens=True).strip()


def test_a_result_is_the_models_own_generate(seq2seq, model_dir):
    alone = [texts(served(seq2seq, [request(text)]))[0] for text in TEXTS]
    assert alone == bare(model_dir, TEXTS)


def test_a_result_does_not_depend_on_its_batch_mates(seq2seq):
    alone = [texts(served(seq2seq, [request(text)]))[0] for text in TEXTS]
    batch = [request(text) for text in TEXTS]
    assert texts(served(seq2seq, batch)) == alone
    assert texts(served(seq2seq, batch[::-1])) == alone[::-1]
    assert len(set(alone)) > 1  # the texts are told apart: the batch is not one answer


def test_an_empty_text_is_refused_alone(seq2seq):
    with pytest.raises(HandlerError, match="text"):
        served(seq2seq, [request("  ")])
    results = seq2seq.infer([request(TEXTS[0]), request(""), request(TEXTS[1])])
    assert isinstance(results[1], HandlerError) and "text" in str(results[1])
    alone = [texts(served(seq2seq, [request(text)]))[0] for text in TEXTS[:2]]
    assert texts([results[0], results[2]]) == alone


def test_a_text_past_the_input_limit_is_refused_not_cut(seq2seq):
    with pytest.raises(HandlerError, match="at most 32"):
        served(seq2seq, [request("word " * 40)])


def test_the_gpu_dtype_is_a_setting():
    assert model_dtype({"dtype": "bfloat16"}, "cpu") == torch.float32
    assert model_dtype({}, "cuda:0") == torch.float16
    assert model_dtype({"dtype": "bfloat16"}, "cuda:0") == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        model_dtype({"dtype": "int8"}, "cuda:0")


def test_each_decoded_token_is_a_point_to_yield_the_gpu_at(seq2seq):
    """gpu_step() between the decoder's steps; the texts are those without it."""
    batch = [request("translate English to German: a red house"), request("summarize: hi")]
    results, steps = yield_points(seq2seq, batch)
    assert steps >= 1
    assert texts(results) == texts(served(seq2seq, batch))
