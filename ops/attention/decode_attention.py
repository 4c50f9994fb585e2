"""Attention of one new token per row over that row's cached keys: split-KV (flash-decoding).

    out = decode_attention(q, k_cache, v_cache, seq_lens, scale)

q [B, H, hd]; k_cache, v_cache [B, S, K, hd] with H a multiple of K (grouped-query attention);
row b attends over its first seq_lens[b] cached positions (the new token's included), and
nothing past them is read, so a step costs what the row holds, not what the cache could hold.
seq_lens lives on the device, so one captured CUDA graph serves every decode step.

    out = decode_attention(q, k_blocks, v_blocks, seq_lens, scale, block_table=table)

The paged form (runtime/cache.py's PagedKVCache): k_blocks, v_blocks [n_blocks, block_size, K, hd]
and table [B, M] of block ids; row b's key at position p is in block table[b, p // block_size],
at offset p % block_size. The kernel looks each key's block up in the table; nothing else changes.

Each program takes one row, one key/value head and one of `splits` slices of the row's keys,
with the H / K query heads that share that key/value head as the rows of its matrix products
(padded to 16, the smallest tl.dot); a second kernel merges the slices by their log-sum-exp.
Splitting fills the GPU when batch x K is small; the slice length follows seq_lens on the device.
Where batch x K alone fills it (one slice per row), the programs write the output themselves
and there is no merge.
"""

import functools

import torch
import triton
import triton.language as tl

from ..triton_helpers import dot, use_pdl, wait_for_prior_kernels

__all__ = ["decode_attention", "num_splits"]

# Keys per inner step: 128 only for 16-bit rows that can hold LONG_ROWS keys or more, in
# FEW_SLICES slices or fewer (batch x key/value heads of 103 or more), on a GPU whose programs can
# hold two pipeline stages of 128-key tiles; 64 otherwise. A 128-key step holds twice the shared
# memory per program, so fewer programs run at once: long rows gain from fewer loop trips, short
# ones lose the occupancy, and many slices of a row are short. A row's capacity (the cache's row
# length, a block table's width) stands in for its length because it is fixed when a CUDA graph is
# captured; a caller that passes only the blocks in use gets the rule at that width. Paged and
# contiguous calls take the same rule, so they give the same bits for the same batch and capacity
# (docs/benchmarks/decode-notes.md has the measurements).
BLOCK_N = 64
BLOCK_N_LONG_ROWS = 128
LONG_ROWS = 1024
FEW_SLICES = 4
# Loads issued one key block ahead: a deeper pipeline only adds shared memory and reads no faster
# (docs/benchmarks/decode-notes.md).
STAGES = 2
# About four programs per SM of the H200's 132: at batch 64 with 8 key/value heads one slice per row
# (no merge kernel), at batch 32 two; more slices per row made batched decode slower.
TARGET_PROGRAMS = 512
MAX_SPLITS = 32


