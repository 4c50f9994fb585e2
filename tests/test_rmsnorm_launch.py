"""The Triton launch path's plumbing: which calls reuse a compiled kernel, and what reaches torch's
static launcher or Triton's C launcher, on the CPU, where fakes stand in for the kernel, its compiled
form and the launcher (the real forward and backward build the keys); then the C++ launcher, which
on a GPU must launch what the Python path launches."""

from types import SimpleNamespace

import pytest
import torch
from conftest import DEVICE, requires_cuda

from ops import fused_add_rms_norm, rms_norm
from ops import rmsnorm_triton as tri

knobs = pytest.importorskip("triton.knobs", reason="Triton < 3.4 launches every kernel through its own path")


# Signature and metadata of a compiled kernel(X, W, n, eps, BLOCK: constexpr, FLAG: constexpr), as
# Triton 3.6 reports them: declared constexprs typed "constexpr", scratch sizes present and zero.
SIGNATURE = {"X": "*bf16", "W": "*bf16", "n": "i32", "eps": "fp32", "BLOCK": "constexpr", "FLAG": "constexpr"}


def metadata(**changes):
    fields = dict(num_warps=4, shared=8, num_ctas=1, global_scratch_size=0, profile_scratch_size=0,
                  launch_cooperative_grid=False, launch_pdl=False)
    return SimpleNamespace(**{**fields, **changes})


class FakeCompiled:
    function, packed_metadata = "function-handle", "packed-metadata"

    def __init__(self, signature=SIGNATURE, meta=None):
        self.launches = []
        self.src = SimpleNamespace(signature=signature)
        self.metadata = meta or metadata()

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
    monkeypatch.setattr(tri, "_current_device", lambda: -1)  # a CPU tensor's get_device()
    monkeypatch.setattr(tri, "_compiled", {})
    monkeypatch.setattr(tri, "_static_launch", None)


@pytest.fixture
def static_launches(compiled_mode, monkeypatch):
    launches = []
    monkeypatch.setattr(tri, "_static_launch", lambda *args: launches.append(args))
    return launches


def test_first_launch_compiles_later_ones_call_the_static_launcher(static_launches):
    kernel, x, w = FakeKernel(), torch.zeros(4, 8), torch.ones(8)
    tri._launch(kernel, ("key",), 5, (x, w), (3, 1e-6), (8, True), 4)
    assert len(kernel.jit_calls) == 1 and not static_launches
    tri._launch(kernel, ("key",), 6, (x, w), (4, 1e-5), (8, True), 4)
    assert len(kernel.jit_calls) == 1 and not kernel.compiled[0].launches
    # function, grid, warps and shared memory from the compiled kernel; the type string of the
    # run-time arguments (pointers "O", i32 "i", fp32 "f") and null scratch pointers; the stream.
    assert static_launches == [("function-handle", 6, 1, 1, 4, 8, "OOifOO",
                                (x.data_ptr(), w.data_ptr(), 4, 1e-5, None, None), 1234)]


def without_source() -> FakeCompiled:
    compiled = FakeCompiled()
    del compiled.src  # a compiled kernel that does not say its signature
    return compiled


@pytest.mark.parametrize("compiled", [
    FakeCompiled(signature={**SIGNATURE, "n": "constexpr"}),  # n == 1 specialized away
    FakeCompiled(signature={**SIGNATURE, "n": "u64"}),  # a type the plan does not map
    FakeCompiled(signature={"X": "*bf16", "W": "*bf16", "eps": "fp32"}),  # an older Triton's signature
    FakeCompiled(meta=metadata(global_scratch_size=128)),
    FakeCompiled(meta=metadata(launch_pdl=True)),
    without_source(),
], ids=["specialized-arg", "unmapped-type", "short-signature", "scratch", "pdl", "no-source"])
def test_kernels_the_static_launcher_cannot_take_go_to_tritons(static_launches, compiled):
    kernel, x, w = FakeKernel(), torch.zeros(4, 8), torch.ones(8)
    tri._compiled[(id(kernel), x.get_device(), 4, (8, True), ("key",))] = compiled, tri._static_plan(compiled, 4)
    tri._launch(kernel, ("key",), 6, (x, w), (4, 1e-5), (8, True), 4)
    assert not static_launches and len(compiled.launches) == 1


def test_without_the_static_launcher_later_launches_call_tritons_c_launcher(compiled_mode):
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


def test_tensors_off_the_current_device_take_tritons_own_path(static_launches, monkeypatch):
    kernel, x = FakeKernel(), torch.zeros(4, 8)
    tri._launch(kernel, ("key",), 1, (x,), (), (), 4)
    monkeypatch.setattr(tri, "_current_device", lambda: 3)
    tri._launch(kernel, ("key",), 1, (x,), (), (), 4)
    assert len(kernel.jit_calls) == 2 and not static_launches


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


# ------------------------------------------------------------------ the C++ launcher (rmsnorm_launcher.cpp)


