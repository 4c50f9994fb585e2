"""The engine (serve/engine.py) in a process of its own, driven through a pipe: what the server runs.

    engine = EngineProcess(EngineSpec(model_dir, ...))   # starts the process, loads the model there
    engine.start(on_death)                               # the threads that send requests and receive outputs
    engine.check(request)                                # ValueError naming the field if it can never run
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
                     | ("stats", token, {...}) | ("alive",)
On this side one writer thread sends, in order, what the event loop queues: the loop never blocks
on a pipe that is full while the engine is in a long step.

Faults. The engine process ignores SIGINT and SIGTERM (a terminal sends Ctrl-C to the whole
process group, a service manager may send SIGTERM to every process of the service): the server
decides when it stops, with "stop", and it ends when the pipe closes. Its stderr comes through a
pipe that a thread here copies to the server's stderr, keeping the last lines: when the engine
dies, every open request ends with finish_reason "error" and `death` says how (its exit status or
signal, and the last line it wrote). It sends a message at least every HEARTBEAT_S; one silent
for answer_timeout_s (a step that never ends, a stopped process) is taken as hung, killed, and
reported the same way.
"""

import asyncio
import itertools
import multiprocessing
import os
import queue
import signal
import threading
import traceback
from collections.abc import Callable

from .engine import Limits, Output, Request, check_request
from .engine_loop import HEARTBEAT_S, STOP_SIGNALS, EngineSpec, serve_engine
from .request import QueueFull

__all__ = ["ANSWER_TIMEOUT_S", "HEARTBEAT_S", "EngineDead", "EngineProcess", "EngineSpec", "describe_exit"]

START_TIMEOUT_S = 600.0  # loading a large checkpoint and capturing the CUDA graphs takes a while
# Silence from the engine for this long is a hang: an engine step takes milliseconds on a GPU, and a
# long prompt on a CPU some seconds. vLLM's engine iteration timeout is the same.
ANSWER_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0  # for the engine process to end after "stop"; then it is killed
STDERR_TAIL_BYTES = 8192  # of the engine's stderr, kept to say why it died


class EngineDead(RuntimeError):
    """The engine process has ended: its message says how (exit status or signal, last stderr line)."""


def describe_exit(exitcode: int | None) -> str:
    """How a process ended, from multiprocessing's exitcode (-N: killed by signal N)."""
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with status {exitcode}"


class StderrTail:
    """The engine process's stderr: each chunk copied to this process's stderr as it comes, the
    last STDERR_TAIL_BYTES kept so that a death can be explained by what the engine wrote last."""

    def __init__(self, conn):
        self._conn = conn  # the read end; kept open while the thread reads its fd
        self._tail = b""
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._copy, name="qwen3-engine-stderr", daemon=True)
        self._thread.start()

    def _copy(self) -> None:
        fd = self._conn.fileno()
        while chunk := os.read(fd, 65536):
            try:
                view = memoryview(chunk)
                while view:  # a pipe may take part of a write
                    view = view[os.write(2, view):]
            except OSError:  # our own stderr is gone: keep reading, so the engine never blocks on it
                pass
            with self._lock:
                self._tail = (self._tail + chunk)[-STDERR_TAIL_BYTES:]

    def forget(self) -> None:
        """Drop what was written so far (the model's loading): a later death is explained by later lines."""
        with self._lock:
            self._tail = b""

    def drain(self, wait_s: float = 1.0) -> None:
        """Wait up to wait_s for the pipe's end (the process has exited): every byte it wrote copied."""
        self._thread.join(wait_s)

    def last_line(self, wait_s: float = 1.0) -> str:
        """The line that tells most about a death: Python's "Fatal Python error: ..." line after a
        crash, else the last non-empty line (an exception's type and message). Waits up to wait_s
        for the pipe's end, so that the last bytes the engine wrote are in."""
        self.drain(wait_s)
        with self._lock:
            lines = [line.strip() for line in self._tail.decode(errors="replace").splitlines() if line.strip()]
        fatal = [line for line in lines if line.startswith("Fatal Python error:")]
        return (fatal or lines or [""])[-1]


