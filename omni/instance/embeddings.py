"""OpenAI embeddings route of an embedding instance.

An input longer than the model takes (all-MiniLM-L6-v2: 256 tokens, its two special
tokens included) is a 400 naming `input`, as OpenAI's is, unless the request asks for
truncation with `truncate_prompt_tokens` (vLLM's extension; the openai client sends it
in `extra_body`):

- k, from 1 to the model's maximum: each input is cut to its first k tokens. A text
  keeps its first k - 2 tokens between [CLS] and [SEP] (as sentence-transformers
  truncates), so k must be at least 3 for text; a list of token ids keeps its first k ids.
- -1: the same with k the model's maximum.
- more than the model's maximum: a 400 naming `truncate_prompt_tokens`.

Inputs no longer than k are embedded whole. `usage.prompt_tokens` counts the tokens
embedded, after any cut.
"""

from __future__ import annotations

import asyncio
import base64
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web

from omni.api.errors import ApiError, json_response
from omni.api.schemas import EmbeddingRequest, parse_request
from omni.engine.bert import EmbeddingModel


class EmbeddingRoutes:
    def __init__(self, model: EmbeddingModel, model_name: str):
        self.model = model
        self.model_name = model_name
        # One thread: the model is not re-entrant, and the event loop stays free for health checks.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="omni-embed")

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/embeddings", self.embeddings)

    def _token_lists(self, req: EmbeddingRequest) -> list[list[int]]:
        """Each input's token ids, cut to `truncate_prompt_tokens` if asked (a 400 if one
        is too long otherwise)."""
        inp, keep = req.input, self._keep(req)
        tokenizer = self.model.tokenizer
        if isinstance(inp, str) or isinstance(inp[0], str):
            lists = tokenizer.encode_batch([inp] if isinstance(inp, str) else inp, keep)
        else:
            lists = [inp] if isinstance(inp[0], int) else inp
            vocab = self.model.model.cfg.vocab_size
            if any(not 0 <= t < vocab for tokens in lists for t in tokens):
                raise ApiError(400, f"Token ids must be in [0, {vocab}).", param="input")
            lists = [tokens[:keep] for tokens in lists]
        limit = tokenizer.max_length
        for i, tokens in enumerate(lists):
            if len(tokens) > limit:
                where = f" in input[{i}]" if len(lists) > 1 else ""
                raise ApiError(
                    400,
                    f"This model's maximum context length is {limit} tokens, however you "
                    f"requested {len(tokens)} tokens{where}. Please reduce the input, or set "
                    f"truncate_prompt_tokens to embed its first tokens only.",
                    param="input",
                    code="context_length_exceeded",
                )
        return lists

    def _keep(self, req: EmbeddingRequest) -> int | None:
        """How many tokens of each input to embed at most: None where the request asks
        for no truncation."""
        keep, limit = req.truncate_prompt_tokens, self.model.tokenizer.max_length
        if keep is None:
            return None
        if keep == -1:
            return limit
        if keep > limit:
            raise ApiError(
                400,
                f"truncate_prompt_tokens is {keep}, more than this model's maximum context "
                f"length of {limit} tokens.",
                param="truncate_prompt_tokens",
                code="invalid_value",
            )
        specials = self.model.tokenizer.special_tokens
        texts = isinstance(req.input, str) or isinstance(req.input[0], str)
        if texts and keep <= specials:
            raise ApiError(
                400,
                f"truncate_prompt_tokens is {keep}; a text needs at least {specials + 1} "
                f"(this model adds {specials} special tokens to each).",
                param="truncate_prompt_tokens",
                code="invalid_value",
            )
        return keep

    async def embeddings(self, request: web.Request) -> web.Response:
        req = parse_request(EmbeddingRequest, await request.read())
        if req.dimensions is not None and req.dimensions != self.model.dimensions:
            raise ApiError(
                400,
                f"This model returns {self.model.dimensions} dimensions; "
                f"'dimensions' cannot change that.",
                param="dimensions",
            )
        token_lists = self._token_lists(req)
        loop = asyncio.get_running_loop()
        vectors = await loop.run_in_executor(self._pool, self.model.embed, token_lists)
        data = []
        for i, vec in enumerate(vectors):
            if req.encoding_format == "base64":
                embedding = base64.b64encode(vec.float().numpy().astype("<f4").tobytes()).decode()
            else:
                embedding = vec.tolist()
            data.append({"object": "embedding", "index": i, "embedding": embedding})
        n_tokens = sum(len(t) for t in token_lists)
        return json_response(
            {
                "object": "list",
                "data": data,
                "model": self.model_name,
                "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
            }
        )
