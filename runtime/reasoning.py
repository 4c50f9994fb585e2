"""Qwen3's reasoning apart from its answer, as a reply streams in: the text between <think> and
</think> at the start of a reply (or after a prompt whose template opened the think block) is
reasoning, the rest is answer. Used by qwen3-chat (dimmed reasoning, a history of answers) and by
the server (`reasoning_content` beside `content`)."""

from enum import Enum

OPEN, CLOSE = "<think>", "</think>"  # ordinary text in Qwen3's tokenizer, not special tokens


class Part(Enum):
    """A part of a reply; its value is its label where the reasoning cannot be dimmed."""

    REASONING = "thinking"
    ANSWER = "answer"


class ReasoningSplitter:
    """Splits a reply streamed in pieces (cut anywhere, inside a tag too) into reasoning and answer.
    A reply that starts (after blank space) with <think> reasons until </think>; one that does not
    is all answer. `thinking=True`: the prompt itself opened the think block. The newlines that follow
    a tag, and those before </think>, are dropped, as Qwen3's template drops them from the reasoning
    and the answer it stores."""

    def __init__(self, thinking: bool = False, plain: bool = False):
        """plain: no chat template, so no reasoning: every piece is answer."""
        self.part: Part | None = Part.REASONING if thinking else Part.ANSWER if plain else None  # None: not yet known
        self.held = ""  # text that may still turn out to be (part of) a tag
        self.after_tag = thinking  # the next text follows a tag: its leading newlines go
        self.reasoned = thinking  # the reply has a reasoning block
        self.answer = ""  # the answer so far: what the history keeps

    def feed(self, piece: str) -> list[tuple[Part, str]]:
        """The parts of the text now certain, in order."""
        self.held += piece
        out: list[tuple[Part, str]] = []
        if self.part is None:
            start = self.held.lstrip()
            if start.startswith(OPEN):
                self.part, self.held, self.after_tag = Part.REASONING, start[len(OPEN):], True
                self.reasoned = True
            elif OPEN.startswith(start):
                return out  # blank space or a part of <think>: wait for more
            else:
                self.part = Part.ANSWER
        if self.part is Part.REASONING:
            before, closed, after = self.held.partition(CLOSE)
            if closed:
                self.emit(out, Part.REASONING, before.rstrip("\n"))
                self.part, self.held, self.after_tag = Part.ANSWER, after, True
            else:  # held: what may begin </think>, and the newlines before it
                cut = len(self.held[: len(self.held) - held_tail(self.held, CLOSE)].rstrip("\n"))
                self.emit(out, Part.REASONING, self.held[:cut])
                self.held = self.held[cut:]
        if self.part is Part.ANSWER:
            self.emit(out, Part.ANSWER, self.held)
            self.held = ""
        return out

    def finish(self) -> list[tuple[Part, str]]:
        """What was held back at the end of the reply: a tag begun but never finished is text."""
        out: list[tuple[Part, str]] = []
        self.emit(out, self.part or Part.ANSWER, self.held)
        self.held = ""
        return out

    def emit(self, out: list[tuple[Part, str]], part: Part, text: str) -> None:
        if self.after_tag:
            text = text.lstrip("\n")
            self.after_tag = not text
        if text:
            out.append((part, text))
            self.answer += text if part is Part.ANSWER else ""


def held_tail(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`: text that a next piece may complete."""
    return next((n for n in range(min(len(text), len(tag) - 1), 0, -1) if tag.startswith(text[-n:])), 0)
