"""The engine (qwen3/engine.py) in a process of its own, driven through a pipe: what the server runs.

    engine = EngineProcess(EngineSpec(model_dir, ...))   # starts the process, loads the model there
    engine.start()                                       # the thread that receives outputs
    seq_id = engine.submit(request, on_output)           # on_output(Output) per event, on that thread
    engine.cancel(seq_id); stats = await engine.stats(); engine.stop()

Why a process: an HTTP server streaming to hundreds of clients spends a core on parsing, JSON
and server-sent events. In one process its event loop and the engine loop share one GIL, and
each waits for the other; in a process of its own the engine steps at its own pace, as vLLM's
engine core does (docs/benchmarks/serve-notes.md has the measurements). Detokenization and stop
strings run there too.

The pipe carries pickled tuples, one message per engine step for all of that step's outputs:
    to the engine:   ("add", id, Request) | ("cancel", id) | ("stats", token) | ("stop",)
    from the engine: ("ready", info) | ("error", message) | ("outputs", [(id, *Output fields), ...])
                     | ("stats", token, {...})
On this side one writer thread sends, in order, what the event loop queues: the loop never blocks
on a pipe that is full while the engine is in a long step. The engine process ignores Ctrl-C
(the terminal sends it to the whole process group): the server ends it with "stop", or it ends
when the pipe closes.
"""

import asyncio
import itertools
import multiprocessing
import queue
import signal
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .engine import PREFILL_TOKENS, Engine, Limits, Output, QueueFull, Request, check_request

START_TIMEOUT_S = 600.0  # loading a large checkpoint and capturing the CUDA graphs takes a while
EXITED = "the engine process has exited: see the server's log"


@dataclass(frozen=True)
class EngineSpec:
    """How the engine process builds its model and engine (picklable: it crosses the process boundary).
    n_blocks None: on CUDA 80% of the free memory, capped at what max_batch full-context sequences
    use; on the CPU the engine's default."""

    model: Path
    dtype: torch.dtype
    device: str
    norm: str = "auto"
    n_blocks: int | None = None
    block_size: int = 16
    max_batch: int = 16
    max_waiting: int = 256
    cuda_graph: bool | None = None
    prefill_tokens: int = PREFILL_TOKENS


