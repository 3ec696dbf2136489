"""OpenAI embeddings route of an embedding instance."""

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
        inp = req.input
        if isinstance(inp, str):
            return self.model.tokenizer.encode_batch([inp])
        if isinstance(inp[0], str):
            return self.model.tokenizer.encode_batch(inp)
        lists = [inp] if isinstance(inp[0], int) else inp
        vocab, limit = self.model.model.cfg.vocab_size, self.model.tokenizer.max_length
        for tokens in lists:
            if any(not 0 <= t < vocab for t in tokens):
                raise ApiError(400, f"Token ids must be in [0, {vocab}).", param="input")
        return [tokens[:limit] for tokens in lists]

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
