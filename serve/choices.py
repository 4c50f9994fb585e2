"""One choice of a response (a request asks for `n`): its sequence in the engine, its outputs, and
how they are written in OpenAI's shapes, whole (`message` / `text`) or as a stream's deltas; and
`arrivals`, a response's choices' outputs as they come."""

import asyncio
import json
from dataclasses import dataclass

from .logprob_json import LogprobsWriter, RawJSON
from .reply import ReplyParser
from .request import Output
from .streams import Outputs


def finish_reason(reason: str | None, reply: ReplyParser | None) -> str | None:
    """A chat reply that stopped by itself finishing with calls (ReplyParser.finishes_with_calls)
    finishes with "tool_calls", as OpenAI's do."""
    return "tool_calls" if reason == "stop" and reply is not None and reply.finishes_with_calls() else reason


@dataclass
class Choice:
    index: int
    outputs: Outputs
    seq_id: int
    reply: ReplyParser | None  # a chat reply's parser; None: a completion
    prompt_ids: list[int] | None  # return_token_ids: the prompt's ids, in the first chunk or the choice
    logprobs: LogprobsWriter | None = None  # the request asked for log-probabilities
    first: bool = True  # no chunk sent yet

    def write_logprobs(self, out: Output) -> RawJSON | dict | None:
        """Chat's as JSON text (serve/logprob_json.py), spliced into a stream's chunk as it is (Server.sse)."""
        return self.logprobs(out.token_ids, out.logprobs) if self.logprobs is not None else None

    def whole(self, out: Output) -> dict:
        """The choice of a response that is not streamed, from its last output (every one merged)."""
        if self.reply is not None:
            delta = self.reply.feed(out.text, final=True)
            # OpenAI's: null beside calls (or where calls were forced), and (vLLM's) after a
            # reasoning block when there is no answer
            reasoned = self.reply.splitter is not None and self.reply.splitter.reasoned
            content = (delta.content or None) if delta.calls or self.reply.forced or reasoned else delta.content
            message = {"role": "assistant", "content": content}
            if self.reply.splitter is not None:  # under both names clients read: DeepSeek's, vLLM's
                message["reasoning_content"] = message["reasoning"] = delta.reasoning or None
            if delta.calls:
                message["tool_calls"] = [call.as_dict() for call in delta.calls]
            choice = {"index": self.index, "message": message, "logprobs": self.write_logprobs(out),
                      "finish_reason": finish_reason(out.finish_reason, self.reply)}
        else:
            choice = {"index": self.index, "text": out.text, "logprobs": self.write_logprobs(out),
                      "finish_reason": out.finish_reason}
        if type(choice["logprobs"]) is RawJSON:  # once per response: as a dict, for the response's JSON
            choice["logprobs"] = json.loads(choice["logprobs"])
        if self.prompt_ids is not None:
            choice |= {"token_ids": out.token_ids, "prompt_token_ids": self.prompt_ids}
        return choice

    def role(self) -> dict:
        """A chat stream's first chunk of this choice: the assistant's role."""
        return self.ids({"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}, ())

    def delta(self, out: Output, final: bool | None = None) -> dict | None:
        """A stream chunk's choice for what arrived since the last one, or None when it would carry
        nothing (text held back, as a tag that may be starting, with no log-probabilities or token
        ids asked for). final: the reply ends here (default: when out has a finish reason);
        held-back text is let go."""
        final = out.finish_reason is not None if final is None else final
        logprobs = self.write_logprobs(out)
        news = final or logprobs is not None or self.prompt_ids is not None  # beside the text: always sent
        if self.reply is None:
            if not (out.text or news):
                return None
            return self.ids({"index": self.index, "text": out.text, "logprobs": logprobs,
                             "finish_reason": out.finish_reason}, out.token_ids)
        parsed = self.reply.feed(out.text, final)
        delta = {"content": parsed.content} if parsed.content else {}
        if parsed.reasoning:
            delta["reasoning_content"] = delta["reasoning"] = parsed.reasoning
        if parsed.calls:
            delta["tool_calls"] = [call.as_dict(index=True) for call in parsed.calls]
        if not (delta or news):
            return None
        return self.ids({"index": self.index, "delta": delta, "logprobs": logprobs,
                         "finish_reason": finish_reason(out.finish_reason, self.reply)}, out.token_ids)

    def ids(self, choice: dict, tokens) -> dict:
        if self.prompt_ids is not None:
            choice["token_ids"] = list(tokens)
            if self.first:
                choice["prompt_token_ids"] = self.prompt_ids
        self.first = False
        return choice


async def arrivals(choices: list[Choice]):
    """(choice, what arrived since its last output, merged) as the choices' outputs arrive, until
    each has had its last. One choice (most requests) awaits its own outputs; several wait for the
    first of a task each."""
    if len(choices) == 1:
        c = choices[0]
        while True:
            out = await c.outputs.take()
            yield c, out
            if out.finish_reason is not None:
                return
    waiting = {asyncio.ensure_future(c.outputs.take()): c for c in choices}
    try:
        while waiting:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda t: waiting[t].index):
                c, out = waiting.pop(task), task.result()
                yield c, out
                if out.finish_reason is None:
                    waiting[asyncio.ensure_future(c.outputs.take())] = c
    finally:
        for task in waiting:
            task.cancel()
