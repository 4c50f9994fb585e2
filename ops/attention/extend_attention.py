"""Causal attention of packed chunks of new tokens over a paged KV cache (extend / chunked prefill).

    out = extend_attention(q, k_blocks, v_blocks, cu_seqlens, seq_lens, block_table, scale)

q [N, H, hd] packs the new tokens of S sequences back to back: sequence s's are
q[cu_seqlens[s] : cu_seqlens[s + 1]] (tokens from cu_seqlens[-1] on are padding: never read, their
output rows never written). k_blocks, v_blocks [n_blocks, block_size, K, hd] (H a multiple of K)
already hold every key of each sequence, the new ones included: sequence s's key at position j is
in block block_table[s, j // block_size], at offset j % block_size. Sequence s has seq_lens[s] keys
and its q_len new tokens are its last ones: new token i is at position seq_lens[s] - q_len + i and
attends to the keys at positions 0 .. that position. Softmax online, in fp32.

Programs: one per (tile of BLOCK_Q new tokens of one sequence, key/value head); its matrix rows are
the tile's tokens x the H / K query heads that share that key/value head (row r: token r // GROUP_P,
head r % GROUP_P, the group padded to a power of two), so each key tile is read once for the
whole group, and a tile of one token (a decode step in the batch) still fills rows with heads.
A program reads keys only up to its last token's position: the work is the causal half; and masks
only its last steps, the keys past its first token's position.

Tiles are numbered without reading anything back to the host (a CUDA graph can capture the call):
sequence s's tiles start at number cu_seqlens[s] // BLOCK_Q + s, which leaves room for its
cdiv(q_len, BLOCK_Q) tiles, and the last sequence's end at cdiv(N, BLOCK_Q) + S at most: the
grid's size, from shapes alone. A program finds its sequence by binary search over cu_seqlens and
returns at once when its tile is past the sequence's tokens. A 2D grid (sequence, tile) would need
max q_len tiles per sequence: without a host bound, N; S x N / BLOCK_Q programs, mostly idle.
"""

import torch
import triton
import triton.language as tl

from ..triton_helpers import dot, round_to, use_pdl, wait_for_prior_kernels

__all__ = ["extend_attention"]

# Matrix rows per program (tokens x heads of a group) and keys per inner step, with the warps and
# pipeline stages that run them: FlashAttention-2's tile for head_dim 128 in 16 bits, with three
# stages: the fastest setting at 16k and 32k keys, where long prompts spend their time, for 0.6B's
# and 8B's heads (scripts/bench_extend_attention.py, docs/benchmarks/extend-attention-h200.json).
ROWS = 64
BLOCK_N = 64
WARPS = 4
STAGES = 3
MIN_DOT = 16  # tl.dot's smallest tile side: a tile has at least 16 rows
LOG2E = 1.4426950408889634  # exp(x) = exp2(x * log2(e)): the scale folds it in, exp2 is one instruction


