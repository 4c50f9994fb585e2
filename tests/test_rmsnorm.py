"""ops.rms_norm and ops.fused_add_rms_norm against transformers' Qwen3RMSNorm module.

Runs on the CPU (Triton through TRITON_INTERPRET=1) and, with TRITON_INTERPRET=0 on a GPU
machine, on CUDA tensors with compiled kernels. The reference is always the HF module.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import DEVICE, requires_cuda
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tolerances import assert_matches_hf
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

import ops
from ops import fused_add_rms_norm, rms_norm

ROOT = Path(__file__).resolve().parent.parent

KERNEL_IMPLS = ["torch", "triton", pytest.param("cuda", marks=requires_cuda)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# 1, odd sizes, q/k-norm, Qwen3-0.6B's hidden, a non-power of two above 2048, 16 KiB rows in
# 16-bit, the widest one-pass row (in fp32), and one wide enough for the looped kernel at any dtype.
WIDTHS = [1, 3, 127, 128, 1024, 2176, 8192, 16384, 20000]


def hf_norm(D: int, eps: float = 1e-6, weight_dtype=torch.float32, seed: int = 0) -> Qwen3RMSNorm:
    module = Qwen3RMSNorm(D, eps=eps)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        module.weight.copy_(torch.randn(D, generator=gen) * 0.5 + 1.0)
    return module.to(device=DEVICE, dtype=weight_dtype)


@torch.no_grad()
def reference(x: torch.Tensor, module: Qwen3RMSNorm) -> torch.Tensor:
    return module(x)


def randn(*shape, dtype=torch.float32, scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", WIDTHS)
def test_matches_hf_module(impl, dtype, D):
    rows = 3 if D > 8192 else 37
    x = randn(rows, D, dtype=dtype)
    module = hf_norm(D, weight_dtype=dtype)
    y = rms_norm(x, module.weight.detach(), 1e-6, impl=impl)
    expected = reference(x, module)
    if impl == "torch":
        assert torch.equal(y, expected)  # the reference is HF's arithmetic, op for op
    else:
        assert_matches_hf(y, x, module)
    with torch.no_grad():
        module.weight.fill_(1.0)  # the normalized value itself: within one ulp of HF's
    assert_matches_hf(rms_norm(x, module.weight.detach(), 1e-6, impl=impl), x, module)


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
@pytest.mark.parametrize("shape", [(64,), (1, 64), (2, 3, 4, 64), (0, 64), (5, 0, 64)])
def test_leading_shapes(impl, shape):
    x = randn(*shape, dtype=torch.bfloat16)
    module = hf_norm(64, weight_dtype=torch.bfloat16)
    y = rms_norm(x, module.weight.detach(), impl=impl)
    assert_matches_hf(y, x, module)


def strided_views():
    """Views whose rows are not contiguous, as the model produces them (name, tensor)."""
    B, S, H, K, hd = 2, 5, 4, 2, 64
    qkv = randn(B, S, (H + 2 * K) * hd, dtype=torch.bfloat16, seed=1)
    wide = randn(6, 300, dtype=torch.bfloat16, seed=2)
    return [
        ("q of fused qkv as (B,S,H,hd)", qkv[..., : H * hd].view(B, S, H, hd)),
        ("k of fused qkv as (B,S,K,hd)", qkv[..., H * hd : (H + K) * hd].view(B, S, K, hd)),
        ("column slice", wide[:, 17:81]),
        ("every other row", wide[::2, :64]),
        ("transposed heads (B,H,S,hd): three strides, copied", qkv[..., : H * hd].view(B, S, H, hd).transpose(1, 2)),
        ("strided last dim: copied", wide[:, :128:2]),
    ]


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
@pytest.mark.parametrize("case", range(6))
def test_strided_views(impl, case):
    name, x = strided_views()[case]
    before = x.clone()
    module = hf_norm(x.shape[-1], weight_dtype=torch.bfloat16)
    y = rms_norm(x, module.weight.detach(), impl=impl)
    assert_matches_hf(y, x, module)
    assert torch.equal(x, before), f"{name}: input modified"


def test_row_layout_reads_views_in_place():
    from ops.norm.rmsnorm_triton import row_layout

    name, q = strided_views()[0]
    B, S, H, hd = q.shape
    row_width = q.stride(1)  # (H + 2K) * hd
    assert row_layout(q) == (H, row_width, hd), name  # rows: (token, head) -> two strides, no copy
    assert row_layout(torch.empty(4, 8, 16)) == (32, 0, 16)
    assert row_layout(q.transpose(1, 2)) is None


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_input_with_fp32_weight_promotes(impl, dtype):
    x = randn(9, 256, dtype=dtype)
    module = hf_norm(256, weight_dtype=torch.float32)
    y = rms_norm(x, module.weight.detach(), impl=impl)
    assert y.dtype == torch.float32
    assert_matches_hf(y, x, module)


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
@pytest.mark.parametrize("eps", [0.0, 1e-6, 1e-5, 0.1])
def test_eps(impl, eps):
    x = randn(8, 96, dtype=torch.float32, scale=0.01)  # small x: eps matters
    module = hf_norm(96, eps=eps)
    assert_matches_hf(rms_norm(x, module.weight.detach(), eps, impl=impl), x, module)


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
def test_fp16_squares_that_overflow_fp16(impl):
    x = randn(4, 512, dtype=torch.float16, scale=400.0)  # x^2 ~ 1.6e5 > fp16 max 65504
    assert torch.isinf(x.pow(2)).any()
    module = hf_norm(512, weight_dtype=torch.float16)
    y = rms_norm(x, module.weight.detach(), impl=impl)
    assert torch.isfinite(y).all()
    assert_matches_hf(y, x, module)


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
@pytest.mark.parametrize("D", [64, 20000])
def test_nan_stays_in_its_row(impl, D):
    x = randn(4, D, dtype=torch.bfloat16)
    x[2, D // 2] = float("nan")
    module = hf_norm(D, weight_dtype=torch.bfloat16)
    y = rms_norm(x, module.weight.detach(), impl=impl)
    assert torch.isnan(y[2]).all()
    assert not torch.isnan(y[[0, 1, 3]]).any()
    assert_matches_hf(y, x, module)


@pytest.mark.skipif(DEVICE.type != "cuda" or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_tensors_on_another_gpu_than_the_current_one():
    """Triton launches on the current device: a second GPU's tensors, with the first GPU current,
    must still be normalized there (on a first call and a repeated one), and the gradients must
    equal the first GPU's bit for bit."""
    assert torch.cuda.current_device() == 0
    second = torch.device("cuda", 1)
    module = hf_norm(1024, weight_dtype=torch.bfloat16).to(second)
    x, r = randn(37, 1024, dtype=torch.bfloat16).to(second), randn(37, 1024, dtype=torch.bfloat16, seed=1).to(second)
    dy = randn(37, 1024, dtype=torch.bfloat16, seed=2)

    def gradient(device):
        xg = x.detach().to(device, copy=True).requires_grad_(True)
        rms_norm(xg, module.weight.detach().to(device), impl="triton").backward(dy.to(device))
        return xg.grad

    for _ in range(2):
        assert_matches_hf(rms_norm(x, module.weight.detach(), impl="triton"), x, module)
        y, summed = fused_add_rms_norm(x, r, module.weight.detach(), impl="triton")
        assert torch.equal(summed, r + x)
        assert_matches_hf(y, r + x, module)
        assert torch.equal(gradient(second).cpu(), gradient(DEVICE).cpu())


