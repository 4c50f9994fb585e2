"""One row through a linear layer: y = x @ W^T for x [1, K], W [N, K] (nn.Linear's layout).

    y = gemv(x, weight, bias=None)
    y, s = gemv_rms_norm(x, residual, norm_weight, eps, weight)  # F.linear(rms_norm(x + residual)), s = x + residual

A batch-1 decode step is a chain of such products, each streaming a weight matrix of a few MB
once. cuBLAS's kernels for these shapes leave much of the bandwidth unused (split-K ones add a reduction
kernel); this one streams W in [BLOCK_N, BLOCK_K] tiles, each program owning BLOCK_N outputs
and reducing over all of K in fp32 (docs/benchmarks/decode-notes.md has the measurements).
Products are summed in another order than cuBLAS's, so results differ from F.linear's by fp32
rounding before the final rounding to the output dtype.

gemv_rms_norm puts the decoder's residual add and RMSNorm in front of the product: every program
reads the whole input row anyway, so each also sums its squares and normalizes it as
ops.fused_add_rms_norm does (the same roundings), and the first program stores the sum for the
next residual add. A batch-1 decode step then has no separate norm kernels between projections.
"""

import torch
import triton
import triton.language as tl

from .triton_helpers import round_to, use_pdl, wait_for_prior_kernels

__all__ = ["gemv", "gemv_rms_norm"]


def gemv_config(N: int, K: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps). Small matrices (Qwen3-0.6B's, < 8M weights): 2-4 outputs per
    program and 1024-wide strides along K, so that many programs stream at once. Large ones (8B's):
    programs of 4-32 outputs, enough to cover the SMs twice, 512 wide: fewer programs re-read the
    input row (the gated down projection recomputes silu(gate) * up in each, so 2 outputs per
    program would re-read a 48 KB row thousands of times). docs/benchmarks/decode-notes.md has
    the whole-model measurements behind both."""
    if N * K < 8 * 2**20:
        return (2 if N <= 4096 else 4), min(1024, triton.next_power_of_2(K)), 4
    block_n = 4
    while block_n < 32 and N // (block_n * 2) >= 264:
        block_n *= 2
    return block_n, min(512, triton.next_power_of_2(K)), 4


@triton.jit
def _gemv_kernel(X, R, NW, S, W, B, Y, N, K, eps, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                 NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PDL: tl.constexpr):
    """GATED: X is [gate | up] (2K values) and the row is silu(gate) * up, rounded as silu_mul
    rounds it (ops/silu_mul.py): SwiGLU's product fused into the down projection.
    NORM: the row is rms_norm(X (+ R if HAS_RESIDUAL), NW, eps), rounded as ops/rmsnorm_triton.py
    rounds it; the first program stores X + R to S."""
    wait_for_prior_kernels(PDL)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    dtype = W.dtype.element_ty
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
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        w = tl.load(W + n[:, None].to(tl.int64) * K + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(X + k, mask=k_ok, other=0.0)
        if GATED:
            gate = x.to(tl.float32)
            up = tl.load(X + K + k, mask=k_ok, other=0.0).to(tl.float32)
            silu = round_to(gate / (1.0 + tl.exp(-gate)), dtype).to(tl.float32)
            x = round_to(silu * up, dtype)
        if NORM:
            if HAS_RESIDUAL:
                x = round_to(x.to(tl.float32) + tl.load(R + k, mask=k_ok, other=0.0).to(tl.float32), dtype)
            normalized = round_to(x.to(tl.float32) * rstd, dtype).to(tl.float32)
            x = round_to(normalized * tl.load(NW + k, mask=k_ok, other=0.0).to(tl.float32), dtype)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:  # added to the fp32 sum, rounded once
        y += tl.load(B + n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(Y + n, y.to(Y.dtype.element_ty), mask=n_ok)


def _launch(x, weight, bias, gated, residual, norm_weight, eps, summed) -> torch.Tensor:
    N, K = weight.shape
    y = x.new_empty(*x.shape[:-1], N)
    block_n, block_k, warps = gemv_config(N, K)
    norm = norm_weight is not None
    pdl = use_pdl(x.device)
    _gemv_kernel[(triton.cdiv(N, block_n),)](
        x, residual if residual is not None else x, norm_weight if norm else x, summed if summed is not None else x,
        weight, bias if bias is not None else x, y, N, K, eps, HAS_BIAS=bias is not None, GATED=gated, NORM=norm,
        HAS_RESIDUAL=residual is not None, BLOCK_N=block_n, BLOCK_K=block_k, PDL=pdl, num_warps=warps,
        launch_pdl=pdl)
    return y


@torch.library.custom_op("qwen3_ops::gemv", mutates_args=())
def _gemv_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool) -> torch.Tensor:
    return _launch(x, weight, bias, gated, None, None, 0.0, None)


@_gemv_op.register_fake
def _(x, weight, bias, gated):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("qwen3_ops::gemv_rms_norm", mutates_args=())
def _gemv_rms_norm_op(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                      weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    summed = torch.empty_like(x) if residual is not None else x.new_empty(0)
    y = _launch(x, weight, bias, False, residual, norm_weight, eps, summed if residual is not None else None)
    return y, summed


@_gemv_rms_norm_op.register_fake
def _(x, residual, norm_weight, eps, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0]), torch.empty_like(x) if residual is not None else x.new_empty(0)


def _check_row(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, width: int, what: str) -> None:
    if weight.dim() != 2 or x.numel() != x.shape[-1] or x.shape[-1] != width:
        raise ValueError(f"gemv takes one row x [..., {what}] and weight [N, K], got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype != weight.dtype or (bias is not None and (bias.shape != weight.shape[:1] or bias.dtype != x.dtype)):
        raise ValueError("x, weight and bias must share a dtype, and bias must be [N]")


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gated: bool = False) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., K] holding one row; with gated, F.linear(silu(gate) * up,
    weight, bias) for x = [gate | up] [..., 2K]. Inference only (no backward)."""
    K = weight.shape[-1] if weight.dim() == 2 else -1
    _check_row(x, weight, bias, 2 * K if gated else K, "2K" if gated else "K")
    return _gemv_op(x.contiguous(), weight.contiguous(), None if bias is None else bias.contiguous(), gated)


def gemv_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                  weight: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(F.linear(rms_norm(s, norm_weight, eps), weight, bias), s) for one row x [..., K], with
    s = x + residual (residual None: s = x, nothing added): ops.fused_add_rms_norm's arithmetic,
    then gemv's. Inference only (no backward)."""
    K = weight.shape[-1] if weight.dim() == 2 else -1
    _check_row(x, weight, bias, K, "K")
    if norm_weight.shape != (K,) or norm_weight.dtype != x.dtype:
        raise ValueError(f"norm_weight must be [K={K}] in x's dtype, got {tuple(norm_weight.shape)} "
                         f"{norm_weight.dtype}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual must match x {tuple(x.shape)} {x.dtype}, got {tuple(residual.shape)} "
                         f"{residual.dtype}")
    y, summed = _gemv_rms_norm_op(x.contiguous(), residual.contiguous() if residual is not None else None,
                                  norm_weight.contiguous(), float(eps), weight.contiguous(),
                                  None if bias is None else bias.contiguous())
    return y, summed if residual is not None else x
