"""A stand-in omnid node: what the edge needs from omnid, with a controlled "GPU time".

Edge tests and benches need many nodes whose speed, capacity and answers they decide:
a real omnid is slow to start and its timing depends on the hardware. This node
answers OpenAI completions with `token_s` seconds per generated token, lets at most
`permits` requests per model generate at once (omnid's permits), imitates a per-tenant
prefix cache, and reports at /stats what it served, so a test can check where the edge
sent what.

    python -m omni.testing.standin --port 9001 --name n1 --model m --permits 4 --token-s 0.01
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections import Counter, deque
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

REPO = Path(__file__).resolve().parents[2]
NO_TENANT = "-"  # stats key for requests without x-omni-tenant (straight to the node)
CACHE_BLOCK = 4  # cached prompt tokens come in whole blocks, as in a paged KV cache


def reply(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def error(status: int, message: str, code: str, param: str | None = None) -> web.Response:
    """An OpenAI-style error: the edge passes these through, clients parse them."""
    body = {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": param,
            "code": code,
        }
    }
    return reply(body, status)


def prompt_words(data: dict) -> list[str]:
    """The prompt's words: completions' prompt (a string or a list of them), or every chat
    message's text joined by spaces."""
    if "messages" in data:
        parts = []
        for m in data.get("messages") or []:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):  # content parts: keep the text ones
                content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(content if isinstance(content, str) else "")
        return " ".join(parts).split()
    prompt = data.get("prompt") or ""
    if isinstance(prompt, list):
        prompt = " ".join(p for p in prompt if isinstance(p, str))
    return prompt.split() if isinstance(prompt, str) else []


class PrefixCache:
    """Prompts seen, as a trie of words: the longest common prefix with any earlier prompt
    is one walk down it, however many prompts came before (a bench sends thousands)."""

    def __init__(self) -> None:
        self.root: dict[str, dict] = {}

    def cached_then_add(self, words: list[str]) -> int:
        """Tokens of `words` an earlier prompt shares (whole blocks only); then remember it."""
        node, common = self.root, 0
        for w in words:
            if w not in node:
                break
            node, common = node[w], common + 1
        for w in words[common:]:
            node = node.setdefault(w, {})
        return common - common % CACHE_BLOCK


class Node:
    """One node's state: permits per model, prefix caches per tenant, what it served."""

    def __init__(self, name: str, models: list[str], permits: int, token_s: float):
        self.name, self.permits, self.token_s = name, permits, token_s
        self.gpu = {m: asyncio.Semaphore(permits) for m in models}
        self.caches: dict[tuple[str, str], PrefixCache] = {}
        self.served: Counter[str] = Counter()
        self.tokens: Counter[str] = Counter()
        self.traceparents: deque[str] = deque(maxlen=100)
        self.in_flight = self.peak_in_flight = self.on_gpu = 0

    def stats(self) -> dict:
        return {
            "node": self.name,
            "served": dict(self.served),
            "tokens": dict(self.tokens),
            "traceparents": list(self.traceparents),
            "in_flight": self.in_flight,  # received, not yet answered (queued ones too)
            "peak_in_flight": self.peak_in_flight,
            "on_gpu": self.on_gpu,  # holding one of a model's permits
        }


def envelope(node: Node, chat: bool, model: str, chunk: bool = False) -> dict[str, Any]:
    kind = "chat.completion" if chat else "text_completion"
    return {
        "id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24],
        "object": kind + ".chunk" if chat and chunk else kind,
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": node.name,
    }


def choice(chat: bool, text: str, finish: str | None, chunk: bool = False) -> dict[str, Any]:
    if not chat:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    key = "delta" if chunk else "message"
    return {"index": 0, key: {"role": "assistant", "content": text}, "finish_reason": finish}


