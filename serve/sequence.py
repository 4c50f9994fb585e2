"""A request as the engine runs it: its tokens, its place in the KV cache and the batch, and its
text as it is handed out (stop tokens, max_tokens and stop strings applied as tokens arrive)."""

from collections.abc import Callable
from dataclasses import dataclass, field

from runtime.grammar import Matcher
from runtime.text import TextStream

from .request import Output, Request


@dataclass(eq=False)  # compared by identity: `seq in self.running` must not compare tensors
class Sequence:
    id: int
    request: Request
    ids: list[int]  # prompt, then generated tokens
    on_output: Callable[[Output], None] | None
    eos: set[int]
    seed: int  # the request's, else one of its own: its tokens come from this stream alone
    stream: TextStream | None
    blocks: list[int] = field(default_factory=list)
    row: int = -1  # while running: its row of the scheduler's block table (Scheduler.block_rows)
    cached: int = 0  # positions [0, cached) are in the cache
    text: str = ""  # generated text decoded so far
    sent: int = 0  # characters of text already handed out
    finish_reason: str | None = None
    unread: int = 0  # launched prefills and decode steps whose token for it is not read yet
    keys: list[bytes] = field(default_factory=list)  # the keys of its first full blocks, as far as computed
    registered: int = 0  # of its blocks, the first this many are registered (prefix caching)
    matcher: Matcher | None = None  # its grammar's state (constrained decoding)

    def __post_init__(self) -> None:
        self.n_prompt = len(self.request.prompt_ids)

    @property
    def n_generated(self) -> int:
        return len(self.ids) - self.n_prompt

    @property
    def prefilling(self) -> bool:
        """Admitted, and some of its tokens (a prompt's, a preempted sequence's) not in the cache yet."""
        return self.cached < len(self.ids)

    @property
    def n_launched(self) -> int:
        """Tokens generated or being generated: the one whose step is in flight counts."""
        return self.cached + 1 - self.n_prompt

    def read(self, token: int) -> str | None:
        """Decode the token just appended to ids and apply the stops (a stop token, max_tokens, a
        stop string: the text is cut before it): the finish reason it brings, or None."""
        reason = None
        if token in self.eos:
            reason = "stop"
        else:
            if self.stream is not None:
                self.text += self.stream.push(token)
            if self.n_generated >= self.request.max_tokens:
                reason = "length"
        if reason is not None and self.stream is not None:
            self.text += self.stream.flush()  # a character the stream held back, now complete or not
        if self.request.stop:
            stop_at = self._find_stop()
            if stop_at is not None:
                self.text, reason = self.text[:stop_at], "stop"
        return reason

    def unsent(self) -> str:
        """The text not handed out yet, but for an end that may begin a stop string; now handed out."""
        end = len(self.text) - (self._held_back() if self.request.stop else 0)
        new, self.sent = self.text[self.sent : end], end
        return new

    def _find_stop(self) -> int | None:
        found = [i for i in (self.text.find(s, max(0, self.sent - len(s))) for s in self.request.stop if s) if i >= 0]
        return min(found) if found else None

    def _held_back(self) -> int:
        """Characters at the end of the text that may begin a stop string: not handed out yet."""
        held = 0
        for stop in self.request.stop:
            for n in range(min(len(stop) - 1, len(self.text) - self.sent), held, -1):
                if self.text.endswith(stop[:n]):
                    held = n
                    break
        return held
