"""Test setup: Triton kernels run on the CPU through the interpreter unless a GPU is in use.

TRITON_INTERPRET must be set before triton is first imported, so it is set here, at the top of
the first module pytest loads. On the GPU machine run `TRITON_INTERPRET=0 pytest` to compile
the kernels for real; tests then run on CUDA tensors.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

INTERPRETED = os.environ["TRITON_INTERPRET"] == "1"

# The references (transformers' rotary embedding) take cos and sin on the CPU too: settle MKL's
# kernel choice before any multi-threaded first call can pick a low-accuracy one (see the function).
from qwen3.model import settle_cpu_trig  # noqa: E402

settle_cpu_trig()
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu")

requires_cuda = pytest.mark.skipif(DEVICE.type != "cuda", reason="needs CUDA (and TRITON_INTERPRET=0)")


@pytest.fixture
def device() -> torch.device:
    return DEVICE
