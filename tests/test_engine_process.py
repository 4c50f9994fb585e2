"""The engine in a process of its own (serve/engine_process.py), as the server drives it: its numbers
on request, and an engine process that dies or hangs ends every open request with "error", says
how it died (the signal, the last line it wrote to stderr), tells the server, and refuses new
requests with that reason, instead of leaving clients waiting. Every wait is bounded."""

import asyncio
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from runtime.sampling import SamplingParams
from serve.engine import Request
from serve.engine_loop import engine_threads
from serve.engine_process import EngineDead, EngineProcess, EngineSpec, describe_exit

SHIPPED = Path(__file__).resolve().parent.parent / "weights" / "qwen3-stdlib-tiny"
WAIT_S = 120  # the engine process starts torch and loads the model on a busy 2-core machine
LONG = Request([1, 2, 3], 1000, SamplingParams(temperature=0.0), eos_ids=())  # still running when the fault comes


class Collected:
    """A request's outputs, with events for the first and the last."""

    def __init__(self):
        self.outputs, self.first, self.last = [], threading.Event(), threading.Event()

    def __call__(self, out) -> None:
        self.outputs.append(out)
        self.first.set()
        if out.finish_reason is not None:
            self.last.set()


def start(answer_timeout_s: float = 60.0) -> tuple[EngineProcess, list[str]]:
    engine = EngineProcess(EngineSpec(SHIPPED, torch.float32, "cpu", max_batch=2, threads=1),
                           answer_timeout_s=answer_timeout_s)
    deaths: list[str] = []
    engine.start(on_death=deaths.append)
    return engine, deaths


def submit_long(engine: EngineProcess) -> Collected:
    collected = Collected()
    engine.submit(LONG, collected)
    assert collected.first.wait(WAIT_S) and not collected.last.is_set()
    return collected


def assert_ended_by(engine: EngineProcess, collected: Collected, deaths: list[str], cause: str) -> None:
    """The open request ended with one "error", the server was told the cause, new work is refused with it."""
    assert collected.last.wait(WAIT_S)
    outputs = collected.outputs
    assert outputs[-1].finish_reason == "error" and sum(o.finish_reason is not None for o in outputs) == 1
    deadline = time.monotonic() + 10
    while not deaths and time.monotonic() < deadline:  # told after the requests are ended
        time.sleep(0.01)
    assert len(deaths) == 1 and deaths[0] == engine.death and deaths[0].startswith(cause), deaths
    with pytest.raises(EngineDead, match=cause):
        engine.submit(LONG, Collected())
    with pytest.raises(EngineDead, match=cause):
        asyncio.run(engine.stats())


def test_a_crashed_engine_process_ends_open_requests_and_says_how_it_died():
    """A fatal signal (a crash in a kernel or a driver): the signal, and the line Python's fault handler
    wrote to the engine's stderr, which the server's stderr shows too."""
    engine, deaths = start()
    try:
        stats = asyncio.run(engine.stats())
        assert stats["free_blocks"] == stats["total_blocks"] > 0 and stats["running"] == 0
        collected = submit_long(engine)
        os.kill(engine.pid, signal.SIGSEGV)
        assert_ended_by(engine, collected, deaths, "the engine process was killed by SIGSEGV")
        assert engine.death.endswith("; the last line of its stderr: Fatal Python error: Segmentation fault")
    finally:
        engine.stop()


def test_a_hung_engine_process_is_killed_once_silent_for_the_answer_timeout():
    """An idle engine is not hung (it sends a heartbeat); a stopped one is, after answer_timeout_s."""
    timeout_s = 3.0
    engine, deaths = start(answer_timeout_s=timeout_s)
    try:
        time.sleep(timeout_s + 1)  # idle for longer than the timeout: still alive
        assert engine.death is None and asyncio.run(engine.stats())["running"] == 0
        collected = submit_long(engine)
        os.kill(engine.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        assert_ended_by(engine, collected, deaths, f"the engine process stopped answering for {timeout_s:g} s")
        assert timeout_s - 0.5 < time.monotonic() - stopped < timeout_s + 5
        assert "and was killed" in engine.death and not engine._process.is_alive()
    finally:
        engine.stop()


@pytest.mark.parametrize("exitcode, says", [(-9, "was killed by SIGKILL"), (1, "exited with status 1"),
                                            (None, "is still running")])
def test_describe_exit(exitcode, says):
    assert describe_exit(exitcode) == says


def test_engine_threads_leave_a_core_for_the_server_on_the_cpu():
    assert engine_threads(3, torch.device("cpu")) == 3
    assert engine_threads(None, torch.device("cuda")) == 1
    assert engine_threads(None, torch.device("cpu")) == max(1, torch.get_num_threads() - 1)
