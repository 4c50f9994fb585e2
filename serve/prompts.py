"""What a request asks of the engine, read from its body: the prompt's token ids (a completion's text
or ids; a chat's messages and tools through the checkpoint's chat template), the grammar its reply
must follow (response_format, a forced or strict tool call: serve/constraints.py), and what takes
a chat reply apart (serve/reply.py). Every request the client got wrong is a 400 naming the field.
"""

import asyncio
import functools
import inspect
import json
from collections.abc import Callable

import jinja2
import jinja2.meta

from runtime.grammar import check_spec, structural_tag
from runtime.reasoning import ReasoningSplitter

from .constraints import calls_constrained, json_format, reasoning_of, response_grammar, tool_grammar
from .protocol import ChatRequest, CompletionRequest, NamedToolChoice, OpenAIError, SamplingFields, short
from .reply import ReplyParser
from .schemas import unenforced

LONG_BODY_BYTES = 1 << 16  # a body longer than this has its prompt tokenized off the event loop


async def off_the_loop_if_long(body: bytes, function: Callable, *args):
    """function(*args) (a prompt's tokenization) in a worker thread when the request's body is
    long: megabytes of text take the tokenizer seconds, and on the event loop every stream and
    /health would wait for them; a short one on the loop, where a thread's round trip would wait
    behind the streams' chunks."""
    if len(body) > LONG_BODY_BYTES:
        return await asyncio.to_thread(function, *args)
    return function(*args)


def completion_prompts(tokenizer, req: CompletionRequest) -> list[list[int]]:
    """A completion's prompts as token ids, each: a text through the tokenizer, or ids; a list of
    texts or of id lists is a batch of prompts, as OpenAI's API takes it."""
    prompt = req.prompt
    batch = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
    return [tokenizer(p, add_special_tokens=False)["input_ids"] if isinstance(p, str) else list(p) for p in batch]


def chat_prompt(tokenizer, model_name: str, req: ChatRequest) -> list[int]:
    """A chat request's messages (and tools) through the checkpoint's chat template, as token ids; a
    400 naming the field for messages or template variables the template cannot take."""
    if not tokenizer.chat_template:
        raise OpenAIError(400, f"The model `{model_name}` has no chat template (a base model): use "
                               "/v1/completions with a plain prompt, or start the server with --chat-template FILE",
                          param="messages")
    messages = []
    for i, m in enumerate(req.messages):
        if m.content is None and m.role != "assistant":  # an assistant's may be its calls alone
            raise OpenAIError(400, f"messages[{i}]: a {m.role} message needs content", param=f"messages[{i}].content")
        if m.role == "tool" and m.tool_call_id is None:
            raise OpenAIError(400, f"messages[{i}]: a tool message needs the tool_call_id of the call it answers",
                              param=f"messages[{i}].tool_call_id")
        content = m.content if isinstance(m.content, str) or m.content is None else "\n".join(
            part.text for part in m.content)  # parts kept apart, as vLLM joins them
        # OpenAI's developer role is the system role of reasoning models; Qwen3's templates know
        # only system, and would drop the message.
        message = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
        if m.name is not None:  # the template decides whether to show it (Qwen3's do not)
            message["name"] = m.name
        if m.tool_calls:  # the template writes the arguments as JSON: it takes them as an object
            message["tool_calls"] = [{"type": "function", "id": call.id, "function": {
                "name": call.function.name, "arguments": json_object(call.function.arguments,
                                                                     f"messages[{i}].tool_calls[{j}]")}}
                for j, call in enumerate(m.tool_calls)]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if (reasoning := m.reasoning_content if m.reasoning_content is not None else m.reasoning) is not None:
            message["reasoning_content"] = reasoning
        messages.append(message)
    names = [tool.function.name for tool in req.tools or []]
    for i, name in enumerate(names):
        if name in names[:i]:  # a call could not say which one it meant
            raise OpenAIError(400, f"tools[{i}] is a second function named {name!r}", param=f"tools[{i}].function.name")
    tools = [tool.model_dump(exclude_none=True) for tool in req.tools] if req.tools else None
    check_template_kwargs(tokenizer, req.chat_template_kwargs or {})
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=True, **(req.chat_template_kwargs or {}))
    except Exception as err:  # a template's own error (jinja raises its own types)
        raise OpenAIError(400, f"The chat template failed on these messages: {err}", param="messages") from None
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# Variables of a chat template that apply_chat_template sets from the request (or its own
# arguments and the tokenizer's special tokens, below): chat_template_kwargs may not set them.
SERVER_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


@functools.lru_cache(maxsize=8)
def template_variables(template: str) -> frozenset[str] | None:
    """The variables a chat template reads, None if jinja2 cannot parse it alone (a tag of an
    extension of transformers')."""
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(jinja2.Environment(
            extensions=["jinja2.ext.loopcontrols"]).parse(template)))
    except jinja2.TemplateError:
        return None


