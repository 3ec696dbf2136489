"""The engine tests' shared engine: the embedded SmolLM2 on the CPU path."""

from __future__ import annotations

import pytest

from omni.engine.checkpoint import Checkpoint
from omni.engine.engine import Engine
from omni.engine.llama import LlamaForCausalLM
from omni.engine.tokenizer import TextTokenizer


@pytest.fixture(scope="module")
def engine(text_model_dir):
    ckpt = Checkpoint.open(text_model_dir)
    eng = Engine(LlamaForCausalLM.load(ckpt), TextTokenizer(ckpt), max_batch_tokens=64)
    yield eng
    eng.shutdown()
