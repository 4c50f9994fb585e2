"""A mixture-of-experts SwiGLU for routed tokens, as grouped GEMMs over the tokens sorted by expert.

    y = fused_moe(x, w13, w2, topk_weights, topk_ids)
    # x [N, D]; w13 [E, 2I, D] = each expert's [gate | up] rows; w2 [E, D, I]
    # topk_weights, topk_ids [N, k]: the experts each token is sent to, and their weights

Each token goes to its k experts: y[n] = sum_j topk_weights[n, j] * expert_{topk_ids[n, j]}(x[n]),
expert_e(x) = w2[e] @ (silu(w13[e, :I] @ x) * (w13[e, I:] @ x)).

Decode (at most PAIR_PATH_MAX_PAIRS pairs, e.g. batch 8 at k = 8): no routing plan. Each
(token, expert) pair is its own row of work: one program per (pair, BLOCK_N output columns) reads
its expert's weight rows once, as a GEMV does. Two pairs that share an expert read its weights
twice, which costs less than sorting when the pairs are few and mostly hit different experts.
Two launches: gate/up per pair; then per (token, BLOCK_N output columns) the down projections of
the token's k pairs and their sum (the combine below, in the same order and rounding).

Prefill and large batches: grouped GEMMs over the pairs sorted by expert.
1. Routing plan (torch ops on the device, no host sync, shapes from N, k and E alone): the N*k
   (token, expert) pairs are sorted by expert; each expert's run of pairs is cut into tiles of
   BLOCK_M rows. The number of tiles depends on the routing, so the grid is its upper bound
   (N*k/BLOCK_M rounded up, plus one partly-filled tile per expert that has pairs) and tiles past
   the last exit at once. A batch-1 decode step is then a fixed sequence of launches, which a
   CUDA graph replays.
2. gate/up: one program per (tile, BLOCK_N columns of I) gathers its tokens' rows of x and
   multiplies them by its expert's gate and up rows; SiLU-and-multiply in the epilogue.
3. down: the same tiles times w2[e], each row multiplied by its routing weight, written to its pair.
4. combine: each token's k rows summed in increasing expert id.

FP8 experts (w13, w2 float8_e4m3fn with block scales [E, rows / block[0], cols / block[1]], as
Qwen's FP8 checkpoints hold them: ops/linear/fp8.py) are read as stored and dequantized in
registers: each tile (within one block column) is converted to the activations' dtype, exactly,
and its fp32 partial sum multiplied by its rows' block scales.

Rounding follows transformers' Qwen3MoeExperts in the activations' dtype: gate and up rounded, silu
rounded, the product rounded; the down projection rounded, then times the routing weight
(rounded); the k results added to zero one at a time in increasing expert id, each sum rounded
(its index_add_ loop over the experts that received tokens).
"""

import torch
import triton
import triton.language as tl

from ..linear.fp8 import check_fp8_weight
from ..triton_helpers import dot, round_to, swiglu, use_pdl, wait_for_prior_kernels

__all__ = ["fused_moe", "fused_moe_reference", "routing_plan"]

PAIR_PATH_MAX_PAIRS = 64  # (token, expert) pairs up to which each pair is computed on its own