@pytest.mark.parametrize(("D", "dtype"), [(65536, torch.bfloat16), (131072, torch.bfloat16),
                                         (8192, torch.bfloat16), (4096, torch.float32),
                                         (4096, torch.bfloat16), (2176, torch.bfloat16), (2048, torch.float32),
                                         (16384, torch.bfloat16), (8192, torch.float32)])
def test_wide_rows_take_the_looped_kernel(D, dtype):
    """Rows past 16K elements, and plain rows of 8 to 32 KiB (faster re-read from L2 on the H200)."""
    from ops.norm.rmsnorm_triton import Looped, forward_launch

    assert isinstance(forward_launch(D, dtype.itemsize, False), Looped)
    x = randn(2 if D > 8192 else 37, D, dtype=dtype)
    module = hf_norm(D, weight_dtype=dtype)
    assert_matches_hf(rms_norm(x, module.weight.detach(), impl="triton"), x, module)


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [7, 128, 1024, 2176, 4096, 8192, 20000])  # 1024-8192: the launch table's 2-32 KiB rows
def test_fused_add_matches_hf_decoder(impl, dtype, D):
    x, residual = randn(5, D, dtype=dtype, seed=3), randn(5, D, dtype=dtype, seed=4)
    module = hf_norm(D, weight_dtype=dtype)
    x_before, residual_before = x.clone(), residual.clone()
    y, summed = fused_add_rms_norm(x, residual, module.weight.detach(), 1e-6, impl=impl)
    expected_sum = residual + x  # what Qwen3DecoderLayer does between its two halves
    assert torch.equal(summed, expected_sum)
    assert_matches_hf(y, expected_sum, module)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_fused_add_promotes_like_the_hf_decoder_under_autocast(impl):
    """Autocast training: bf16 branch output + fp32 residual stream -> fp32 sum, as torch adds."""
    x, residual = randn(6, 256, dtype=torch.bfloat16, seed=5), randn(6, 256, seed=6)
    module = hf_norm(256)
    y, summed = fused_add_rms_norm(x, residual, module.weight.detach(), impl=impl)
    assert summed.dtype == torch.float32 and torch.equal(summed, residual + x)
    assert_matches_hf(y, residual + x, module)


