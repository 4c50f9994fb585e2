"""An OpenAI-compatible HTTP server over the engine (serve/engine.py); scripts/serve.py starts it.

    POST /v1/completions        prompt (text or token ids) -> text
    POST /v1/chat/completions   messages, through the tokenizer's chat template -> an assistant turn
    GET  /v1/models             the one model served
    GET  /health                status, and the KV cache's free blocks (back to full when idle);
                                503 while shutting down or once the engine has died

FastAPI on uvicorn: the ASGI stack vLLM and SGLang serve with, well kept and small. Streaming is
server-sent events; the JSON bodies are parsed by hand and checked by pydantic (serve/protocol.py),
so every bad request gets OpenAI's error shape ({"error": {"message", "type", "param", "code"}}),
never FastAPI's own 422; so do an unknown path (404) and a wrong method (405), which Starlette
would answer with {"detail": ...}.

The engine runs in a process of its own and owns the model (serve/engine_process.py); a request
hands it a callback, called on the thread that receives the engine's outputs, that appends each
output to the request's Outputs, and the event loop is woken once per burst of outputs for every
request with news (see Outbox), not once per token; a request that is not streamed is woken once,
by its last output.

Faults, as a client sees them:
- A client that leaves cancels its request within one engine step, and its blocks are freed:
  Starlette ends a stream when its client disconnects; a request that is not streamed has a task
  that awaits the ASGI disconnect message (no polling).
- SIGINT or SIGTERM (HTTPServer): new connections are refused and new requests on open ones get
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
  refused with a 400 that points to /v1/completions; no plain-text fallback guesses a format.
- A stream sends a chunk per generated token while the server keeps up; when tokens arrive
  faster than the event loop sends chunks (many concurrent streams), one chunk carries every
  token that arrived since the last, so the loop's work per token falls as load rises. A chunk's
  text may be empty while the detokenizer or a possible stop string holds text back.
- logprobs are the model's own distribution (runtime/logprobs.py: before the sampler's filters,
  as vLLM's default; under a grammar, its masked logits), one entry per generated token, a stop
  token too.
- Sampling parameters not given come from the checkpoint's generation_config.json, as in
  scripts/generate.py (so a greedy request equals `generate.py --temperature 0`); max_tokens
  defaults to 16 for completions (OpenAI's default) and to the rest of the context for chat.
"""

import asyncio
import contextlib
import dataclasses
import inspect
import json
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from runtime.grammar import check_spec, structural_tag
from runtime.reasoning import OPEN, ReasoningSplitter
from runtime.sampling import sampling_params
from runtime.text import TokenPieces

from .choices import Choice, LogprobsWriter
from .constraints import json_format, reasoning_of, response_grammar, tool_grammar, unenforced
from .engine import Output, QueueFull
from .engine import Request as EngineRequest
from .engine_process import EngineDead, EngineProcess
from .metrics import CONTENT_TYPE_LATEST, Metrics
from .protocol import ChatRequest, CompletionRequest, NamedToolChoice, OpenAIError, SamplingFields, parse
from .reply import ReplyParser
from .streams import EventStream, Outbox, Outputs, event

