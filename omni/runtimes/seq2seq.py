"""Translation and summarization with an encoder-decoder checkpoint (T5, BART, Marian...),
through Hugging Face transformers' `AutoModelForSeq2SeqLM`.

Input `text`: one UTF-8 string (BYTES [1]). Output `text`: what the model wrote for it
(BYTES [1]).

The requests of a batch share one greedy `generate()` call. Their texts are padded on the
right, so every real token keeps its position (BART's learned positions, T5's relative
ones), and the attention mask keeps the padding out of the encoder and of the decoder's
cross-attention; greedy decoding keeps each sequence's tokens its own. A result does not
depend on its batch-mates (on the CPU; on a GPU in float16, kernels chosen by batch size
may round differently, which can, rarely, tip a near tie between two tokens).

Weights: a model directory as transformers saves one (model and tokenizer), e.g.
`hf download google-t5/t5-small --local-dir models/t5-small`. Optional keys in
omni-model.toml: `prefix` (put before every text, as T5 was trained: "translate English
to German: ", "summarize: "; default none), `max_new_tokens` (default 128),
`max_input_tokens` (longer texts are refused, not cut; default the tokenizer's limit, at
most 1024), `dtype` on a GPU ("float16", the default, "bfloat16" or "float32": T5's
larger checkpoints overflow in float16).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

from omni.instance.handler import Answers, Handler, HandlerError, TensorSpec, each, together

from .model_config import read_model_config
from .tensors import bytes_tensor, single_text
from .token_steps import yielding

DEFAULT_MAX_NEW_TOKENS = 128
DEFAULT_MAX_INPUT_TOKENS = 1024
GPU_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def read_text(request: dict[str, np.ndarray]) -> str:
    """The request's text, refused where there is nothing to translate or summarize."""
    text = single_text(request, "text")
    if not text.strip():
        raise HandlerError("text: empty")
    return text


def model_dtype(config: dict, device: str) -> torch.dtype:
    """float32 on the CPU; on a GPU, the settings' `dtype` (float16 unless it says)."""
    if not device.startswith("cuda"):
        return torch.float32
    name = str(config.get("dtype", "float16"))
    if name not in GPU_DTYPES:
        raise ValueError(f"dtype = {name!r}, expected one of {sorted(GPU_DTYPES)}")
    return GPU_DTYPES[name]


class Seq2Seq(Handler):
    inputs = (TensorSpec("text", "BYTES", (1,)),)
    outputs = (TensorSpec("text", "BYTES", (1,)),)
    max_batch_size = 16
    max_queue_delay_ms = 5.0

    def load(self, model_dir: Path, device: str) -> None:
        config = read_model_config(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.tokenizer.padding_side = "right"  # real tokens keep their positions
        self.model = AutoModelForSeq2SeqLM.from_pretrained(model_dir)
        self.model.to(device, model_dtype(config, device)).eval()
        self.device = device
        self.prefix = str(config.get("prefix", ""))
        limit = min(self.tokenizer.model_max_length, DEFAULT_MAX_INPUT_TOKENS)
        self.max_input_tokens = int(config.get("max_input_tokens", limit))
        self.options = {
            "max_new_tokens": int(config.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)),
            "num_beams": 1,  # greedy: each sequence's tokens its own
            "do_sample": False,
        }

    def infer(self, batch: list[dict[str, np.ndarray]]) -> Answers:
        texts = each(each(batch, read_text), self.encoded)
        written = together(texts, self.generate)  # the good texts in one generate()
        return each(written, lambda text: {"text": bytes_tensor(text)})

    def encoded(self, text: str) -> list[int]:
        """The text's tokens (with the prefix), refused past max_input_tokens."""
        ids = self.tokenizer(self.prefix + text, return_token_type_ids=False)["input_ids"]
        if len(ids) > self.max_input_tokens:
            raise HandlerError(f"text: {len(ids)} tokens, at most {self.max_input_tokens}")
        return ids

    def generate(self, token_lists: list[list[int]]) -> list[str]:
        """What the model writes for each tokenized text, from one generate() call."""
        padded = self.tokenizer.pad({"input_ids": token_lists}, return_tensors="pt")
        with torch.inference_mode():
            tokens = self.model.generate(
                input_ids=padded["input_ids"].to(self.device),
                attention_mask=padded["attention_mask"].to(self.device),
                logits_processor=yielding(),
                **self.options,
            )
        texts = self.tokenizer.batch_decode(tokens, skip_special_tokens=True)
        return [text.strip() for text in texts]

    def unload(self) -> None:
        self.model = self.tokenizer = None
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()
