"""A few rows through a linear layer: y = x @ W^T for x [M, K] with M up to ~64, W [N, K].

    y = skinny_linear(x, weight, bias=None)
    a = skinny_linear(x, gate_up_weight, gated=True)   # silu(x @ W_gate^T) * (x @ W_up^T)

A decode step over a batch of 2-64 rows multiplies each weight matrix by a few rows: the product
is bound by streaming the weights once, as at one row (ops/linear/gemv.py), not by arithmetic. Each
program owns BLOCK_N outputs of BLOCK_M rows and streams its [BLOCK_N, K] slice of W through
tl.dot in pipelined [BLOCK_N, BLOCK_K] tiles. Where N alone gives too few programs to keep the
GPU's memory system busy (Qwen3-0.6B's o and down projections: 1,024 outputs), K is split over
SPLIT programs that write fp32 partial sums, and a second kernel adds them in a fixed order (so a
result never depends on timing), adds the bias and rounds once to the output dtype. Both launch
with programmatic dependent launch, as the other decode kernels do (ops/triton_helpers.py).
Products are summed in another order than cuBLAS's, so results differ from F.linear's by fp32
rounding before the final rounding to the output dtype.

gated=True takes a fused [gate; up] weight [2F, K] (an MLP's gate_up_proj) and returns SwiGLU's
product silu(gate) * up [M, F], as ops/linear/gemv.py does at one row: a program streams W's rows n and
F + n for its outputs n, and the gate is applied where the sums are rounded, in either kernel.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..triton_helpers import dot, round_to, swiglu, use_pdl, wait_for_prior_kernels
from .fp8 import check_fp8_weight, quantize_groups

__all__ = ["faster_than_cublas", "skinny_linear"]

TARGET_PROGRAMS = 128  # about one program per SM of an H100/H200


def faster_than_cublas(rows: int, weight: torch.Tensor) -> bool:
    """Whether a product of `rows` rows (a batched decode step's, or a prompt's of up to 64 tokens)
    with `weight` takes this kernel on the model's fused path: 2-64 rows by 16-bit matrices of
    under 8M weights (Qwen3-0.6B's; a tensor-parallel rank's shard counts by its own size), where
    cuBLAS's kernels of a few microseconds leave bandwidth unused. At 8B's sizes cuBLAS streams as
    fast or faster (docs/benchmarks/decode-notes.md has both); fp32 stays with cuBLAS."""
    return 1 < rows <= 64 and weight.numel() < 8 * 2**20 and weight.element_size() == 2


def takes_fp8(rows: int) -> bool:
    """Whether a product of `rows` rows by an FP8 weight takes this kernel (which reads the weight
    as stored, one byte a weight) rather than dequantize-then-cuBLAS: 2-64 rows, any size."""
    return 1 < rows <= 64


@dataclass(frozen=True)
class SkinnyLaunch:
    block_m: int
    block_n: int  # outputs per program (gated: gate rows, and as many up rows)
    block_k: int
    split: int  # programs along K, each summing k_per_split columns
    k_per_split: int
    warps: int
    stages: int


def skinny_launch(M: int, N: int, K: int, gated: bool = False, scale_k: int | None = None) -> SkinnyLaunch:
    """32 weight rows per program (64 for N >= 6144 rows), 128-wide tiles along K, pipelined 4
    deep; K split in powers of two while there are fewer than TARGET_PROGRAMS programs and each
    part keeps at least 4 tiles (then trimmed so that no part starts past K). N counts W's rows.
    An FP8 weight (scale_k: its block's width) takes 64 rows at any size, and tiles within one
    block column."""
    block_m = min(64, max(16, triton.next_power_of_2(M)))
    block_n = 64 if N >= 6144 or scale_k is not None else 32
    block_k = 128 if scale_k is None else min(128, scale_k)
    programs = triton.cdiv(N, block_n) * triton.cdiv(M, block_m)
    split = 1
    while programs * split * 2 <= TARGET_PROGRAMS and K // (split * 2) >= 4 * block_k:
        split *= 2
    k_per_split = triton.cdiv(triton.cdiv(K, split), block_k) * block_k
    return SkinnyLaunch(block_m, block_n // 2 if gated else block_n, block_k, triton.cdiv(K, k_per_split),
                        k_per_split, 4, 4)


@triton.jit
def _tile_product(x, w, WS, n, n_ok, XS, m, m_ok, k0, K, WS_COLS, XS_COLS, SCALED: tl.constexpr,
                  A8: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, IEEE: tl.constexpr,
                  DTYPE: tl.constexpr):
    """x [BLOCK_M, BLOCK_K] @ w [BLOCK_N (rows n), BLOCK_K]^T in fp32, [BLOCK_M, BLOCK_N]. SCALED:
    w is FP8, converted to x's dtype DTYPE (exact: every e4m3 value is a bf16 and an fp16 one),
    and the product is returned transposed, [BLOCK_N, BLOCK_M] (the weight the dot's first
    operand), each row times its block scale in the block column of k0.
    A8: x is FP8 too, in groups of SCALE_K columns scaled by XS [M, XS_COLS]: an FP8 tensor-core
    product of the two as stored, times both scales."""
    if SCALED:  # (an if-else: Triton compiles the statements after a constexpr branch's return too)
        # A tile past K (the last split's may be) has zero weights: any column's scale keeps it 0.
        column = tl.minimum(k0 // SCALE_K, WS_COLS - 1)
        s = tl.load(WS + (n // SCALE_N) * WS_COLS + column, mask=n_ok, other=0.0)
        if A8:
            xs = tl.load(XS + m * XS_COLS + column, mask=m_ok, other=0.0)
            product = dot(w, tl.trans(x), False) * s[:, None] * xs[None, :]
        else:
            product = dot(w.to(DTYPE), tl.trans(x), IEEE) * s[:, None]
    else:
        product = dot(x, tl.trans(w), IEEE)
    return product


@triton.jit
def _skinny_kernel(X, XS, W, WS, B, Y, PARTIAL, M, N, K, K_PER_SPLIT, WS_COLS, XS_COLS, HAS_BIAS: tl.constexpr,
                   GATED: tl.constexpr, STORE_PARTIAL: tl.constexpr, SCALED: tl.constexpr, A8: tl.constexpr,
                   SCALE_N: tl.constexpr,
                   SCALE_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   IEEE: tl.constexpr, PDL: tl.constexpr):
    """Rows m, outputs n, the K_PER_SPLIT columns of program_id(2): y stored, bias added to the
    fp32 sum; or with STORE_PARTIAL the fp32 sum stored to PARTIAL [SPLIT, M, N] (GATED: the
    gate's and the up projection's, [SPLIT, M, 2N]). GATED: W and B hold [gate; up], 2N rows.
    SCALED: W is FP8 with block scales WS [rows / SCALE_N, WS_COLS]; a tile's product (BLOCK_K
    within one block column) is multiplied by its rows' scales in fp32. A8: X is FP8 too, with
    scales XS [M, XS_COLS] per SCALE_K columns (quantize_groups)."""
    wait_for_prior_kernels(PDL)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < M, n < N
    x_row = m[:, None].to(tl.int64) * K
    w_row = n[:, None].to(tl.int64) * K
    k_start = tl.program_id(2) * K_PER_SPLIT
    # SCALED: the sums accumulate transposed, [BLOCK_N, BLOCK_M] (_tile_product), and turn at the end.
    shape: tl.constexpr = [BLOCK_N, BLOCK_M] if SCALED else [BLOCK_M, BLOCK_N]
    acc = tl.zeros(shape, tl.float32)
    if GATED:  # the up rows n + N beside the gate rows n
        up_row = (n + N)[:, None].to(tl.int64) * K
        acc_up = tl.zeros(shape, tl.float32)
    for k0 in range(k_start, k_start + K_PER_SPLIT, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(X + x_row + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(W + w_row + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += _tile_product(x, w, WS, n, n_ok, XS, m, m_ok, k0, K, WS_COLS, XS_COLS, SCALED, A8, SCALE_N,
                             SCALE_K, IEEE, X.dtype.element_ty)
        if GATED:
            w_up = tl.load(W + up_row + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc_up += _tile_product(x, w_up, WS, n + N, n_ok, XS, m, m_ok, k0, K, WS_COLS, XS_COLS, SCALED, A8,
                                    SCALE_N, SCALE_K, IEEE, X.dtype.element_ty)
    if SCALED:
        acc = tl.trans(acc)
        if GATED:
            acc_up = tl.trans(acc_up)
    mask = m_ok[:, None] & n_ok[None, :]
    if not STORE_PARTIAL:
        if HAS_BIAS:
            acc += tl.load(B + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            if GATED:
                acc_up += tl.load(B + N + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc = swiglu(acc, acc_up, Y.dtype.element_ty)
        tl.store(Y + m[:, None].to(tl.int64) * N + n[None, :], round_to(acc, Y.dtype.element_ty), mask=mask)
    else:
        width = 2 * N if GATED else N
        out = tl.program_id(2).to(tl.int64) * M * width + m[:, None].to(tl.int64) * width + n[None, :]
        tl.store(PARTIAL + out, acc, mask=mask)
        if GATED:
            tl.store(PARTIAL + out + N, acc_up, mask=mask)


@triton.jit
def _sum_splits_kernel(PARTIAL, B, Y, M, N, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, SPLIT: tl.constexpr,
                       BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Y [M, N] = the sum over the SPLIT partials in increasing order (+ bias), rounded once;
    GATED: silu(gate) * up of the summed gate and up halves."""
    wait_for_prior_kernels(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < M * N
    row, col = i // N, i % N
    width = 2 * N if GATED else N
    src = row.to(tl.int64) * width + col
    acc = tl.zeros([BLOCK], tl.float32)
    if GATED:
        acc_up = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(PARTIAL + s * M * width + src, mask=ok, other=0.0)
        if GATED:
            acc_up += tl.load(PARTIAL + s * M * width + src + N, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(B + col, mask=ok, other=0.0).to(tl.float32)
        if GATED:
            acc_up += tl.load(B + N + col, mask=ok, other=0.0).to(tl.float32)
    if GATED:
        acc = swiglu(acc, acc_up, Y.dtype.element_ty)
    tl.store(Y + i, round_to(acc, Y.dtype.element_ty), mask=ok)


SUM_BLOCK = 1024


@torch.library.custom_op("qwen3_ops::skinny_linear", mutates_args=())
def _skinny_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool,
               scale: torch.Tensor | None, block: list[int], fp8_activations: bool) -> torch.Tensor:
    rows, K = weight.shape
    N = rows // 2 if gated else rows  # outputs
    y = x.new_empty(*x.shape[:-1], N)
    M = y.numel() // N if N else 0
    if M == 0:
        return y
    scaled = scale is not None
    x_scale = x  # A8: the activations' scales
    if fp8_activations:
        x, x_scale = quantize_groups(x.reshape(M, K), block[1])
    launch = skinny_launch(M, rows, K, gated, block[1] if scaled else None)
    partial = x.new_empty(launch.split * M * rows if launch.split > 1 else 0, dtype=torch.float32)
    pdl = use_pdl(x.device)
    grid = (triton.cdiv(N, launch.block_n), triton.cdiv(M, launch.block_m), launch.split)
    _skinny_kernel[grid](
        x, x_scale, weight, scale if scaled else x, bias, y, partial, M, N, K, launch.k_per_split,
        scale.shape[1] if scaled else 1, x_scale.shape[-1], HAS_BIAS=bias is not None, GATED=gated,
        STORE_PARTIAL=launch.split > 1, SCALED=scaled, A8=fp8_activations,
        SCALE_N=block[0] if scaled else 1, SCALE_K=block[1] if scaled else 1,
        BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k,
        IEEE=y.dtype == torch.float32, PDL=pdl, num_warps=launch.warps, num_stages=launch.stages, launch_pdl=pdl)
    if launch.split > 1:
        _sum_splits_kernel[(triton.cdiv(M * N, SUM_BLOCK),)](
            partial, bias, y, M, N, HAS_BIAS=bias is not None, GATED=gated, SPLIT=launch.split, BLOCK=SUM_BLOCK,
            PDL=pdl, num_warps=4, launch_pdl=pdl)
    return y


@_skinny_op.register_fake
def _(x, weight, bias, gated, scale, block, fp8_activations):
    return x.new_empty(*x.shape[:-1], weight.shape[0] // 2 if gated else weight.shape[0])


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gated: bool = False,
                  scale: torch.Tensor | None = None, block: tuple[int, int] | None = None,
                  fp8_activations: bool = False) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., K]: any number of rows, fast for a few. With gated,
    weight (and bias) hold [gate; up] rows and the result is silu(gate) * up of that product
    ([..., N / 2]). An FP8 weight comes with its block scales `scale` and `block`
    (ops/linear/fp8.py's rules); with fp8_activations, x is quantized too, per block[1] columns of
    each row (ops/linear/fp8.py's quantize_groups), and the products run on FP8 tensor cores
    (w8a8, as transformers' and vLLM's FP8 linear layers compute). Inference only."""
    if (weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1] or not weight.shape[1]
            or (gated and weight.shape[0] % 2)):
        raise ValueError(f"skinny_linear takes x [..., K] and weight [N, K] with K >= 1"
                         f"{' and N even (gated)' if gated else ''}, got {tuple(x.shape)} and {tuple(weight.shape)}")
    if bias is not None and (bias.shape != weight.shape[:1] or bias.dtype != x.dtype):
        raise ValueError("bias must be [N] in x's dtype")
    block = check_fp8_weight(weight, scale, block, x.dtype, gated)
    if fp8_activations and block is None:
        raise ValueError("fp8_activations takes an FP8 weight")
    return _skinny_op(x.contiguous(), weight.contiguous(), None if bias is None else bias.contiguous(), gated,
                      None if scale is None else scale.contiguous(), list(block) if block else [], fp8_activations)
