"""What runs in the engine's process (serve/engine_process.py starts it): the engine built from an
EngineSpec, then a loop that alternates between the server's messages and engine steps, sending
each step's outputs back in one message, and a heartbeat when it has sent nothing for HEARTBEAT_S.
"""

import faulthandler
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .engine import Engine, Output
from .interpreter import frozen_heap

# The engine process sends a message at least this often, so that silence means a hang.
HEARTBEAT_S = 1.0
STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


@dataclass(frozen=True)
class EngineSpec:
    """How the engine process builds its model and engine (picklable: it crosses the process boundary).
    n_blocks None: on CUDA 80% of the free memory, capped at what max_batch full-context sequences
    use; on the CPU the engine's default. threads None: see engine_threads."""

    model: Path
    dtype: torch.dtype
    device: str
    norm: str = "auto"
    kernels: str = "auto"
    quantization: str | None = None
    n_blocks: int | None = None
    block_size: int = 16
    max_batch: int = 16
    max_waiting: int = 256
    cuda_graph: bool | None = None
    prefill_tokens: int | None = None  # the engine's default for the device
    prefix_cache: bool = True
    threads: int | None = None


def default_blocks(model, device: torch.device, max_batch: int, block_size: int) -> int | None:
    """On CUDA: 80% of the free memory, but no more than max_batch full-context sequences need."""
    from runtime.cache import PagedKVCache

    if device.type != "cuda":
        return None  # the engine's default
    free, _ = torch.cuda.mem_get_info(device)
    by_memory = int(0.8 * free) // PagedKVCache.bytes_per_block(model, block_size)
    full = max_batch * -(-model.config.max_position_embeddings // block_size)
    return max(1, min(by_memory, full))


def engine_threads(threads: int | None, device: torch.device) -> int:
    """The engine's intra-op threads: the caller's number, else one on CUDA (the host side of a GPU
    engine is bookkeeping on small tensors) and on the CPU torch's default less one, at least one.
    The server's process needs a core for its event loop: an operation split over every core waits
    for the thread whose core the server holds, so one thread fewer is faster, not slower."""
    if threads is not None:
        return threads
    if device.type == "cuda":
        return 1
    return max(1, torch.get_num_threads() - 1)


def build_engine(spec: EngineSpec) -> Engine:
    from tqdm import tqdm

    from qwen3 import Qwen3ForCausalLM
    from runtime.text import load_tokenizer

    # tqdm's default lock (the loader makes a bar) is a named multiprocessing semaphore: left behind by
    # a killed engine, the resource tracker it shares with the server reports it as leaked at the
    # server's exit. The bars of one process need a thread lock only.
    tqdm.set_lock(threading.RLock())
    device = torch.device(spec.device)
    torch.set_num_threads(engine_threads(spec.threads, device))
    tokenizer = load_tokenizer(spec.model)
    model = Qwen3ForCausalLM.from_pretrained(spec.model, dtype=spec.dtype, device=device, norm_impl=spec.norm,
                                             kernels=spec.kernels, quantization=spec.quantization, progress=False)
    n_blocks = spec.n_blocks or default_blocks(model, device, spec.max_batch, spec.block_size)
    return Engine(model, tokenizer, n_blocks=n_blocks, block_size=spec.block_size, max_batch=spec.max_batch,
                  cuda_graph=spec.cuda_graph, prefill_tokens=spec.prefill_tokens,
                  prefix_cache=spec.prefix_cache)


def stats(engine: Engine) -> dict:
    return {"free_blocks": engine.cache.pool.num_free, "total_blocks": engine.cache.n_blocks,
            "block_size": engine.cache.block_size, "running": len(engine.running), "waiting": len(engine.waiting),
            "peak_running": engine.peak_running, "preemptions": engine.preemptions,
            "prefix_cache": engine.prefix_stats()}


def take_over_stderr(stderr) -> None:
    """Send this process's stderr (fd 2, C libraries' and Python's alike) into the pipe the server
    reads, and dump the Python stacks there on a fatal signal (a crash in a kernel or a driver)."""
    sys.stderr.flush()
    os.dup2(stderr.fileno(), 2)
    stderr.close()
    faulthandler.enable()


class EngineLoop:
    """The engine process's side of the pipe: the server's messages in, each step's outputs out."""

    def __init__(self, conn, engine: Engine):
        self.conn, self.engine = conn, engine
        self.outputs: list[tuple] = []
        self.seq_ids: dict[int, int] = {}  # the server's id -> the engine's
        self.last_sent = time.monotonic()

    def collect(self, client_id: int) -> Callable[[Output], None]:
        def on_output(out: Output) -> None:
            # A flat tuple per output, built by hand: dataclasses.astuple deep-copies every field
            self.outputs.append((client_id, out.text, out.token_ids, out.finish_reason, out.prompt_tokens,
                                 out.completion_tokens, out.logprobs))
            if out.finish_reason is not None:
                self.seq_ids.pop(client_id, None)
        return on_output

    def handle(self, message: tuple) -> bool:
        """Apply one message from the server; False once it says stop."""
        if message[0] == "add":
            _, client_id, request = message
            try:
                self.seq_ids[client_id] = self.engine.add(request, self.collect(client_id)).id
            except Exception:  # checked by the server first: a bug lands here, not a user's error
                traceback.print_exc()
                self.collect(client_id)(Output("", [], "error", len(request.prompt_ids), 0))
        elif message[0] == "cancel":
            if message[1] in self.seq_ids:
                self.engine.cancel(self.seq_ids[message[1]])
        elif message[0] == "stats":
            self.send(("stats", message[1], stats(self.engine)))
        else:  # stop
            return False
        return True

    def send(self, message: tuple) -> None:
        self.conn.send(message)
        self.last_sent = time.monotonic()

    def step(self) -> None:
        """One engine step if there is work; its outputs, or a heartbeat once HEARTBEAT_S has passed unheard."""
        if self.engine.has_work():
            try:
                self.engine.step()
            except Exception:  # a bug must not hang every client: end what was in flight, keep serving
                traceback.print_exc()
                self.engine.abort_all()
        if self.outputs:
            outputs, self.outputs = self.outputs, []
            self.send(("outputs", outputs))
        elif time.monotonic() - self.last_sent >= HEARTBEAT_S:
            self.send(("alive",))

    def run(self) -> None:
        """Alternate between the pipe's messages and steps until "stop" or a closed pipe."""
        with torch.inference_mode():
            try:
                while True:
                    # Idle: wait for a message (a heartbeat's time at most); busy: take what is there and step.
                    waiting_s = 0 if self.engine.has_work() else HEARTBEAT_S
                    while self.conn.poll(waiting_s):
                        waiting_s = 0
                        if not self.handle(self.conn.recv()):
                            return
                    self.step()
            except (EOFError, OSError):  # the server is gone
                return


def serve_engine(conn, stderr, spec: EngineSpec) -> None:
    """The engine process: build the engine, then serve the pipe's messages (EngineLoop)."""
    for sig in STOP_SIGNALS:  # the server stops this process, not the terminal
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # blocked by the server while it started us
    take_over_stderr(stderr)
    try:
        engine = build_engine(spec)
    except (OSError, ValueError, KeyError) as err:  # a bad checkpoint: the loader's message says which
        conn.send(("error", str(err)))
        return
    except Exception as err:  # out of memory, a driver error...: one line still, with the error's kind
        conn.send(("error", f"{type(err).__name__}: {err}"))
        return
    with frozen_heap():  # the model and the tokenizer, out of the collector's sight (serve/interpreter.py)
        try:
            conn.send(("ready", {"limits": engine.limits,
                                 "generation_config": getattr(engine.model, "generation_config", {}) or {}}))
        except OSError:  # the server went away while the model loaded
            return
        EngineLoop(conn, engine).run()
    # Stopped, or the server is gone: nothing is left to do, and the interpreter's teardown of
    # torch and the model would keep the server's shutdown waiting for nothing.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