def num_splits(batch: int, n_kv_heads: int, device: torch.device) -> int:
    """Slices per row: on a GPU enough programs to fill it, at most MAX_SPLITS. It depends on the
    batch and the heads only, not on the cache's length, so one compiled kernel serves every
    length; slices past a row's keys return at once. Without slicing, a batch of 32 rows of 1,000
    keys would be 256 programs each reading its row's keys one block after another: latency-bound.
    Off a GPU (Triton's interpreter, which runs the programs one after another) there is nothing
    to fill: one slice per row."""
    if device.type != "cuda":
        return 1
    return max(1, min(TARGET_PROGRAMS // (batch * n_kv_heads), MAX_SPLITS))


def keys_per_step(splits: int, row_capacity: int, dtype: torch.dtype, head_dim: int,
                  shared_memory: int | None) -> int:
    """Keys a program reads per loop trip (see BLOCK_N), for rows that can hold row_capacity keys
    of head_dim (a power of two) values, on a GPU whose programs may use shared_memory bytes
    (None: no limit, the interpreter)."""
    tiles = 2 * STAGES * BLOCK_N_LONG_ROWS * head_dim * dtype.itemsize  # keys and values, each stage
    fits = shared_memory is None or tiles + 16 * 1024 <= shared_memory  # 16 KB for q, scores, etc.
    long_tiles = (row_capacity >= LONG_ROWS and splits <= FEW_SLICES and dtype.itemsize == 2
                  and head_dim <= 128 and fits)
    return BLOCK_N_LONG_ROWS if long_tiles else BLOCK_N


@functools.cache
def shared_memory_per_program(device: torch.device) -> int | None:
    """The shared memory a kernel's program may use on `device` (the opt-in limit); None off CUDA."""
    if device.type != "cuda":
        return None
    return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 0)


@triton.jit
def _split_kernel(
    Q, K, V, SEQ_LENS, BLOCK_TABLE, O_PART, LSE_PART, OUT,
    scale, max_len, stride_kb, stride_ks, stride_table,
    PAGED: tl.constexpr, PAGE: tl.constexpr,
    N_KV: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HD: tl.constexpr, BLOCK_HD: tl.constexpr,
    SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, FP32: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_prior_kernels(PDL)
    b = tl.program_id(0).to(tl.int64)
    kv = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.minimum(tl.load(SEQ_LENS + b), max_len)  # never past the cache, whatever the caller says
    per_split = tl.cdiv(tl.cdiv(seq_len, SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_HD)
    g_ok, d_ok = g < GROUP, d < HD
    heads = kv * GROUP + g
    q = tl.load(Q + (b * N_KV * GROUP + heads[:, None]) * HD + d[None, :], mask=g_ok[:, None] & d_ok[None, :],
                other=0.0)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_HD], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        kv_mask = n_ok[:, None] & d_ok[None, :]
        if PAGED:  # key n of row b: block table[b, n // PAGE], offset n % PAGE in it
            block = tl.load(BLOCK_TABLE + b * stride_table + n // PAGE, mask=n_ok, other=0).to(tl.int64)
            offsets = block * stride_kb + (n % PAGE) * stride_ks
        else:  # key n of row b: position n of cache row b
            offsets = b * stride_kb + n * stride_ks
        k = tl.load(K + kv * HD + offsets[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = dot(q, tl.trans(k), FP32)
        s = tl.where(n_ok[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        v = tl.load(V + kv * HD + offsets[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, FP32)
        m = m_new
    out = acc / tl.maximum(denom, 1e-30)[:, None]
    if SPLITS == 1:  # the row's only slice: its result is the output
        tl.store(OUT + (b * N_KV * GROUP + heads[:, None]) * HD + d[None, :], out.to(OUT.dtype.element_ty),
                 mask=g_ok[:, None] & d_ok[None, :])
    else:
        # An empty slice (past the row's length) leaves lse = -inf: the merge gives it no weight.
        lse = tl.where(denom > 0, m + tl.log(tl.maximum(denom, 1e-30)), float("-inf"))
        part = (b * N_KV * GROUP + heads) * SPLITS + split
        tl.store(O_PART + part[:, None] * HD + d[None, :], out, mask=g_ok[:, None] & d_ok[None, :])
        tl.store(LSE_PART + part, lse, mask=g_ok)


@triton.jit
def _merge_kernel(O_PART, LSE_PART, OUT, SPLITS: tl.constexpr, BLOCK_SPLITS: tl.constexpr, HD: tl.constexpr,
                  BLOCK_HD: tl.constexpr, PDL: tl.constexpr):
    wait_for_prior_kernels(PDL)
    row_head = tl.program_id(0).to(tl.int64)  # b * H + h
    sp = tl.arange(0, BLOCK_SPLITS)
    d = tl.arange(0, BLOCK_HD)
    sp_ok, d_ok = sp < SPLITS, d < HD
    lse = tl.load(LSE_PART + row_head * SPLITS + sp, mask=sp_ok, other=float("-inf"))
    weight = tl.exp(lse - tl.max(lse, axis=0))  # the first slice is never empty: max is finite
    parts = tl.load(O_PART + (row_head * SPLITS + sp[:, None]) * HD + d[None, :],
                    mask=sp_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(weight[:, None] * parts, axis=0) / tl.sum(weight, axis=0)
    tl.store(OUT + row_head * HD + d, out.to(OUT.dtype.element_ty), mask=d_ok)


@torch.library.custom_op("qwen3_ops::decode_attention", mutates_args=())
def _decode_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
                         scale: float, splits: int, block_table: torch.Tensor | None = None) -> torch.Tensor:
    B, H, hd = q.shape
    K = k_cache.shape[2]
    out = torch.empty_like(q)
    parts = splits if splits > 1 else 0  # one slice per row: written straight to the output
    o_part = torch.empty(B, H, parts, hd, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(B, H, parts, dtype=torch.float32, device=q.device)
    group = H // K
    block_hd = triton.next_power_of_2(hd)
    paged = block_table is not None
    pdl = use_pdl(q.device)
    page = k_cache.shape[1] if paged else 1
    max_len = block_table.shape[1] * page if paged else k_cache.shape[1]  # keys a row can hold
    _split_kernel[(B, K, splits)](
        q, k_cache, v_cache, seq_lens, block_table if paged else seq_lens, o_part, lse_part, out, scale, max_len,
        k_cache.stride(0), k_cache.stride(1), block_table.stride(0) if paged else 0,
        PAGED=paged, PAGE=page,
        N_KV=K, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HD=hd, BLOCK_HD=block_hd,
        SPLITS=splits, BLOCK_N=keys_per_step(splits, max_len, q.dtype, block_hd, shared_memory_per_program(q.device)),
        FP32=q.dtype == torch.float32, PDL=pdl, num_warps=4, num_stages=STAGES, launch_pdl=pdl,
    )
    if splits > 1:
        _merge_kernel[(B * H,)](o_part, lse_part, out, SPLITS=splits, BLOCK_SPLITS=triton.next_power_of_2(splits),
                                HD=hd, BLOCK_HD=block_hd, PDL=pdl, num_warps=1, launch_pdl=pdl)
    return out


@_decode_attention_op.register_fake
def _(q, k_cache, v_cache, seq_lens, scale, splits, block_table=None):
    return torch.empty_like(q)


def _check(q, k_cache, v_cache, seq_lens, block_table) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        layout = "[n_blocks, block_size, K, hd]" if block_table is not None else "[B, S, K, hd]"
        raise ValueError(f"q must be [B, H, hd] and the caches {layout}, got {tuple(q.shape)}, "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    B, H, hd = q.shape
    if block_table is not None and (block_table.dim() != 2 or block_table.shape[0] != B
                                    or block_table.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"block_table must be an integer tensor [B={B}, blocks], got {tuple(block_table.shape)}")
    rows = B if block_table is None else k_cache.shape[0]
    if k_cache.shape[0] != rows or k_cache.shape[3] != hd or H % k_cache.shape[2]:
        raise ValueError(f"caches {tuple(k_cache.shape)} do not fit q {tuple(q.shape)} (H a multiple of K)")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q and the caches must share a dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if k_cache.stride()[2:] != (hd, 1) or v_cache.stride() != k_cache.stride():
        raise ValueError("each cached position must hold its K x hd values contiguously")
    if seq_lens.shape != (B,) or seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"seq_lens must be an integer tensor [B={B}], got {tuple(seq_lens.shape)}")


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float, block_table: torch.Tensor | None = None, splits: int | None = None) -> torch.Tensor:
    """[B, H, hd]: softmax(q k^T * scale) v over each row's first seq_lens[b] keys (1 <= seq_lens[b]
    <= S, which the caller guarantees; the kernel reads no further than S either way). With
    block_table [B, M], the caches are blocks [n_blocks, block_size, K, hd], S = M * block_size,
    and the table's entries for a row's first seq_lens[b] positions must be valid block ids.
    splits: slices per row, 1 to MAX_SPLITS (default: num_splits's choice for the device)."""
    _check(q, k_cache, v_cache, seq_lens, block_table)
    if splits is None:
        splits = num_splits(q.shape[0], k_cache.shape[2], q.device)
    elif isinstance(splits, bool) or not isinstance(splits, int) or not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"splits must be an integer in [1, {MAX_SPLITS}], got {splits!r}")
    return _decode_attention_op(q.contiguous(), k_cache, v_cache, seq_lens, float(scale), splits, block_table)
