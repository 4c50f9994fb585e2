"""Grouped-query attention with Qwen3's QK-norm, over the keys that an AttentionMetadata describes.

Shapes: N tokens of S sequences, H query heads, K key/value heads (H % K == 0: grouped-query
attention), hd head_dim, D hidden_size. With tensor parallelism H and K are this rank's.

Each token attends to its own sequence's keys at positions up to its own, computed the way the
tokens' layout allows (runtime/metadata.py builds it):
- one new token per sequence after cached ones, fused path: the split-KV Triton decode kernel over
  each sequence's blocks (ops/attention/decode_attention.py), no mask, lengths on the device;
- sequences from position 0: their new tokens, causal; as rows [S, T] through SDPA, or packed back
  to back through varlen flash attention (CUDA, 16 bits), SDPA under a block-diagonal mask (under a
  CUDA graph or torch.compile), or SDPA per sequence (eagerly: the bounds read to the host);
- new tokens after cached ones otherwise (a prefill after a cached prefix, a prompt's next chunk, a
  chat's next turn, the reference decode): fused, the Triton kernel for packed query chunks over
  paged keys (ops/attention/extend_attention.py); else the cache's blocks gathered into rows, SDPA
  under a mask of the positions.
"""

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ops.attention.decode_attention import decode_attention
from ops.attention.extend_attention import extend_attention
from ops.attention.qk_norm_rope import qk_norm_rope
from runtime.metadata import AttentionMetadata

from .config import Qwen3Config
from .layers import FusedLinear, RMSNorm, RotaryEmbedding, apply_rotary, linear, normed_linear, stack_fused_parts
from .parallel import TensorParallel

# SDPA's backends, cuDNN's left out: SDPA may pick cuDNN attention for a 16-bit prefill, and cuDNN
# builds an execution plan for every new sequence length (tens of ms per layer), which a server
# meets with nearly every request. Flash and memory-efficient attention need no plan. (The CPU
# has none of cuDNN's.) On CUDA, flash takes no mask and memory-efficient attention no grouped k/v
# (enable_gqa): a masked call of a GQA model would fall to the math backend, which holds every
# [T, keys] score in fp32, so there k and v are repeated per query head first.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

try:  # torch's variable-length flash attention (torch 2.10 named causal attention is_causal)
    from torch.nn.attention.varlen import varlen_attn

    _VARLEN_ARGS = inspect.signature(varlen_attn).parameters
    VARLEN_CAUSAL = dict(window_size=(-1, 0)) if "window_size" in _VARLEN_ARGS else dict(is_causal=True)
    if "enable_gqa" in _VARLEN_ARGS:
        VARLEN_CAUSAL["enable_gqa"] = True
except ImportError:
    varlen_attn = None