class EngineProcess:
    """The server's handle on the engine process; the calls of Engine that a server needs.

    The constructor starts the process and, unless wait=False, waits until it has loaded the model;
    with wait=False the caller does other work meanwhile (serve.py loads its tokenizer) and then
    calls wait_until_ready, after which limits and generation_config are there. Either way, an
    exception (a Ctrl-C included) on the way kills the process."""

    def __init__(self, spec: EngineSpec, answer_timeout_s: float = ANSWER_TIMEOUT_S, wait: bool = True):
        self.max_batch, self.max_waiting = spec.max_batch, spec.max_waiting
        self.answer_timeout_s = answer_timeout_s
        self._stopping = False  # stop() or kill() asked for the end: not a death
        self._hung = False  # the reader killed a silent engine
        self.death: str | None = None  # once the process has ended: how, in one sentence
        self._callbacks: dict[int, Callable[[Output], None]] = {}
        self._ids = itertools.count()
        self._tokens = itertools.count()
        self._stats: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._outgoing: queue.SimpleQueue = queue.SimpleQueue()  # messages for the writer thread; None ends it
        self._reader: threading.Thread | None = None
        self._writer: threading.Thread | None = None
        self._stderr: StderrTail | None = None  # once the process has started
        self._on_death: Callable[[str], None] | None = None
        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        self._conn, child = context.Pipe()
        stderr_in, stderr_out = context.Pipe(duplex=False)
        self._process = context.Process(target=serve_engine, args=(child, stderr_out, spec), name="qwen3-engine",
                                        daemon=True)
        try:
            # Blocked while the process starts: a signal handler raising in the middle of start()
            # would cut the child's start-up data short (a traceback from the child). The child
            # inherits the mask, so a Ctrl-C reaching it while it imports waits until it ignores it.
            signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
            try:
                self._process.start()
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # a pending one is raised here
            child.close()
            stderr_out.close()
            self._stderr = StderrTail(stderr_in)
        except BaseException:
            self.kill()
            raise
        if wait:
            self.wait_until_ready()

    def wait_until_ready(self) -> None:
        """Wait for the model to load. RuntimeError if the process dies or takes START_TIMEOUT_S,
        ValueError with the load's error (a bad checkpoint); the process is killed then."""
        try:
            info = self._ready_info()
        except BaseException:  # Ctrl-C while loading too: never leave the process behind
            self.kill()
            raise
        self._stderr.forget()
        self.limits: Limits = info["limits"]
        self.generation_config = info["generation_config"]
        self.max_len = self.limits.max_len

    def _ready_info(self) -> dict:
        if not self._conn.poll(START_TIMEOUT_S):
            raise RuntimeError(f"the engine process did not start within {START_TIMEOUT_S:.0f} s")
        try:
            message = self._conn.recv()
        except EOFError:
            self._process.join(timeout=STOP_TIMEOUT_S)
            raise RuntimeError(self._describe_death("while loading the model")) from None
        if message[0] == "error":
            self._process.join()
            raise ValueError(message[1])
        return message[1]

    @property
    def pid(self) -> int | None:
        """The engine process's id."""
        return self._process.pid

    def check(self, request: Request) -> None:
        check_request(request, self.limits)

    def submit(self, request: Request, on_output: Callable[[Output], None]) -> int:
        """Queue a request that `check` has passed; returns its id. QueueFull past the bound,
        EngineDead once the process has ended."""
        if len(self._callbacks) >= self.max_batch + self.max_waiting:
            raise QueueFull(f"the server is full ({self.max_batch} running and {self.max_waiting} waiting at most); "
                            "try again later")
        seq_id = next(self._ids)
        self._callbacks[seq_id] = on_output
        # Checked after registering: the reader sets `death` before it ends the open requests, so a
        # request registered too late for that sees it here.
        if self.death is not None:
            self._callbacks.pop(seq_id, None)
            raise EngineDead(self.death)
        self._send(("add", seq_id, request))
        return seq_id

    def cancel(self, seq_id: int) -> None:
        """Stop a request (a client went away): its blocks are freed at the engine's next step."""
        self._send(("cancel", seq_id))

    async def stats(self, timeout_s: float = 10.0) -> dict:
        """The engine's numbers now: free and total blocks, running and waiting sequences.
        EngineDead once the process has ended; TimeoutError if it does not answer in timeout_s."""
        loop = asyncio.get_running_loop()
        token = next(self._tokens)
        future = loop.create_future()
        self._stats[token] = (loop, future)
        try:
            if self.death is not None:
                raise EngineDead(self.death)
            self._send(("stats", token))
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._stats.pop(token, None)

    def start(self, on_death: Callable[[str], None] | None = None) -> None:
        """Start the threads that send to the engine and receive its outputs. on_death(reason) is
        called on the receiving thread if the process ends unasked, after the open requests have
        been ended."""
        self._on_death = on_death
        self._reader = threading.Thread(target=self._receive, name="qwen3-engine-outputs", daemon=True)
        self._writer = threading.Thread(target=self._write, name="qwen3-engine-requests", daemon=True)
        self._reader.start()
        self._writer.start()

    def stop(self) -> None:
        """Ask the engine process to end, and wait for it (killed after STOP_TIMEOUT_S)."""
        self._stopping = True
        self._send(("stop",))
        self._outgoing.put(None)
        if self._writer is None:  # never started: nothing sends the stop
            self._conn.send(("stop",))
        self._process.join(timeout=STOP_TIMEOUT_S)
        if self._process.is_alive():
            self._process.kill()
        for thread in (self._writer, self._reader):
            if thread is not None:
                thread.join(timeout=5)
        self._stderr_drained()

    def kill(self) -> None:
        """End the engine process at once (the server is exiting without a graceful stop)."""
        self._stopping = True
        if self._process.pid is None:  # never started
            return
        if self._process.is_alive():
            self._process.kill()
        self._process.join(timeout=5)
        self._stderr_drained()

    def _stderr_drained(self) -> None:
        """The process has ended: its last lines copied to our stderr before the server exits
        (cli/output.leave skips the interpreter's teardown, where a daemon thread would have had time)."""
        if self._stderr is not None:
            self._stderr.drain()

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
        """The reader thread: hand each output to its request's callback, each stats reply to its
        waiter; once the process ends (or is silent for answer_timeout_s: it is then killed), end
        every open request."""
        while True:
            try:
                if not self._conn.poll(self.answer_timeout_s):
                    self._hung = True
                    self._process.kill()
                    break
                message = self._conn.recv()
            except (EOFError, OSError):  # the engine process ended: nothing more will come
                break
            if message[0] == "outputs":
                self._hand_out(message[1])
            elif message[0] == "stats":
                loop, future = self._stats.get(message[1], (None, None))
                if future is not None:
                    self._resolve(loop, future, lambda f=future, r=message[2]: f.done() or f.set_result(r))
        self._ended()

    def _hand_out(self, outputs: list[tuple]) -> None:
        for client_id, *fields in outputs:
            out = Output(*fields)
            callback = self._callbacks.get(client_id)
            if out.finish_reason is not None:
                self._callbacks.pop(client_id, None)
            if callback is not None:
                self._deliver(callback, out)

    def _describe_death(self, when: str = "") -> str:
        """One sentence: how the engine process ended, and the last line it wrote to stderr."""
        self._process.join(timeout=5)
        if self._hung:
            how = (f"stopped answering for {self.answer_timeout_s:g} s (an engine step that never ends, or a "
                   "stopped process) and was killed")
        else:
            how = describe_exit(self._process.exitcode)
        line = self._stderr.last_line()
        return f"the engine process {how}{' ' + when if when else ''}" + (
            f"; the last line of its stderr: {line}" if line else "")

    def _ended(self) -> None:
        """The process has ended: say how, end every open request and /health waiting, tell the server."""
        asked = self._stopping and not self._hung
        self.death = "the engine process was stopped (the server is shutting down)" if asked else \
            self._describe_death()
        for client_id in list(self._callbacks):  # end every stream still open
            self._deliver(self._callbacks.pop(client_id, None), Output("", [], "error", 0, 0))
        gone = EngineDead(self.death)
        for loop, future in list(self._stats.values()):  # and every /health waiting for an answer
            self._resolve(loop, future, lambda f=future: f.done() or f.set_exception(gone))
        if not asked and self._on_death is not None:
            self._on_death(self.death)

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