def test_fused_add_on_strided_views():
    name, x = strided_views()[0]
    residual = randn(*x.shape, dtype=x.dtype, seed=9)
    module = hf_norm(x.shape[-1], weight_dtype=x.dtype)
    y, summed = fused_add_rms_norm(x, residual, module.weight.detach(), impl="triton")
    assert torch.equal(summed, residual + x), name
    assert_matches_hf(y, residual + x, module)


@pytest.mark.parametrize("D", [64, 20000])  # the one-pass and the looped kernel
def test_fused_add_reads_x_and_residual_by_their_own_layouts(D):
    """x strided and the residual contiguous, the other way round, and both strided: each input is
    addressed by its own row layout."""
    base = randn(3, 4, 2 * D, dtype=torch.bfloat16, seed=12)
    strided, plain = base[..., D:], randn(3, 4, D, dtype=torch.bfloat16, seed=13)
    module = hf_norm(D, weight_dtype=torch.bfloat16)
    for x, residual in ((strided, plain), (plain, strided), (strided, base[..., :D])):
        y, summed = fused_add_rms_norm(x, residual, module.weight.detach(), impl="triton")
        assert torch.equal(summed, residual + x)
        assert_matches_hf(y, residual + x, module)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lead=st.lists(st.integers(1, 5), min_size=0, max_size=3),
    D=st.integers(1, 300),
    pad=st.integers(0, 7),
    dtype=st.sampled_from(DTYPES),
    weight_dtype=st.sampled_from(DTYPES),
    eps=st.sampled_from([0.0, 1e-6, 1e-5, 1e-2]),
    scale=st.sampled_from([1e-3, 1.0, 50.0]),
    seed=st.integers(0, 2**16),
)
def test_property_random_layouts(lead, D, pad, dtype, weight_dtype, eps, scale, seed):
    """Any shape, row padding (a strided row layout), dtype pair and eps: Triton == HF module."""
    base = randn(*lead, D + pad, dtype=dtype, scale=scale, seed=seed)
    x = base[..., pad : pad + D]
    module = hf_norm(D, eps=eps, weight_dtype=weight_dtype, seed=seed)
    assert_matches_hf(rms_norm(x, module.weight.detach(), eps, impl="triton"), x, module)


