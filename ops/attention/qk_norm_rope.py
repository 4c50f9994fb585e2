"""Attention's input step in one kernel: q/k RMSNorm, rotary embedding and the KV-cache write.

    q, k = qk_norm_rope(qkv, q_weight, k_weight, cos, sin, positions, eps, n_heads, n_kv_heads,
                        k_cache, v_cache, slots)

qkv [N, (H + 2K) * hd] is the fused q/k/v projection of N tokens. Each q head and k head is
normalized (Qwen3's QK-norm, Hugging Face's Qwen3RMSNorm arithmetic) and rotated by its token's
position; q [N, H, hd] and k [N, K, hd] are returned, and k and v are written to the cache's
slot `slots[n]` ([n_slots, K, hd] per layer). Without a cache nothing is written.

Rounding follows transformers op for op, so bf16 results are the bits its modules give: the
normalized row is rounded to the input dtype before the weight multiply; cos and sin (fp32
tables, as transformers computes them) are rounded to the dtype; each product of `q * cos +
rotate_half(q) * sin` and their sum are rounded, as each 16-bit torch op rounds its result.
"""

import torch
import triton
import triton.language as tl

from ..triton_helpers import round_to, use_pdl, wait_for_prior_kernels

__all__ = ["qk_norm_rope"]


