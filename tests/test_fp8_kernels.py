"""The kernels that read Qwen's block-scaled FP8 weights as stored (ops/linear/fp8.py, gemv.py,
skinny_gemm.py, ops/moe/fused_moe.py).

References: transformers' modules (nn.Linear, Qwen3MLP's SwiGLU, Qwen3RMSNorm) holding the weights
transformers' FineGrainedFP8 integration dequantizes them to (qwen3/fp8.py's dequantize, which
tests/test_fp8.py holds equal to it), in fp32. A weight-only kernel computes exactly those
products in another order. The w8a8 path (FP8 activations as well, the checkpoint's
`activation_scheme: dynamic`) is held to the same modules fed the activations it rounds
(qwen3/fp8.py's quantize in blocks of one row). Blocks of 32 (16 x 64 too) divide the test shapes
as Qwen's 128 divide the real ones; some shapes end in partial blocks."""

import pytest
import torch
from conftest import DEVICE
from test_decode_ops import assert_close, randn
from tolerances import LAYER_BF16_REL, W8A8_GPU_REL, relative_error
from torch import nn
from transformers.models.qwen3 import modeling_qwen3 as hf

from ops.linear.fp8 import check_fp8_weight, dequantize_fp8, quantize_groups
from ops.linear.gemv import gemv, gemv_rms_norm
from ops.linear.skinny_gemm import skinny_launch, skinny_linear
from ops.moe.fused_moe import fused_moe, fused_moe_reference
from qwen3.fp8 import dequantize, quantize

FP32, BF16 = torch.float32, torch.bfloat16


def fp8_weight(N: int, K: int, block, seed: int):
    """(q, scale, the dequantized weight in fp32) of a random weight with blocks of unlike scales."""
    w = 0.2 * randn(N, K, dtype=FP32, seed=seed) * torch.logspace(-1, 0.5, K, device=DEVICE)
    w *= torch.logspace(0.5, -0.5, N, device=DEVICE)[:, None]
    q, scale = quantize(w, block)
    return q, scale, dequantize(q, scale, block, FP32)


def hf_linear(weight: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=DEVICE)
    with torch.no_grad():
        layer.weight.copy_(weight)
    return layer


def hf_swiglu(gate_up: torch.Tensor) -> hf.Qwen3MLP:
    """transformers' MLP holding [gate; up] = gate_up (its down projection unused)."""
    F_, D = gate_up.shape[0] // 2, gate_up.shape[1]
    mlp = hf.Qwen3MLP(hf.Qwen3Config(hidden_size=D, intermediate_size=F_, hidden_act="silu")).to(DEVICE)
    with torch.no_grad():
        mlp.gate_proj.weight.copy_(gate_up[:F_])
        mlp.up_proj.weight.copy_(gate_up[F_:])
    return mlp


def swiglu_of(mlp: hf.Qwen3MLP, x: torch.Tensor) -> torch.Tensor:
    return mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_dequantize_kernel_equals_the_formats_dequantization(dtype):
    """The fused path's dequantization of a prefill's weights is qwen3/fp8.py's exactly (one
    rounding of the fp32 product), stacked experts too."""
    q, scale, _ = fp8_weight(96, 80, (32, 32), seed=1)
    assert torch.equal(dequantize_fp8(q, scale, (32, 32), dtype), dequantize(q, scale, (32, 32), dtype))
    stacked = torch.stack([q, q.flip(0)]), torch.stack([scale, scale.flip(0)])
    expected = torch.stack([dequantize(a, b, (32, 32), dtype) for a, b in zip(*stacked)])
    assert torch.equal(dequantize_fp8(*stacked, (32, 32), dtype), expected)


# (N, K, block, gated): Qwen-like whole blocks, partial blocks at both edges, unequal block sides
# (the few-rows kernel's tiles are a block wide: several along K). The one-row kernel's tiles are
# 512-2048 wide: longer rows too (several tiles, the last partial).
SHAPES = [(128, 96, (32, 32), False), (72, 100, (32, 32), False), (128, 80, (16, 64), True), (64, 160, (32, 32), True)]
LONG_ROWS = [(64, 2100, (32, 64), False), (64, 1100, (32, 32), True)]


