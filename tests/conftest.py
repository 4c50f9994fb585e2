"""Test setup: Triton kernels run on the CPU through the interpreter unless a GPU is in use.

TRITON_INTERPRET must be set before triton is first imported, so it is set here, at the top of
the first module pytest loads. On the GPU machine run `TRITON_INTERPRET=0 pytest` to compile
the kernels for real; tests then run on CUDA tensors.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
# pytest-xdist runs the suite in several worker processes (README's test command): each gets its
# share of the cores for torch's intra-op threads, and so do the programs the tests start, so that
# the workers do not oversubscribe the machine (a thread that waits for a busy core stalls every
# operation it takes part in).
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // WORKERS)))

import pytest  # noqa: E402
import torch  # noqa: E402

INTERPRETED = os.environ["TRITON_INTERPRET"] == "1"

# The references (transformers' rotary embedding) take cos and sin on the CPU too: settle MKL's
# kernel choice before any multi-threaded first call can pick a low-accuracy one (see the function).
from qwen3.layers import settle_cpu_trig  # noqa: E402

settle_cpu_trig()
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu")

requires_cuda = pytest.mark.skipif(DEVICE.type != "cuda", reason="needs CUDA (and TRITON_INTERPRET=0)")

# The model's two paths: transformers' operations with the torch norms, or the fused Triton kernels
# with the Triton norms (the GPU's default; on the CPU through the interpreter).
PATHS = {"reference": dict(norm_impl="torch", kernels="reference"), "fused": dict(norm_impl="triton", kernels="fused")}


def use_path(model, path: str | None) -> None:
    """Put the model on one of PATHS, or (None) back to its defaults ("auto")."""
    chosen = PATHS[path] if path is not None else dict(norm_impl="auto", kernels="auto")
    model.set_norm_impl(chosen["norm_impl"])
    model.set_kernels(chosen["kernels"])


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of many tiny forwards (the engine's), which OpenMP threads
    only slow down when the machine's cores are shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def device() -> torch.device:
    return DEVICE


@pytest.fixture
def run_cli(capfd, monkeypatch):
    """run_cli(*args, stdin=b""): scripts/generate.py with these arguments (and this standard
    input) in this process, as tests/in_process.py runs a script."""
    import io
    import sys

    from in_process import GENERATE, call_main

    def run(*args: str, stdin: bytes = b""):
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
        return call_main(GENERATE.main, list(args), capfd)

    return run
