"""The OpenAI API's request bodies as serve/server.py takes them, and OpenAI's error shape.

Every field is checked strictly (`max_tokens: true` or `"temperature": "0.5"` is a 400, not 1 or
0.5), and a refusal names the field as the API does (`prompt`, `messages[0].content`). Three kinds
of fields beyond the ones the server implements:
- defined by OpenAI's API but not implemented here (best_of, echo, logit_bias...):
  a 400 naming the field unless it holds the value that asks for nothing (`n: 1`, `tools: []`),
  never an answer that silently ignores it (UNSUPPORTED; marked so in the models below);
- defined by the API and accepted whatever they hold, because they do not change the answer
  (`user`, `metadata`, `service_tier`, ...: marked IGNORED below), each checked as the API types it;
- not in the API: a 400 "Unrecognized request argument", as OpenAI answers. The extensions this
  server adds (top_k, min_p, repetition_penalty, ignore_eos, return_token_ids, chat_template_kwargs)
  are vLLM's.
"""

import json
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from runtime.logprobs import MAX_LOGPROBS


class OpenAIError(Exception):
    """A refusal in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with its status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | int | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class Strict(BaseModel):
    """No coercion (true is not 1, "0.5" is not 0.5) and no unknown fields."""

    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # IGNORED: chunks carry no padding field to obfuscate


MAX_CHOICES = 64  # n at most: each choice is a sequence in the batch


class SamplingFields(Strict):
    """The fields both endpoints share."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever the model says (benchmarks)
    # vLLM's extension: each choice carries its token ids ("token_ids"; a stream's chunk, its own) and
    # the prompt's ("prompt_token_ids"; a stream's first chunk), so that a client can resend the exact
    # tokens of a reply (a conversation's next turn then finds them in the prefix cache)
    return_token_ids: bool = False
    n: int = Field(1, ge=1, le=MAX_CHOICES)  # choices, each a sequence of its own sharing the prompt's prefill
    frequency_penalty: Any = None
    logit_bias: Any = None
    user: str | None = None  # IGNORED


class JSONSchema(Strict):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # `schema` would shadow pydantic's own
    strict: bool | None = None  # always: the output follows the schema by construction


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchema | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    # each token's log-probability and those of the `logprobs` most likely (vLLM's bound, above OpenAI's 5)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None  # vLLM's extension of completions, as chat's
    best_of: Any = None  # UNSUPPORTED unless 1
    echo: Any = None
    suffix: Any = None


class TextPart(Strict):
    type: Literal["text"]
    text: str


# OpenAI's rule for a function's name: one that a call's JSON (and Qwen3's template) holds as it is.
TOOL_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class FunctionCall(Strict):
    name: str = Field(pattern=TOOL_NAME)  # a tool's, as the request's tools are named
    arguments: str  # a JSON object, as a string


class MessageToolCall(Strict):
    """A call an assistant message made (sent back in the history)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall
    index: int | None = None  # a streamed call's place, kept by clients that gather the chunks


class Message(Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = None  # a participant's name: handed to the chat template (Qwen3's show none)
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    # An assistant reply's reasoning, sent back in the history as this server returned it (or under
    # the shorter name `reasoning`): handed to the chat template, which Qwen3's show only for the
    # replies after the last user message (a tool-calling turn's reasoning), as they were generated.
    reasoning_content: str | None = None
    reasoning: str | None = None
    function_call: Any = None
    audio: Any = None
    refusal: Any = None
    annotations: Any = None  # UNSUPPORTED unless null: a reply's (this server gives none) sent back


class FunctionDefinition(Strict):
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema, rendered by the chat template
    strict: bool | None = None  # its calls follow the parameters schema exactly (constrained decoding)


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extension: {"enable_thinking": false}
    logprobs: bool | None = None  # each token's log-probability
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # and those of the most likely, with logprobs
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    functions: Any = None
    function_call: Any = None
    response_format: ResponseFormat | None = None
    audio: Any = None
    modalities: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    store: Any = None
    metadata: dict[str, str] | None = None  # IGNORED
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None  # IGNORED
    parallel_tool_calls: bool | None = None  # false: one call at most (constrained decoding enforces it)
    prediction: Any = None
    prompt_cache_key: str | None = None  # IGNORED: the prefix cache finds a prompt's blocks by their tokens
    safety_identifier: str | None = None  # IGNORED


# Field -> (the values that ask for nothing, what the server does instead). Each is refused with
# a 400 naming it when set to anything else.
UNSUPPORTED: dict[str, tuple[tuple, str]] = {
    "best_of": ((1,), "use n for several choices, each returned"),
    "frequency_penalty": ((0, 0.0), "use presence_penalty or repetition_penalty"),
    "logit_bias": (({},), "no bias on token logits"),
    "echo": ((False,), "the prompt is not echoed"),
    "suffix": (("",), "fill-in-the-middle is not implemented"),
    "functions": (([],), "function calling is not implemented: use tools"),
    "function_call": (("none",), "function calling is not implemented: use tools and tool_choice"),
    "audio": ((), "text only"),
    "modalities": ((["text"],), "text only"),
    "reasoning_effort": ((), 'thinking is switched with chat_template_kwargs {"enable_thinking": false}'),
    "verbosity": ((), "the model's own length"),
    "web_search_options": ((), "no web search"),
    "store": ((False,), "completions are not stored"),
    "refusal": ((), "the chat template has no refusals"),
    "annotations": ((), "the chat template has no annotations"),
}


def short(value: Any, limit: int = 80) -> str:
    """The value as JSON (what the client sent: true, not True), cut to `limit` characters: an error
    quotes a long prompt's start only."""
    def plain(v: Any) -> Any:  # a parsed part of the request as it was sent
        return v.model_dump(exclude_unset=True) if isinstance(v, BaseModel) else repr(v)

    text = json.dumps(value, default=plain)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_off(value: Any, allowed: tuple) -> bool:
    """Whether value asks for nothing: null, or one of `allowed` of the same type (true is not 1)."""
    return value is None or any(type(value) is type(a) and value == a for a in allowed)


