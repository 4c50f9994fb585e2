"""A chat reply, as it streams in, taken apart into what OpenAI's API returns: reasoning
(reasoning_content), the answer (content) and tool calls (tool_calls), in Qwen3's formats.

    parser = ReplyParser(splitter, tools={"get_weather"})
    delta = parser.feed(text)            # each new piece of the reply
    delta = parser.feed(text, final=True)  # the last one

Reasoning is the text between <think> and </think> (runtime/reasoning.py). Tool calls are Qwen3's
(hermes) format in the answer, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`: one whose
body is not a JSON object with a known tool's name and an object of arguments stays in the content,
as text. A call inside the reasoning is reasoning. Text that may still turn out to be (part of) a
tag is held back until it is known, so a stream's deltas add up to what the whole reply gives, and
whitespace around tool calls (Qwen3 writes newlines there) is not content.

A call is known to be one only once it closes, so a stream carries it whole, in one delta; but
where the grammar writes the calls (`forced`: serve/constraints.py), a call that begins is one,
and its arguments stream as they come, as OpenAI's do: a first piece with its id, name and empty
arguments, then pieces of its arguments. A forced call cut short (max_tokens, a stop string) is
a call with the arguments written so far, as OpenAI returns it (none, if cut before its name).
"""

import json
import uuid
from dataclasses import dataclass, field

from runtime.reasoning import Part, ReasoningSplitter, held_tail

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
CALL_END = "}\n" + TOOL_CLOSE  # what follows a call's arguments, as Qwen3 writes it


def call_begin(name: str) -> str:
    """What comes before a call's arguments, as Qwen3 writes it (and the grammar of a forced call)."""
    return TOOL_OPEN + '\n{"name": ' + json.dumps(name) + ', "arguments": '


@dataclass
class ToolCall:
    """A call, or in a stream a piece of one: its first piece names it, later ones (name None) carry
    more of its arguments."""

    index: int  # its place among the reply's calls
    name: str | None
    arguments: str  # a JSON object, as OpenAI's API carries it: a string
    id: str | None = None

    def as_dict(self, index: bool = False) -> dict:
        """The call as a message's tool_calls entry (index: as a stream's delta)."""
        if self.name is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return {"index": self.index, **call} if index else call


def new_call(index: int, name: str, arguments: str) -> ToolCall:
    return ToolCall(index, name, arguments, "call_" + uuid.uuid4().hex[:24])


@dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class ReplyParser:
    def __init__(self, splitter: ReasoningSplitter | None, tools: set[str] | None, forced: str | None = None):
        """splitter: None when the reply has no reasoning to take apart; tools: the names of the
        tools whose calls are parsed (None: none are); forced: the tool_choice whose grammar writes
        the calls ("auto": strict tools, or one call at most; "required"; "named": the function
        tool_choice names), None where calls are parsed whole."""
        self.splitter, self.tools, self.forced = splitter, tools, forced
        self.begins = {call_begin(name): name for name in tools or ()} if forced else {}
        self.open_call: int | None = None  # the index of the forced call whose arguments are arriving
        self.arguments = ""  # that call's arguments so far
        self.cut = False  # the reply ended inside a call's arguments
        self.held = ""  # answer text that may be part of a tool call
        self.space = ""  # whitespace at the end of the content so far: content only if text follows
        self.n_calls = 0
        self.after_call = False  # the last thing seen was a call: whitespace after it is not content
        self.said = False  # some content has been given

    def finishes_with_calls(self) -> bool:
        """Whether the reply, stopped by itself, finishes with "tool_calls", as OpenAI's do: it made
        whole calls, not of a function tool_choice named (OpenAI's finish such a reply with "stop")."""
        return self.n_calls > 0 and not self.cut and self.forced != "named"

    def feed(self, text: str, final: bool = False) -> Delta:
        parts = [(Part.ANSWER, text)] if self.splitter is None else self.splitter.feed(text)
        if final and self.splitter is not None:
            parts += self.splitter.finish()
        delta = Delta(reasoning="".join(t for part, t in parts if part is Part.REASONING))
        answer = "".join(t for part, t in parts if part is Part.ANSWER)
        if self.tools is None:
            delta.content = answer
            return delta
        self.held += answer
        while True:
            if self.open_call is not None:
                if not self.more_arguments(delta):
                    break
                continue
            start = self.held.find(TOOL_OPEN)
            if start >= 0 and self.begins:
                begun = self.begun_call(self.held[start:])
                if begun == "":  # may still be a call's beginning
                    self.text(delta, self.held[:start])
                    self.held = self.held[start:]
                    break
                if begun is not None:
                    self.text(delta, self.held[:start])
                    self.held = self.held[start + len(call_begin(begun)) :]
                    self.open(delta, begun)
                    continue
            end = self.held.find(TOOL_CLOSE, start) if start >= 0 else -1
            if end < 0:  # no whole call: the text before what may begin one is content
                keep = len(self.held) - (start if start >= 0 else len(self.held) - held_tail(self.held, TOOL_OPEN))
                self.text(delta, self.held[: len(self.held) - keep])
                self.held = self.held[len(self.held) - keep :]
                break
            self.text(delta, self.held[:start])
            call = self.call(self.held[start + len(TOOL_OPEN) : end])
            if call is None:  # not a call of a known tool: text
                self.text(delta, self.held[start : end + len(TOOL_CLOSE)])
            else:
                self.space, self.after_call = "", True  # the whitespace around a call is the call's
                delta.calls.append(call)
            self.held = self.held[end + len(TOOL_CLOSE) :]
        if final:
            self.end(delta)
        return delta

    def end(self, delta: Delta) -> None:
        """The reply has ended: what was held back is let go, as what it turned out to be."""
        if self.open_call is not None:  # cut inside a forced call: it keeps what it has
            if self.held == "}" and complete_json(self.arguments + "}"):  # the arguments' own last brace
                self.add_arguments(delta, self.held)
            elif not (CALL_END.startswith(self.held) and complete_json(self.arguments)):  # else its end was cut
                self.add_arguments(delta, self.held)
                self.cut = True
            self.held, self.open_call = "", None
        if self.cut_call_begun():
            self.held = ""  # a forced call cut before its name: the format's text, not the answer's
        self.text(delta, self.held)
        self.held = ""
        if not self.n_calls:
            delta.content += self.space

    def text(self, delta: Delta, text: str) -> None:
        """Content, but for whitespace that ends it (held until text follows) or begins it after a
        call; text on both sides of a call is kept apart by one newline, where the call stood."""
        if self.after_call:
            text = text.lstrip()
            if not text:
                return
            self.after_call = False
            self.space = "\n" if self.said else ""
        body = text.rstrip()
        if body:
            delta.content += self.space + body
            self.space = text[len(body) :]
            self.said = True
        else:
            self.space += text

    def call(self, body: str) -> ToolCall | None:
        try:
            value = json.loads(body)
        except ValueError:
            return None
        if not isinstance(value, dict) or value.get("name") not in self.tools:
            return None
        arguments = value.get("arguments", {})
        if not isinstance(arguments, dict):
            return None
        self.n_calls += 1
        return new_call(self.n_calls - 1, value["name"], json.dumps(arguments, ensure_ascii=False))

    def cut_call_begun(self) -> bool:
        """Whether the text held at the reply's end is a forced call's beginning: a written
        <tool_call> (the grammar holds to the call from there), or, where the reply is calls only,
        any part of one."""
        if not any(begin.startswith(self.held) for begin in self.begins):
            return False
        return self.held.startswith(TOOL_OPEN) or self.forced in ("required", "named")

    def begun_call(self, text: str) -> str | None:
        """The tool whose forced call `text` (from <tool_call> on) begins; "" while text may still
        become one's beginning; None when it cannot."""
        for begin, name in self.begins.items():
            if text.startswith(begin):
                return name
        return "" if any(begin.startswith(text) for begin in self.begins) else None

    def open(self, delta: Delta, name: str) -> None:
        self.space, self.after_call = "", True
        self.n_calls += 1
        self.open_call, self.arguments = self.n_calls - 1, ""
        delta.calls.append(new_call(self.open_call, name, ""))

    def more_arguments(self, delta: Delta) -> bool:
        """The open call's arguments that have arrived; whether the call has ended."""
        end = self.held.find(CALL_END)
        if end < 0:
            keep = held_tail(self.held, CALL_END)
            self.add_arguments(delta, self.held[: len(self.held) - keep])
            self.held = self.held[len(self.held) - keep :]
            return False
        self.add_arguments(delta, self.held[:end])
        self.held, self.open_call = self.held[end + len(CALL_END) :], None
        return True

    def add_arguments(self, delta: Delta, text: str) -> None:
        """More of the open call's arguments: onto its piece of this delta, or a piece of their own."""
        if not text:
            return
        self.arguments += text
        if delta.calls and delta.calls[-1].index == self.open_call:
            delta.calls[-1].arguments += text
        else:
            delta.calls.append(ToolCall(self.open_call, None, text))


def complete_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