def heads_per_program(n_tokens: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_H, num_warps): a decode step's tokens (one per batch row, up to 256) take a program
    per 128-value head (Qwen3's head_dim), so that even one token spreads over many SMs; longer
    inputs (prefill) take 8 such heads (2 KiB of bf16) per program, as the norm kernels pack short
    rows: a 128-value head alone is too little work for a program. Narrower heads are packed so
    that a program holds as many values."""
    values = 128 if n_tokens <= 256 else 1024
    block_h = triton.next_power_of_2(-(-values // head_dim))
    return (block_h, 1) if n_tokens <= 256 else (block_h, 2)


@triton.jit
def _qk_norm_rope_kernel(
    QKV, QW, KW, COS, SIN, POS, SLOTS, Q_OUT, K_OUT, K_CACHE, V_CACHE,
    n_slots, eps,
    N_HEADS: tl.constexpr, N_KV: tl.constexpr, HD: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, HAS_CACHE: tl.constexpr, PDL: tl.constexpr,
):
    """One program per (token, BLOCK_H of its H + 2K heads): q and k heads are normalized,
    rotated and stored (k also to the cache); v heads are copied to the cache."""
    wait_for_prior_kernels(PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    HALF: tl.constexpr = HD // 2
    dtype = QKV.dtype.element_ty
    cols = tl.arange(0, BLOCK_HALF)
    col_ok = cols < HALF
    is_q = head < N_HEADS
    is_k = (head >= N_HEADS) & (head < N_HEADS + N_KV)
    is_v = (head >= N_HEADS + N_KV) & (head < N_HEADS + 2 * N_KV)
    ok = (is_q | is_k | is_v)[:, None] & col_ok[None, :]
    src = QKV + token * (N_HEADS + 2 * N_KV) * HD + head[:, None] * HD + cols[None, :]
    x1 = tl.load(src, mask=ok, other=0.0)
    x2 = tl.load(src + HALF, mask=ok, other=0.0)
    # The caller checks positions against the cache; clamping keeps any slip inside it. (Without
    # a cache SLOTS is the positions tensor: readable, never used.)
    slot = tl.minimum(tl.maximum(tl.load(SLOTS + token), 0), n_slots - 1)
    # q and k heads: RMSNorm over the head's HD values with its q or k weight, then RoPE.
    w1 = tl.where(is_q[:, None], tl.load(QW + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :],
                  tl.load(KW + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :])
    w2 = tl.where(is_q[:, None], tl.load(QW + HALF + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :],
                  tl.load(KW + HALF + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :])
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    rstd = tl.rsqrt((tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / HD + eps)[:, None]
    y1 = round_to(round_to(f1 * rstd, dtype).to(tl.float32) * w1, dtype).to(tl.float32)
    y2 = round_to(round_to(f2 * rstd, dtype).to(tl.float32) * w2, dtype).to(tl.float32)
    pos = tl.load(POS + token)
    c = round_to(tl.load(COS + pos * HALF + cols, mask=col_ok, other=0.0), dtype).to(tl.float32)[None, :]
    s = round_to(tl.load(SIN + pos * HALF + cols, mask=col_ok, other=0.0), dtype).to(tl.float32)[None, :]
    # [y1, y2] * cos + [-y2, y1] * sin, every product and sum rounded as torch rounds it.
    out1 = round_to(round_to(y1 * c, dtype).to(tl.float32) + round_to(-y2 * s, dtype).to(tl.float32), dtype)
    out2 = round_to(round_to(y2 * c, dtype).to(tl.float32) + round_to(y1 * s, dtype).to(tl.float32), dtype)
    q_ok = is_q[:, None] & col_ok[None, :]
    q_dst = Q_OUT + (token * N_HEADS + head[:, None]) * HD + cols[None, :]
    tl.store(q_dst, out1, mask=q_ok)
    tl.store(q_dst + HALF, out2, mask=q_ok)
    k_ok = is_k[:, None] & col_ok[None, :]
    kv_head = tl.where(is_k, head - N_HEADS, head - N_HEADS - N_KV)[:, None]  # for k and v heads alike
    k_dst = K_OUT + (token * N_KV + kv_head) * HD + cols[None, :]
    tl.store(k_dst, out1, mask=k_ok)
    tl.store(k_dst + HALF, out2, mask=k_ok)
    if HAS_CACHE:
        cache_row = (slot * N_KV + kv_head) * HD + cols[None, :]
        tl.store(K_CACHE + cache_row, out1, mask=k_ok)
        tl.store(K_CACHE + cache_row + HALF, out2, mask=k_ok)
        v_ok = is_v[:, None] & col_ok[None, :]
        tl.store(V_CACHE + cache_row, x1, mask=v_ok)
        tl.store(V_CACHE + cache_row + HALF, x2, mask=v_ok)


@torch.library.custom_op("qwen3_ops::qk_norm_rope", mutates_args=("k_cache", "v_cache"))
def _qk_norm_rope_op(
    qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    positions: torch.Tensor, eps: float, n_heads: int, n_kv_heads: int,
    k_cache: torch.Tensor | None, v_cache: torch.Tensor | None, slots: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    N, hd = qkv.shape[0], q_weight.shape[0]
    q = torch.empty(N, n_heads, hd, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(N, n_kv_heads, hd, dtype=qkv.dtype, device=qkv.device)
    has_cache = k_cache is not None
    if N:
        block_h, warps = heads_per_program(N, hd)
        pdl = use_pdl(qkv.device)
        _qk_norm_rope_kernel[(N, triton.cdiv(n_heads + 2 * n_kv_heads, block_h))](
            qkv, q_weight, k_weight, cos, sin, positions, slots if has_cache else positions, q, k,
            k_cache if has_cache else q, v_cache if has_cache else q,
            k_cache.shape[0] if has_cache else 1, eps,
            N_HEADS=n_heads, N_KV=n_kv_heads, HD=hd, BLOCK_HALF=triton.next_power_of_2(hd // 2),
            BLOCK_H=block_h, HAS_CACHE=has_cache, PDL=pdl, num_warps=warps, launch_pdl=pdl,
        )
    return q, k


@_qk_norm_rope_op.register_fake
def _(qkv, q_weight, k_weight, cos, sin, positions, eps, n_heads, n_kv_heads, k_cache, v_cache, slots):
    N, hd = qkv.shape[0], q_weight.shape[0]
    return qkv.new_empty(N, n_heads, hd), qkv.new_empty(N, n_kv_heads, hd)


def _check(qkv, q_weight, k_weight, cos, sin, positions, n_heads, n_kv_heads, k_cache, v_cache, slots) -> None:
    hd = q_weight.shape[0] if q_weight.dim() == 1 else -1
    if qkv.dim() != 2 or hd < 2 or hd % 2 or qkv.shape[1] != (n_heads + 2 * n_kv_heads) * hd:
        raise ValueError(f"qkv must be [N, (n_heads + 2 * n_kv_heads) * head_dim], got {tuple(qkv.shape)} "
                         f"for {n_heads} + 2 x {n_kv_heads} heads of a {tuple(q_weight.shape)} q_norm weight")
    if k_weight.shape != q_weight.shape or q_weight.dtype != qkv.dtype or k_weight.dtype != qkv.dtype:
        raise ValueError("q_weight and k_weight must be [head_dim] in qkv's dtype")
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != hd // 2 or cos.dtype != torch.float32:
        raise ValueError(f"cos and sin must be fp32 tables [positions, head_dim / 2], got {tuple(cos.shape)}")
    if positions.shape != (qkv.shape[0],) or positions.dtype != torch.long:
        raise ValueError(f"positions must be a LongTensor [N={qkv.shape[0]}], got {tuple(positions.shape)}")
    if (k_cache is None) != (v_cache is None) or (k_cache is None) != (slots is None):
        raise ValueError("k_cache, v_cache and slots go together")
    if k_cache is not None:
        if k_cache.shape != v_cache.shape or k_cache.shape[1:] != (n_kv_heads, hd) or k_cache.dtype != qkv.dtype:
            raise ValueError(f"k_cache and v_cache must be [n_slots, {n_kv_heads}, {hd}] in qkv's dtype")
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("k_cache and v_cache must be contiguous")
        if slots.shape != positions.shape or slots.dtype != torch.long:
            raise ValueError("slots must be a LongTensor shaped like positions")


def qk_norm_rope(
    qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    positions: torch.Tensor, eps: float, n_heads: int, n_kv_heads: int,
    k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None, slots: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N, H, hd], k [N, K, hd]) normalized and rotated; k and v written at `slots` of the
    cache when one is given. Inference only (no backward): the model's unfused path, which
    runs transformers' operations one by one, is the reference and the training path."""
    _check(qkv, q_weight, k_weight, cos, sin, positions, n_heads, n_kv_heads, k_cache, v_cache, slots)
    # contiguous: the kernel reads positions[i] at position i (an expanded tensor has stride 0)
    positions = positions.contiguous()
    return _qk_norm_rope_op(qkv.contiguous(), q_weight.contiguous(), k_weight.contiguous(), cos, sin,
                            positions, float(eps), n_heads, n_kv_heads, k_cache, v_cache,
                            None if slots is None else slots.contiguous())
