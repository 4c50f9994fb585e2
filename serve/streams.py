"""How a request's outputs travel from the engine's receiving thread to its HTTP response: each
request's `Outputs` (merged when they arrive faster than the loop takes them), the `Outbox` that
wakes the event loop once per burst, and `EventStream`, the server-sent events response that
closes its request when the client goes away."""

import asyncio
import json
import threading
from collections import deque
from collections.abc import Callable

from fastapi.responses import StreamingResponse

from .protocol import OpenAIError
from .request import Output


class Outputs:
    """One request's outputs, appended on the thread that receives the engine's outputs, taken on
    the event loop. each=False (a request that is not streamed): the loop is woken by the last
    output only, not by every step's."""

    def __init__(self, outbox: "Outbox", each: bool = True):
        self.outbox, self.each = outbox, each
        self.items: deque[Output] = deque()
        self.ready = asyncio.Event()
        self.done = False  # the last output has been taken
        self.cut: OpenAIError | None = None  # why the server ended it (a shutdown): what its client gets

    def put(self, out: Output) -> None:  # the receiving thread
        self.items.append(out)
        if self.each or out.finish_reason is not None:
            self.outbox.notify(self)

    async def take(self) -> Output:
        """Every output that arrived since the last take, merged into one: waits for one, or with
        each=False for the last (those before it may have arrived before the first take)."""
        while not self.items or not (self.each or self.items[-1].finish_reason is not None):
            await self.ready.wait()
            self.ready.clear()
        first = self.items.popleft()
        if not self.items:  # one output, as when the loop keeps up: taken as it came
            self.done = first.finish_reason is not None
            return first
        text, tokens, last = [first.text], list(first.token_ids), first
        logprobs = list(first.logprobs) if first.logprobs is not None else None
        while self.items:
            last = self.items.popleft()
            text.append(last.text)
            tokens += last.token_ids
            if logprobs is not None:
                logprobs += last.logprobs or []
        self.done = last.finish_reason is not None
        return Output("".join(text), tokens, last.finish_reason, last.prompt_tokens, last.completion_tokens, logprobs)


class Outbox:
    """Wakes the event loop for requests with new outputs: one call_soon_threadsafe (a write to
    the loop's wake-up pipe) per burst of outputs, whichever requests they belong to, instead of
    one per token. A burst is what the receiving thread hands out before the loop runs `deliver`."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.dirty: list[Outputs] = []
        self.scheduled = False
        self.lock = threading.Lock()  # the list and the flag change on two threads

    def notify(self, outputs: Outputs) -> None:  # the receiving thread
        with self.lock:
            self.dirty.append(outputs)
            schedule, self.scheduled = not self.scheduled, True
        if schedule:
            self.loop.call_soon_threadsafe(self.deliver)

    def deliver(self) -> None:  # the loop
        with self.lock:
            dirty, self.dirty, self.scheduled = self.dirty, [], False
        for outputs in dirty:
            outputs.ready.set()


class EventStream(StreamingResponse):
    """Server-sent events whose on_close runs however the response ends: also when the client leaves
    before the first event, when the events' generator has not started and its own finally would
    never run."""

    def __init__(self, events, on_close: Callable[[], None]):
        super().__init__(events, media_type="text/event-stream")
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def event(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"
