"""The engine in a process of its own (qwen3/engine_process.py), as the server drives it: its numbers
on request, and an engine process that dies ends every open request with "error" and refuses new
ones with one clear error, instead of leaving clients waiting. Every wait is bounded."""

import asyncio
import os
import signal
import threading
from pathlib import Path

import pytest
import torch

from qwen3.engine import Request
from qwen3.engine_process import EngineProcess, EngineSpec
from qwen3.sampling import SamplingParams

SHIPPED = Path(__file__).resolve().parent.parent / "weights" / "qwen3-stdlib-tiny"
WAIT_S = 120  # the engine process starts torch and loads the model on a busy 2-core machine


def test_a_dead_engine_process_ends_open_requests_and_refuses_new_ones():
    engine = EngineProcess(EngineSpec(SHIPPED, torch.float32, "cpu", max_batch=2))
    engine.start()
    try:
        stats = asyncio.run(engine.stats())
        assert stats["free_blocks"] == stats["total_blocks"] > 0 and stats["running"] == 0
        outputs, first, last = [], threading.Event(), threading.Event()

        def on_output(out):
            outputs.append(out)
            first.set()
            if out.finish_reason is not None:
                last.set()

        request = Request([1, 2, 3], 1000, SamplingParams(temperature=0.0), eos_ids=())  # long enough to be cut
        engine.submit(request, on_output)
        assert first.wait(WAIT_S) and not last.is_set()
        os.kill(engine.pid, signal.SIGKILL)
        assert last.wait(WAIT_S)
        assert outputs[-1].finish_reason == "error" and sum(o.finish_reason is not None for o in outputs) == 1
        with pytest.raises(RuntimeError, match="engine process has exited"):
            engine.submit(request, on_output)
        with pytest.raises(RuntimeError, match="engine process has exited"):
            asyncio.run(engine.stats())
    finally:
        engine.stop()
