"""The OpenAI-compatible server's state over the engine (serve/engine.py): what a request becomes
(an engine request, its choices' outputs) and how it is answered, whole or streamed. The routes
and the error shape are serve/app.py's; cli/serve.py starts both.

The engine runs in a process of its own and owns the model (serve/engine_process.py); a request
hands it a callback, called on the thread that receives the engine's outputs, that appends each
output to the request's Outputs, and the event loop is woken once per burst of outputs for every
request with news (see Outbox), not once per token; a request that is not streamed is woken once,
by its last output.

Faults, as a client sees them:
- A client that leaves cancels its request within one engine step, and its blocks are freed:
  Starlette ends a stream when its client disconnects; a request that is not streamed has a task
  that awaits the ASGI disconnect message (no polling).
- SIGINT or SIGTERM (serve/http_server.py): new connections are refused and new requests on open ones get
  503; open requests have shutdown_timeout_s to finish, then end with an error their clients
  read (a stream's last event, a 503); the engine process is stopped and the server exits 0. A
  second signal exits at once (status 128 + the signal).
- The engine process dies or hangs: open requests end with an error that says how it died, new
  ones and /health get 503, and the server exits with status 1, so that its supervisor restarts
  it. Not the engine alone: loading the model again takes as long as restarting the server, the
  GPU may be in a bad state only a new process clears, and a crash that repeats should show as
  the server's own failure, with the supervisor's backoff and log, not as a server that
  restarts its engine in a loop while /health says ok.
- 429 past the queue bound (--max-waiting), with Retry-After.

Choices made here:
- A chat request to a model whose tokenizer has no chat template (the shipped base model) is
  refused with a 400 that points to /v1/completions and --chat-template; no plain-text fallback
  guesses a format.
- A stream sends a chunk per generated token while the server keeps up; when tokens arrive
  faster than the event loop sends chunks (many concurrent streams), one chunk carries every
  token that arrived since the last, so the loop's work per token falls as load rises. A choice
  sends no chunk while the detokenizer, a possible stop string or a possible tag holds its text back.
- logprobs are the model's own distribution (runtime/logprobs.py: before the sampler's filters,
  as vLLM's default; under a grammar, its masked logits), one entry per generated token, a stop
  token too.
- Sampling parameters not given come from the checkpoint's generation_config.json, as in
  scripts/generate.py (so a greedy request equals `generate.py --temperature 0`); max_tokens
  defaults to 16 for completions (OpenAI's default) and to the rest of the context for chat.
"""

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import Callable
from contextlib import aclosing

from fastapi import Request
from fastapi.responses import JSONResponse

from runtime.reasoning import OPEN
from runtime.sampling import sampling_params
from runtime.text import TokenPieces

from .choices import Choice, arrivals
from .engine import Output
from .engine import Request as EngineRequest
from .engine_process import EngineDead, EngineProcess
from .logprob_json import LogprobsWriter, RawJSON, TokenNames
from .metrics import Metrics
from .prompts import reply_grammar
from .protocol import OpenAIError, SamplingFields
from .reply import ReplyParser
from .request import QueueFull
from .streams import EventStream, Outbox, Outputs, event

RETRY_AFTER_S = 1  # a 429's Retry-After: the queue moves by whole requests, each a second or so


def engine_dead(reason: str) -> OpenAIError:
    """What a request gets once the engine process has died: how it died."""
    return OpenAIError(503, reason[:1].upper() + reason[1:], type_="server_error", code="engine_dead")


