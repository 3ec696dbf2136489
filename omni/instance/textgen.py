"""OpenAI chat and text completion routes of a text-generation instance."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import orjson
from aiohttp import web

from omni.api.errors import ApiError, error_body, json_response
from omni.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationFields,
    parse_request,
)
from omni.api.toolcalls import ToolCall, parser_for
from omni.api.tooluse import ToolUse
from omni.engine import kv_transfer
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
    def __init__(
        self,
        engine: Engine,
        model_name: str,
        tool_parser: str | None = None,
        handoff_dir: Path | None = None,
    ):
        """`handoff_dir`: where KV handoffs of disaggregated serving are written and read
        (the instance's socket directory; kv_transfer.py)."""
        self.engine = engine
        self.model_name = model_name
        self.handoff_dir = handoff_dir
        tok = engine.tokenizer
        self.tool_family = parser_for(tok.model_type, tok.chat_template_source, tool_parser)

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        req = parse_request(ChatCompletionRequest, await request.read())
        tools = self._tool_use(req)
        await self._check_tools(tools)
        tok = self.engine.tokenizer
        history = [m.to_template() for m in req.messages]
        try:
            prompt = tok.encode_chat(*tools.template_inputs(history, tok.template_renders_tools))
        except ChatTemplateError as exc:
            if not any(m["role"] == "tool" for m in history) or tok.template_renders_tools:
                raise ApiError(400, str(exc), param="messages") from None
            try:  # a template that refuses the 'tool' role: results as user turns
                prompt = tok.encode_chat(*tools.template_inputs(history, False, tool_role=False))
            except ChatTemplateError as exc:
                raise ApiError(400, str(exc), param="messages") from None
        return await self._respond(request, req, prompt, chat=True, tools=tools)

    def _tool_use(self, req: ChatCompletionRequest) -> ToolUse:
        choice = req.tool_choice_json()
        if choice not in ("none", "auto") and not req.tools:
            raise ApiError(400, "tool_choice needs tools.", param="tool_choice")
        names = {t.function.name for t in req.tools or []}
        if isinstance(choice, dict) and choice["function"]["name"] not in names:
            raise ApiError(
                400,
                f"tool_choice names {choice['function']['name']!r}, which is not in tools.",
                param="tool_choice",
            )
        tools = ToolUse(
            self.tool_family,
            [t.model_dump(exclude_none=True) for t in req.tools or []],
            choice,
            req.parallel_tool_calls,
        )
        if tools.grammar_forced and req.response_format and req.response_format.type != "text":
            raise ApiError(
                400,
                "A tool_choice that forces a call cannot go with a response_format.",
                param="response_format",
            )
        return tools

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
            n=req.n,
        )

    async def _check_tools(self, tools: ToolUse) -> None:
        """Each tool's parameters must be a JSON schema of an object that the grammar
        engine can compile, whatever tool_choice says (as OpenAI checks them): a 400
        naming the tool otherwise."""
        for i, tool in enumerate(tools.tools):
            function = tool["function"]
            reason = await self._parameters_fault(function.get("parameters"))
            if reason is not None:
                raise ApiError(
                    400,
                    f"Invalid schema for function {function['name']!r}: {reason}",
                    param=f"tools[{i}].function.parameters",
                    code="invalid_function_parameters",
                )

    async def _parameters_fault(self, schema: dict | None) -> str | None:
        """Why a tool's parameters schema cannot be used (None where it can)."""
        if schema is None:
            return None
        if schema.get("type", "object") != "object":  # a call's arguments are an object
            return f"parameters must be a JSON schema of type 'object', not {schema['type']!r}"
        try:
            await asyncio.to_thread(self.engine.check_grammar, GrammarSpec.json_schema(schema))
        except GrammarError as exc:
            return str(exc)
        return None

    async def _grammar(self, req: GenerationFields, tools: ToolUse | None) -> GrammarSpec | None:
        """The grammar a response_format or a forced tool call asks for, compiled (a 400
        naming the field if it cannot be)."""
        fmt = getattr(req, "response_format", None)
        tag = tools.grammar() if tools is not None else None
        if tag is not None:
            spec, param, what = GrammarSpec.structural_tag(tag), "tools", "Invalid tools"
        elif fmt is None or fmt.type == "text":
            return None
        elif fmt.type == "json_object":
            spec, param, what = GrammarSpec("json_object"), "response_format", "Invalid format"
        else:
            spec = GrammarSpec.json_schema(fmt.json_schema.json_schema or {})
            param = "response_format.json_schema.schema"
            what = f"Invalid schema for response_format {fmt.json_schema.name!r}"
        try:
            await asyncio.to_thread(self.engine.check_grammar, spec)
        except GrammarError as exc:
            raise ApiError(400, f"{what}: {exc}", param=param, code="invalid_value") from None
        return spec

    async def _respond(
        self,
        request: web.Request,
        req: GenerationFields,
        prompt: list[int],
        chat: bool,
        tools: ToolUse | None = None,
    ) -> web.StreamResponse:
        params = self._sampling(req, prompt)
        export = request.headers.get(kv_transfer.EXPORT_HEADER)
        if export is not None:
            return await self._prefill(prompt, principal(request), export)
        params.grammar = await self._grammar(req, tools)
        gen = GenerationRequest(prompt, params, principal(request))
        handoff = request.headers.get(kv_transfer.IMPORT_HEADER)
        if handoff is not None:
            await self._take_handoff(gen, handoff)
        fmt = _Formatter(self.model_name, chat, self.engine.tokenizer.decode)
        tools = tools if tools is not None and tools.active else None
        outputs = self.engine.stream(gen)
        if req.stream:
            return await _stream(request, outputs, fmt, req.include_usage, req.n, tools)
        text: dict[int, list[str]] = {i: [] for i in range(req.n)}
        logprobs: dict[int, list] = {i: [] for i in range(req.n)}
        last: dict[int, StepOutput] = {}
        async for out in outputs:
            if out.finish_reason == "error":
                raise RuntimeError(f"generation failed: {out.error}")
            text[out.index].append(out.text)
            logprobs[out.index].extend(out.logprobs or [])
            last[out.index] = out
        choices = [
            fmt.choice(i, "".join(text[i]), last[i].finish_reason, logprobs[i], tools)
            for i in range(req.n)
        ]
        return json_response(fmt.whole(choices, list(last.values())))

    def _handoff_path(self, handoff_id: str) -> Path:
        if self.handoff_dir is None:
            raise ApiError(400, "This instance takes no KV handoffs.")
        try:
            return kv_transfer.handoff_path(self.handoff_dir, handoff_id)
        except kv_transfer.HandoffError as exc:
            raise ApiError(400, str(exc)) from None

    async def _prefill(self, prompt: list[int], who: str, handoff_id: str) -> web.Response:
        """Disaggregated serving's first half: compute the prompt's full blocks short of
        the one with its last token and write their K/V for a decode instance."""
        path = self._handoff_path(handoff_id)
        t0 = time.monotonic()
        handoff = await self.engine.prefill_handoff(prompt, who)
        if handoff is None:  # too short to be worth moving
            return json_response({"blocks": 0, "bytes": 0, "cached_tokens": 0})
        nbytes = await asyncio.to_thread(kv_transfer.write, path, handoff)
        return json_response(
            {
                "blocks": handoff.k.shape[1],
                "bytes": nbytes,
                "cached_tokens": handoff.cached_tokens,
                "seconds": time.monotonic() - t0,
            }
        )

    async def _take_handoff(self, gen: GenerationRequest, handoff_id: str) -> None:
        """Disaggregated serving's second half: the prompt's blocks a prefill instance
        computed, checked to be this request's (then the file is gone either way)."""
        path = self._handoff_path(handoff_id)
        try:
            handoff = await asyncio.to_thread(kv_transfer.read, path)
            runner = self.engine.runner
            handoff.check(gen.principal, gen.prompt_ids, runner.block_shape, runner.kv_dtype)
        except kv_transfer.HandoffError as exc:  # omnid's handoff, not the client's fault
            raise ApiError(
                503, f"KV handoff refused: {exc}", code="kv_handoff_failed", retry_after=1
            ) from None
        finally:
            path.unlink(missing_ok=True)
        gen.kv_import = handoff.payloads()
        gen.prior_cached_tokens = handoff.cached_tokens


