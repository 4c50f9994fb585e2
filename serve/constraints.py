"""What a request's output must follow, as the grammar the engine constrains it with
(runtime/grammar.py): `response_format`'s JSON, and tool calls forced by `tool_choice` ("required",
a named function) or by `strict` tools, in Qwen3's formats, after the reasoning block where the
model reasons first.

    reasoning = reasoning_of(template, prompt_tail)              # "none", "first" or "inside"
    spec = response_grammar(kind, schema, reasoning)             # None: free text
    spec = tool_grammar(tools, tool_choice, reasoning)

The reasoning block, from the prompt as the chat template ended it: "inside" when the prompt
opened it (the thinking-only 2507 models): any text, `</think>`, then the answer; "first" when
the template switches thinking (`enable_thinking`: Qwen3's hybrid models) and did not close an
empty block in the prompt: the model opens it itself, `<think>` any text `</think>`, then the
answer; none otherwise (thinking off, a template without think tags, or one that mentions them
only for the history, as non-thinking models' may). A tool
call is Qwen3's (hermes) format, as its chat template asks for it and serve/reply.py parses it:
`<tool_call>\n{"name": "NAME", "arguments": ARGUMENTS}\n</tool_call>`, the arguments following the
tool's parameters schema.
"""

from runtime.grammar import structural_tag
from runtime.reasoning import CLOSE, OPEN

from .reply import CALL_END, TOOL_OPEN, call_begin
from .schemas import opened

# Whitespace between two JSON tokens: one character at most (a space or a newline, never a run):
# models, small ones most, that favour blank space otherwise write it until max_tokens (vLLM has
# disable_any_whitespace for the same reason). The JSON stays valid, written without indentation.
MAX_WHITESPACE = 1
THINK_TAGS = [OPEN, CLOSE]  # never inside the reasoning's text or the answer's
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def reasoning_of(template: str | None, prompt_tail: str) -> str:
    """How the reply's reasoning block stands, from the template and the prompt's last text."""
    tail = prompt_tail.rstrip()
    if tail.endswith(OPEN):
        return "inside"
    hybrid = template is not None and OPEN in template and "enable_thinking" in template
    return "first" if hybrid and not tail.endswith(CLOSE) else "none"


def after_reasoning(answer: dict, reasoning: str) -> str:
    """The structural tag of a reply: the reasoning block as `reasoning` says, then answer."""
    if reasoning == "none":
        return structural_tag(answer)
    block = {"type": "tag", "begin": OPEN if reasoning == "first" else "",
             "content": {"type": "any_text", "excludes": THINK_TAGS}, "end": CLOSE}
    return structural_tag({"type": "sequence", "elements": [block, {"type": "const_string", "value": "\n\n"},
                                                             answer]})


def json_format(schema: dict | bool) -> dict:
    return {"type": "json_schema", "json_schema": opened(schema), "max_whitespace_cnt": MAX_WHITESPACE}


def response_grammar(kind: str, schema: dict | None, reasoning: str) -> str | None:
    """response_format's: "json_object" (any JSON object) or "json_schema" (that schema); "text": None."""
    if kind == "text":
        return None
    return after_reasoning(json_format(schema if kind == "json_schema" else {"type": "object"}), reasoning)


def tool_call(name: str, parameters: dict | None) -> dict:
    """One call of the named tool, its arguments following its parameters; `{}` for a tool without
    (OpenAI: "omitting parameters defines a function with an empty parameter list")."""
    return {"type": "tag", "begin": call_begin(name),
            "content": json_format(parameters if parameters is not None else NO_PARAMETERS), "end": CALL_END}


def calls_constrained(tools: list[tuple[str, dict | None, bool]], choice: str, parallel: bool) -> bool:
    """Whether the grammar writes the reply's tool calls (tool_grammar's rule): so that a call that
    begins is one, and its arguments follow its tool's schema."""
    unconstrained = choice == "auto" and parallel and not any(strict for _, _, strict in tools)
    return bool(tools) and choice != "none" and not unconstrained


def tool_grammar(tools: list[tuple[str, dict | None, bool]], choice: str, reasoning: str,
                 parallel: bool = True) -> str | None:
    """tools: (name, parameters, strict) of each tool offered. choice: "required" (calls only, one or
    more, of any of them, a newline apart, as Qwen3 writes several), a tool's name (one call of it),
    "auto" (text and calls: constrained only when a tool is strict or calls are not parallel, and
    then every call follows its tool's schema) or "none" (None). parallel False: one call at most
    (OpenAI's parallel_tool_calls), the reply ending with it."""
    if not calls_constrained(tools, choice, parallel):
        return None
    names = {name: parameters for name, parameters, _ in tools}
    calls = [tool_call(name, parameters) for name, parameters in names.items()]
    if choice == "auto":
        return after_reasoning({"type": "triggered_tags", "triggers": [TOOL_OPEN], "excludes": THINK_TAGS,
                                "tags": calls, "stop_after_first": not parallel}, reasoning)
    if choice == "required":
        return after_reasoning({"type": "tags_with_separator", "tags": calls, "separator": "\n",
                                "at_least_one": True, "stop_after_first": not parallel}, reasoning)
    return after_reasoning(tool_call(choice, names[choice]), reasoning)