@pytest.mark.parametrize("dtype", [FP32, BF16])
@pytest.mark.parametrize("N, K, block, gated", SHAPES + LONG_ROWS)
def test_one_row_reads_the_fp8_weight_as_the_dequantized_one(dtype, N, K, block, gated):
    """gemv of an FP8 weight (gated: SwiGLU of [gate; up]) and its residual-add-norm prologue
    equal transformers' modules holding the dequantized weight."""
    q, scale, w = fp8_weight(N, K, block, seed=N + K)
    x = randn(1, K, dtype=dtype, seed=2)
    if gated:
        mlp = hf_swiglu(w)
        expected = swiglu_of(mlp.to(dtype), x)
    else:
        expected = hf_linear(w).to(dtype)(x)
    with torch.no_grad():
        assert_close(gemv(x, q, None, gated, scale, block), expected)
        residual, norm = randn(1, K, dtype=dtype, seed=3), hf.Qwen3RMSNorm(K, eps=1e-6).to(DEVICE, dtype)
        norm.weight.copy_(1.0 + 0.2 * randn(K, dtype=torch.float32, seed=4))  # seeded: not the global RNG's
        normed = norm(x + residual)
        y, summed = gemv_rms_norm(x, residual, norm.weight, 1e-6, q, None, gated, scale, block)
        reference = swiglu_of(mlp, normed) if gated else hf_linear(w).to(dtype)(normed)
        assert torch.equal(summed, x + residual)
        if dtype == FP32:
            assert_close(y, reference)
        else:  # transformers' bf16 modules round the norm's output, each product and the gate: ours
            # (fp32 sums rounded once) must be as close to their fp32 result as theirs, within a bf16 step
            exact_norm = hf.Qwen3RMSNorm(K, eps=1e-6).to(DEVICE)
            exact_norm.weight.copy_(norm.weight.float())
            normed32 = exact_norm(summed.float())
            exact = swiglu_of(hf_swiglu(w), normed32) if gated else hf_linear(w)(normed32)
            assert relative_error(y, exact) <= relative_error(reference, exact) + LAYER_BF16_REL / 2


@pytest.mark.parametrize("dtype", [FP32, BF16])
@pytest.mark.parametrize("N, K, block, gated", SHAPES)
@pytest.mark.parametrize("rows", [5, 70])
def test_a_few_rows_read_the_fp8_weight_as_the_dequantized_one(dtype, N, K, block, gated, rows):
    """skinny_linear of an FP8 weight, weight-only (activations as given)."""
    q, scale, w = fp8_weight(N, K, block, seed=N + K)
    x = randn(rows, K, dtype=dtype, seed=4)
    expected = swiglu_of(hf_swiglu(w).to(dtype), x) if gated else hf_linear(w).to(dtype)(x)
    with torch.no_grad():
        assert_close(skinny_linear(x, q, None, gated, scale, block), expected)


def test_activations_quantize_per_row_group_as_the_format_quantizes():
    """quantize_groups is qwen3/fp8.py's quantize with blocks of one row by `group` columns,
    exactly (scales and float8 values), an all-zero group and a partial last group included."""
    x = randn(6, 200, dtype=BF16, seed=5) * 30
    x[1, 64:128] = 0
    q, scale = quantize_groups(x, 64)
    q_ref, scale_ref = quantize(x.float(), (1, 64))
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.float(), q_ref.float())


