"""Block-scaled FP8 weights, as Qwen's FP8 checkpoints store them (qwen3/fp8.py has the format):
`weight` float8_e4m3fn [N, K] (or [E, N, K] for stacked experts) and `scale` float32
[ceil(N / block[0]), ceil(K / block[1])] (per expert), w = weight * scale of its block.

    block = check_fp8_weight(weight, scale, block, x.dtype)   # None for a weight in x's dtype
    w = dequantize_fp8(weight, scale, block, torch.bfloat16)   # the fp32 product, rounded once
    q, s = quantize_groups(x, 128)                             # activations: FP8 per 128 columns of a row

The decode kernels read such a weight as it is stored: the GEMV (ops/linear/gemv.py) and the
fused MoE (ops/moe/fused_moe.py) dequantize it in registers; the skinny GEMM of 2-64 rows
(ops/linear/skinny_gemm.py) quantizes the rows too (quantize_groups) and multiplies FP8 by FP8 on
the tensor cores, scaling each block's sum. Their tiles must each lie within one block, so they
take blocks whose sides are powers of two from 16 (Qwen's are 128 x 128); a gated weight
([gate; up] rows) must start its up rows on a block boundary. A prefill step of many rows
dequantizes each weight to the activations' dtype just before its matmul (dequantize_fp8).
"""

import torch
import triton
import triton.language as tl

from ..triton_helpers import round_to, to_e4m3

__all__ = ["check_fp8_weight", "dequantize_fp8", "kernel_block", "quantize_groups"]

FP8 = torch.float8_e4m3fn


def kernel_block(block: tuple[int, int]) -> bool:
    """Whether the kernels take weights of this block size (both sides powers of two, >= 16)."""
    return all(b >= 16 and b & (b - 1) == 0 for b in block)


def check_fp8_weight(weight: torch.Tensor, scale: torch.Tensor | None, block: tuple[int, int] | None,
                     dtype: torch.dtype, gated: bool = False) -> tuple[int, int] | None:
    """The block size of an FP8 `weight` ([N, K], or [E, N, K]) whose multipliers are `scale`, checked
    against it; None for a weight in the activations' `dtype` (then scale and block must be None).
    ValueError naming what does not fit."""
    if weight.dtype != FP8:
        if scale is not None or block is not None:
            raise ValueError(f"scale and block go with a float8_e4m3fn weight, got a {weight.dtype} one")
        if weight.dtype != dtype:
            raise ValueError(f"the weight's dtype {weight.dtype} must be the activations' {dtype} (or FP8)")
        return None
    if scale is None or block is None:
        raise ValueError("an FP8 weight needs its scale and block")
    block = tuple(int(b) for b in block)
    if len(block) != 2 or not kernel_block(block):
        raise ValueError(f"FP8 blocks must be two powers of two >= 16, got {block}")
    grid = tuple(-(-size // b) for size, b in zip(weight.shape[-2:], block))
    if scale.dtype != torch.float32 or tuple(scale.shape) != (*weight.shape[:-2], *grid):
        raise ValueError(f"scale must be float32 {(*weight.shape[:-2], *grid)} for weight {tuple(weight.shape)} in "
                         f"blocks of {block}, got {scale.dtype} {tuple(scale.shape)}")
    if gated and (weight.shape[-2] // 2) % block[0]:
        raise ValueError(f"a gated FP8 weight's halves ({weight.shape[-2] // 2} rows) must be whole blocks of "
                         f"{block[0]} rows")
    return block


@triton.jit
def _dequantize_kernel(Q, S, W, N, K, S_COLS, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """W[rows, cols] = Q * S of each element's block, the fp32 product rounded once."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (n < N)[:, None] & (k < K)[None, :]
    offsets = n[:, None].to(tl.int64) * K + k[None, :]
    q = tl.load(Q + offsets, mask=ok, other=0.0).to(tl.float32)
    s = tl.load(S + (n // SCALE_N)[:, None] * S_COLS + (k // SCALE_K)[None, :], mask=ok, other=0.0)
    tl.store(W + offsets, round_to(q * s, W.dtype.element_ty), mask=ok)


@torch.library.custom_op("qwen3_ops::dequantize_fp8", mutates_args=())
def _dequantize_op(q: torch.Tensor, scale: torch.Tensor, block: list[int], dtype: torch.dtype) -> torch.Tensor:
    w = torch.empty(q.shape, dtype=dtype, device=q.device)
    N, K = q.shape
    if w.numel():
        block_n, block_k = 32, 128
        _dequantize_kernel[(triton.cdiv(N, block_n), triton.cdiv(K, block_k))](
            q, scale, w, N, K, scale.shape[1], SCALE_N=block[0], SCALE_K=block[1], BLOCK_N=block_n,
            BLOCK_K=block_k, num_warps=4)
    return w


@_dequantize_op.register_fake
def _(q, scale, block, dtype):
    return torch.empty(q.shape, dtype=dtype, device=q.device)


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                   dtype: torch.dtype) -> torch.Tensor:
    """The FP8 `weight` [N, K] (or stacked [E, N, K], each N a whole number of blocks) in `dtype`:
    each element times its block's scale in fp32, rounded once (qwen3/fp8.py's dequantize)."""
    block = check_fp8_weight(weight, scale, block, dtype)
    if block is None:
        raise ValueError(f"dequantize_fp8 takes a float8_e4m3fn weight, got {weight.dtype}")
    if weight.dim() == 3 and weight.shape[1] % block[0]:
        raise ValueError(f"stacked FP8 weights must hold whole blocks of {block[0]} rows, got {tuple(weight.shape)}")
    flat = _dequantize_op(weight.contiguous().flatten(0, -2), scale.contiguous().flatten(0, -2), list(block), dtype)
    return flat.view(weight.shape)


@triton.jit
def _quantize_groups_kernel(X, Q, S, K, S_COLS, GROUP: tl.constexpr):
    """Row program_id(0), group program_id(1): S = amax / 448, the largest float8_e4m3fn (1 for an
    all-zero group), Q = X / S rounded to float8_e4m3fn."""
    row = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    ok = k < K
    x = tl.load(X + row * K + k, mask=ok, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    # Rounded divisions (div_rn): Triton's `/` on fp32 is the GPU's approximate one, whose last bit
    # differs from torch's quotient (qwen3/fp8.py's quantize, the reference).
    s = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
    tl.store(Q + row * K + k, to_e4m3(tl.math.div_rn(x, s), Q.dtype.element_ty), mask=ok)
    tl.store(S + row * S_COLS + tl.program_id(1), s)


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) of activations x [M, K]: each row's groups of `group` columns scaled so that the
    largest magnitude is 448, the largest float8_e4m3fn (scale = amax / 448, an all-zero group 1) and rounded to
    float8_e4m3fn, as qwen3/fp8.py's quantize does a weight in blocks of (1, group)."""
    M, K = x.shape
    q = torch.empty(M, K, dtype=FP8, device=x.device)
    scale = torch.empty(M, -(-K // group), dtype=torch.float32, device=x.device)
    if q.numel():
        _quantize_groups_kernel[(M, scale.shape[1])](x.contiguous(), q, scale, K, scale.shape[1], GROUP=group,
                                                     num_warps=1)
    return q, scale
