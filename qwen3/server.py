"""An OpenAI-compatible HTTP server over the engine (qwen3/engine.py); scripts/serve.py starts it.

    POST /v1/completions        prompt (text or token ids) -> text
    POST /v1/chat/completions   messages, through the tokenizer's chat template -> an assistant turn
    GET  /v1/models             the one model served
    GET  /health                status, and the KV cache's free blocks (back to full when idle)

FastAPI on uvicorn: the ASGI stack vLLM and SGLang serve with, well kept and small. Streaming is
Starlette's StreamingResponse (server-sent events), which cancels the stream's task when the
client disconnects, so a dropped stream cancels its sequence and frees its blocks; the JSON
bodies are parsed by hand and checked by pydantic, so every bad request gets OpenAI's error
shape ({"error": {"message", "type", "param", "code"}}), never FastAPI's own 422; so do an unknown
path (404) and a wrong method (405), which Starlette would answer with {"detail": ...}.

The engine runs in a process of its own and owns the model (qwen3/engine_process.py); a request
hands it a callback, called on the thread that receives the engine's outputs, that appends each
output to the request's Outputs, and the event loop is woken once per burst of outputs for every
request with news (see Outbox), not once per token.

Choices made here:
- A chat request to a model whose tokenizer has no chat template (the shipped base model) is
  refused with a 400 that points to /v1/completions; no plain-text fallback guesses a format.
- n > 1, best_of, logprobs and echo are refused with a 400 (one choice per request).
- A stream sends a chunk per generated token while the server keeps up; when tokens arrive
  faster than the event loop sends chunks (many concurrent streams), one chunk carries every
  token that arrived since the last, so the loop's work per token falls as load rises. A chunk's
  text may be empty while the detokenizer or a possible stop string holds text back.
- Sampling parameters not given come from the checkpoint's generation_config.json, as in
  scripts/generate.py (so a greedy request equals `generate.py --temperature 0`); max_tokens
  defaults to 16 for completions (OpenAI's default) and to the rest of the context for chat.
- More requests than the batch holds wait in the engine's queue; past its bound (--max-waiting)
  a request gets 429.
"""

import asyncio
import json
import sys
import threading
import time
import uuid
from collections import deque
from contextlib import asynccontextmanager
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException

from .engine import Output, QueueFull
from .engine import Request as EngineRequest
from .engine_process import EngineProcess
from .generation import sampling_params

# The thread that receives the engine's outputs and the event loop share the GIL. The receiver
# waits on the pipe with the GIL released; getting it back from a busy event loop takes up to
# Python's switch interval, 5 ms by default, which would hold a decode step's tokens back for
# longer than the step took. While serving, the interval is 0.1 ms.
GIL_SWITCH_INTERVAL_S = 1e-4


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return JSONResponse({"error": error}, status_code=self.status)