def refuse_unsupported(model: BaseModel, path: str = "") -> None:
    """OpenAIError(400) naming the first field that asks for what the server does not implement."""
    for name, (allowed, instead) in UNSUPPORTED.items():
        if name in type(model).model_fields and not is_off(value := getattr(model, name), allowed):
            where = f"{path}.{name}" if path else name
            raise OpenAIError(400, f"'{where}' is not supported by this server: {instead}; got {short(value)}",
                              param=where, code="unsupported_parameter")
    for i, message in enumerate(getattr(model, "messages", None) or []):
        refuse_unsupported(message, f"messages[{i}]")


# Fields whose type is a union: a value of none of its kinds is described here, not by each member's error.
KINDS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of lists of token ids",
    "stop": "a string or a list of strings",
    "content": "a string or a list of text parts ({\"type\": \"text\", \"text\": ...})",
}
# Every field name of the request models: what is not one in a pydantic error location is the tag of
# a union's member ("str", "list[int]").
FIELD_NAMES = {name for model in (CompletionRequest, ChatRequest, Message, TextPart, StreamOptions, Tool,
                                   FunctionDefinition, NamedToolChoice, NamedFunction, MessageToolCall, FunctionCall,
                                   ResponseFormat, JSONSchema)
               for name in model.model_fields} | {"schema"}  # JSONSchema.schema_'s name in the API


def field_path(loc: tuple) -> str:
    """A pydantic error location as the API names the field: ("messages", 0, "content", "str") ->
    messages[0].content."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in FIELD_NAMES:
            path += f".{part}" if path else part
    return path


def union_at(loc: tuple) -> int | None:
    """Where in a pydantic error location a union field of KINDS stands, followed by its member's tag."""
    for i, part in enumerate(loc[:-1]):
        if part in KINDS and isinstance(loc[i + 1], str) and loc[i + 1] not in FIELD_NAMES:
            return i
    return None


def invalid(err: ValidationError) -> OpenAIError:
    """The 400 for a body pydantic refused, naming the field. Of several errors (one per member of
    a union) the deepest is reported: the member the value came closest to."""
    errors = err.errors()
    first = max(errors, key=lambda e: len(e["loc"]))
    loc = first["loc"]
    if first["type"] == "extra_forbidden":
        parent = field_path(loc[:-1])
        path = f"{parent}.{loc[-1]}" if parent else str(loc[-1])
        return OpenAIError(400, f"Unrecognized request argument supplied: {path}", param=path,
                           code="unknown_parameter")
    if first["type"] == "missing":
        path = field_path(loc)
        return OpenAIError(400, f"Missing required parameter: '{path}'", param=path)
    i = union_at(loc)
    if i is not None and not any(part in FIELD_NAMES for part in loc[i + 2 :]):
        # The value is of none of the union's kinds (not a mistake inside one, as a content part's type)
        path = field_path(loc[: i + 1])
        value = next((e["input"] for e in errors if len(e["loc"]) == i + 2 and e["loc"][: i + 1] == loc[: i + 1]),
                     first.get("input"))
        return OpenAIError(400, f"Invalid type for '{path}': expected {KINDS[loc[i]]}, got {short(value)}",
                           param=path)
    path = field_path(loc)
    return OpenAIError(400, f"Invalid value for '{path}': {first['msg']} (got {short(first.get('input'))})",
                       param=path)


def parse(model: type[BaseModel], body: bytes) -> Any:
    """The request model of a JSON body, or the OpenAIError(400) that says what is wrong with it."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise OpenAIError(400, f"Malformed JSON in the request body: {err}") from None
    if not isinstance(data, dict):
        raise OpenAIError(400, "The request body must be a JSON object")
    try:
        request = model.model_validate(data)
    except ValidationError as err:
        raise invalid(err) from None
    refuse_unsupported(request)
    return request