def varlen_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether packed sequences attend through varlen flash attention (CUDA, 16-bit, torch >= 2.10)."""
    return varlen_attn is not None and device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)


def static_shapes(device: torch.device) -> bool:
    """Whether this forward is being captured in a CUDA graph or traced by torch.compile: then
    nothing may depend on tensor values read back to the host (no sync, no data-dependent shape)."""
    return torch.compiler.is_compiling() or (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


@dataclass
class TokenBatch:
    """What every layer of one forward reads about its tokens, made once per forward."""

    meta: AttentionMetadata
    positions: torch.Tensor  # [N] long: each token's position in its sequence
    fused: bool  # the Triton kernels (config.kernels "fused", no autograd) or transformers' operations
    cos: torch.Tensor  # fused: fp32 tables [P, hd/2]; reference: [N, hd] in the activations' dtype
    sin: torch.Tensor
    packed_mask: torch.Tensor | None = None  # [N, N] bool: packed sequences under static shapes without varlen


def token_batch(meta: AttentionMetadata, positions: torch.Tensor, rotary: RotaryEmbedding, dtype: torch.dtype,
                fused: bool) -> TokenBatch:
    """The TokenBatch of tokens at positions [N] laid out as `meta` says, in activations of `dtype`."""
    device = positions.device
    cos, sin = rotary.tables(device) if fused else rotary(positions, dtype)
    mask = None
    if meta.rows is None and meta.from_start and static_shapes(device) and not varlen_supported(device, dtype):
        mask = packed_mask(meta.cu_seqlens, positions.shape[0])
    return TokenBatch(meta, positions, fused, cos, sin, mask)


def packed_mask(cu_seqlens: torch.Tensor, N: int) -> torch.Tensor:
    """[N, N] bool: token i sees token j of its own sequence at or before it (padding after the last
    sequence is a sequence of its own, so that no row is empty). Device-side ops only."""
    tokens = torch.arange(N, device=cu_seqlens.device)
    sequence = torch.searchsorted(cu_seqlens[1:], tokens.to(cu_seqlens.dtype), right=True)
    return (sequence[:, None] == sequence[None, :]) & (tokens[:, None] >= tokens[None, :])


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None = None,
         causal: bool = False) -> torch.Tensor:
    """SDPA of q [..., H, Tq, hd] over k, v [..., K, Tk, hd] (grouped: H a multiple of K)."""
    H, K = q.shape[-3], k.shape[-3]
    gqa = H != K
    if gqa and mask is not None and q.is_cuda:  # see SDPA_BACKENDS: each query head its own k/v
        k, v, gqa = k.repeat_interleave(H // K, dim=-3), v.repeat_interleave(H // K, dim=-3), False
    with sdpa_kernel(SDPA_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Causal attention of sequences packed back to back: q [N, H, hd], k and v [N, K, hd], sequence
    s at tokens [cu_seqlens[s], cu_seqlens[s + 1]) attending to its own tokens only -> [N, H, hd]
    (the padding's rows are unset or junk). varlen flash attention where it runs (no host sync: a
    CUDA graph captures it); else SDPA under `mask` [N, N] (block-diagonal causal) when given,
    which a graph also captures; else SDPA per sequence, the bounds read back to the host."""
    N = q.shape[0]
    if varlen_supported(q.device, q.dtype):
        return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, N, N, scale=scale, **VARLEN_CAUSAL)
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [heads, N, hd]
    if mask is not None:
        return sdpa(q, k, v, scale, mask).transpose(0, 1)
    out = q.new_zeros(q.shape)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds, bounds[1:]):
        if end > start:
            out[:, start:end] = sdpa(q[:, start:end], k[:, start:end], v[:, start:end], scale, causal=True)
    return out.transpose(0, 1)


def cached_attention(q: torch.Tensor, batch: TokenBatch, layer: int, scale: float) -> torch.Tensor:
    """The reference read of new tokens after cached ones: q [N, H, hd] over each sequence's keys,
    gathered from its blocks, at positions up to each query's -> [N, H, hd]. Rows of T tokens in one
    SDPA call; packed sequences one at a time, their bounds read back to the host (eager only)."""
    meta = batch.meta
    if meta.rows is None:
        out = q.new_zeros(q.shape)
        bounds, lengths = meta.cu_seqlens.tolist(), meta.seq_lens.tolist()
        for s, (start, end) in enumerate(zip(bounds, bounds[1:])):
            if end > start:
                out[start:end] = rows_attention(q[start:end], batch.positions[start:end], meta.cache, layer,
                                                meta.block_tables[s : s + 1], lengths[s], scale)
        return out
    return rows_attention(q, batch.positions, meta.cache, layer, meta.block_tables, meta.max_seq_len, scale,
                          meta.num_sequences)


def rows_attention(q: torch.Tensor, positions: torch.Tensor, cache, layer: int, block_tables: torch.Tensor,
                   max_seq_len: int, scale: float, S: int = 1) -> torch.Tensor:
    """S rows of T new tokens (q [S * T, H, hd] at positions [S * T]) over their rows' keys in the
    cache through block_tables [S, M], each query up to its own position -> [S * T, H, hd]."""
    T = q.shape[0] // S
    n_blocks = cache.blocks_for(max_seq_len)  # the blocks that hold every row's keys
    k_rows, v_rows = cache.gather(layer, block_tables[:, :n_blocks])  # [S, keys, K, hd]
    keys = torch.arange(k_rows.shape[1], device=q.device)
    mask = keys <= positions.view(S, T)[:, :, None]  # [S, T, keys]
    out = sdpa(q.view(S, T, *q.shape[1:]).transpose(1, 2), k_rows.transpose(1, 2), v_rows.transpose(1, 2), scale,
               mask[:, None])
    return out.transpose(1, 2).reshape(q.shape)