def default_blocks(model, device: torch.device, max_batch: int, block_size: int) -> int | None:
    """On CUDA: 80% of the free memory, but no more than max_batch full-context sequences need."""
    from .cache import PagedKVCache

    if device.type != "cuda":
        return None  # the engine's default
    free, _ = torch.cuda.mem_get_info(device)
    by_memory = int(0.8 * free) // PagedKVCache.bytes_per_block(model, block_size)
    full = max_batch * -(-model.config.max_position_embeddings // block_size)
    return max(1, min(by_memory, full))


def build_engine(spec: EngineSpec) -> Engine:
    from .model import Qwen3ForCausalLM
    from .text import load_tokenizer

    device = torch.device(spec.device)
    if device.type == "cuda":
        # The host side of a GPU engine is bookkeeping on small tensors: one thread. Spare
        # intra-op threads only spin after each op, on cores the server and its clients need.
        torch.set_num_threads(1)
    tokenizer = load_tokenizer(spec.model)
    model = Qwen3ForCausalLM.from_pretrained(spec.model, dtype=spec.dtype, device=device, norm_impl=spec.norm,
                                             progress=False)
    n_blocks = spec.n_blocks or default_blocks(model, device, spec.max_batch, spec.block_size)
    return Engine(model, tokenizer, n_blocks=n_blocks, block_size=spec.block_size, max_batch=spec.max_batch,
                  max_waiting=spec.max_waiting, cuda_graph=spec.cuda_graph, prefill_tokens=spec.prefill_tokens)


def stats(engine: Engine) -> dict:
    return {"free_blocks": engine.cache.num_free, "total_blocks": engine.cache.n_blocks,
            "block_size": engine.cache.block_size, "running": len(engine.running), "waiting": len(engine.waiting),
            "peak_running": engine.peak_running, "preemptions": engine.preemptions}


def serve_engine(conn, spec: EngineSpec) -> None:
    """The engine process: build the engine, then alternate between the pipe's messages and steps."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        engine = build_engine(spec)
    except (OSError, ValueError, KeyError) as err:  # a bad checkpoint: the loader's message says which
        conn.send(("error", str(err)))
        return
    except Exception as err:  # out of memory, a driver error...: one line still, with the error's kind
        conn.send(("error", f"{type(err).__name__}: {err}"))
        return
    conn.send(("ready", {"limits": engine.limits, "generation_config": getattr(engine.model, "generation_config",
                                                                                   {}) or {}}))
    outputs: list[tuple] = []
    seq_ids: dict[int, int] = {}  # the server's id -> the engine's

    def collect(client_id: int) -> Callable[[Output], None]:
        def on_output(out: Output) -> None:
            # A flat tuple per output, built by hand: dataclasses.astuple deep-copies every field
            outputs.append((client_id, out.text, out.token_ids, out.finish_reason, out.prompt_tokens,
                            out.completion_tokens))
            if out.finish_reason is not None:
                seq_ids.pop(client_id, None)
        return on_output

    with torch.inference_mode():
        while True:
            try:
                # Idle: wait for a message (a second at a time); busy: take what is there and step.
                waiting_s = 0 if engine.has_work() else 1.0
                while conn.poll(waiting_s):
                    waiting_s = 0
                    message = conn.recv()
                    if message[0] == "add":
                        _, client_id, request = message
                        try:
                            seq_ids[client_id] = engine.add(request, collect(client_id)).id
                        except Exception:  # checked by the server first: a bug lands here, not a user's error
                            traceback.print_exc()
                            collect(client_id)(Output("", [], "error", len(request.prompt_ids), 0))
                    elif message[0] == "cancel":
                        if message[1] in seq_ids:
                            engine.cancel(seq_ids[message[1]])
                    elif message[0] == "stats":
                        conn.send(("stats", message[1], stats(engine)))
                    else:  # stop
                        return
            except (EOFError, OSError):  # the server is gone
                return
            if engine.has_work():
                try:
                    engine.step()
                except Exception:  # a bug must not hang every client: end what was in flight, keep serving
                    traceback.print_exc()
                    engine.abort_all()
            if outputs:
                conn.send(("outputs", outputs))
                outputs = []


class EngineProcess:
    """The server's handle on the engine process; the calls of Engine that a server needs."""

    def __init__(self, spec: EngineSpec):
        self.max_batch, self.max_waiting = spec.max_batch, spec.max_waiting
        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        self._conn, child = context.Pipe()
        self._process = context.Process(target=serve_engine, args=(child, spec), name="qwen3-engine", daemon=True)
        self._process.start()
        child.close()
        if not self._conn.poll(START_TIMEOUT_S):
            self._process.kill()
            raise RuntimeError(f"the engine process did not start within {START_TIMEOUT_S:.0f} s")
        try:
            message = self._conn.recv()
        except EOFError:
            self._process.join()
            raise RuntimeError(f"the engine process exited with code {self._process.exitcode}") from None
        if message[0] == "error":
            self._process.join()
            raise ValueError(message[1])
        info = message[1]
        self.limits: Limits = info["limits"]
        self.generation_config = info["generation_config"]
        self.max_len = self.limits.max_len
        self._callbacks: dict[int, Callable[[Output], None]] = {}
        self._ids = itertools.count()
        self._tokens = itertools.count()
        self._stats: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._outgoing: queue.SimpleQueue = queue.SimpleQueue()  # messages for the writer thread; None ends it
        self._reader: threading.Thread | None = None
        self._writer: threading.Thread | None = None
        self._alive = True

    @property
    def pid(self) -> int | None:
        """The engine process's id."""
        return self._process.pid

    def check(self, request: Request) -> None:
        check_request(request, self.limits)

    def submit(self, request: Request, on_output: Callable[[Output], None]) -> int:
        """Queue a request; returns its id. ValueError if it can never run, QueueFull past the bound."""
        check_request(request, self.limits)
        if len(self._callbacks) >= self.max_batch + self.max_waiting:
            raise QueueFull(f"{self.max_batch} requests are running and {self.max_waiting} already waiting; "
                            "try again later")
        seq_id = next(self._ids)
        self._callbacks[seq_id] = on_output
        # Checked after registering: the reader marks the engine dead before it ends the open
        # requests, so a request registered too late for that sees the mark here.
        if not self._alive:
            self._callbacks.pop(seq_id, None)
            raise RuntimeError(EXITED)
        self._send(("add", seq_id, request))
        return seq_id

    def cancel(self, seq_id: int) -> None:
        """Stop a request (a client went away): its blocks are freed at the engine's next step."""
        self._send(("cancel", seq_id))

    async def stats(self, timeout_s: float = 10.0) -> dict:
        """The engine's numbers now: free and total blocks, running and waiting sequences."""
        loop = asyncio.get_running_loop()
        token = next(self._tokens)
        future = loop.create_future()
        self._stats[token] = (loop, future)
        try:
            if not self._alive:
                raise RuntimeError(EXITED)
            self._send(("stats", token))
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._stats.pop(token, None)

    def start(self) -> None:
        """Start the threads that send to the engine and receive its outputs."""
        self._reader = threading.Thread(target=self._receive, name="qwen3-engine-outputs", daemon=True)
        self._writer = threading.Thread(target=self._write, name="qwen3-engine-requests", daemon=True)
        self._reader.start()
        self._writer.start()

    def stop(self) -> None:
        self._send(("stop",))
        self._outgoing.put(None)
        if self._writer is None:  # never started: nothing sends the stop
            self._conn.send(("stop",))
        self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()
        for thread in (self._writer, self._reader):
            if thread is not None:
                thread.join(timeout=5)

    def _send(self, message: tuple) -> None:
        self._outgoing.put(message)

    def _write(self) -> None:
        """The writer thread: send what is queued, in order, until None or a closed pipe."""
        while (message := self._outgoing.get()) is not None:
            try:
                self._conn.send(message)
            except (OSError, ValueError):  # the engine process is gone: the reader ends the requests
                return

    def _receive(self) -> None:
        """The reader thread: hand each output to its request's callback, each stats reply to its waiter."""
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):  # the engine process ended: nothing more will come
                break
            if message[0] == "outputs":
                for client_id, *fields in message[1]:
                    out = Output(*fields)
                    callback = self._callbacks.get(client_id)
                    if out.finish_reason is not None:
                        self._callbacks.pop(client_id, None)
                    if callback is not None:
                        self._deliver(callback, out)
            elif message[0] == "stats":
                loop, future = self._stats.get(message[1], (None, None))
                if future is not None:
                    self._resolve(loop, future, lambda f=future, r=message[2]: f.done() or f.set_result(r))
        self._alive = False
        for client_id in list(self._callbacks):  # end every stream still open
            self._deliver(self._callbacks.pop(client_id, None), Output("", [], "error", 0, 0))
        gone = RuntimeError(EXITED)
        for loop, future in list(self._stats.values()):  # and every /health waiting for an answer
            self._resolve(loop, future, lambda f=future: f.done() or f.set_exception(gone))

    @staticmethod
    def _resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future, settle: Callable[[], object]) -> None:
        try:
            loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop has closed (shutdown): nobody waits any more
            pass

    @staticmethod
    def _deliver(callback: Callable[[Output], None] | None, out: Output) -> None:
        if callback is None:
            return
        try:
            callback(out)
        except Exception:  # one client's callback must not stop the others'
            traceback.print_exc()