async def _stream(
    request: web.Request,
    outputs: AsyncIterator[StepOutput],
    fmt: _Formatter,
    usage: bool,
    n: int,
    tools: ToolUse | None,
) -> web.StreamResponse:
    resp = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(request)
    calls = {i: tools.stream() for i in range(n)} if tools is not None else {}
    pending: dict[int, list] = {i: [] for i in range(n)}  # logprobs of text held back
    last: dict[int, StepOutput] = {}
    try:
        if fmt.chat:
            for i in range(n):
                await _send(resp, fmt.chunk(i, {"role": "assistant", "content": ""}, None))
        async for out in outputs:
            if out.finish_reason == "error":
                await _send(resp, error_body(f"generation failed: {out.error}", 500))
                break
            i = out.index
            pending[i].extend(out.logprobs or [])
            text = calls[i].feed(out.text) if i in calls else out.text
            if text:
                await _send(resp, fmt.chunk(i, text, None, pending[i]))
                pending[i] = []
            if out.finished:
                last[i] = out
                reason = out.finish_reason
                if i in calls:
                    rest, found = calls[i].finish(cut_off=reason == "length")
                    if rest:
                        await _send(resp, fmt.chunk(i, rest, None, pending[i]))
                        pending[i] = []
                    for delta in _call_deltas(found):
                        await _send(resp, fmt.chunk(i, delta, None))
                    if found and reason == "stop":
                        reason = "tool_calls"
                await _send(resp, fmt.chunk(i, None, reason, pending[i]))
        if usage and len(last) == n:
            await _send(resp, fmt.usage_chunk(list(last.values())))
        await resp.write(b"data: [DONE]\n\n")
    except ConnectionResetError:
        pass  # client left: closing `outputs` cancels the generation
    finally:
        await outputs.aclose()
    return resp


