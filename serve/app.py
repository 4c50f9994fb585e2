"""An OpenAI-compatible HTTP server over the engine: the FastAPI app, its routes and its error
shape, over serve/server.py's Server; cli/serve.py starts it.

    POST /v1/completions        prompt (text or token ids) -> text
    POST /v1/chat/completions   messages, through the tokenizer's chat template -> an assistant turn
    GET  /v1/models             the one model served
    GET  /health                status, and the KV cache's free blocks (back to full when idle);
                                503 while shutting down or once the engine has died
    GET  /metrics               Prometheus' text format (serve/metrics.py)

FastAPI on uvicorn: the ASGI stack vLLM and SGLang serve with, well kept and small. Streaming is
server-sent events; the JSON bodies are parsed by hand and checked by pydantic (serve/protocol.py),
so every bad request gets OpenAI's error shape ({"error": {"message", "type", "param", "code"}}),
never FastAPI's own 422; so do an unknown path (404) and a wrong method (405), which Starlette
would answer with {"detail": ...}.
"""

import asyncio
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from .engine_process import EngineDead, EngineProcess
from .interpreter import frozen_heap, short_switch_interval
from .metrics import CONTENT_TYPE_LATEST
from .prompts import chat_prompt, completion_prompts, off_the_loop_if_long, reasoning_block, reply_parser
from .protocol import ChatRequest, CompletionRequest, OpenAIError, parse
from .server import Server, engine_dead

HEALTH_TIMEOUT_S = 10.0  # /health's wait for the engine's numbers; longer is a 503


def create_app(engine: EngineProcess, tokenizer, model_name: str, reasoning: bool = True) -> FastAPI:
    """The app; its lifespan starts the engine's threads and stops the engine. reasoning: see Server."""
    server = Server(engine, tokenizer, model_name, reasoning)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        with short_switch_interval(), frozen_heap():
            try:
                server.begin(asyncio.get_running_loop())
                yield
            finally:
                engine.stop()

    app = FastAPI(title="qwen3-from-scratch", lifespan=lifespan)
    app.state.server = server
    answer_errors_in_openai_shape(app)
    add_routes(app, server, engine, tokenizer, model_name)
    return app


def answer_errors_in_openai_shape(app: FastAPI) -> None:
    """Every error answered as {"error": {"message", "type", "param", "code"}}: the server's own,
    Starlette's (an unknown path, a wrong method) and a bug's (a 500 that names the exception)."""

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


def add_routes(app: FastAPI, server: Server, engine: EngineProcess, tokenizer, model_name: str) -> None:
    """The API's routes (the module docstring lists them): what the server serves, then generation."""
    add_status_routes(app, server, engine, model_name)
    add_generation_routes(app, server, engine, tokenizer, model_name)


def add_status_routes(app: FastAPI, server: Server, engine: EngineProcess, model_name: str) -> None:
    """/health, /metrics and the model list."""

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


def add_generation_routes(app: FastAPI, server: Server, engine: EngineProcess, tokenizer, model_name: str) -> None:
    """/v1/completions and /v1/chat/completions: a request's body read (serve/prompts.py), handed to
    the engine and answered (Server.run)."""

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.body()
        req = parse(CompletionRequest, body)
        server.check_model(req.model)
        prompts = await off_the_loop_if_long(body, completion_prompts, tokenizer, req)
        grammar = await server.grammar_of(req, "none", False)
        requests = [server.engine_request(req, ids, req.max_tokens, default_max_tokens=16, logprobs=req.logprobs,
                                          grammar=grammar) for ids in prompts]
        return await server.run(request, requests, req)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await request.body()
        req = parse(ChatRequest, body)
        server.check_model(req.model)
        ids = await off_the_loop_if_long(body, chat_prompt, tokenizer, model_name, req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        room = min(server.max_len, engine.limits.n_blocks * engine.limits.block_size) - len(ids)
        if room < 1 and max_tokens is None:  # the prompt alone fills the context: the messages are too long
            raise OpenAIError(400, f"This model's maximum context length is {server.max_len} tokens and the "
                              f"server's KV cache holds {engine.limits.n_blocks * engine.limits.block_size:,} tokens; "
                              f"the messages are {len(ids)} tokens, leaving no room for a reply", param="messages")
        if req.top_logprobs and not req.logprobs:  # as OpenAI refuses it
            raise OpenAIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        block = reasoning_block(tokenizer, ids)
        grammar = await server.grammar_of(req, block, True)
        limit = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        engine_request = server.engine_request(req, ids, max_tokens, default_max_tokens=max(room, 1),
                                               logprobs=logprobs, grammar=grammar, fields=("messages", limit))
        replies = [reply_parser(server.reasoning, block, req) for _ in range(req.n)]
        return await server.run(request, [engine_request], req, replies)