def pair_config(K: int, N: int, scale_k: int = 512) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) of the gate/up pair kernel over N output rows of K values: 8 output rows
    per program, so that even one pair's GEMV spreads over every SM (I = 768 gate/up rows: 96
    programs per pair); K in chunks of up to 512 that divide it where one can (K = 768: 3 x 256,
    not 2 x 512 with a quarter of the second masked off). Rows shorter than that (no Qwen3-MoE's)
    take more rows per program, up to N, so that a tile still holds 4K weights. An FP8 weight's
    tiles lie within one block column (scale_k wide)."""
    block_k = triton.next_power_of_2(K) if K <= 512 else next((b for b in (512, 256, 128) if K % b == 0), 512)
    return min(max(8, 4096 // block_k), max(8, triton.next_power_of_2(N))), min(block_k, scale_k)


def down_combine_config(I: int, top_k: int, D: int, scale_k: int = 8192) -> tuple[int, int, int]:  # noqa: E741
    """(BLOCK_N, BLOCK_K, num_warps) of the down-and-combine pair kernel over D output columns:
    each program holds a [k, BLOCK_N, BLOCK_K] tile of its token's k experts' weights; 8 output
    columns x k experts, BLOCK_K chosen so that the tile stays at 8K elements (32 per thread of 8
    warps). Where I is too short for that (no Qwen3-MoE's), more columns, up to D, fill the tile."""
    k_pow2 = triton.next_power_of_2(top_k)
    block_k = max(16, min(triton.next_power_of_2(I), 8192 // (8 * k_pow2), scale_k))
    block_n = min(max(8, 8192 // (k_pow2 * block_k)), max(8, triton.next_power_of_2(D)))
    return block_n, block_k, 8


def tile_config(pairs: int, scale_k: int = 64) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) of the sorted path: 16-row tiles while few pairs share an
    expert (batched decode), 64 for prefill; not tuned yet. FP8: tiles within a block column."""
    return (16 if pairs <= 256 else 64), 64, min(64, scale_k)


@triton.jit
def _block_scales(S, rows, row_ok, scale_col, S_COLS, SCALE_N: tl.constexpr):
    """The block scales of an FP8 expert's weight rows `rows` (any shape) in block column
    scale_col, from S, that expert's scales [rows / SCALE_N, S_COLS]."""
    return tl.load(S + (rows // SCALE_N) * S_COLS + scale_col, mask=row_ok, other=0.0)


def routing_plan(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """(order, tile_expert, tile_row0, tile_row_end) of the sorted (token, expert) pairs:
    order [N*k]: the pair indices (n * k + j) sorted by expert id (stable);
    tile_expert [tiles] int32: each tile's expert (num_experts: no tile, the program exits);
    tile_row0, tile_row_end [tiles] int32: the tile's rows [row0, row_end) of `order`.
    Only device-side torch ops whose shapes follow from the input's shape: no host sync."""
    flat = topk_ids.reshape(-1).long()  # [N*k]
    pairs = flat.numel()
    order = torch.sort(flat, stable=True).indices.to(torch.int32)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E] pairs per expert (bincount would sync)
    pair_start = counts.cumsum(0) - counts  # [E] each expert's first row in `order`
    tiles = (counts + block_m - 1) // block_m  # [E]
    tile_end = tiles.cumsum(0)
    max_tiles = triton.cdiv(pairs, block_m) + min(num_experts, pairs)
    t = torch.arange(max_tiles, device=flat.device)
    tile_expert = torch.searchsorted(tile_end, t, right=True)  # [tiles] num_experts past the last tile
    e = tile_expert.clamp(max=num_experts - 1)
    row0 = pair_start[e] + (t - (tile_end[e] - tiles[e])) * block_m
    row_end = torch.minimum(row0 + block_m, pair_start[e] + counts[e])
    return order, tile_expert.to(torch.int32), row0.to(torch.int32), row_end.to(torch.int32)


@triton.jit
def _gate_up_kernel(X, W13, S13, H, ORDER, TILE_EXPERT, TILE_ROW0, TILE_ROW_END, D, I, E, S13_COLS,  # noqa: E741
                    TOP_K: tl.constexpr, IEEE: tl.constexpr, SCALED: tl.constexpr, SCALE_N: tl.constexpr,
                    SCALE_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """H[r, cols] = silu(x_r @ gate_e^T) * (x_r @ up_e^T) for the tile's sorted rows r."""
    tile = tl.program_id(0)
    expert = tl.load(TILE_EXPERT + tile)
    if expert >= E:  # past the last tile of this routing
        return
    rows = tl.load(TILE_ROW0 + tile) + tl.arange(0, BLOCK_M)
    row_ok = rows < tl.load(TILE_ROW_END + tile)
    token = (tl.load(ORDER + rows, mask=row_ok, other=0) // TOP_K).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < I
    w = W13 + expert.to(tl.int64) * 2 * I * D
    scales = S13 + expert.to(tl.int64) * (2 * I // SCALE_N) * S13_COLS  # SCALED: the expert's block scales
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, D, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < D
        x = tl.load(X + token[:, None] * D + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        w_gate = tl.load(w + cols[None, :].to(tl.int64) * D + k[:, None], mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
        w_up = tl.load(w + (I + cols[None, :]).to(tl.int64) * D + k[:, None], mask=w_mask, other=0.0)
        if SCALED:
            column = k0 // SCALE_K
            gate += dot(x, w_gate.to(X.dtype.element_ty), IEEE) * _block_scales(
                scales, cols, col_ok, column, S13_COLS, SCALE_N)[None, :]
            up += dot(x, w_up.to(X.dtype.element_ty), IEEE) * _block_scales(
                scales, I + cols, col_ok, column, S13_COLS, SCALE_N)[None, :]
        else:
            gate += dot(x, w_gate, IEEE)
            up += dot(x, w_up, IEEE)
    dtype = H.dtype.element_ty
    out = round_to(swiglu(gate, up, dtype), dtype)
    tl.store(H + rows[:, None].to(tl.int64) * I + cols[None, :], out, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(H, W2, S2, TOPK_WEIGHTS, Y, ORDER, TILE_EXPERT, TILE_ROW0, TILE_ROW_END, D, I, E,  # noqa: E741
                 S2_COLS, IEEE: tl.constexpr, SCALED: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Y[pair, cols] = (H[r] @ down_e^T) * weight[pair] for the tile's sorted rows r, pair = order[r]."""
    tile = tl.program_id(0)
    expert = tl.load(TILE_EXPERT + tile)
    if expert >= E:
        return
    rows = tl.load(TILE_ROW0 + tile) + tl.arange(0, BLOCK_M)
    row_ok = rows < tl.load(TILE_ROW_END + tile)
    pair = tl.load(ORDER + rows, mask=row_ok, other=0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < D
    w = W2 + expert.to(tl.int64) * D * I
    scales = S2 + expert.to(tl.int64) * tl.cdiv(D, SCALE_N) * S2_COLS  # SCALED: the expert's block scales
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < I
        h = tl.load(H + rows[:, None].to(tl.int64) * I + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_down = tl.load(w + cols[None, :].to(tl.int64) * I + k[:, None], mask=k_ok[:, None] & col_ok[None, :],
                         other=0.0)
        if SCALED:
            acc += dot(h, w_down.to(H.dtype.element_ty), IEEE) * _block_scales(
                scales, cols, col_ok, k0 // SCALE_K, S2_COLS, SCALE_N)[None, :]
        else:
            acc += dot(h, w_down, IEEE)
    dtype = Y.dtype.element_ty
    weight = tl.load(TOPK_WEIGHTS + pair, mask=row_ok, other=0.0).to(tl.float32)
    out = round_to(round_to(acc, dtype).to(tl.float32) * weight[:, None], dtype)
    tl.store(Y + pair[:, None] * D + cols[None, :], out, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _sum_in_id_order(y, ids, TOP_K: tl.constexpr, BLOCK: tl.constexpr, dtype: tl.constexpr):
    """One token's k weighted expert rows y [K_POW2, BLOCK] (fp32 holding dtype values) added to
    zero in increasing expert id, each sum rounded to dtype: transformers' index_add_ loop over
    the experts. ids [K_POW2]: the rows' experts, lanes past TOP_K above every id (never added)."""
    rank = tl.sum((ids[None, :] < ids[:, None]).to(tl.int32), axis=1)  # [K_POW2] place of each row in id order
    acc = tl.zeros([BLOCK], tl.float32)
    for r in tl.static_range(TOP_K):
        acc = round_to(acc + tl.sum(tl.where(rank[:, None] == r, y, 0.0), axis=0), dtype).to(tl.float32)
    return acc.to(dtype)


@triton.jit
def _gate_up_pair_kernel(X, W13, S13, H, TOPK_IDS, D, I, S13_COLS, TOP_K: tl.constexpr,  # noqa: E741
                         SCALED: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """H[pair, cols] = silu(x_n @ gate_e^T) * (x_n @ up_e^T) for pair = n * TOP_K + j, e = its expert;
    fp32 products summed in fp32 (a GEMV: no tensor cores, no TF32)."""
    wait_for_prior_kernels(PDL)
    pair = tl.program_id(0).to(tl.int64)
    token = pair // TOP_K
    expert = tl.load(TOPK_IDS + pair).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < I
    w = W13 + expert * 2 * I * D
    scales = S13 + expert * (2 * I // SCALE_N) * S13_COLS  # SCALED: the expert's block scales
    gate = tl.zeros([BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, D, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < D
        x = tl.load(X + token * D + k, mask=k_ok, other=0.0).to(tl.float32)
        w_mask = col_ok[:, None] & k_ok[None, :]
        w_gate = tl.load(w + cols[:, None].to(tl.int64) * D + k[None, :], mask=w_mask, other=0.0)
        w_up = tl.load(w + (I + cols[:, None]).to(tl.int64) * D + k[None, :], mask=w_mask, other=0.0)
        if SCALED:
            gate += tl.sum(w_gate.to(tl.float32) * x[None, :], axis=1) * _block_scales(
                scales, cols, col_ok, k0 // SCALE_K, S13_COLS, SCALE_N)
            up += tl.sum(w_up.to(tl.float32) * x[None, :], axis=1) * _block_scales(
                scales, I + cols, col_ok, k0 // SCALE_K, S13_COLS, SCALE_N)
        else:
            gate += tl.sum(w_gate.to(tl.float32) * x[None, :], axis=1)
            up += tl.sum(w_up.to(tl.float32) * x[None, :], axis=1)
    dtype = H.dtype.element_ty
    tl.store(H + pair * I + cols, round_to(swiglu(gate, up, dtype), dtype), mask=col_ok)


@triton.jit
def _down_combine_pair_kernel(H, W2, S2, TOPK_WEIGHTS, TOPK_IDS, OUT, D, I, S2_COLS,  # noqa: E741
                              TOP_K: tl.constexpr, K_POW2: tl.constexpr, SCALED: tl.constexpr,
                              SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """OUT[n, cols] = the sum over token n's k pairs p = n * k + j of round(round(H[p] @ down_e^T) *
    weight[p]), e = the pair's expert, added to zero in increasing expert id, each sum rounded:
    the down projection and the combine in one pass, all k experts' weight rows in flight at once."""
    wait_for_prior_kernels(PDL)
    n = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, K_POW2)
    j_ok = j < TOP_K
    pair = n * TOP_K + j  # [K_POW2]
    ids = tl.load(TOPK_IDS + pair, mask=j_ok, other=0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < D
    w_row = ids.to(tl.int64)[:, None] * D + cols[None, :]  # [K_POW2, BLOCK_N]: rows of W2 seen as [E * D, I]
    w_ok = j_ok[:, None] & col_ok[None, :]
    acc = tl.zeros([K_POW2, BLOCK_N], tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < I
        h = tl.load(H + pair[:, None] * I + k[None, :], mask=j_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(W2 + w_row[:, :, None] * I + k[None, None, :], mask=w_ok[:, :, None] & k_ok[None, None, :],
                    other=0.0)  # [K_POW2, BLOCK_N, BLOCK_K]
        if SCALED:  # scale rows of W2 seen as [E * D, I]: D is whole blocks of SCALE_N rows
            acc += tl.sum(w.to(tl.float32) * h.to(tl.float32)[:, None, :], axis=2) * _block_scales(
                S2, w_row, w_ok, k0 // SCALE_K, S2_COLS, SCALE_N)
        else:
            acc += tl.sum(w.to(tl.float32) * h.to(tl.float32)[:, None, :], axis=2)
    dtype = OUT.dtype.element_ty
    weight = tl.load(TOPK_WEIGHTS + pair, mask=j_ok, other=0.0).to(tl.float32)
    y = round_to(round_to(acc, dtype).to(tl.float32) * weight[:, None], dtype).to(tl.float32)
    out = _sum_in_id_order(y, tl.where(j_ok, ids, 2**30), TOP_K, BLOCK_N, dtype)
    tl.store(OUT + n * D + cols, out, mask=col_ok)


@triton.jit
def _combine_kernel(Y, TOPK_IDS, OUT, D, TOP_K: tl.constexpr, K_POW2: tl.constexpr, BLOCK_D: tl.constexpr):
    """OUT[n] = the k rows Y[n * k + j] added to zero in increasing expert id, each sum rounded."""
    n = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    j = tl.arange(0, K_POW2)
    j_ok = j < TOP_K
    ids = tl.load(TOPK_IDS + n * TOP_K + j, mask=j_ok, other=2**30)
    y = tl.load(Y + (n * TOP_K + j[:, None]) * D + cols[None, :], mask=j_ok[:, None] & col_ok[None, :], other=0.0)
    dtype = OUT.dtype.element_ty
    tl.store(OUT + n * D + cols, _sum_in_id_order(y.to(tl.float32), ids, TOP_K, BLOCK_D, dtype), mask=col_ok)


@torch.library.custom_op("qwen3_ops::fused_moe", mutates_args=())
def _fused_moe_op(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None,
                  block: list[int]) -> torch.Tensor:
    N, D = x.shape
    E, I = w2.shape[0], w2.shape[2]  # noqa: E741
    top_k = topk_ids.shape[1]
    out = torch.empty_like(x)
    if N == 0:
        return out
    scaled = w13_scale is not None
    scales = dict(SCALED=scaled, SCALE_N=block[0] if scaled else 1, SCALE_K=block[1] if scaled else 1)
    s13, s2 = (w13_scale, w2_scale) if scaled else (x, x)
    s13_cols, s2_cols = (w13_scale.shape[2], w2_scale.shape[2]) if scaled else (1, 1)
    pairs = N * top_k
    if pairs <= PAIR_PATH_MAX_PAIRS:
        h = x.new_empty(pairs, I)  # [N*k, I] by pair
        pdl = use_pdl(x.device)
        block_n, block_k = pair_config(D, I, block[1] if scaled else 512)
        _gate_up_pair_kernel[(pairs, triton.cdiv(I, block_n))](x, w13, s13, h, topk_ids, D, I, s13_cols, TOP_K=top_k,
                                                                **scales, BLOCK_N=block_n, BLOCK_K=block_k, PDL=pdl,
                                                                num_warps=4, launch_pdl=pdl)
        block_n, block_k, warps = down_combine_config(I, top_k, D, block[1] if scaled else 8192)
        _down_combine_pair_kernel[(N, triton.cdiv(D, block_n))](
            h, w2, s2, topk_weights, topk_ids, out, D, I, s2_cols, TOP_K=top_k, K_POW2=triton.next_power_of_2(top_k),
            **scales, BLOCK_N=block_n, BLOCK_K=block_k, PDL=pdl, num_warps=warps, launch_pdl=pdl)
        return out
    block_m, block_n, block_k = tile_config(pairs, block[1] if scaled else 64)
    order, tile_expert, tile_row0, tile_row_end = routing_plan(topk_ids, E, block_m)
    tiles = tile_expert.numel()
    ieee = x.dtype == torch.float32
    h = x.new_empty(pairs, I)  # [N*k, I] in sorted order
    y = x.new_empty(pairs, D)  # [N*k, D] by pair
    _gate_up_kernel[(tiles, triton.cdiv(I, block_n))](
        x, w13, s13, h, order, tile_expert, tile_row0, tile_row_end, D, I, E, s13_cols, TOP_K=top_k, IEEE=ieee,
        **scales, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    _down_kernel[(tiles, triton.cdiv(D, block_n))](
        h, w2, s2, topk_weights, y, order, tile_expert, tile_row0, tile_row_end, D, I, E, s2_cols, IEEE=ieee,
        **scales, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    block_d = min(1024, triton.next_power_of_2(D))
    _combine_kernel[(N, triton.cdiv(D, block_d))](y, topk_ids, out, D, TOP_K=top_k,
                                                  K_POW2=triton.next_power_of_2(top_k), BLOCK_D=block_d, num_warps=4)
    return out


@_fused_moe_op.register_fake
def _(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block):
    return torch.empty_like(x)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              block: tuple[int, int] | None = None) -> torch.Tensor:
    """The experts' SwiGLU of the routed tokens x [N, D], summed with their routing weights: [N, D]
    (the Triton kernels; no backward: inference only). FP8 experts come with their block scales
    w13_scale [E, 2I / block[0], D / block[1]], w2_scale [E, D / block[0], I / block[1]] and `block`;
    I and D must then be whole blocks of rows."""
    N, D = x.shape
    E, two_i, _ = w13.shape
    if w13.shape != (E, two_i, D) or two_i % 2 or w2.shape != (E, D, two_i // 2):
        raise ValueError(f"fused_moe takes w13 [E, 2I, D] and w2 [E, D, I] for x [N, D={D}], got "
                         f"{tuple(w13.shape)} and {tuple(w2.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != N:
        raise ValueError(f"topk_ids and topk_weights must both be [N={N}, k], got {tuple(topk_ids.shape)} "
                         f"and {tuple(topk_weights.shape)}")
    if x.dtype != topk_weights.dtype:
        raise ValueError("x and topk_weights must share a dtype")
    block13 = check_fp8_weight(w13, w13_scale, block, x.dtype, gated=True)
    block2 = check_fp8_weight(w2, w2_scale, block, x.dtype)
    if block2 is not None and D % block2[0]:
        raise ValueError(f"FP8 experts' D={D} must be whole blocks of {block2[0]} rows")
    if (block13 is None) != (block2 is None):
        raise ValueError("w13 and w2 must both be FP8 or both in x's dtype")
    return _fused_moe_op(x.contiguous(), w13.contiguous(), w2.contiguous(), topk_weights.contiguous(),
                         topk_ids.contiguous(), None if block13 is None else w13_scale.contiguous(),
                         None if block2 is None else w2_scale.contiguous(), list(block13) if block13 else [])


def fused_moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor) -> torch.Tensor:
    """The same in torch ops, transformers' Qwen3MoeExperts loop: each expert that received
    tokens runs its SwiGLU on them, and the weighted results are added into a zero output
    (index_add_ in increasing expert id). Syncs the host (which experts are hit): not for decode."""
    out = torch.zeros_like(x)
    E = w13.shape[0]
    mask = torch.nn.functional.one_hot(topk_ids, num_classes=E).permute(2, 1, 0)  # [E, k, N]
    for expert in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()[:, 0].tolist():
        slot, token = torch.where(mask[expert])
        gate, up = torch.nn.functional.linear(x[token], w13[expert]).chunk(2, dim=-1)
        h = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w2[expert])
        out.index_add_(0, token, h * topk_weights[token, slot, None])
    return out
