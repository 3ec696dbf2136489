"""Tokenizer, chat template and streaming detokenization for a checkpoint."""

from __future__ import annotations

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from .checkpoint import Checkpoint, CheckpointError


class ChatTemplateError(ValueError):
    """The messages cannot be rendered with the model's chat template."""


def _raise(message: str):
    raise ChatTemplateError(message)


class TextTokenizer:
    """tokenizer.json plus the special tokens and chat template from tokenizer_config.json."""

    def __init__(self, ckpt: Checkpoint):
        self._tok = Tokenizer.from_file(str(ckpt.path / "tokenizer.json"))
        cfg = ckpt.json("tokenizer_config.json")
        self.bos_token: str | None = _token_text(cfg.get("bos_token"))
        self.eos_token: str | None = _token_text(cfg.get("eos_token"))
        self.add_bos = bool(cfg.get("add_bos_token", False))
        self.eos_ids = _eos_ids(ckpt, self._tok, self.eos_token)
        self._template = None
        template = cfg.get("chat_template")
        self.model_type: str = ckpt.config.get("model_type", "")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template_source: str = template or ""
        if template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            try:
                self._template = env.from_string(template)
            except TemplateError as exc:
                path = ckpt.path / "tokenizer_config.json"
                raise CheckpointError(f"{path}: chat_template does not compile ({exc})") from None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    @property
    def raw(self) -> Tokenizer:
        """The `tokenizers` object itself (for libraries that read the vocabulary)."""
        return self._tok

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    @property
    def template_renders_tools(self) -> bool:
        """Whether the chat template writes `tools` and tool calls itself."""
        return "tools" in self.chat_template_source

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and self.bos_token:
            bos = self._tok.token_to_id(self.bos_token)
            if bos is not None and (not ids or ids[0] != bos):
                ids = [bos, *ids]
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None
    ) -> str:
        if self._template is None:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except ChatTemplateError:
            raise
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from None

    def encode_chat(self, messages: list[dict], tools: list | None = None) -> list[int]:
        # The template already writes the special tokens it wants.
        text = self.apply_chat_template(messages, tools=tools)
        return self.encode(text, add_special_tokens=False)

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self)


class StreamDecoder:
    """Turns a growing token list into text deltas.

    Decodes a short window before the new tokens, so byte-level merges and
    multi-token UTF-8 characters come out whole: a window that still ends in
    U+FFFD is held back until the next token completes it.
    """

    WINDOW = 6

    def __init__(self, tokenizer: TextTokenizer):
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # tokens already turned into text

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read])
        full_text = self._tok.decode(self._ids[self._prefix :])
        if full_text.endswith("\ufffd") or len(full_text) <= len(prefix_text):
            return ""
        delta = full_text[len(prefix_text) :]
        self._read = len(self._ids)
        self._prefix = max(0, self._read - self.WINDOW)
        return delta


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # AddedToken serialised as {"content": ...}
        return value.get("content")
    return value


def _eos_ids(ckpt: Checkpoint, tok: Tokenizer, eos_token: str | None) -> set[int]:
    ids: set[int] = set()
    for source in (ckpt.config, ckpt.json("generation_config.json")):
        value = source.get("eos_token_id")
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    if eos_token and (eos := tok.token_to_id(eos_token)) is not None:
        ids.add(eos)
    return ids