def _call_deltas(calls: list[ToolCall]) -> list[dict]:
    """OpenAI's streamed form of each call: its id and name, then its arguments."""
    deltas = []
    for index, call in enumerate(calls):
        head = {"index": index, "id": call.id, "type": "function"}
        deltas.append({"tool_calls": [{**head, "function": {"name": call.name, "arguments": ""}}]})
        deltas.append({"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]})
    return deltas


async def _send(resp: web.StreamResponse, data: dict) -> None:
    await resp.write(b"data: " + orjson.dumps(data) + b"\n\n")


class _Formatter:
    """OpenAI response objects for one request."""

    def __init__(self, model: str, chat: bool, token_text: Callable[[list[int]], str]):
        self.model, self.chat = model, chat
        self._token_text = token_text
        self._offsets: dict[int, int] = {}  # per choice: completions' text_offset of its next token
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _envelope(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    @staticmethod
    def _usage(lasts: list[StepOutput]) -> dict:
        """The prompt once, the tokens of every choice."""
        prompt = lasts[0].prompt_tokens
        completion = sum(out.completion_tokens for out in lasts)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": lasts[0].cached_tokens},
        }

    def _logprobs(self, index: int, entries: list) -> dict | None:
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
            offsets.append(self._offsets.get(index, 0))
            self._offsets[index] = offsets[-1] + len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [{text(a): b for a, b in alts} for _, _, alts in entries],
            "text_offset": offsets,
        }

    def choice(
        self, index: int, text: str, reason: str, logprobs: list, tools: ToolUse | None
    ) -> dict:
        """One whole choice; with tools, the model's calls read out of its text."""
        if not self.chat:
            out = {"index": index, "text": text}
        else:
            message: dict = {"role": "assistant", "content": text}
            if tools is not None:
                parsed = tools.parse(text, cut_off=reason == "length")
                if parsed.calls or parsed.cut:  # (a call cut off is neither content nor a call)
                    message["content"] = parsed.content
                if parsed.calls:
                    message["tool_calls"] = [c.to_json() for c in parsed.calls]
                    reason = "tool_calls" if reason == "stop" else reason
            out = {"index": index, "message": message}
        out.update(finish_reason=reason, logprobs=self._logprobs(index, logprobs))
        return out

    def whole(self, choices: list[dict], lasts: list[StepOutput]) -> dict:
        body = self._envelope("chat.completion" if self.chat else "text_completion")
        return {**body, "choices": choices, "usage": self._usage(lasts)}

    def chunk(
        self,
        index: int,
        delta: str | dict | None,
        finish_reason: str | None,
        logprobs: list | None = None,
    ) -> dict:
        if self.chat:
            if isinstance(delta, str):
                delta = {"content": delta}
            choice = {"index": index, "delta": delta or {}, "finish_reason": finish_reason}
            body = self._envelope("chat.completion.chunk")
        else:
            choice = {"index": index, "text": delta or "", "finish_reason": finish_reason}
            body = self._envelope("text_completion")
        choice["logprobs"] = self._logprobs(index, logprobs or [])
        return {**body, "choices": [choice]}

    def usage_chunk(self, lasts: list[StepOutput]) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(obj), "choices": [], "usage": self._usage(lasts)}