class Server:
    """The routes' shared state: the engine, the tokenizer, what the model is called, and the open
    requests (to end them at a shutdown)."""

    def __init__(self, engine: EngineProcess, tokenizer, model_name: str, reasoning: bool = True):
        """reasoning: chat replies' reasoning apart, in reasoning_content, where the chat template has
        think tags (Qwen3's)."""
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.reasoning = reasoning and OPEN in (tokenizer.chat_template or "")
        self.metrics = Metrics(model_name)
        self.token_names = TokenNames(TokenPieces(tokenizer))  # tokens as log-probabilities name them
        self.generation_config = engine.generation_config
        self.max_len = engine.max_len
        self.created = int(time.time())
        self.loop: asyncio.AbstractEventLoop | None = None
        self.outbox: Outbox | None = None
        self.open: dict[int, Outputs] = {}  # by the engine's id
        self.idle = asyncio.Event()  # set while nothing is open
        self.idle.set()
        self.refusal: OpenAIError | None = None  # what every new request gets (shutting down, engine dead)
        self.on_fatal: Callable[[str], None] | None = None  # called on the loop when the engine dies
        self._drain: asyncio.Task | None = None

    # ---- the lifecycle -------------------------------------------------------------------------

    def begin(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the loop, at start-up: the outbox, and the engine's threads."""
        self.loop, self.outbox = loop, Outbox(loop)
        self.engine.start(on_death=lambda reason: loop.call_soon_threadsafe(self.engine_died, reason))

    def engine_died(self, reason: str) -> None:  # the loop
        self.refusal = engine_dead(reason)
        if self.on_fatal is not None:
            self.on_fatal(reason)

    def drain_soon(self, grace_s: float) -> None:
        """From a signal handler: refuse new requests, give the open ones grace_s, then cut them."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._start_drain, grace_s)

    def _start_drain(self, grace_s: float) -> None:  # the loop
        if self.refusal is None:
            self.refusal = OpenAIError(503, "The server is shutting down: it takes no new requests",
                                       type_="server_error", code="server_shutting_down")
        self._drain = asyncio.ensure_future(self.drain(grace_s))

    async def drain(self, grace_s: float) -> None:
        try:
            await asyncio.wait_for(self.idle.wait(), grace_s)
        except asyncio.TimeoutError:
            cut = OpenAIError(503, f"The server shut down before this request finished (open requests get "
                                   f"{grace_s:g} s: --shutdown-timeout)", type_="server_error", code="server_shutdown")
            for seq_id, outputs in list(self.open.items()):
                outputs.cut = cut
                self.engine.cancel(seq_id)

    # ---- a request -----------------------------------------------------------------------------

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise OpenAIError(404, f"The model `{name}` does not exist. This server serves `{self.model_name}`.",
                              param="model", code="model_not_found")

    def engine_request(self, req: SamplingFields, prompt_ids: list[int], max_tokens: int | None,
                       default_max_tokens: int, logprobs: int | None = None, grammar: str | None = None,
                       fields: tuple[str, str] = ("prompt", "max_tokens")) -> EngineRequest:
        """The engine's request, or a 400 naming the field as the client sent it: fields are what
        the request calls its prompt and its token limit ("messages", "max_completion_tokens")."""
        try:
            params = sampling_params(
                self.generation_config, temperature=req.temperature, top_k=req.top_k, top_p=req.top_p,
                min_p=req.min_p, repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
            )
        except ValueError as err:
            raise OpenAIError(400, str(err), param=getattr(err, "param", None)) from None
        if max_tokens is None:
            max_tokens = default_max_tokens
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if "" in stop:  # it would be found before the first token: no answer could ever be given
            raise OpenAIError(400, "stop strings must not be empty", param="stop")
        request = EngineRequest(prompt_ids, max_tokens, params, seed=req.seed, stop=tuple(stop),
                                eos_ids=() if req.ignore_eos else None, logprobs=logprobs, grammar=grammar)
        try:
            self.engine.check(request)
        except ValueError as err:  # ParameterError names the field, as the engine calls it
            param, message = getattr(err, "param", None), str(err)
            if param == "max_tokens":  # the prompt alone too long for the context is the prompt's fault
                param = fields[0] if len(prompt_ids) >= self.max_len else fields[1]
                message = message.replace("max_tokens", fields[1])
            elif param == "prompt":  # a chat's prompt is its messages
                param = fields[0]
            raise OpenAIError(400, message, param=param) from None
        return request

    async def grammar_of(self, req: SamplingFields, block: str, chat: bool) -> str | None:
        """prompts.reply_grammar(), from a worker thread when there is a schema or tools to build a
        grammar of; a request without runs only its checks, on the loop (a thread's round trip per
        request would wait behind every stream's chunks at hundreds of streams)."""
        fmt, tools = req.response_format, chat and req.tools
        if (fmt is not None and fmt.type != "text") or tools:
            return await asyncio.to_thread(reply_grammar, req, block, chat)
        return reply_grammar(req, block, chat)

    def submit(self, request: EngineRequest, outputs: Outputs) -> int:
        """The request handed to the engine, open until close(); 429 past the queue bound, 503 once
        the server stops taking requests."""
        if self.refusal is not None:
            raise self.refusal
        clock = self.metrics.request()

        def on_output(out: Output) -> None:  # the receiving thread
            clock.output(out)
            outputs.put(out)

        try:
            seq_id = self.engine.submit(request, on_output)
        except QueueFull as err:
            raise OpenAIError(429, str(err), type_="rate_limit_error", code="queue_full",
                              headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineDead as err:
            raise engine_dead(str(err)) from None
        self.open[seq_id] = outputs
        self.idle.clear()
        return seq_id

    def close(self, seq_id: int) -> None:
        """The request's response has ended: cancel its sequence unless it finished."""
        outputs = self.open.pop(seq_id, None)
        if outputs is not None and not outputs.done:
            self.engine.cancel(seq_id)
        if not self.open:
            self.idle.set()

    def failure(self, outputs: Outputs, out: Output) -> OpenAIError | None:
        """The error a request's last output stands for, if any: a shutdown's cut, the engine's death
        or failure."""
        if out.finish_reason == "cancelled":
            return outputs.cut
        if out.finish_reason != "error":
            return None
        if self.engine.death is not None:
            return engine_dead(self.engine.death)
        return OpenAIError(500, "The engine failed while generating this request (the server's log says why)",
                           type_="server_error")

    async def run(self, http: Request, requests: list[EngineRequest], fields: SamplingFields,
                  replies: list[ReplyParser] | None = None):
        """The response to a request of a prompt each in `requests` (a completion may have several,
        a chat one) and `fields.n` choices a prompt: choice p * n + i is prompt p's i-th, a sequence
        of its own (with a seed, seed + i, as the prompt alone would have it) that finds the prompt's
        blocks the first one prefilled. replies: a chat request's parser per choice (None: a completion)."""
        chat = replies is not None
        n = fields.n
        if fields.stream_options is not None and not fields.stream:  # as OpenAI refuses it
            raise OpenAIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        room = self.engine.max_batch + self.engine.max_waiting
        if n * len(requests) > room:  # never all taken at once: a 429 would say "later" forever
            asked = f"n is {n}" if len(requests) == 1 else f"{len(requests)} prompts of n = {n} choices each"
            raise OpenAIError(400, f"{asked}, but this server holds {room} requests at once "
                              f"(--max-batch {self.engine.max_batch} + --max-waiting {self.engine.max_waiting})",
                              param="n" if len(requests) == 1 else "prompt")
        choices: list[Choice] = []
        try:
            for p, request in enumerate(requests):
                prompt_ids = request.prompt_ids if fields.return_token_ids else None
                for i in range(n):
                    seed = None if request.seed is None else (request.seed + i) % 2**63
                    outputs = Outputs(self.outbox, each=fields.stream)
                    seq_id = self.submit(dataclasses.replace(request, seed=seed), outputs)
                    writer = LogprobsWriter(self.token_names, chat) if request.logprobs is not None else None
                    choices.append(Choice(p * n + i, outputs, seq_id, replies[p * n + i] if chat else None, prompt_ids,
                                          writer))
        except OpenAIError:  # past the queue bound midway: the choices taken are let go
            self.close_all(choices)
            raise
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        if fields.stream:
            include_usage = bool(fields.stream_options and fields.stream_options.include_usage)
            return EventStream(self.sse(choices, rid, include_usage, chat, n), on_close=lambda: self.close_all(choices))
        watcher = asyncio.ensure_future(self.cancel_on_disconnect(http, choices))
        try:  # each choice's last output, with every one before it: a single wake-up each
            outs = await asyncio.gather(*(c.outputs.take() for c in choices))
        finally:
            watcher.cancel()
            self.close_all(choices)
        for choice, out in zip(choices, outs):
            if (error := self.failure(choice.outputs, out)) is not None:
                raise error
        if any(out.finish_reason == "cancelled" for out in outs):  # its client has left: nobody reads this
            return JSONResponse({}, status_code=499)
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                             "created": int(time.time()), "model": self.model_name,
                             "choices": [c.whole(out) for c, out in zip(choices, outs)],
                             "usage": self.usage(outs, n)})

    def close_all(self, choices: list[Choice]) -> None:
        for choice in choices:
            self.close(choice.seq_id)

    async def cancel_on_disconnect(self, http: Request, choices: list[Choice]) -> None:
        """Once the client has gone (the ASGI http.disconnect message, which the server sends when the
        connection closes), cancel its sequences: the engine frees their blocks at its next step."""
        while (await http.receive())["type"] != "http.disconnect":
            pass
        for choice in choices:
            self.engine.cancel(choice.seq_id)

    @staticmethod
    def usage(outs: list[Output], n: int) -> dict:
        """Each prompt once (outs: every choice's, in order, n a prompt), the tokens of every choice."""
        prompt, completion = sum(out.prompt_tokens for out in outs[::n]), sum(out.completion_tokens for out in outs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    async def sse(self, choices: list[Choice], rid: str, include_usage: bool, chat: bool, n: int):
        """Server-sent events in OpenAI's chunk format, each chunk one choice's news (its index; none
        while a choice has nothing to tell, its text held back: Choice.delta), ending
        with `data: [DONE]`; a request the server ends (a shutdown, the engine's death) ends with an
        event {"error": {...}}, which the openai client raises as an APIError. If the client goes
        away, Starlette cancels this generator at its await, and EventStream's on_close cancels the
        sequences. A chat reply's reasoning goes to delta.reasoning_content, its tool calls to
        delta.tool_calls (serve/reply.py: a call whole in one delta, or, where the grammar writes the
        calls, its arguments in pieces as they come). With include_usage, every chunk carries
        "usage": null and one more chunk, without choices, the usage, as OpenAI's stream does."""
        # Every chunk's fields but its choice, written once: the event loop writes a chunk per
        # stream per engine step (tens of thousands a second at hundreds of streams).
        fields = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                  "created": int(time.time()), "model": self.model_name}
        head = "data: " + json.dumps(fields | ({"usage": None} if include_usage else {}))[:-1] + ', "choices": ['

        def chunk(choice: dict) -> str:
            logprobs = choice["logprobs"]
            if type(logprobs) is not RawJSON:
                return f"{head}{json.dumps(choice)}]}}\n\n"
            del choice["logprobs"]  # JSON text already (serve/logprob_json.py): spliced in, last
            return f'{head}{json.dumps(choice)[:-1]}, "logprobs": {logprobs}}}]}}\n\n'

        if chat:
            for c in choices:
                yield chunk(c.role())
        last: dict[int, Output] = {}  # each choice's last output, by its index
        async with aclosing(arrivals(choices)) as news:
            async for c, out in news:
                if (error := self.failure(c.outputs, out)) is not None:
                    if out.text and (piece := c.delta(out, final=True)) is not None:
                        yield chunk(piece)
                    yield event(error.body())
                    yield "data: [DONE]\n\n"
                    return
                if out.finish_reason == "cancelled":  # its client has left
                    return
                if (piece := c.delta(out)) is not None:
                    yield chunk(piece)
                if out.finish_reason is not None:
                    last[c.index] = out
        if include_usage:
            usage = self.usage([last[i] for i in sorted(last)], n)
            yield f"data: {json.dumps(fields | {'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"