def standin_app(
    name: str, models: list[str], permits: int, token_s: float, token_bytes: int = 0
) -> web.Application:
    """The node as an aiohttp app (tests may also run it in-process). `token_bytes` pads
    each token's text to that size: big answers, for slow-reader tests."""

    def token(i: int) -> str:
        text = f" t{i}"
        return text + "x" * (token_bytes - len(text))

    node = Node(name, models, permits, token_s)
    app = web.Application()
    app["node"] = node

    async def tag(request: web.Request, response: web.StreamResponse) -> None:
        """Every answer, streamed or not, says which node gave it and carries the trace."""
        response.headers["x-omni-node"] = name
        if trace := request.headers.get("traceparent"):
            response.headers["traceparent"] = trace

    app.on_response_prepare.append(tag)

    async def healthz(request: web.Request) -> web.Response:
        return reply({"status": "ok"})

    async def list_models(request: web.Request) -> web.Response:
        data = [
            {"id": m, "object": "model", "owned_by": "omni", "permits": permits} for m in models
        ]
        return reply({"object": "list", "data": data})

    async def stats(request: web.Request) -> web.Response:
        return reply(node.stats())

    async def complete(request: web.Request) -> web.StreamResponse:
        if trace := request.headers.get("traceparent"):
            node.traceparents.append(trace)
        node.in_flight += 1
        node.peak_in_flight = max(node.peak_in_flight, node.in_flight)
        try:
            return await generate(request, request.path.endswith("/chat/completions"))
        finally:
            node.in_flight -= 1

    async def generate(request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            data = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            return error(400, "Request body is not valid JSON.", "invalid_json")
        if not isinstance(data, dict):
            return error(400, "Request body must be a JSON object.", "invalid_value")
        model = data.get("model")
        if model not in node.gpu:
            message = f"The model '{model}' does not exist or is not loaded."
            return error(404, message, "model_not_found", "model")
        max_tokens = data.get("max_completion_tokens" if chat else "max_tokens")
        max_tokens = data.get("max_tokens", 16) if max_tokens is None else max_tokens
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
            message = "max_tokens must be a non-negative integer."
            return error(400, message, "invalid_value", "max_tokens")
        tenant = request.headers.get("x-omni-tenant", NO_TENANT)
        words = prompt_words(data)
        async with node.gpu[model]:
            node.on_gpu += 1
            try:
                cache = node.caches.setdefault((tenant, model), PrefixCache())
                usage = {
                    "prompt_tokens": len(words),
                    "completion_tokens": max_tokens,
                    "total_tokens": len(words) + max_tokens,
                    "prompt_tokens_details": {"cached_tokens": cache.cached_then_add(words)},
                }
                if data.get("stream"):
                    response = await stream(request, chat, model, max_tokens, usage)
                else:
                    if token_s > 0 and max_tokens:
                        await asyncio.sleep(token_s * max_tokens)
                    text = "".join(token(i) for i in range(max_tokens))
                    body = envelope(node, chat, model)
                    body.update(choices=[choice(chat, text, "length")], usage=usage)
                    response = reply(body)
            finally:
                node.on_gpu -= 1
        node.served[tenant] += 1
        node.tokens[tenant] += max_tokens
        return response

    async def stream(
        request: web.Request, chat: bool, model: str, max_tokens: int, usage: dict
    ) -> web.StreamResponse:
        """One SSE event per token, `token_s` apart, then the usage and [DONE]."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        head = envelope(node, chat, model, chunk=True)
        for i in range(max_tokens):
            if token_s > 0:
                await asyncio.sleep(token_s)
            finish = "length" if i == max_tokens - 1 else None
            event = {**head, "choices": [choice(chat, token(i), finish, chunk=True)]}
            await response.write(b"data: " + orjson.dumps(event) + b"\n\n")
        await response.write(b"data: " + orjson.dumps({**head, "choices": [], "usage": usage}))
        await response.write(b"\n\ndata: [DONE]\n\n")
        await response.write_eof()
        return response

    app.router.add_get("/healthz", healthz)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/stats", stats)
    app.router.add_post("/v1/completions", complete)
    app.router.add_post("/v1/chat/completions", complete)
    return app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StandinNode:
    """A stand-in node in its own process (as omnid would be), ready once constructed:
    a test can kill it (SIGKILL) to see what the edge does when a node dies."""

    def __init__(
        self,
        name: str = "node",
        models: tuple[str, ...] | list[str] = ("m",),
        permits: int = 4,
        token_s: float = 0.0,
        token_bytes: int = 0,
        port: int | None = None,
        ready_timeout_s: float = 20.0,
    ):
        self.name, self.port = name, port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "omni.testing.standin", "--port", str(self.port)]
        argv += ["--name", name, "--permits", str(permits), "--token-s", str(token_s)]
        argv += ["--token-bytes", str(token_bytes)]
        for m in models:
            argv += ["--model", m]
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (open while the process runs)
        self.proc = subprocess.Popen(argv, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT)
        try:
            self._wait_ready(ready_timeout_s)
        except BaseException:
            self.kill()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"stand-in {self.name} exited ({self.proc.returncode}):\n" + self.log()
                )
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=1) as resp:
                    if resp.status == 200:
                        return
            except OSError:  # refused until it listens; URLError is an OSError
                pass
            time.sleep(0.05)
        raise RuntimeError(f"stand-in {self.name} not healthy in {timeout_s}s:\n" + self.log())

    def log(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-4000:]

    def stats(self) -> dict:
        with urllib.request.urlopen(self.url + "/stats", timeout=5) as resp:
            return orjson.loads(resp.read())

    def kill(self) -> None:
        """SIGKILL: the node vanishes mid-request, as a crashed host would."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self) -> StandinNode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._log.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="standin", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", required=True, help="x-omni-node and system_fingerprint")
    parser.add_argument("--model", action="append", required=True, help="repeat for more")
    parser.add_argument("--permits", type=int, default=4, help="per model, generating at once")
    parser.add_argument("--token-s", type=float, default=0.0, help="GPU seconds per token")
    parser.add_argument("--token-bytes", type=int, default=0, help="pad each token to this")
    args = parser.parse_args(argv)
    app = standin_app(args.name, args.model, args.permits, args.token_s, args.token_bytes)
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
