"""OpenAI chat and text completion routes of a text-generation instance."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable

import orjson
from aiohttp import web

from omni.api.errors import ApiError, error_body, json_response
from omni.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationFields,
    parse_request,
)
from omni.engine.engine import Engine, GenerationRequest, StepOutput
from omni.engine.grammar import GrammarError, GrammarSpec
from omni.engine.sampling import SamplingParams
from omni.engine.tokenizer import ChatTemplateError

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


TENANT_HEADER = "x-omni-tenant"  # set by the edge from the caller's API key
SESSION_HEADER = "x-session-affinity"


def principal(request: web.Request) -> str:
    """Whose prefix cache a request may use: its tenant's, narrowed to its session if given."""
    return f"{request.headers.get(TENANT_HEADER, '')}/{request.headers.get(SESSION_HEADER, '')}"


class TextGenRoutes:
    def __init__(self, engine: Engine, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        req = parse_request(ChatCompletionRequest, await request.read())
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            prompt = self.engine.tokenizer.encode_chat(messages)
        except ChatTemplateError as exc:
            raise ApiError(400, str(exc), param="messages") from None
        return await self._respond(request, req, prompt, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = parse_request(CompletionRequest, await request.read())
        if isinstance(req.prompt, str):
            prompt = self.engine.tokenizer.encode(req.prompt)
        elif isinstance(req.prompt[0], str):
            prompt = self.engine.tokenizer.encode(req.prompt[0])
        else:
            prompt = list(req.prompt)
            self._check_token_ids(prompt, "prompt")
        return await self._respond(request, req, prompt, chat=False)

    def _check_token_ids(self, ids, param: str) -> None:
        vocab = self.engine.model.cfg.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ApiError(400, f"Token ids must be in [0, {vocab}).", param=param)

    def _sampling(self, req: GenerationFields, prompt: list[int]) -> SamplingParams:
        context = min(self.engine.max_context, self.engine.kv_capacity_tokens)
        room = context - len(prompt)
        if room < 1:
            param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
            raise ApiError(
                400,
                f"The prompt is {len(prompt)} tokens; this model's context is {context} tokens.",
                param=param,
                code="context_length_exceeded",
            )
        if (
            isinstance(req, ChatCompletionRequest)
            and req.top_logprobs is not None
            and not (req.logprobs)
        ):
            raise ApiError(
                400,
                "top_logprobs requires logprobs to be true.",
                param="top_logprobs",
                code="invalid_value",
            )
        limit = req.token_limit
        if limit is not None and limit > room:
            raise ApiError(
                400,
                f"max_tokens is {limit}, but the prompt ({len(prompt)} tokens) leaves room for "
                f"{room} in this model's {context}-token context.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        bias = {int(k): v for k, v in (req.logit_bias or {}).items()}
        self._check_token_ids(bias, "logit_bias")
        self._check_token_ids(req.stop_token_ids or [], "stop_token_ids")
        if req.min_tokens > (limit or room):
            raise ApiError(
                400,
                f"min_tokens ({req.min_tokens}) is more than max_tokens ({limit or room}).",
                param="min_tokens",
                code="invalid_value",
            )
        return SamplingParams(
            max_tokens=limit or room,
            logit_bias=bias,
            min_tokens=req.min_tokens,
            ignore_eos=req.ignore_eos,
            stop_token_ids=list(req.stop_token_ids or []),
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=max(req.top_k, 0),
            min_p=req.min_p,
            repetition_penalty=req.repetition_penalty,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            logprobs=req.logprob_count,
            seed=req.seed,
            stop=req.stop_list,
        )

    async def _grammar(self, req: GenerationFields) -> GrammarSpec | None:
        """The grammar a response_format asks for, compiled (a 400 if it cannot be)."""
        fmt = getattr(req, "response_format", None)
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            spec = GrammarSpec("json_object")
        else:
            spec = GrammarSpec.json_schema(fmt.json_schema.json_schema or {})
        try:
            await asyncio.to_thread(self.engine.check_grammar, spec)
        except GrammarError as exc:
            raise ApiError(
                400,
                f"Invalid JSON schema: {exc}",
                param="response_format.json_schema.schema",
                code="invalid_value",
            ) from None
        return spec

    async def _respond(
        self, request: web.Request, req: GenerationFields, prompt: list[int], chat: bool
    ) -> web.StreamResponse:
        params = self._sampling(req, prompt)
        params.grammar = await self._grammar(req)
        gen = GenerationRequest(prompt, params, principal(request))
        fmt = _Formatter(self.model_name, chat, self.engine.tokenizer.decode)
        outputs = self.engine.stream(gen)
        if req.stream:
            return await _stream(request, outputs, fmt, req.include_usage)
        text, logprobs, last = [], [], None
        async for out in outputs:
            text.append(out.text)
            logprobs.extend(out.logprobs or [])
            last = out
        if last.finish_reason == "error":
            raise RuntimeError(f"generation failed: {last.error}")
        return json_response(fmt.whole("".join(text), last, logprobs))


async def _stream(
    request: web.Request, outputs: AsyncIterator[StepOutput], fmt: _Formatter, usage: bool
) -> web.StreamResponse:
    resp = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(request)
    try:
        if fmt.chat:
            await _send(resp, fmt.chunk({"role": "assistant", "content": ""}, None))
        pending = []  # logprobs of tokens whose text is still held back
        async for out in outputs:
            if out.finish_reason == "error":
                await _send(resp, error_body(f"generation failed: {out.error}", 500))
                break
            pending.extend(out.logprobs or [])
            if out.text:
                await _send(resp, fmt.chunk(out.text, None, pending))
                pending = []
            if out.finished:
                await _send(resp, fmt.chunk(None, out.finish_reason, pending))
                if usage:
                    await _send(resp, fmt.usage_chunk(out))
        await resp.write(b"data: [DONE]\n\n")
    except ConnectionResetError:
        pass  # client left: closing `outputs` cancels the generation
    finally:
        await outputs.aclose()
    return resp


async def _send(resp: web.StreamResponse, data: dict) -> None:
    await resp.write(b"data: " + orjson.dumps(data) + b"\n\n")


class _Formatter:
    """OpenAI response objects for one request."""

    def __init__(self, model: str, chat: bool, token_text: Callable[[list[int]], str]):
        self.model, self.chat = model, chat
        self._token_text = token_text
        self._offset = 0  # completions' text_offset of the next token
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _envelope(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    @staticmethod
    def _usage(out: StepOutput) -> dict:
        return {
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": out.completion_tokens,
            "total_tokens": out.prompt_tokens + out.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": out.cached_tokens},
        }

    def _logprobs(self, entries: list) -> dict | None:
        """OpenAI's logprobs object: chat's `content` list, or the legacy completions form."""
        if not entries:
            return None

        def text(token_id: int) -> str:
            return self._token_text([token_id])

        if self.chat:

            def entry(tid: int, lp: float) -> dict:
                t = text(tid)
                return {"token": t, "logprob": lp, "bytes": list(t.encode())}

            return {
                "content": [
                    {**entry(tid, lp), "top_logprobs": [entry(a, b) for a, b in alts]}
                    for tid, lp, alts in entries
                ]
            }
        tokens, offsets = [text(tid) for tid, _, _ in entries], []
        for t in tokens:
            offsets.append(self._offset)
            self._offset += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [{text(a): b for a, b in alts} for _, _, alts in entries],
            "text_offset": offsets,
        }

    def whole(self, text: str, out: StepOutput, logprobs: list) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
            body = self._envelope("chat.completion")
        else:
            choice = {"index": 0, "text": text}
            body = self._envelope("text_completion")
        choice.update(finish_reason=out.finish_reason, logprobs=self._logprobs(logprobs))
        return {**body, "choices": [choice], "usage": self._usage(out)}

    def chunk(
        self, delta: str | dict | None, finish_reason: str | None, logprobs: list | None = None
    ) -> dict:
        if self.chat:
            if isinstance(delta, str):
                delta = {"content": delta}
            choice = {"index": 0, "delta": delta or {}, "finish_reason": finish_reason}
            body = self._envelope("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": delta or "", "finish_reason": finish_reason}
            body = self._envelope("text_completion")
        choice["logprobs"] = self._logprobs(logprobs or [])
        return {**body, "choices": [choice]}

    def usage_chunk(self, out: StepOutput) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(obj), "choices": [], "usage": self._usage(out)}
