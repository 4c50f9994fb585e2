"""One row through a linear layer: y = x @ W^T for x [1, K], W [N, K] (nn.Linear's layout).

    y = gemv(x, weight, bias=None)
    a = gemv(x, gate_up_weight, gated=True)                      # silu(x @ W_gate^T) * (x @ W_up^T)
    y, s = gemv_rms_norm(x, residual, norm_weight, eps, weight)  # F.linear(rms_norm(x + residual)), s = x + residual
    y = gemv(x, fp8_weight, scale=weight_scale_inv, block=(128, 128))   # block-scaled FP8 W (qwen3/fp8.py)

A batch-1 decode step is a chain of such products, each streaming a weight matrix of a few MB
once. cuBLAS's kernels for these shapes leave much of the bandwidth unused (split-K ones add a reduction
kernel); this one streams W in [BLOCK_N, BLOCK_K] tiles, each program owning BLOCK_N outputs
and reducing over all of K in fp32 (docs/benchmarks/decode-notes.md has the measurements).
Products are summed in another order than cuBLAS's, so results differ from F.linear's by fp32
rounding before the final rounding to the output dtype.

gated=True takes a fused [gate; up] weight [2F, K] (an MLP's gate_up_proj) and returns SwiGLU's
product silu(gate) * up [.., F]: a program owns F's outputs n and streams both W rows n and F + n,
so the gate costs no kernel of its own and the down projection reads F values, not 2F.

gemv_rms_norm puts the decoder's residual add and RMSNorm in front of the product: every program
reads the whole input row anyway, so each also sums its squares and normalizes it as
ops.fused_add_rms_norm does (the same roundings), and the first program stores the sum for the
next residual add. A batch-1 decode step then has no separate norm kernels between projections.

An FP8 weight (float8_e4m3fn, with `scale` [ceil(N / block[0]), ceil(K / block[1])] multiplying
each block, as Qwen's FP8 checkpoints store it) is read as it is stored, one byte a weight, and
dequantized in registers: each input tile is multiplied by its columns' block scales in fp32
before the products (a program's rows lie in one block row), so the sum is that of the exactly
dequantized weights times x, in another rounding order. The activations stay in x's dtype.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..triton_helpers import round_to, swiglu, use_pdl, wait_for_prior_kernels
from .fp8 import check_fp8_weight

__all__ = ["gemv", "gemv_rms_norm"]


@dataclass(frozen=True)
class GemvLaunch:
    block_n: int  # weight rows per program
    block_k: int
    warps: int


# Weights a program's tile holds at least: 2 rows of a 1024-wide stride, the smallest launch below.
MIN_TILE = 2048


def gemv_config(N: int, K: int, element_size: int = 2, gated: bool = False) -> GemvLaunch:
    """The launch for N weight rows of K: 1024-wide strides along K, and few rows per program, so
    that many programs stream at once: 2 for matrices under 8M weights of up to 4096 rows
    (Qwen3-0.6B's but its gate/up projection), 4 otherwise (Qwen3-8B's, where 2 rows, or 8 or
    more with 512-wide strides, stream slower). A gated launch splits its rows between gate and
    up. Rows shorter than a stride (K < 1024, no Qwen3 projection) take more rows per program, so
    that a tile still holds MIN_TILE weights: a program of a few hundred weights would cost more
    to schedule than to stream. One-byte (FP8) weights stream fastest in other tiles, by Qwen3-8B's
    shapes: 16 rows of 512 for a gated [gate; up] weight, 4 rows of 2048 for long rows (K >= 8192),
    8 of 512 for other matrices of 24M weights or more and 4 of 1024 below.
    docs/benchmarks/decode-notes.md has the measurements."""
    if element_size == 1:
        if gated:
            block_n, block_k = 16, 512
        elif K >= 8192:
            block_n, block_k = 4, 2048
        else:
            block_n, block_k = (8, 512) if N * K >= 24 * 2**20 else (4, 1024)
        block_k = min(block_k, triton.next_power_of_2(K))
        return GemvLaunch(max(block_n, MIN_TILE // block_k), block_k, 4)
    block_k = min(1024, triton.next_power_of_2(K))
    block_n = 2 if N * K < 8 * 2**20 and N <= 4096 else 4
    return GemvLaunch(max(block_n, MIN_TILE // block_k), block_k, 4)


@triton.jit
def _input_tile(X, R, NW, k, k_ok, rstd, dtype: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """The input row's values at columns k, in fp32, as the product reads them (see _gemv_kernel)."""
    x = tl.load(X + k, mask=k_ok, other=0.0)
    if NORM:
        if HAS_RESIDUAL:
            x = round_to(x.to(tl.float32) + tl.load(R + k, mask=k_ok, other=0.0).to(tl.float32), dtype)
        normalized = round_to(x.to(tl.float32) * rstd, dtype).to(tl.float32)
        x = round_to(normalized * tl.load(NW + k, mask=k_ok, other=0.0).to(tl.float32), dtype)
    return x.to(tl.float32)