def test_every_specialization_matches_hf():
    """Triton compiles a kernel per specialization of its arguments: misaligned x or weight, D not
    a multiple of 16, strided rows, another dtype, a residual. Each must compute HF's values, as
    must a call of one already compiled with fewer rows (the row count is not specialized)."""
    D = 256
    flat = randn(40 * D + 1, dtype=torch.bfloat16, seed=11)
    module, module_fp16 = hf_norm(D, weight_dtype=torch.bfloat16), hf_norm(D, weight_dtype=torch.float16)
    w = module.weight.detach()
    w_misaligned = torch.cat([w[:1], w])[1:]
    cases = [
        ("aligned", flat[: 40 * D].view(40, D), w, module),
        ("misaligned x", flat[1:].view(40, D), w, module),
        ("misaligned weight", flat[: 40 * D].view(40, D), w_misaligned, module),
        ("fewer rows", flat[: 3 * D].view(3, D), w, module),
        ("strided rows", flat[: 40 * D].view(20, 2 * D)[:, :D], w, module),
        ("fp16", flat[: 40 * D].view(40, D).half(), module_fp16.weight.detach(), module_fp16),
    ]
    for _name, x, weight, hf in cases:  # (pytest -l shows which case failed)
        assert_matches_hf(rms_norm(x, weight, impl="triton"), x, hf)
    narrow = hf_norm(250, weight_dtype=torch.bfloat16)
    x = flat[: 40 * 250].view(40, 250)
    assert_matches_hf(rms_norm(x, narrow.weight.detach(), impl="triton"), x, narrow)
    x, residual = flat[: 40 * D].view(40, D), flat[1:].view(40, D)
    y, summed = fused_add_rms_norm(x, residual, w, impl="triton")
    assert torch.equal(summed, residual + x)
    assert_matches_hf(y, residual + x, module)


# ------------------------------------------------------------------------------ bad input


def test_errors_name_the_problem(monkeypatch):
    x, w = randn(4, 8), randn(8)
    with pytest.raises(ValueError, match="1-D of size D=8"):
        rms_norm(x, w.view(2, 4))
    with pytest.raises(ValueError, match="1-D of size D=8"):
        rms_norm(x, randn(9))
    with pytest.raises(TypeError, match="floating point"):
        rms_norm(x.long(), w)
    with pytest.raises(TypeError, match="floating point"):
        rms_norm(x, w.int())
    with pytest.raises(TypeError, match="must be tensors"):
        rms_norm(x.tolist(), w)
    with pytest.raises(ValueError, match="same device"):
        rms_norm(x, torch.empty(8, device="meta"))
    with pytest.raises(ValueError, match="unknown RMSNorm impl 'fast'"):
        rms_norm(x, w, impl="fast")
    with pytest.raises(ValueError, match="non-empty last dimension"):
        rms_norm(randn(4, 0), randn(0))
    with pytest.raises(ValueError, match="eps"):
        rms_norm(x, w, eps=-1.0)
    with pytest.raises(TypeError, match="float32, float16 and bfloat16"):
        rms_norm(x.double(), w.double(), impl="triton")
    with pytest.raises(ValueError, match="residual must match x"):
        fused_add_rms_norm(x, randn(4, 9), w)
    with pytest.raises(TypeError, match="residual must be float32"):
        fused_add_rms_norm(x, x.long(), w, impl="triton")


REFUSALS_WITHOUT_INTERPRETER = """
import torch
from ops import rms_norm
for impl in ("triton", "cuda"):
    try:
        rms_norm(torch.ones(2, 8), torch.ones(8), impl=impl)
    except ValueError as err:
        print(err)
"""


@pytest.mark.skipif(DEVICE.type == "cuda", reason="checks the CPU-without-interpreter error")
def test_triton_on_cpu_without_interpreter_is_refused():
    """A process without TRITON_INTERPRET (this one has it from conftest, read when triton loads)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", REFUSALS_WITHOUT_INTERPRETER], capture_output=True, text=True,
                            env={**env, "PYTHONPATH": str(ROOT)}, timeout=120)
    triton, cuda = result.stdout.splitlines()
    assert "impl='triton' needs CUDA tensors" in triton and "TRITON_INTERPRET=1" in triton
    assert "impl='cuda' needs CUDA tensors" in cuda
    # auto never picks triton for CPU tensors
    assert ops.resolve_impl("auto", torch.device("cpu")) == "torch"