@pytest.mark.parametrize("dtype", [FP32, BF16])
@pytest.mark.parametrize("N, K, block, gated", SHAPES)
def test_fp8_activations_multiply_as_their_rounding(dtype, N, K, block, gated):
    """skinny_linear(fp8_activations=True), the w8a8 path: transformers' modules holding the
    dequantized weight, fed each row rounded to FP8 in groups of block[1] columns."""
    q, scale, w = fp8_weight(N, K, block, seed=N + K)
    x = randn(9, K, dtype=dtype, seed=6)
    x_q, x_scale = quantize(x.float(), (1, block[1]))
    rounded = dequantize(x_q, x_scale, (1, block[1]), FP32)
    expected = swiglu_of(hf_swiglu(w), rounded) if gated else hf_linear(w)(rounded)
    with torch.no_grad():
        actual = skinny_linear(x, q, None, gated, scale, block, fp8_activations=True)
    if DEVICE.type == "cuda":  # FP8 tensor cores (the interpreter multiplies exactly, in fp32)
        assert actual.dtype == dtype and relative_error(actual, expected) < W8A8_GPU_REL
    else:
        assert_close(actual, expected.to(dtype))


def test_a_split_past_k_reads_no_scale_past_the_last_block():
    """When K's tiles do not divide over the splits, the last split runs whole tiles past K: their
    weights are masked to zero, and the scale they multiply must be a real one (a NaN beyond the
    scales' end would make 0 * NaN)."""
    N, K, block = 64, 1152, (128, 128)
    launch = skinny_launch(4, N, K, scale_k=block[1])
    assert launch.split * launch.k_per_split > K  # the case
    q, scale, w = fp8_weight(N, K, block, seed=7)
    beyond = torch.full((scale.numel() + 64,), float("nan"), device=DEVICE)
    beyond[: scale.numel()] = scale.flatten()
    x = randn(4, K, dtype=FP32, seed=8)
    with torch.no_grad():
        assert_close(skinny_linear(x, q, None, False, beyond[: scale.numel()].view(scale.shape), block),
                     hf_linear(w)(x))


@pytest.mark.parametrize("dtype", [FP32, BF16])
@pytest.mark.parametrize("N, k", [(3, 2), (40, 2)], ids=["pairs", "sorted-tiles"])
def test_fp8_experts_equal_the_dequantized_ones(dtype, N, k):
    """fused_moe of FP8 experts (decode's pair kernels, prefill's sorted tiles) equals transformers'
    expert loop (fused_moe_reference) over the dequantized experts."""
    E, D, I, block = 8, 64, 32, (32, 32)  # noqa: E741
    w13 = [fp8_weight(2 * I, D, block, seed=10 + e) for e in range(E)]
    w2 = [fp8_weight(D, I, block, seed=30 + e) for e in range(E)]
    stack = lambda parts, i: torch.stack([p[i] for p in parts])  # noqa: E731
    gen = torch.Generator().manual_seed(N)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(N)]).to(DEVICE)
    weights = torch.rand(N, k, generator=gen).to(DEVICE, dtype)
    x = randn(N, D, dtype=dtype, seed=9)
    expected = fused_moe_reference(x, stack(w13, 2).to(dtype), stack(w2, 2).to(dtype), weights, ids)
    actual = fused_moe(x, stack(w13, 0), stack(w2, 0), weights, ids, stack(w13, 1), stack(w2, 1), block)
    assert_close(actual, expected)


def test_fp8_weights_that_do_not_fit_are_one_clear_error():
    q, scale, _ = fp8_weight(64, 64, (32, 32), seed=11)
    x = randn(1, 64, dtype=BF16, seed=12)
    with pytest.raises(ValueError, match="needs its scale and block"):
        gemv(x, q)
    with pytest.raises(ValueError, match="scale must be float32 \\(2, 2\\)"):
        gemv(x, q, scale=scale[:1], block=(32, 32))
    with pytest.raises(ValueError, match="powers of two"):
        skinny_linear(x.expand(3, 64), q, scale=scale, block=(24, 32))
    with pytest.raises(ValueError, match="whole blocks of 32 rows"):
        gemv(x, fp8_weight(96, 64, (32, 32), seed=13)[0], gated=True, scale=quantize(torch.ones(96, 64), (32, 32))[1],
             block=(32, 32))
    with pytest.raises(ValueError, match="must be the activations'"):
        check_fp8_weight(q.float(), None, None, BF16)