def test_cpp_launcher_refuses_a_kernel_signature_it_does_not_know():
    """A plan is registered with the Triton signature of the kernel it launches; one that does not
    match the forward's parameters (another Triton, a changed kernel) must be refused, not launched."""
    launcher = tri._cpp_launcher()
    assert launcher is not None, "the C++ launcher did not build"
    x, w = torch.zeros(4, 8), torch.ones(8)
    one_pass = "OOOOOO" + "iifiiiiii" + "OO"
    for types, block_rows in [(one_pass[:-3], 2), (one_pass.replace("f", "i"), 2), (one_pass, 0), ("O" * 40, 2)]:
        with pytest.raises(ValueError, match="unexpected kernel parameter types"):
            launcher.add_forward_plan(x, None, w, False, 0, 4, 0, types, block_rows)


def test_cpp_forward_declines_what_it_has_no_plan_for():
    launcher = tri._cpp_launcher()
    assert launcher is not None, "the C++ launcher did not build"
    assert launcher.forward(torch.zeros(4, 8), None, torch.ones(8), 1e-6, False) is None  # CPU tensors


def python_path_forward(monkeypatch, *args, **kwargs):
    with monkeypatch.context() as patch:
        patch.setattr(tri, "_cpp_forward", None)
        return tri.forward(*args, **kwargs)


@requires_cuda
@pytest.mark.parametrize(("rows", "D", "dtype", "weight_dtype", "offset"), [
    (37, 1024, torch.bfloat16, torch.bfloat16, 0),
    (37, 1024, torch.bfloat16, torch.bfloat16, 1),  # x not 16-byte aligned
    (300, 4096, torch.float16, torch.float32, 0),  # promotes to fp32
    (5, 8192, torch.float32, torch.float32, 0),  # the looped kernel
    (3, 20000, torch.bfloat16, torch.bfloat16, 0),  # looped, D not a multiple of 16
    (1, 128, torch.bfloat16, torch.bfloat16, 0),  # one row, as a decode step
])
def test_cpp_launches_equal_the_python_path(monkeypatch, rows, D, dtype, weight_dtype, offset):
    """Once a kernel is compiled, repeated contiguous calls launch from C++: the same kernel as the
    Python path, so the outputs must be equal bit for bit (and, through that path, to HF's)."""
    flat = torch.randn(rows * D + offset, device=DEVICE).to(dtype)
    x = flat[offset:].view(rows, D)
    residual = torch.randn(rows, D, device=DEVICE, dtype=dtype)
    w = (torch.randn(D, device=DEVICE) * 0.5 + 1).to(weight_dtype)
    for args in [dict(), dict(store_rstd=True), dict(residual=residual), dict(residual=residual, store_rstd=True)]:
        expected = python_path_forward(monkeypatch, x, w, 1e-6, **args)  # compiles and registers
        launched = tri._cpp_launcher().forward(x, args.get("residual"), w, 1e-6, args.get("store_rstd", False))
        assert launched is not None, f"no C++ plan for {args}"
        for got, want in zip(launched, expected):
            assert (got is None and want is None) or torch.equal(got, want), args


@requires_cuda
@pytest.mark.parametrize(("D", "dtype", "weight_dtype"), [(1024, torch.bfloat16, torch.bfloat16),
                                                         (4096, torch.bfloat16, torch.float32),
                                                         (200, torch.float32, torch.float32)])
def test_cpp_autograd_nodes_equal_the_python_path(monkeypatch, D, dtype, weight_dtype):
    """The C++ nodes' second step (launched from C++ throughout) gives the gradients of the
    Python path (the custom ops' autograd) bit for bit, for the norm and the fused add."""
    x = torch.randn(300, D, device=DEVICE, dtype=dtype)
    r = torch.randn(300, D, device=DEVICE, dtype=dtype)
    w = (torch.randn(D, device=DEVICE) * 0.5 + 1).to(weight_dtype)
    dy = torch.randn(300, D, device=DEVICE, dtype=torch.promote_types(dtype, weight_dtype))

    def step():
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, r, w)]
        y, s = fused_add_rms_norm(leaves[0], leaves[1], leaves[2], impl="triton")
        (rms_norm(y, leaves[2], impl="triton") + s).backward(dy)
        return [t.grad for t in leaves]

    step()  # compiles and registers every kernel
    cpp = step()
    with monkeypatch.context() as patch:
        patch.setattr(tri, "_autograd_in_cpp", lambda: None)
        patch.setattr(tri, "_cpp_forward", None)
        python = step()
    for a, b in zip(cpp, python):
        assert torch.equal(a, b)


def test_a_kernel_the_cpp_launcher_refuses_stays_on_the_python_path(monkeypatch):
    """A Triton whose kernel parameters differ from what the C++ side expects must not fail the
    call that compiled the kernel: the plan is left out, with a warning."""
    monkeypatch.setattr(tri, "_cpp_forward", None)
    plan = (0, 4, 0, "OOOOOO" + "iiiiiiiii", None)  # eps typed as an int: refused
    with pytest.warns(RuntimeWarning, match="cannot take a Triton RMSNorm kernel"):
        tri._register_forward(torch.zeros(4, 8), None, torch.ones(8), False, plan, 2)
    assert tri._cpp_forward is None
