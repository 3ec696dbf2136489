"""OpenAI request schemas: one definition, checked by omnid and used by instances.

Strict and closed: a wrong type or an unknown field is a 400 that names the
field, instead of a silently ignored parameter.
"""

from __future__ import annotations

from typing import Annotated, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from .errors import ApiError

MAX_STOP_SEQUENCES = 4
MAX_EMBEDDING_INPUTS = 2048
# OpenAI's seed is a signed 64-bit integer; the engine seeds choice i with seed + i (n <= 128),
# which torch.Generator.manual_seed takes for any seed in this range.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionCall(Strict):
    name: str
    arguments: str  # a JSON object, encoded


class MessageToolCall(Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall
    index: int | None = None  # kept by the openai client's stream helper; not used


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's past calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    # an assistant message sent back as the openai client received it: not used
    refusal: str | None = None
    annotations: list | None = None
    audio: dict | None = None
    function_call: dict | None = None

    @model_validator(mode="after")
    def _tool_fields_in_place(self):
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a 'tool' message needs a tool_call_id")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an 'assistant' message has tool_calls")
        return self

    def to_template(self) -> dict:
        """The message as a chat template reads it."""
        out: dict = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        if self.name:
            out["name"] = self.name
        return out

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class StreamOptions(Strict):
    include_usage: bool = False


class GenerationFields(Strict):
    """Parameters shared by chat and text completions."""

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = 0  # extension (as in vLLM); 0 or -1: off
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0  # extension
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] = 1.0  # extension
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=128)] = 1  # choices, sharing the prompt's KV
    user: str | None = None  # accepted, not used
    # token id (as a string, as OpenAI sends it) -> bias added to its logit
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0  # extensions, as in vLLM
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value):
        if value and not all(key.isdigit() for key in value):
            raise ValueError("keys must be token ids")
        return value

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens


class JsonSchemaFormat(Strict):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    json_schema: dict | None = Field(default=None, alias="schema")  # "schema" names a method
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a json_schema")
        return self


class FunctionDefinition(Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict | None = None  # a JSON schema for the arguments
    strict: bool | None = None  # calls are exact only under tool_choice required/named


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(GenerationFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    response_format: ResponseFormat | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None

    @property
    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def tool_choice_json(self) -> str | dict:
        choice = self.tool_choice or "auto"
        return choice if isinstance(choice, str) else choice.model_dump()


class CompletionRequest(GenerationFields):
    prompt: (
        str
        | Annotated[list[int], Field(min_length=1)]
        | Annotated[list[str], Field(min_length=1, max_length=1)]
    )
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None  # the legacy API's count

    @property
    def logprob_count(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, value):
        if value == "" or value == [""]:
            raise ValueError("prompt must not be empty")
        return value


class EmbeddingRequest(Strict):
    model: str
    input: (
        str
        | Annotated[list[str], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
        | Annotated[list[int], Field(min_length=1)]
        | Annotated[list[list[int]], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None
    # extension (vLLM's name): embed each input's first k tokens (-1: as many as the
    # model takes) instead of refusing a longer one (omni/runtime/embeddings.py)
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _some_tokens(cls, value):
        if value == 0:
            raise ValueError("must be a number of tokens, or -1 for the model's maximum")
        return value

    @field_validator("input")
    @classmethod
    def _no_empty_items(cls, value):
        items = [value] if isinstance(value, str) else value
        if any(len(item) == 0 for item in items if isinstance(item, str | list)):
            raise ValueError("input must not contain empty strings or token lists")
        return value


ModelT = TypeVar("ModelT", bound=BaseModel)


def parse_request(schema: type[ModelT], body: bytes) -> ModelT:
    """Validate a JSON body; raise a 400 naming the first offending field."""
    try:
        return schema.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        # Of a union's per-branch errors, a broken constraint says more than a type mismatch.
        first = errors[0]["loc"][:1]
        same_field = [e for e in errors if e["loc"][:1] == first]
        err = next((e for e in same_field if not e["type"].endswith("_type")), errors[0])
        if err["type"] == "json_invalid":
            raise ApiError(400, "Request body is not valid JSON.", code="invalid_json") from None
        param = _param_name(err["loc"])
        if err["type"] == "extra_forbidden":
            message = f"Unrecognized request argument supplied: {param}"
        elif err["type"] == "missing":
            message = f"Missing required parameter: '{param}'."
        elif err["type"] == "model_type":
            message = "Request body must be a JSON object."
        else:
            detail = err["msg"].removeprefix("Value error, ")
            message = f"Invalid value for '{param}': {detail}."
        raise ApiError(400, message, param=param or None, code="invalid_value") from None


def _param_name(loc: tuple) -> str:
    """('messages', 0, 'role') -> 'messages[0].role'; drops pydantic's union-branch labels."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif (
            "[" in part
            or part.startswith(("function-", "constrained-"))
            or part
            in {
                "str",
                "int",
                "float",
                "bool",
                "list",
            }
        ):
            continue  # union member tags such as 'list[str]'
        else:
            out += f".{part}" if out else part
    return out