def check_template_kwargs(tokenizer, kwargs: dict) -> None:
    """A 400 naming the key unless each of chat_template_kwargs is a variable the template reads
    and the server does not set, of the type the template expects where that is known (Qwen3's
    enable_thinking: a JSON boolean; "false" would be a true string to the template, and thinking
    would stay on). A key the template never reads would be silently ignored."""
    arguments = inspect.signature(tokenizer.apply_chat_template).parameters
    server_sets = SERVER_VARIABLES | set(tokenizer.special_tokens_map) | {
        key for key, p in arguments.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
    template = tokenizer.chat_template
    known = template_variables(template) if isinstance(template, str) else None
    for key, value in kwargs.items():
        where = f"chat_template_kwargs.{key}"
        if key in server_sets:
            raise OpenAIError(400, f"chat_template_kwargs may set the template's own variables only, not {key!r} "
                              "(the server sets it from the request)", param=where)
        if known is not None and key not in known:
            own = ", ".join(sorted(known - server_sets)) or "none"
            raise OpenAIError(400, f"The chat template has no variable {key!r} (its own: {own})", param=where)
        if key == "enable_thinking" and not isinstance(value, bool):
            raise OpenAIError(400, f"'{where}' must be true or false, got {short(value)}", param=where)


def reply_grammar(req: SamplingFields, block: str, chat: bool) -> str | None:
    """The grammar the reply must follow (serve/constraints.py), or None; a 400 naming the field
    whose schema xgrammar cannot build or would not enforce, or a forced tool_choice that names
    no tool offered. Building a grammar may take long (a long regex: seconds): call it from a
    thread, not the event loop. block: the prompt's reasoning_block ("none" for a completion)."""
    spec, fmt = None, req.response_format
    if fmt is not None and fmt.type != "text":
        schema = fmt.json_schema.schema_ if fmt.json_schema is not None else None
        if fmt.type == "json_schema" and schema is None:
            raise OpenAIError(400, "response_format of type json_schema needs json_schema.schema",
                              param="response_format.json_schema")
        if fmt.type == "json_object" and fmt.json_schema is not None:
            raise OpenAIError(400, "response_format of type json_object takes no json_schema (type json_schema "
                              "does)", param="response_format.json_schema")
        spec = response_grammar(fmt.type, schema, block)
        checked(spec, "response_format.json_schema.schema", schema)
    tools, choice = (req.tools or [], tool_choice(req)) if chat else ([], "auto")
    if chat and isinstance(req.tool_choice, NamedToolChoice) and choice not in {t.function.name for t in tools}:
        raise OpenAIError(400, f"tool_choice names the function {choice!r}, which is not among the tools "
                          "of the request", param="tool_choice")
    if choice == "required" and not tools:
        raise OpenAIError(400, "tool_choice 'required' needs tools", param="tool_choice")
    calls = tool_grammar(tool_specs(tools), choice, block, parallel=chat and req.parallel_tool_calls is not False)
    if calls is not None:
        if spec is not None:
            raise OpenAIError(400, "response_format and a forced or strict tool call would both decide the reply: "
                              "ask for one of them", param="response_format")
        for i, tool in enumerate(tools):  # the tools the grammar holds
            if tool.function.parameters is not None and choice in ("auto", "required", tool.function.name):
                checked(structural_tag(json_format(tool.function.parameters)), f"tools[{i}].function.parameters",
                        tool.function.parameters)
        spec = calls
    return spec


def reasoning_block(tokenizer, prompt_ids: list[int]) -> str:
    """How a chat prompt leaves the reply's reasoning block (serve/constraints.py reasoning_of):
    "inside" (the prompt opened it), "first" (the model opens it) or "none"."""
    return reasoning_of(tokenizer.chat_template, tokenizer.decode(prompt_ids[-8:]))


def tool_choice(req: ChatRequest) -> str:
    """The request's tool_choice as a word: "auto" (its default), "none", "required", or the name of
    the function it names."""
    choice = req.tool_choice or "auto"
    return choice.function.name if isinstance(choice, NamedToolChoice) else choice


def tool_specs(tools) -> list[tuple[str, dict | None, bool]]:
    """(name, parameters, strict) of each tool, as serve/constraints.py takes them."""
    return [(t.function.name, t.function.parameters, bool(t.function.strict)) for t in tools]


def reply_parser(split_reasoning: bool, block: str, req: ChatRequest) -> ReplyParser:
    """What takes a chat reply apart (serve/reply.py): with split_reasoning, its reasoning (starting
    inside it when the prompt's reasoning `block` is "inside": the prompt opened the think block,
    as templates of thinking-only models do), and the calls of the request's tools unless
    tool_choice is none (their arguments streamed as they come where the grammar writes them)."""
    splitter = None
    if split_reasoning:
        splitter = ReasoningSplitter(thinking=block == "inside")
    choice = tool_choice(req)
    if not req.tools or choice == "none":
        return ReplyParser(splitter, None)
    forced = None
    if calls_constrained(tool_specs(req.tools), choice, req.parallel_tool_calls is not False):
        forced = "named" if isinstance(req.tool_choice, NamedToolChoice) else choice
    return ReplyParser(splitter, {t.function.name for t in req.tools}, forced)


def checked(spec: str, where: str, schema) -> None:
    """A 400 naming the field unless xgrammar can build the grammar of spec, and enforce its schema."""
    try:
        check_spec(spec)
    except ValueError as err:
        raise OpenAIError(400, f"'{where}' is not a JSON schema this server can follow: {err}", param=where) from None
    if schema is not None and (problem := unenforced(schema)) is not None:  # None: json_object's any object
        raise OpenAIError(400, f"'{where}' is not a JSON schema this server can follow: {problem}", param=where)


def json_object(arguments: str, where: str) -> dict | str:
    """A history's tool call arguments as the object the chat template writes, or a 400 naming it;
    none at all ("", as some clients send a call without arguments) is the empty object; text that
    is not JSON (a call cut short, as this server returns one) goes to the template as it is
    (Qwen3's writes a string as it is)."""
    if not arguments.strip():
        return {}
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    if not isinstance(value, dict):
        raise OpenAIError(400, f"'{where}.function.arguments' must be a JSON object, got {arguments[:80]!r}",
                          param=f"{where}.function.arguments")
    return value
