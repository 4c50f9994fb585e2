"""One row through a linear layer: y = x @ W^T for x [1, K], W [N, K] (nn.Linear's layout).

    y = gemv(x, weight, bias=None)

A batch-1 decode step is a chain of such products, each streaming a weight matrix of a few MB
once. cuBLAS's kernels for these shapes leave much of the bandwidth unused (split-K ones add a reduction
kernel); this one streams W in [BLOCK_N, BLOCK_K] tiles, each program owning BLOCK_N outputs
and reducing over all of K in fp32 (docs/benchmarks/decode-notes.md has the measurements).
Products are summed in another order than cuBLAS's, so results differ from F.linear's by fp32
rounding before the final rounding to the output dtype.
"""

import torch
import triton
import triton.language as tl

from .triton_helpers import round_to

__all__ = ["gemv"]


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
def _gemv_kernel(X, W, B, Y, N, K, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """GATED: X is [gate | up] (2K values) and the row is silu(gate) * up, rounded as silu_mul
    rounds it (ops/silu_mul.py): SwiGLU's product fused into the down projection."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        w = tl.load(W + n[:, None].to(tl.int64) * K + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(X + k, mask=k_ok, other=0.0)
        if GATED:
            gate = x.to(tl.float32)
            up = tl.load(X + K + k, mask=k_ok, other=0.0).to(tl.float32)
            silu = round_to(gate / (1.0 + tl.exp(-gate)), W.dtype.element_ty).to(tl.float32)
            x = round_to(silu * up, W.dtype.element_ty)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:  # added to the fp32 sum, rounded once
        y += tl.load(B + n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(Y + n, y.to(Y.dtype.element_ty), mask=n_ok)


@torch.library.custom_op("qwen3_ops::gemv", mutates_args=())
def _gemv_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool) -> torch.Tensor:
    N, K = weight.shape
    y = x.new_empty(*x.shape[:-1], N)
    block_n, block_k, warps = gemv_config(N, K)
    _gemv_kernel[(triton.cdiv(N, block_n),)](x, weight, bias if bias is not None else x, y, N, K,
                                             HAS_BIAS=bias is not None, GATED=gated, BLOCK_N=block_n,
                                             BLOCK_K=block_k, num_warps=warps)
    return y


@_gemv_op.register_fake
def _(x, weight, bias, gated):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gated: bool = False) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., K] holding one row; with gated, F.linear(silu(gate) * up,
    weight, bias) for x = [gate | up] [..., 2K]. Inference only (no backward)."""
    K = weight.shape[-1] if weight.dim() == 2 else -1
    if x.numel() != x.shape[-1] or x.shape[-1] != (2 * K if gated else K):
        raise ValueError(f"gemv takes one row x [..., {'2K' if gated else 'K'}] and weight [N, K], got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype != weight.dtype or (bias is not None and (bias.shape != weight.shape[:1] or bias.dtype != x.dtype)):
        raise ValueError("x, weight and bias must share a dtype, and bias must be [N]")
    return _gemv_op(x.contiguous(), weight.contiguous(), bias, gated)