# The thread that receives the engine's outputs and the event loop share the GIL. The receiver
# waits on the pipe with the GIL released; getting it back from a busy event loop takes up to
# Python's switch interval, 5 ms by default, which would hold a decode step's tokens back for
# longer than the step took. While serving, the interval is 0.1 ms.
GIL_SWITCH_INTERVAL_S = 1e-4
RETRY_AFTER_S = 1  # a 429's Retry-After: the queue moves by whole requests, each a second or so
HEALTH_TIMEOUT_S = 10.0  # /health's wait for the engine's numbers; longer is a 503
# uvicorn's own bound on a graceful shutdown, past the server's: requests cut at the end of the
# grace period still need a moment to send their last event.
SHUTDOWN_MARGIN_S = 5.0


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
        self.pieces = TokenPieces(tokenizer)  # tokens as log-probabilities name them
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
                       default_max_tokens: int, logprobs: int | None = None,
                       grammar: str | None = None) -> EngineRequest:
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
        request = EngineRequest(prompt_ids, max_tokens, params, seed=req.seed, stop=tuple(stop),
                                eos_ids=() if req.ignore_eos else None, logprobs=logprobs, grammar=grammar)
        try:
            self.engine.check(request)
        except ValueError as err:  # ParameterError names the field
            raise OpenAIError(400, str(err), param=getattr(err, "param", None)) from None
        return request

    def completion_prompt(self, req: CompletionRequest) -> list[int]:
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise OpenAIError(400, f"One prompt per request, got {len(prompt)}", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        return list(prompt)

    def chat_prompt(self, req: ChatRequest) -> list[int]:
        if not self.tokenizer.chat_template:
            raise OpenAIError(400, f"The model `{self.model_name}` has no chat template (a base model): use "
                                   "/v1/completions with a plain prompt", param="messages")
        messages = []
        for i, m in enumerate(req.messages):
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
        tools = [tool.model_dump(exclude_none=True) for tool in req.tools] if req.tools else None
        # The template's own variables only: apply_chat_template's arguments (the template, tools, the
        # generation prompt...) are the server's to set.
        arguments = inspect.signature(self.tokenizer.apply_chat_template).parameters
        for key in req.chat_template_kwargs or {}:
            if key in arguments and arguments[key].kind is not inspect.Parameter.VAR_KEYWORD:
                raise OpenAIError(400, f"chat_template_kwargs may set the template's variables only, not {key!r}",
                                  param=f"chat_template_kwargs.{key}")
        try:
            text = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                      add_generation_prompt=True, **(req.chat_template_kwargs or {}))
        except Exception as err:  # a template's own error (jinja raises its own types)
            raise OpenAIError(400, f"The chat template failed on these messages: {err}", param="messages") from None
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def grammar(self, req: SamplingFields, prompt_ids: list[int], chat: bool) -> str | None:
        """The grammar the reply must follow (serve/constraints.py), or None; a 400 naming the field
        whose schema xgrammar cannot build or would not enforce, or a forced tool_choice that names
        no tool offered. Building a grammar may take long (a long regex: seconds): call it from a
        thread, not the event loop."""
        reasoning = self.reasoning_block(prompt_ids) if chat else "none"
        spec, fmt = None, req.response_format
        if fmt is not None and fmt.type != "text":
            schema = fmt.json_schema.schema_ if fmt.json_schema is not None else None
            if fmt.type == "json_schema" and schema is None:
                raise OpenAIError(400, "response_format of type json_schema needs json_schema.schema",
                                  param="response_format.json_schema")
            if fmt.type == "json_object" and fmt.json_schema is not None:
                raise OpenAIError(400, "response_format of type json_object takes no json_schema (type json_schema "
                                  "does)", param="response_format.json_schema")
            spec = response_grammar(fmt.type, schema, reasoning)
            checked(spec, "response_format.json_schema.schema", schema)
        tools, choice = (req.tools or [], req.tool_choice or "auto") if chat else ([], "auto")
        if isinstance(choice, NamedToolChoice):
            choice = choice.function.name
            if choice not in {t.function.name for t in tools}:
                raise OpenAIError(400, f"tool_choice names the function {choice!r}, which is not among the tools "
                                  "of the request", param="tool_choice")
        if choice == "required" and not tools:
            raise OpenAIError(400, "tool_choice 'required' needs tools", param="tool_choice")
        calls = tool_grammar([(t.function.name, t.function.parameters, bool(t.function.strict)) for t in tools],
                             choice, reasoning, parallel=chat and req.parallel_tool_calls is not False)
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

    async def grammar_of(self, req: SamplingFields, prompt_ids: list[int], chat: bool) -> str | None:
        """grammar(), from a worker thread when there is a schema or tools to build a grammar of; a
        request without runs only its checks, on the loop (a thread's round trip per request
        would wait behind every stream's chunks at hundreds of streams)."""
        fmt, tools = req.response_format, chat and req.tools
        if (fmt is not None and fmt.type != "text") or tools:
            return await asyncio.to_thread(self.grammar, req, prompt_ids, chat)
        return self.grammar(req, prompt_ids, chat)

    def reasoning_block(self, prompt_ids: list[int]) -> str:
        """How a chat prompt leaves the reply's reasoning block (serve/constraints.py reasoning_of):
        "inside" (the prompt opened it), "first" (the model opens it) or "none"."""
        return reasoning_of(self.tokenizer.chat_template, self.tokenizer.decode(prompt_ids[-8:]))

    def reply_parser(self, req: ChatRequest, prompt_ids: list[int]) -> ReplyParser:
        """What takes a chat reply apart (serve/reply.py): its reasoning where the template has think
        tags (starting inside it when the prompt ends by opening the think block, as templates of
        thinking-only models do), and the calls of the request's tools unless tool_choice is none."""
        splitter = None
        if self.reasoning:
            splitter = ReasoningSplitter(thinking=self.reasoning_block(prompt_ids) == "inside")
        tools = {t.function.name for t in req.tools} if req.tools and req.tool_choice != "none" else None
        return ReplyParser(splitter, tools)

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

    async def run(self, http: Request, request: EngineRequest, fields: SamplingFields,
                  replies: list[ReplyParser] | None = None):
        """The response to a request of `fields.n` choices, each a sequence of its own (with a seed,
        choice i's is seed + i) that finds the prompt's blocks the first one prefilled. replies: a
        chat request's parser per choice (None: a completion)."""
        chat = replies is not None
        if fields.stream_options is not None and not fields.stream:  # as OpenAI refuses it
            raise OpenAIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        room = self.engine.max_batch + self.engine.max_waiting
        if fields.n > room:  # never all taken at once: a 429 would say "later" forever
            raise OpenAIError(400, f"n is {fields.n}, but this server holds {room} requests at once "
                              f"(--max-batch {self.engine.max_batch} + --max-waiting {self.engine.max_waiting})",
                              param="n")
        prompt_ids = request.prompt_ids if fields.return_token_ids else None
        choices: list[Choice] = []
        try:
            for i in range(fields.n):
                seed = None if request.seed is None else (request.seed + i) % 2**63
                outputs = Outputs(self.outbox, each=fields.stream)
                seq_id = self.submit(dataclasses.replace(request, seed=seed), outputs)
                writer = LogprobsWriter(self.pieces, chat) if request.logprobs is not None else None
                choices.append(Choice(i, outputs, seq_id, replies[i] if chat else None, prompt_ids, writer))
        except OpenAIError:  # past the queue bound midway: the choices taken are let go
            self.close_all(choices)
            raise
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        if fields.stream:
            include_usage = bool(fields.stream_options and fields.stream_options.include_usage)
            return EventStream(self.sse(choices, rid, include_usage, chat), on_close=lambda: self.close_all(choices))
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
                             "choices": [c.whole(out) for c, out in zip(choices, outs)], "usage": self.usage(outs)})

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
    def usage(outs: list[Output]) -> dict:
        """The prompt once, the tokens of every choice."""
        prompt, completion = outs[0].prompt_tokens, sum(out.completion_tokens for out in outs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    async def sse(self, choices: list[Choice], rid: str, include_usage: bool, chat: bool):
        """Server-sent events in OpenAI's chunk format, each chunk one choice's news (its index), ending
        with `data: [DONE]`; a request the server ends (a shutdown, the engine's death) ends with an
        event {"error": {...}}, which the openai client raises as an APIError. If the client goes
        away, Starlette cancels this generator at its await, and EventStream's on_close cancels the
        sequences. A chat reply's reasoning goes to delta.reasoning_content, its tool calls to
        delta.tool_calls, a whole call in one delta (Choice.delta)."""
        # Every chunk's fields but its choice, written once: the event loop writes a chunk per
        # stream per engine step (tens of thousands a second at hundreds of streams).
        head = "data: " + json.dumps({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                                      "created": int(time.time()), "model": self.model_name})[:-1] + ', "choices": ['

        def chunk(choice: dict) -> str:
            return f"{head}{json.dumps(choice)}]}}\n\n"

        if chat:
            for c in choices:
                yield chunk(c.role())
        last: list[Output] = []
        async with contextlib.aclosing(arrivals(choices)) as news:
            async for c, out in news:
                if (error := self.failure(c.outputs, out)) is not None:
                    if out.text:
                        yield chunk(c.delta(out, final=True))
                    yield event(error.body())
                    yield "data: [DONE]\n\n"
                    return
                if out.finish_reason == "cancelled":  # its client has left
                    return
                yield chunk(c.delta(out))
                if out.finish_reason is not None:
                    last.append(out)
        if include_usage:
            yield f"{head}], \"usage\": {json.dumps(self.usage(last))}}}\n\n"
        yield "data: [DONE]\n\n"


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


def checked(spec: str, where: str, schema) -> None:
    """A 400 naming the field unless xgrammar can build the grammar of spec, and enforce its schema."""
    try:
        check_spec(spec)
    except ValueError as err:
        raise OpenAIError(400, f"'{where}' is not a JSON schema this server can follow: {err}", param=where) from None
    if (problem := unenforced(schema)) is not None:
        raise OpenAIError(400, f"'{where}' is not a JSON schema this server can follow: {problem}", param=where)


def json_object(arguments: str, where: str) -> dict:
    """A history's tool call arguments as the object the chat template writes, or a 400 naming it."""
    try:
        value = json.loads(arguments)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise OpenAIError(400, f"'{where}.function.arguments' must be a JSON object, got {arguments[:80]!r}",
                          param=f"{where}.function.arguments")
    return value


def create_app(engine: EngineProcess, tokenizer, model_name: str, reasoning: bool = True) -> FastAPI:
    """The app; its lifespan starts the engine's threads and stops the engine. reasoning: see Server."""
    server = Server(engine, tokenizer, model_name, reasoning)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        interval = sys.getswitchinterval()
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        try:
            server.begin(asyncio.get_running_loop())
            yield
        finally:
            engine.stop()
            sys.setswitchinterval(interval)

    app = FastAPI(title="qwen3-from-scratch", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, err: OpenAIError):
        return err.response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException):
        """Starlette's own refusals, an unknown path (404) and a wrong method (405), in OpenAI's shape."""
        asked = f"{request.method} {request.url.path}"
        if err.status_code == 404:
            endpoints = ", ".join(f"{'/'.join(sorted(route.methods))} {route.path}" for route in app.routes
                                  if isinstance(route, APIRoute))
            message = f"Invalid URL ({asked}): this server serves {endpoints}"
        elif err.status_code == 405:
            message = f"Invalid method ({asked}): {request.url.path} takes {(err.headers or {}).get('Allow')}"
        else:
            message = str(err.detail)
        return OpenAIError(err.status_code, message, headers=err.headers).response()  # a 405's Allow

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception):
        return OpenAIError(500, f"Internal server error: {type(err).__name__}: {err}", type_="server_error").response()

    async def engine_stats() -> dict:
        """The engine's numbers (free_blocks, total_blocks, block_size, running, ...), or the
        OpenAIError (503) that says why there are none."""
        if server.refusal is not None:
            raise server.refusal
        try:
            return await engine.stats(HEALTH_TIMEOUT_S)
        except EngineDead as err:
            raise engine_dead(str(err)) from None
        except asyncio.TimeoutError:
            raise OpenAIError(503, f"The engine did not answer within {HEALTH_TIMEOUT_S:g} s (a long step, or "
                                   "hung)", type_="server_error", code="engine_busy") from None

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: what some load balancers' checks send
    async def health():
        stats = await engine_stats()
        return {"status": "ok", **stats, "max_batch": engine.max_batch, "max_waiting": engine.max_waiting}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(await engine_stats()), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": server.created, "owned_by": "qwen3-from-scratch",
                "max_model_len": server.max_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")  # the openai client's models.retrieve(name); a name may hold "/"
    async def model(name: str):
        server.check_model(name)
        return model_card()

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse(CompletionRequest, await request.body())
        server.check_model(req.model)
        ids = server.completion_prompt(req)
        grammar = await server.grammar_of(req, ids, False)
        engine_request = server.engine_request(req, ids, req.max_tokens, default_max_tokens=16,
                                               logprobs=req.logprobs, grammar=grammar)
        return await server.run(request, engine_request, req)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse(ChatRequest, await request.body())
        server.check_model(req.model)
        ids = server.chat_prompt(req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        room = min(server.max_len, engine.limits.n_blocks * engine.limits.block_size) - len(ids)
        if room < 1 and max_tokens is None:  # the prompt alone fills the context: the messages are too long
            raise OpenAIError(400, f"This model's maximum context length is {server.max_len} tokens and the "
                              f"cache holds {engine.limits.n_blocks * engine.limits.block_size}; the messages "
                              f"are {len(ids)} tokens, leaving no room for a reply", param="messages")
        if req.top_logprobs and not req.logprobs:  # as OpenAI refuses it
            raise OpenAIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        grammar = await server.grammar_of(req, ids, True)
        engine_request = server.engine_request(req, ids, max_tokens, default_max_tokens=max(room, 1),
                                               logprobs=logprobs, grammar=grammar)
        return await server.run(request, engine_request, req, [server.reply_parser(req, ids) for _ in range(req.n)])

    return app


class HTTPServer(uvicorn.Server):
    """uvicorn's server with this server's ends (see the module docstring): signals drain it, a dead
    engine ends it. `say` prints one line for the user; after run(), `status` is the exit status
    and `death` how the engine died, if it did."""

    def __init__(self, app: FastAPI, host: str, port: int, shutdown_timeout_s: float, say: Callable[[str], None]):
        super().__init__(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                        timeout_graceful_shutdown=shutdown_timeout_s + SHUTDOWN_MARGIN_S))
        self.state: Server = app.state.server
        self.state.on_fatal = self.engine_died
        self.shutdown_timeout_s, self.say = shutdown_timeout_s, say
        self.stopping = False
        self.status = 0
        self.death: str | None = None

    def handle_exit(self, sig: int, frame) -> None:
        """uvicorn's signal handler (SIGINT, SIGTERM), in place of its own: the first drains, the
        second exits at once. uvicorn's would also raise the signal again once it has stopped, and
        a second Ctrl-C would end the process in tracebacks."""
        name, n = signal.Signals(sig).name, len(self.state.open)
        requests = f"{n} open request{'s' if n != 1 else ''}"
        if self.stopping:
            self.say(f"second {name}: stopped at once, {requests} cut off")
            self.state.engine.kill()
            os._exit(128 + sig)
        self.stopping = True
        self.say(f"{name}: shutting down; {requests} {'gets' if n == 1 else 'get'} up to {self.shutdown_timeout_s:g} s "
                 f"to finish (a second {name} stops at once)")
        self.should_exit = True
        self.state.drain_soon(self.shutdown_timeout_s)

    def engine_died(self, reason: str) -> None:  # the loop
        self.status, self.death = 1, reason
        self.should_exit = True
