"""What a model's `speculative` table may say (speculative.py does the work). Without torch:
omnid checks a catalog against it."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("ngram", "draft", "eagle3", "mtp")
WITH_WEIGHTS = ("draft", "eagle3")  # proposers that load a checkpoint (`path`)
OWN_WEIGHTS = ("mtp",)  # proposers read from the model's own checkpoint
MAX_K = 16


def mtp_layers(config: dict) -> int:
    """The multi-token-prediction layers a checkpoint's config.json says it ships
    (DeepSeek-V3's: one), which method "mtp" drafts with."""
    return int(config.get("num_nextn_predict_layers") or 0)


@dataclass(frozen=True)
class SpecConfig:
    method: str = "ngram"
    k: int = 4  # the most tokens proposed for a sequence at a step
    max_batch: int = 32  # decoding sequences above which a step does not speculate
    ngram_max: int = 4  # the longest n-gram matched (the longest that matches wins)
    ngram_min: int = 1
    # "draft": a causal LM's checkpoint with the target's tokenizer; "eagle3": an EAGLE-3
    # head's checkpoint (the published format: fc, midlayer, norm, lm_head, d2t, t2d);
    # "mtp" reads the multi-token-prediction layer of the model's own checkpoint
    path: str = ""

    def __post_init__(self):
        for key in ("k", "max_batch", "ngram_max", "ngram_min"):
            if type(getattr(self, key)) is not int:
                raise ValueError(f"speculative.{key} must be an integer")
        if self.method not in METHODS:
            raise ValueError(f"speculative.method {self.method!r} is not one of {list(METHODS)}")
        if not 1 <= self.k <= MAX_K:
            raise ValueError(f"speculative.k must be 1 to {MAX_K}, not {self.k}")
        if self.max_batch < 1 or not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("speculative: max_batch >= 1 and 1 <= ngram_min <= ngram_max")
        if not isinstance(self.path, str):
            raise ValueError("speculative.path must be a string")
        if self.method in WITH_WEIGHTS and not self.path.startswith("/"):
            raise ValueError(
                f"speculative.path: method {self.method!r} needs its checkpoint's absolute path"
            )
        if self.method in OWN_WEIGHTS and self.path:
            raise ValueError(
                f"speculative.path: method {self.method!r} reads the model's own checkpoint"
            )
        if self.method not in WITH_WEIGHTS and self.path:
            raise ValueError(f"speculative.path: method {self.method!r} loads no weights")
