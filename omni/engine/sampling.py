"""Token sampling: penalties, logit bias, min tokens, greedy, temperature, top-k, top-p,
min-p, per-request seed."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .grammar import GrammarSpec


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0  # keep tokens at least this fraction as likely as the best one
    repetition_penalty: float = 1.0  # > 1 discourages any token already seen
    presence_penalty: float = 0.0  # OpenAI: subtracted once from generated tokens' logits
    frequency_penalty: float = 0.0  # OpenAI: subtracted per occurrence in the output
    seed: int | None = None
    logprobs: int | None = None  # None: off; n: the chosen token's and the n most likely
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)  # finish on these, EOS or not
    logit_bias: dict[int, float] = field(default_factory=dict)  # added to those tokens' logits
    min_tokens: int = 0  # no EOS or stop token before this many have been generated
    grammar: GrammarSpec | None = None  # structured output: only what it allows
    n: int = 1  # sequences from one prompt (its KV shared), each its own random stream

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def shaped(self) -> bool:
        """Whether the logits change on the host before the pick (bias, penalties,
        held-back stops): then the argmax the engine computes on the device is not the
        answer. (A grammar's mask is applied on the device, to the batch's logits.)"""
        return self.penalized or bool(self.logit_bias) or self.min_tokens > 0

    @property
    def penalized(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def make_generator(seed: int | None) -> torch.Generator:
    """Same seed, same output; no seed draws a fresh one."""
    gen = torch.Generator(device="cpu")
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def apply_penalties(
    logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]
) -> torch.Tensor:
    """Repetition penalty over prompt and output (CTRL-style: divide positive logits,
    multiply negative ones); presence and frequency penalties over the output (OpenAI)."""
    logits = logits.float().clone()
    if params.repetition_penalty != 1.0 and (prompt or output):
        seen = torch.tensor(sorted(set(prompt) | set(output)), device=logits.device)
        values = logits[seen]
        logits[seen] = torch.where(
            values > 0, values / params.repetition_penalty, values * params.repetition_penalty
        )
    if output and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(
            torch.tensor(output, device=logits.device), minlength=logits.numel()
        ).float()
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return logits


def apply_bias(logits: torch.Tensor, bias: dict[int, float], banned: set[int]) -> torch.Tensor:
    """OpenAI's logit_bias (added to the raw logits; -100 all but bans a token), and the
    tokens that may not come yet (min_tokens: EOS and the stop tokens) banned outright."""
    logits = logits.float().clone()
    if bias:
        ids = torch.tensor(list(bias), device=logits.device)
        logits[ids] += torch.tensor(list(bias.values()), device=logits.device)
    if banned:
        logits[torch.tensor(sorted(banned), device=logits.device)] = float("-inf")
    return logits


def shape(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt: list[int] = (),
    output: list[int] = (),
    banned: set[int] = frozenset(),
) -> torch.Tensor:
    """One row of logits [vocab] as the request's penalties, bias and banned tokens leave
    it (the row itself when it has none)."""
    if params.penalized:
        logits = apply_penalties(logits, params, list(prompt), list(output))
    if params.logit_bias or banned:
        logits = apply_bias(logits, params.logit_bias, banned)
    return logits


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy request draws from (fp32, on the CPU): temperature,
    then top-k, min-p and top-p, of a row shape() left."""
    logits = logits.float().cpu() / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # keep the smallest set whose mass reaches top_p (always at least one token)
        drop = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= params.top_p * probs.sum()
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return probs


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator,
    prompt: list[int] = (),
    output: list[int] = (),
    banned: set[int] = frozenset(),
) -> int:
    """Pick the next token from one row of logits [vocab]; `prompt` and `output` are the
    tokens so far, for the penalties; `banned` may not be picked (min_tokens)."""
    logits = shape(logits, params, prompt, output, banned)
    if params.greedy:
        return int(torch.argmax(logits))
    return int(torch.multinomial(probabilities(logits, params), 1, generator=generator))