@triton.jit
def _scaled(x, scales, k, k_ok, SCALED: tl.constexpr, SCALE_K: tl.constexpr):
    """x [BLOCK_K] (fp32) times the block scale of each of its columns k (an FP8 weight's, from
    its block row `scales`), so that w * result is the dequantized weight's product; x unscaled."""
    if SCALED:  # (an if-else: Triton compiles the statements after a constexpr branch's return too)
        scaled = x * tl.load(scales + k // SCALE_K, mask=k_ok, other=0.0)
    else:
        scaled = x
    return scaled


@triton.jit
def _gemv_kernel(X, R, NW, S, W, WS, B, Y, N, K, eps, WS_COLS, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                 NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SCALED: tl.constexpr, SCALE_N: tl.constexpr,
                 SCALE_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Outputs n of this program: y[n] = x . W[n] (+ B[n]), rounded once.
    GATED: W is [gate; up] (2N rows, B 2N values) and y[n] = silu(gate[n]) * up[n], gate[n] and
    up[n] each rounded as the projection's output would be, then the product as ops/linear/silu_mul.py
    rounds it.
    NORM: the row is rms_norm(X (+ R if HAS_RESIDUAL), NW, eps), rounded as ops/norm/rmsnorm_triton.py
    rounds it; the first program stores X + R to S.
    SCALED: W is FP8 with block scales WS [rows / SCALE_N, WS_COLS]; BLOCK_N divides SCALE_N, so
    a program's gate rows share one block row (and its up rows another)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    rows = W + n[:, None].to(tl.int64) * K  # gate rows when GATED
    if GATED:
        up_rows = W + (n + N)[:, None].to(tl.int64) * K
    gate_scales = WS + (tl.program_id(0) * BLOCK_N // SCALE_N) * WS_COLS  # SCALED: this program's block row
    up_scales = WS + ((tl.program_id(0) * BLOCK_N + N) // SCALE_N) * WS_COLS
    dtype = Y.dtype.element_ty
    # No kernel writes the weights, so the first tiles are loaded before waiting for the kernel
    # that writes X, their loads overlapping that kernel's last microseconds.
    k = tl.arange(0, BLOCK_K)
    tile_ok = n_ok[:, None] & (k < K)[None, :]
    w_first = tl.load(rows + k[None, :], mask=tile_ok, other=0.0)
    if GATED:
        w_up_first = tl.load(up_rows + k[None, :], mask=tile_ok, other=0.0)
    wait_for_prior_kernels(PDL)
    rstd = 0.0
    if NORM:  # first pass over the row: its sum of squares (and the residual sum, stored once)
        squares = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            x = tl.load(X + k, mask=k_ok, other=0.0)
            if HAS_RESIDUAL:
                x = round_to(x.to(tl.float32) + tl.load(R + k, mask=k_ok, other=0.0).to(tl.float32), dtype)
                tl.store(S + k, x, mask=k_ok & (tl.full([BLOCK_K], tl.program_id(0), tl.int32) == 0))
            squares += x.to(tl.float32) * x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    if GATED:
        acc_up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    # the first tile's products
    k = tl.arange(0, BLOCK_K)
    x = _input_tile(X, R, NW, k, k < K, rstd, dtype, NORM, HAS_RESIDUAL)
    acc += w_first.to(tl.float32) * _scaled(x, gate_scales, k, k < K, SCALED, SCALE_K)[None, :]
    if GATED:
        acc_up += w_up_first.to(tl.float32) * _scaled(x, up_scales, k, k < K, SCALED, SCALE_K)[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        tile_ok = n_ok[:, None] & k_ok[None, :]
        # The weight tiles are loaded first: their loads from memory are the long ones, and the
        # input row's (from L2) then wait in their shadow, not before them.
        w = tl.load(rows + k[None, :], mask=tile_ok, other=0.0)
        if GATED:
            w_up = tl.load(up_rows + k[None, :], mask=tile_ok, other=0.0)
        x = _input_tile(X, R, NW, k, k_ok, rstd, dtype, NORM, HAS_RESIDUAL)
        acc += w.to(tl.float32) * _scaled(x, gate_scales, k, k_ok, SCALED, SCALE_K)[None, :]
        if GATED:
            acc_up += w_up.to(tl.float32) * _scaled(x, up_scales, k, k_ok, SCALED, SCALE_K)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:  # added to the fp32 sum, rounded once
        y += tl.load(B + n, mask=n_ok, other=0.0).to(tl.float32)
    if GATED:
        up = tl.sum(acc_up, axis=1)
        if HAS_BIAS:
            up += tl.load(B + N + n, mask=n_ok, other=0.0).to(tl.float32)
        y = swiglu(y, up, dtype)
    tl.store(Y + n, round_to(y, Y.dtype.element_ty), mask=n_ok)


def _launch(x, weight, bias, gated, residual, norm_weight, eps, summed, scale, block) -> torch.Tensor:
    rows, K = weight.shape
    N = rows // 2 if gated else rows  # outputs
    y = x.new_empty(*x.shape[:-1], N)
    launch = gemv_config(rows, K, weight.element_size(), gated)
    block_n = max(1, launch.block_n // 2) if gated else launch.block_n  # gated: as many gate rows as up rows
    scaled = scale is not None
    if scaled:  # a program's rows within one block row
        block_n = min(block_n, block[0])
    norm = norm_weight is not None
    pdl = use_pdl(x.device)
    _gemv_kernel[(triton.cdiv(N, block_n),)](
        x, residual if residual is not None else x, norm_weight if norm else x, summed if summed is not None else x,
        weight, scale if scaled else x, bias if bias is not None else x, y, N, K, eps,
        scale.shape[1] if scaled else 1, HAS_BIAS=bias is not None, GATED=gated, NORM=norm,
        HAS_RESIDUAL=residual is not None, SCALED=scaled, SCALE_N=block[0] if scaled else 1,
        SCALE_K=block[1] if scaled else 1, BLOCK_N=block_n, BLOCK_K=launch.block_k, PDL=pdl,
        num_warps=launch.warps, launch_pdl=pdl)
    return y


@torch.library.custom_op("qwen3_ops::gemv", mutates_args=())
def _gemv_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool,
             scale: torch.Tensor | None, block: list[int]) -> torch.Tensor:
    return _launch(x, weight, bias, gated, None, None, 0.0, None, scale, block)


def _output(x: torch.Tensor, weight: torch.Tensor, gated: bool) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0] // 2 if gated else weight.shape[0])


@_gemv_op.register_fake
def _(x, weight, bias, gated, scale, block):
    return _output(x, weight, gated)


@torch.library.custom_op("qwen3_ops::gemv_rms_norm", mutates_args=())
def _gemv_rms_norm_op(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                      weight: torch.Tensor, bias: torch.Tensor | None, gated: bool, scale: torch.Tensor | None,
                      block: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    summed = torch.empty_like(x) if residual is not None else x.new_empty(0)
    y = _launch(x, weight, bias, gated, residual, norm_weight, eps, summed if residual is not None else None,
                scale, block)
    return y, summed


@_gemv_rms_norm_op.register_fake
def _(x, residual, norm_weight, eps, weight, bias, gated, scale, block):
    return _output(x, weight, gated), torch.empty_like(x) if residual is not None else x.new_empty(0)


def _check_row(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool,
               scale: torch.Tensor | None, block: tuple[int, int] | None) -> list[int]:
    """The checked block size as the ops take it ([] for a weight in x's dtype)."""
    K = weight.shape[-1] if weight.dim() == 2 else -1
    if weight.dim() != 2 or x.numel() != x.shape[-1] or x.shape[-1] != K or (gated and weight.shape[0] % 2):
        raise ValueError(f"gemv takes one row x [..., K] and weight [N, K]{' with N even (gated)' if gated else ''}, "
                         f"got {tuple(x.shape)} and {tuple(weight.shape)}")
    if bias is not None and (bias.shape != weight.shape[:1] or bias.dtype != x.dtype):
        raise ValueError("bias must be [N] in x's dtype")
    block = check_fp8_weight(weight, scale, block, x.dtype, gated)
    return list(block) if block else []


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gated: bool = False,
         scale: torch.Tensor | None = None, block: tuple[int, int] | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., K] holding one row; with gated, weight (and bias) hold
    [gate; up] rows and the result is silu(gate) * up of that product ([..., N / 2]). An FP8
    weight comes with its block scales `scale` and `block` (ops/linear/fp8.py's rules).
    Inference only (no backward)."""
    block = _check_row(x, weight, bias, gated, scale, block)
    return _gemv_op(x.contiguous(), weight.contiguous(), None if bias is None else bias.contiguous(), gated,
                    None if scale is None else scale.contiguous(), block)


def gemv_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                  weight: torch.Tensor, bias: torch.Tensor | None = None, gated: bool = False,
                  scale: torch.Tensor | None = None,
                  block: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(gemv(rms_norm(s, norm_weight, eps), weight, bias, gated), s) for one row x [..., K], with
    s = x + residual (residual None: s = x, nothing added): ops.fused_add_rms_norm's arithmetic,
    then gemv's. Inference only (no backward)."""
    block = _check_row(x, weight, bias, gated, scale, block)
    K = weight.shape[-1]
    if norm_weight.shape != (K,) or norm_weight.dtype != x.dtype:
        raise ValueError(f"norm_weight must be [K={K}] in x's dtype, got {tuple(norm_weight.shape)} "
                         f"{norm_weight.dtype}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual must match x {tuple(x.shape)} {x.dtype}, got {tuple(residual.shape)} "
                         f"{residual.dtype}")
    y, summed = _gemv_rms_norm_op(x.contiguous(), residual.contiguous() if residual is not None else None,
                                  norm_weight.contiguous(), float(eps), weight.contiguous(),
                                  None if bias is None else bias.contiguous(), gated,
                                  None if scale is None else scale.contiguous(), block)
    return y, summed if residual is not None else x