class Outputs:
    """One request's outputs, appended on the thread that receives the engine's outputs, taken on
    the event loop."""

    def __init__(self, outbox: "Outbox"):
        self.outbox = outbox
        self.items: deque[Output] = deque()
        self.ready = asyncio.Event()

    def put(self, out: Output) -> None:  # the receiving thread
        self.items.append(out)
        self.outbox.notify(self)

    async def take(self) -> Output:
        """Every output that arrived since the last take, merged into one (waits for one)."""
        while not self.items:
            await self.ready.wait()
            self.ready.clear()
        first = self.items.popleft()
        text, tokens, last = [first.text], list(first.token_ids), first
        while self.items:
            last = self.items.popleft()
            text.append(last.text)
            tokens += last.token_ids
        return Output("".join(text), tokens, last.finish_reason, last.prompt_tokens, last.completion_tokens)


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


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """The fields both endpoints share. Unknown fields are ignored, as OpenAI's API does for
    fields it does not use; known fields of the wrong type are a 400."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    best_of: int | None = None
    logprobs: Any = None
    echo: bool = False
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever the model says (benchmarks)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None


class ChatRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def parse(model: type[BaseModel], body: bytes) -> Any:
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise OpenAIError(400, f"Malformed JSON in the request body: {err}") from err
    if not isinstance(data, dict):
        raise OpenAIError(400, "The request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise OpenAIError(400, f"Invalid value for '{param}': {first['msg']} (got {first.get('input')!r})",
                          param=param) from err


class Server:
    """The routes' shared state: the engine, the tokenizer and what the model is called."""

    def __init__(self, engine: EngineProcess, tokenizer, model_name: str):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.generation_config = engine.generation_config
        self.max_len = engine.max_len
        self.created = int(time.time())
        self.outbox: Outbox | None = None  # made on the event loop's first request

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise OpenAIError(404, f"The model `{name}` does not exist. This server serves `{self.model_name}`.",
                              param="model", code="model_not_found")

    def engine_request(self, req: SamplingFields, prompt_ids: list[int], max_tokens: int | None,
                       default_max_tokens: int) -> EngineRequest:
        if req.n != 1 or (req.best_of or 1) != 1:
            raise OpenAIError(400, f"Only n=1 is supported, got n={req.n}", param="n")
        if req.logprobs not in (None, False) or req.echo:
            raise OpenAIError(400, "logprobs and echo are not supported", param="logprobs" if req.logprobs else "echo")
        if req.frequency_penalty not in (None, 0.0):
            raise OpenAIError(400, "frequency_penalty is not supported; use presence_penalty or repetition_penalty",
                              param="frequency_penalty")
        try:
            params = sampling_params(
                self.generation_config, temperature=req.temperature, top_k=req.top_k, top_p=req.top_p,
                min_p=req.min_p, repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
            )
        except ValueError as err:
            raise OpenAIError(400, str(err), param=getattr(err, "param", None)) from err
        if max_tokens is None:
            max_tokens = default_max_tokens
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        request = EngineRequest(prompt_ids, max_tokens, params, seed=req.seed, stop=tuple(stop),
                                eos_ids=() if req.ignore_eos else None)
        try:
            self.engine.check(request)
        except ValueError as err:  # ParameterError names the field
            raise OpenAIError(400, str(err), param=getattr(err, "param", None)) from err
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
        for m in req.messages:
            content = m.content if isinstance(m.content, str) or m.content is None else "".join(
                part.text for part in m.content)
            messages.append({"role": m.role, "content": content or ""})
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                      **(req.chat_template_kwargs or {}))
        except Exception as err:  # a template's own error (jinja raises its own types)
            raise OpenAIError(400, f"The chat template failed on these messages: {err}", param="messages") from err
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    async def run(self, http: Request, request: EngineRequest, chat: bool, stream: bool, include_usage: bool):
        if self.outbox is None or self.outbox.loop is not asyncio.get_running_loop():
            self.outbox = Outbox(asyncio.get_running_loop())
        outputs = Outputs(self.outbox)
        try:
            seq_id = self.engine.submit(request, outputs.put)
        except QueueFull as err:
            raise OpenAIError(429, str(err), type_="rate_limit_error", code="queue_full") from err
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        if stream:
            return StreamingResponse(self.sse(outputs, seq_id, rid, chat, include_usage),
                                     media_type="text/event-stream")
        finished = False
        try:
            text, out = "", None
            while out is None or out.finish_reason is None:
                try:
                    out = await asyncio.wait_for(outputs.take(), timeout=1.0)
                except asyncio.TimeoutError:
                    if await http.is_disconnected():  # nobody left to answer
                        return JSONResponse({}, status_code=499)
                    continue
                text += out.text
            finished = True
        finally:
            if not finished:  # the client went away (or the handler was cancelled)
                self.engine.cancel(seq_id)
        usage = self.usage(out)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": out.finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": out.finish_reason}
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                             "created": int(time.time()), "model": self.model_name, "choices": [choice],
                             "usage": usage})

    @staticmethod
    def usage(out: Output) -> dict:
        return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
                "total_tokens": out.prompt_tokens + out.completion_tokens}

    async def sse(self, outputs: Outputs, seq_id: int, rid: str, chat: bool, include_usage: bool):
        """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`. If the client
        goes away, Starlette cancels this generator at its await: the finally cancels the sequence."""
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, finish_reason: str | None, role: bool = False, usage=None) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
                choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
            else:
                choices = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}]
            body = {"id": rid, "object": kind, "created": created, "model": self.model_name,
                    "choices": [] if usage else choices}
            if usage:
                body["usage"] = usage
            return f"data: {json.dumps(body)}\n\n"

        finished = False
        try:
            if chat:
                yield chunk(None, None, role=True)
            while True:
                out = await outputs.take()  # what arrived since the last chunk: a token, or more under load
                yield chunk(out.text, out.finish_reason)
                if out.finish_reason:
                    finished = True
                    break
            if include_usage:
                yield chunk(None, None, usage=self.usage(out))
            yield "data: [DONE]\n\n"
        finally:
            if not finished:
                self.engine.cancel(seq_id)


def create_app(engine: EngineProcess, tokenizer, model_name: str) -> FastAPI:
    """The app; its lifespan starts the engine's output receiver and stops the engine."""
    server = Server(engine, tokenizer, model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        interval = sys.getswitchinterval()
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        try:
            engine.start()
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
        response = OpenAIError(err.status_code, message).response()
        response.headers.update(err.headers or {})  # a 405's Allow
        return response

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception):
        return OpenAIError(500, f"Internal server error: {type(err).__name__}: {err}", type_="server_error").response()

    @app.get("/health")
    async def health():
        stats = await engine.stats()  # free_blocks, total_blocks, block_size, running, waiting, ...
        return {"status": "ok", **stats, "max_batch": engine.max_batch, "max_waiting": engine.max_waiting}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": server.created,
                                            "owned_by": "qwen3-from-scratch", "max_model_len": server.max_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse(CompletionRequest, await request.body())
        server.check_model(req.model)
        ids = server.completion_prompt(req)
        engine_request = server.engine_request(req, ids, req.max_tokens, default_max_tokens=16)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await server.run(request, engine_request, chat=False, stream=req.stream, include_usage=include_usage)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse(ChatRequest, await request.body())
        server.check_model(req.model)
        ids = server.chat_prompt(req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        room = min(server.max_len, engine.limits.n_blocks * engine.limits.block_size) - len(ids)
        engine_request = server.engine_request(req, ids, max_tokens, default_max_tokens=max(room, 1))
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await server.run(request, engine_request, chat=True, stream=req.stream, include_usage=include_usage)

    return app
