"""The Triton launch path's plumbing, on the CPU: which calls reuse a compiled kernel, and what
reaches Triton's C launcher. Fakes stand in for the kernel and its compiled form (the compiled
path itself runs in test_rmsnorm.py on a GPU); the real forward and backward build the keys."""

import pytest
import torch

from ops import rmsnorm_triton as tri

knobs = pytest.importorskip("triton.knobs", reason="Triton < 3.4 launches every kernel through its own path")


class FakeCompiled:
    function, packed_metadata = "function-handle", "packed-metadata"

    def __init__(self):
        self.launches = []

    def run(self, *args):
        self.launches.append(args)


class FakeKernel:
    """kernel[grid](*args, num_warps=...) records the call and returns a new compiled kernel."""

    def __init__(self):
        self.jit_calls, self.compiled = [], []

    def __getitem__(self, grid):
        def launch(*args, num_warps):
            self.jit_calls.append((grid, args, num_warps))
            self.compiled.append(FakeCompiled())
            return self.compiled[-1]

        return launch


@pytest.fixture
def compiled_mode(monkeypatch):
    monkeypatch.setattr(tri, "INTERPRETED", False)
    monkeypatch.setattr(tri, "_current_stream", lambda device: 1234)
    monkeypatch.setattr(tri, "_compiled", {})


def test_first_launch_compiles_later_ones_call_the_c_launcher(compiled_mode):
    kernel, x, w = FakeKernel(), torch.zeros(4, 8), torch.ones(8)
    tri._launch(kernel, ("key",), 5, (x, w), (3, 1e-6), (8, True), 4)
    assert kernel.jit_calls == [((5,), (x, w, 3, 1e-6, 8, True), 4)]
    tri._launch(kernel, ("key",), 6, (x, w), (4, 1e-5), (8, True), 4)
    assert len(kernel.jit_calls) == 1
    # The runner's arguments (grid, stream, function, metadata, launch metadata and hooks), then
    # the kernel's arguments with tensors as raw pointers, then the constexprs.
    assert kernel.compiled[0].launches == [(6, 1, 1, 1234, "function-handle", "packed-metadata", None, None, None,
                                            x.data_ptr(), w.data_ptr(), 4, 1e-5, 8, True)]


def test_a_new_key_num_warps_or_constexpr_compiles_again(compiled_mode):
    kernel, x = FakeKernel(), torch.zeros(4, 8)
    for key, constexprs, warps in [(("a",), (8,), 4), (("b",), (8,), 4), (("a",), (16,), 4), (("a",), (8,), 8)]:
        tri._launch(kernel, key, 1, (x,), (), constexprs, warps)
    assert len(kernel.jit_calls) == 4


def test_launch_hooks_take_tritons_own_path(compiled_mode):
    kernel, x = FakeKernel(), torch.zeros(4, 8)
    tri._launch(kernel, ("key",), 1, (x,), (), (), 4)

    def hook(metadata):
        pass

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        tri._launch(kernel, ("key",), 1, (x,), (), (), 4)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(kernel.jit_calls) == 2 and not kernel.compiled[0].launches


@pytest.fixture
def launched_keys(monkeypatch):
    keys = []
    monkeypatch.setattr(tri, "_launch", lambda kernel, key, *rest: keys.append((kernel, key)))
    return keys


def test_forward_keys_follow_what_triton_specializes(launched_keys):
    flat = torch.zeros(64 * 256 + 1, dtype=torch.bfloat16)
    w = torch.ones(256, dtype=torch.bfloat16)
    calls = {
        "aligned": (flat[: 40 * 256].view(40, 256), w),
        "fewer rows": (flat[: 3 * 256].view(3, 256), w),
        "misaligned x": (flat[1 : 1 + 40 * 256].view(40, 256), w),
        "misaligned weight": (flat[: 40 * 256].view(40, 256), torch.cat([w[:1], w])[1:]),
        "strided rows": (flat[: 40 * 256].view(20, 512)[:, :256], w),
        "fp16": (flat[: 40 * 256].view(40, 256).half(), w.half()),
        "D=250": (flat[: 40 * 250].view(40, 250), w[:250]),
    }
    keys = {}
    for name, (x, weight) in calls.items():
        tri.forward(x, weight, 1e-6)
        keys[name] = launched_keys.pop()
    assert keys["fewer rows"] == keys["aligned"]  # the row count is not specialized
    others = [k for name, k in keys.items() if name not in ("aligned", "fewer rows")]
    assert len(set(others + [keys["aligned"]])) == len(others) + 1


def test_backward_launches_the_kernel_then_the_dweight_reduction(launched_keys):
    x, w = torch.zeros(40, 256, dtype=torch.bfloat16), torch.ones(256, dtype=torch.bfloat16)
    tri.backward(torch.zeros_like(x), x, w, torch.ones(40))
    assert [kernel for kernel, _ in launched_keys] == [tri._backward, tri._sum_partials]