@triton.jit
def _attend(acc, m, denom, q, K, V, block_row, n0, end, pos, kv, d, d_ok, scale2,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            PAGE: tl.constexpr, BLOCK_N: tl.constexpr, FP32: tl.constexpr, CAUSAL: tl.constexpr):
    """One step of the online softmax over keys n0 .. n0 + BLOCK_N (in base 2: scale2 holds log2 e).
    CAUSAL: the step holds keys past some row's position, or past `end`: masked; else every row sees
    every key of the step, and nothing is masked but the head dimension's padding."""
    n = n0 + tl.arange(0, BLOCK_N)
    if CAUSAL:
        n_ok = n < end
        block = tl.load(block_row + n // PAGE, mask=n_ok, other=0).to(tl.int64)
        kv_mask = n_ok[:, None] & d_ok[None, :]
    else:
        block = tl.load(block_row + n // PAGE).to(tl.int64)
        kv_mask = d_ok[None, :]
    k = tl.load(K + (block * stride_kb + (n % PAGE) * stride_ks + kv * stride_kh)[:, None] + d[None, :],
                mask=kv_mask, other=0.0)
    scores = dot(q, tl.trans(k), FP32) * scale2
    if CAUSAL:  # a row sees keys up to its position; key 0 is in every row's first step, so m is finite after it
        scores = tl.where((n[None, :] <= pos[:, None]) & n_ok[None, :], scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(scores - m_new[:, None])
    denom = denom * alpha + tl.sum(p, axis=1)
    v = tl.load(V + (block * stride_vb + (n % PAGE) * stride_vs + kv * stride_vh)[:, None] + d[None, :],
                mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + dot(round_to(p, v.dtype), v, FP32)
    return acc, m_new, denom


@triton.jit
def _extend_kernel(
    Q, K, V, OUT, CU_SEQLENS, SEQ_LENS, BLOCK_TABLE,
    scale2, n_seqs, max_len, stride_qn, stride_qh, stride_on, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_table,
    PAGE: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_Q: tl.constexpr,
    HD: tl.constexpr, BLOCK_HD: tl.constexpr, BLOCK_N: tl.constexpr, FP32: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_prior_kernels(PDL)
    tile = tl.program_id(0)
    kv = tl.program_id(1)
    # This tile's sequence: the last s whose first tile, cu_seqlens[s] // BLOCK_Q + s, is <= tile.
    lo = tl.zeros([], tl.int32)
    hi = lo + n_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        before = tl.load(CU_SEQLENS + mid) // BLOCK_Q + mid <= tile
        lo = tl.where(before, mid, lo)
        hi = tl.where(before, hi, mid - 1)
    s = lo.to(tl.int64)
    q_start = tl.load(CU_SEQLENS + s)
    q_len = tl.load(CU_SEQLENS + s + 1) - q_start
    q0 = (tile - q_start // BLOCK_Q - lo) * BLOCK_Q  # the tile's first token, within the sequence
    if (q0 < 0) | (q0 >= q_len):  # room left over past the sequence's tiles
        return
    seq_len = tl.load(SEQ_LENS + s)
    first = seq_len - q_len  # position of new token 0
    # Keys the tile reads: up to its last token's position (never past the table's capacity); the
    # keys before its first token's position are seen by every row: whole steps of those unmasked.
    end = tl.minimum(first + tl.minimum(q0 + BLOCK_Q, q_len), max_len)
    open_end = tl.minimum(first + q0, end) // BLOCK_N * BLOCK_N

    r = tl.arange(0, BLOCK_Q * GROUP_P)
    token = q0 + r // GROUP_P
    head = kv * GROUP + r % GROUP_P
    row_ok = (token < q_len) & (r % GROUP_P < GROUP)
    pos = first + token
    d = tl.arange(0, BLOCK_HD)
    d_ok = d < HD
    row = (q_start + token).to(tl.int64)
    q = tl.load(Q + row[:, None] * stride_qn + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    m = tl.full([BLOCK_Q * GROUP_P], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_Q * GROUP_P], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_P, BLOCK_HD], tl.float32)
    block_row = BLOCK_TABLE + s * stride_table
    for n0 in range(0, open_end, BLOCK_N):
        acc, m, denom = _attend(acc, m, denom, q, K, V, block_row, n0, end, pos, kv, d, d_ok, scale2,
                                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                                PAGE, BLOCK_N, FP32, False)
    for n0 in range(open_end, end, BLOCK_N):
        acc, m, denom = _attend(acc, m, denom, q, K, V, block_row, n0, end, pos, kv, d, d_ok, scale2,
                                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                                PAGE, BLOCK_N, FP32, True)
    out = acc / denom[:, None]
    tl.store(OUT + row[:, None] * stride_on + head[:, None] * stride_oh + d[None, :],
             round_to(out, OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def tokens_per_tile(group: int, max_new_tokens: int | None) -> int:
    """BLOCK_Q: ROWS // (the group padded to a power of two) tokens, fewer where no sequence has
    that many new tokens (rows of absent tokens are wasted work), but at least MIN_DOT rows."""
    group_p = triton.next_power_of_2(group)
    block_q = max(1, ROWS // group_p)
    if max_new_tokens is not None:
        block_q = min(block_q, max(triton.next_power_of_2(max(1, max_new_tokens)), MIN_DOT // group_p))
    return block_q


@torch.library.custom_op("qwen3_ops::extend_attention", mutates_args=())
def _extend_attention_op(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, cu_seqlens: torch.Tensor,
                         seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float, block_q: int) -> torch.Tensor:
    N, H, hd = q.shape
    page, K = k_blocks.shape[1], k_blocks.shape[2]
    S = seq_lens.shape[0]
    out = torch.empty(N, H, hd, dtype=q.dtype, device=q.device)
    if N == 0 or S == 0:
        return out
    group = H // K
    pdl = use_pdl(q.device)
    _extend_kernel[(triton.cdiv(N, block_q) + S, K)](
        q, k_blocks, v_blocks, out, cu_seqlens, seq_lens, block_table,
        scale * LOG2E, S, block_table.shape[1] * page, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *k_blocks.stride()[:3], *v_blocks.stride()[:3], block_table.stride(0),
        PAGE=page, GROUP=group, GROUP_P=triton.next_power_of_2(group), BLOCK_Q=block_q,
        HD=hd, BLOCK_HD=max(MIN_DOT, triton.next_power_of_2(hd)), BLOCK_N=BLOCK_N,
        FP32=q.dtype == torch.float32, PDL=pdl, num_warps=WARPS, num_stages=STAGES, launch_pdl=pdl,
    )
    return out


@_extend_attention_op.register_fake
def _(q, k_blocks, v_blocks, cu_seqlens, seq_lens, block_table, scale, block_q):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def _check(q, k_blocks, v_blocks, cu_seqlens, seq_lens, block_table) -> None:
    if q.dim() != 3 or k_blocks.dim() != 4 or k_blocks.shape != v_blocks.shape:
        raise ValueError(f"q must be [N, H, hd] and the caches [n_blocks, block_size, K, hd], got {tuple(q.shape)}, "
                         f"{tuple(k_blocks.shape)} and {tuple(v_blocks.shape)}")
    H, hd = q.shape[1:]
    if k_blocks.shape[3] != hd or H % k_blocks.shape[2]:
        raise ValueError(f"caches {tuple(k_blocks.shape)} do not fit q {tuple(q.shape)} (H a multiple of K)")
    dtypes = q.dtype, k_blocks.dtype, v_blocks.dtype
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16) or len(set(dtypes)) > 1:
        raise ValueError(f"q and the caches must share a float dtype, got {', '.join(map(str, dtypes))}")
    if q.stride(2) != 1 or k_blocks.stride(3) != 1 or v_blocks.stride(3) != 1:
        raise ValueError("q and the caches must be contiguous in their last dimension")
    page = k_blocks.shape[1]
    if page & (page - 1):
        raise ValueError(f"block_size must be a power of two, got {page}")
    S = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if seq_lens.dim() != 1 or seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"seq_lens must be an integer tensor [S], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    if cu_seqlens.shape != (S + 1,) or cu_seqlens.dtype != torch.int32:
        raise ValueError(f"cu_seqlens must be an int32 tensor [S+1={S + 1}], got {cu_seqlens.dtype} "
                         f"{tuple(cu_seqlens.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] != S or block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_table must be an integer tensor [S={S}, blocks], got {tuple(block_table.shape)}")


def extend_attention(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, cu_seqlens: torch.Tensor,
                     seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float,
                     max_new_tokens: int | None = None) -> torch.Tensor:
    """[N, H, hd] in q's dtype: each new token's causal softmax(q k^T * scale) v over its sequence's
    keys (see the module's docstring). The caller guarantees q_len_s <= seq_lens[s] and valid block
    ids for each sequence's first seq_lens[s] positions; rows of padding tokens are left unwritten.
    max_new_tokens: a host bound on the longest chunk (optional): a smaller one lets a tile hold
    fewer tokens (BLOCK_Q), so that decode-like batches waste fewer rows. Nothing is read back to the host."""
    _check(q, k_blocks, v_blocks, cu_seqlens, seq_lens, block_table)
    block_q = tokens_per_tile(q.shape[1] // k_blocks.shape[2], max_new_tokens)
    return _extend_attention_op(q, k_blocks, v_blocks, cu_seqlens, seq_lens, block_table, float(scale), block_q)