class Attention(nn.Module):
    """Grouped-query attention with per-head RMSNorm on q and k (Qwen3's QK-norm) before RoPE.
    With `tp`: this rank's query heads and the key/value heads they read; the output is this
    rank's partial sum of o_proj (its bias on rank 0 only), to be all-reduced."""

    def __init__(self, config: Qwen3Config, layer_idx: int, tp: TensorParallel | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads = (
            tp.heads(config) if tp else (config.num_attention_heads, config.num_key_value_heads)
        )
        self.head_dim = config.head_dim
        D, H, K, hd = config.hidden_size, self.n_heads, self.n_kv_heads, config.head_dim
        self.qkv_proj = FusedLinear(D, {"q_proj": H * hd, "k_proj": K * hd, "v_proj": K * hd}, config.attention_bias)
        self.o_proj = nn.Linear(H * hd, D, bias=config.attention_bias and (tp is None or tp.rank == 0))
        self.q_norm = RMSNorm(hd, config.rms_norm_eps, config.norm_impl)
        self.k_norm = RMSNorm(hd, config.rms_norm_eps, config.norm_impl)
        self.register_load_state_dict_pre_hook(stack_fused_parts)

    def forward(self, x: torch.Tensor, batch: TokenBatch, residual: torch.Tensor | None = None,
                norm: RMSNorm | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention of norm(x + residual) [N, D], x + residual): x [N, D]. The decoder layer passes
        its input norm and the residual stream (normed_linear: at one row the norm is fused into the
        qkv projection); alone, neither."""
        N = x.shape[0]
        qkv, residual = normed_linear(norm, self.qkv_proj, x, residual, batch.fused)  # [N, (H + 2K) hd]
        q, k, v = self.rotated_qkv(qkv, batch)  # [N, H, hd], [N, K, hd], [N, K, hd]; keys and values cached
        out = self.attend(q, k, v, batch)  # [N, H, hd]
        return linear(self.o_proj, out.reshape(N, self.n_heads * self.head_dim), batch.fused), residual

    def rotated_qkv(self, qkv: torch.Tensor, batch: TokenBatch) -> tuple[torch.Tensor, ...]:
        """q and k normalized per head and rotated by position, v as projected; k and v written to
        the cache at the tokens' slots (the fused kernel does all of it in one pass)."""
        H, K, hd = self.n_heads, self.n_kv_heads, self.head_dim
        meta, N = batch.meta, qkv.shape[0]
        v = qkv[:, (H + K) * hd :].view(N, K, hd)
        k_cache, v_cache = meta.cache.layer(self.layer_idx) if meta.cache is not None else (None, None)
        if batch.fused:
            q, k = qk_norm_rope(qkv, self.q_norm.weight, self.k_norm.weight, batch.cos, batch.sin, batch.positions,
                                self.q_norm.eps, H, K, k_cache, v_cache, meta.slots)
            return q, k, v
        q, k, _ = qkv.split([H * hd, K * hd, K * hd], dim=-1)
        q = apply_rotary(self.q_norm(q.view(N, H, hd)), batch.cos, batch.sin)
        k = apply_rotary(self.k_norm(k.view(N, K, hd)), batch.cos, batch.sin)
        if meta.cache is not None:
            meta.cache.write(self.layer_idx, meta.slots, k, v)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: TokenBatch) -> torch.Tensor:
        """Each token over its sequence's keys at positions up to its own -> [N, H, hd] (see the module)."""
        meta, scale = batch.meta, self.head_dim**-0.5
        if meta.rows == 1 and meta.cache is not None and batch.fused:
            if meta.consecutive_blocks:  # each row's keys one run: no table to read before them
                k_rows, v_rows = meta.cache.rows(self.layer_idx, *meta.block_tables.shape)  # [S, M * block, K, hd]
                return decode_attention(q, k_rows, v_rows, meta.seq_lens, scale)
            k_blocks, v_blocks = meta.cache.blocks(self.layer_idx)  # [n_blocks, block_size, K, hd]
            return decode_attention(q, k_blocks, v_blocks, meta.seq_lens, scale, block_table=meta.block_tables)
        if not meta.from_start:
            if batch.fused:
                k_blocks, v_blocks = meta.cache.blocks(self.layer_idx)
                return extend_attention(q, k_blocks, v_blocks, meta.cu_seqlens, meta.seq_lens, meta.block_tables,
                                        scale)
            return cached_attention(q, batch, self.layer_idx, scale)
        if meta.rows is None:
            return packed_attention(q, k, v, meta.cu_seqlens, batch.packed_mask, scale)
        S, T = meta.num_sequences, meta.rows
        rows = [t.view(S, T, *t.shape[1:]).transpose(1, 2) for t in (q, k, v)]  # [S, heads, T, hd]
        return sdpa(*rows, scale, causal=T > 1).transpose(1, 2).reshape(q.shape)
