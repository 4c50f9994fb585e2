"""A few rows through a linear layer: y = x @ W^T for x [M, K] with M up to ~64, W [N, K].

    y = skinny_linear(x, weight, bias=None)

A decode step over a batch of 2-64 rows multiplies each weight matrix by a few rows: the product
is bound by streaming the weights once, as at one row (ops/gemv.py), not by arithmetic. Each
program owns BLOCK_N outputs of BLOCK_M rows and streams its [BLOCK_N, K] slice of W through
tl.dot in pipelined [BLOCK_N, BLOCK_K] tiles. Where N alone gives too few programs to keep the
GPU's memory system busy (Qwen3-0.6B's o and down projections: 1,024 outputs), K is split over
SPLIT programs that write fp32 partial sums, and a second kernel adds them in a fixed order (so a
result never depends on timing), adds the bias and rounds once to the output dtype. Both launch
with programmatic dependent launch, as the other decode kernels do (ops/triton_helpers.py).
Products are summed in another order than cuBLAS's, so results differ from F.linear's by fp32
rounding before the final rounding to the output dtype.
"""

import torch
import triton
import triton.language as tl

from .triton_helpers import dot, round_to, use_pdl, wait_for_prior_kernels

__all__ = ["faster_than_cublas", "skinny_linear"]

TARGET_PROGRAMS = 128  # about one program per SM of an H100/H200


def faster_than_cublas(rows: int, weight: torch.Tensor) -> bool:
    """Whether a product of `rows` rows (a batched decode step's, or a prompt's of up to 64 tokens)
    with `weight` takes this kernel on the model's fused path: 2-64 rows by 16-bit matrices of
    under 8M weights (Qwen3-0.6B's; a tensor-parallel rank's shard counts by its own size), where
    cuBLAS's kernels of a few microseconds leave bandwidth unused. At 8B's sizes cuBLAS streams as
    fast or faster (docs/benchmarks/decode-notes.md has both); fp32 stays with cuBLAS."""
    return 1 < rows <= 64 and weight.numel() < 8 * 2**20 and weight.element_size() == 2


def skinny_config(M: int, N: int, K: int) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT, num_warps, num_stages): 32 outputs per program (64 for
    N >= 6144), 128-wide tiles along K, pipelined 4 deep; K split in powers of two while there are
    fewer than TARGET_PROGRAMS programs and each part keeps at least 4 tiles."""
    block_m = min(64, max(16, triton.next_power_of_2(M)))
    block_n, block_k = (64 if N >= 6144 else 32), 128
    programs = triton.cdiv(N, block_n) * triton.cdiv(M, block_m)
    split = 1
    while programs * split * 2 <= TARGET_PROGRAMS and K // (split * 2) >= 4 * block_k:
        split *= 2
    return block_m, block_n, block_k, split, 4, 4


@triton.jit
def _skinny_kernel(X, W, B, Y, PARTIAL, M, N, K, K_PER_SPLIT, HAS_BIAS: tl.constexpr,
                   STORE_PARTIAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   IEEE: tl.constexpr, PDL: tl.constexpr):
    """Rows m, outputs n, the K_PER_SPLIT columns of program_id(2): y stored, bias added to the
    fp32 sum; or with STORE_PARTIAL the fp32 sum stored to PARTIAL [SPLIT, M, N]."""
    wait_for_prior_kernels(PDL)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < M, n < N
    x_row = m[:, None].to(tl.int64) * K
    w_row = n[:, None].to(tl.int64) * K
    k_start = tl.program_id(2) * K_PER_SPLIT
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_start, k_start + K_PER_SPLIT, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        w = tl.load(W + w_row + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(X + x_row + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc += dot(x, tl.trans(w), IEEE)
    out = m[:, None].to(tl.int64) * N + n[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    if not STORE_PARTIAL:
        if HAS_BIAS:
            acc += tl.load(B + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + out, round_to(acc, Y.dtype.element_ty), mask=mask)
    else:
        tl.store(PARTIAL + tl.program_id(2).to(tl.int64) * M * N + out, acc, mask=mask)


@triton.jit
def _sum_splits_kernel(PARTIAL, B, Y, MN, N, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
                       PDL: tl.constexpr):
    """Y = sum over the SPLIT partials in increasing order (+ bias), rounded once."""
    wait_for_prior_kernels(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < MN
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(PARTIAL + s * MN + i, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(B + i % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + i, round_to(acc, Y.dtype.element_ty), mask=ok)


SUM_BLOCK = 1024


@torch.library.custom_op("qwen3_ops::skinny_linear", mutates_args=())
def _skinny_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    N, K = weight.shape
    y = x.new_empty(*x.shape[:-1], N)
    M = y.numel() // N if N else 0
    if M == 0:
        return y
    block_m, block_n, block_k, split, warps, stages = skinny_config(M, N, K)
    k_per_split = triton.cdiv(triton.cdiv(K, split), block_k) * block_k
    split = triton.cdiv(K, k_per_split)
    partial = x.new_empty(split * M * N if split > 1 else 0, dtype=torch.float32)
    pdl = use_pdl(x.device)
    bias_or_x = bias if bias is not None else x
    _skinny_kernel[(triton.cdiv(N, block_n), triton.cdiv(M, block_m), split)](
        x, weight, bias_or_x, y, partial, M, N, K, k_per_split, HAS_BIAS=bias is not None, STORE_PARTIAL=split > 1,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=x.dtype == torch.float32, PDL=pdl, num_warps=warps,
        num_stages=stages, launch_pdl=pdl)
    if split > 1:
        _sum_splits_kernel[(triton.cdiv(M * N, SUM_BLOCK),)](
            partial, bias_or_x, y, M * N, N, HAS_BIAS=bias is not None, SPLIT=split, BLOCK=SUM_BLOCK, PDL=pdl,
            num_warps=4, launch_pdl=pdl)
    return y


@_skinny_op.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., K]: any number of rows, fast for a few. Inference only."""
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1] or not weight.shape[1]:
        raise ValueError(f"skinny_linear takes x [..., K] and weight [N, K] with K >= 1, got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if x.dtype != weight.dtype or (bias is not None and (bias.shape != weight.shape[:1] or bias.dtype != x.dtype)):
        raise ValueError("x, weight and bias must share a dtype, and bias must be [N]")
    return _skinny_op(x.contiguous(), weight.contiguous(), None if bias is None else bias.contiguous())
