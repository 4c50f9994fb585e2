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
"""

import json
import uuid
from dataclasses import dataclass, field

from runtime.reasoning import Part, ReasoningSplitter, held_tail

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class ToolCall:
    index: int  # its place among the reply's calls
    name: str
    arguments: str  # a JSON object, as OpenAI's API carries it: a string
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def as_dict(self, index: bool = False) -> dict:
        """The call as a message's tool_calls entry (index: as a stream's delta)."""
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return {"index": self.index, **call} if index else call


@dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class ReplyParser:
    def __init__(self, splitter: ReasoningSplitter | None, tools: set[str] | None):
        """splitter: None when the reply has no reasoning to take apart; tools: the names of the
        tools whose calls are parsed (None: none are)."""
        self.splitter, self.tools = splitter, tools
        self.held = ""  # answer text that may be part of a tool call
        self.space = ""  # whitespace at the end of the content so far: content only if text follows
        self.n_calls = 0
        self.after_call = False  # the last thing seen was a call: whitespace after it is not content
        self.said = False  # some content has been given

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
            start = self.held.find(TOOL_OPEN)
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
            self.text(delta, self.held)
            self.held = ""
            if not self.n_calls:
                delta.content += self.space
        return delta

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
        return ToolCall(self.n_calls - 1, value["name"], json.dumps(arguments, ensure_ascii=False))
