"""Qwen3, top to bottom: RMSNorm, rotary embedding, attention, MLP, decoder layer, model, LM head.

Shapes: B batch, T new tokens, S cache slots per row, D hidden_size, H query heads,
K key/value heads (H % K == 0: grouped-query attention), hd head_dim, F intermediate_size,
V vocab_size, P max_position_embeddings.

Checkpoint keys are Hugging Face's. q/k/v and gate/up are each one matmul here (FusedLinear),
whose rows the checkpoint's separate projections fill (`checkpoint_tensors`). A layer's MLP is
dense (MLP) or, in a Qwen3-MoE model, the sparse block of router + experts (qwen3/moe.py).

With tensor parallelism (`tp`, qwen3/parallel.py) each rank holds its share of the heads, of F and
of V: H, K, F and V below are then this rank's counts, attention and the MLP each return this
rank's partial sum of their output projection, and DecoderLayer adds the ranks' partial sums.

Two paths compute the same function (config.kernels picks one). The reference path is
transformers' operations one by one (the training path, and what runs on the CPU by default). The
fused path, for inference, runs attention's input step (q/k-norm, RoPE, cache write), the one-token
attention and SiLU-and-multiply as single Triton kernels (ops/), so that a decode step is a few
large kernels per layer, which a CUDA graph then replays (runtime/generate.py).
"""

import inspect
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ops import IMPLS, fused_add_rms_norm, rms_norm
from ops.attention.decode_attention import decode_attention
from ops.attention.qk_norm_rope import qk_norm_rope
from ops.linear import skinny_gemm
from ops.linear.gemv import gemv, gemv_rms_norm
from ops.linear.silu_mul import silu_mul
from runtime.cache import KVCache, PagedKVCache
from runtime.checks import check_in_vocab, check_input_ids

from .config import KERNELS, Qwen3Config, resolve_kernels
from .moe import Experts, SparseMoeBlock, is_sparse_layer
from .parallel import TensorParallel, VocabParallelEmbedding, all_reduce, gather_vocab

# SDPA's backends, cuDNN's left out: SDPA may pick cuDNN attention for a 16-bit prefill, and cuDNN
# builds an execution plan for every new sequence length (tens of ms per layer), which a server
# meets with nearly every request. Flash and memory-efficient attention need no plan. (The CPU
# has none of cuDNN's.) On
# CUDA, flash takes no mask and memory-efficient attention no grouped k/v (enable_gqa): a masked
# call of a GQA model would fall to the math backend, which holds every [T, keys] score in fp32,
# so there k and v are repeated per query head first.
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


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Causal attention of sequences packed back to back: q [T, H, hd], k and v [T, K, hd], sequence
    i at tokens [cu_seqlens[i], cu_seqlens[i + 1]) attending to its own tokens only -> [T, H, hd]
    (the padding's rows are unset or junk). varlen flash attention where it runs (no host sync: a
    CUDA graph captures it); else SDPA under `mask` [T, T] (block-diagonal causal) when given,
    which a graph also captures; else SDPA per sequence, the bounds read back to the host."""
    T, H, _ = q.shape
    if varlen_supported(q.device, q.dtype):
        return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, T, T, scale=scale, **VARLEN_CAUSAL)
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [heads, T, hd]
    group = H // k.shape[0]
    gqa = group > 1
    with sdpa_kernel(SDPA_BACKENDS):
        if mask is not None:
            if gqa and q.is_cuda:  # see SDPA_BACKENDS: a masked GQA call wants k/v per query head
                k, v, gqa = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0), False
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa).transpose(0, 1)
        out = q.new_zeros(q.shape)
        bounds = cu_seqlens.tolist()
        for start, end in zip(bounds, bounds[1:]):
            if end > start:
                out[:, start:end] = F.scaled_dot_product_attention(
                    q[:, start:end], k[:, start:end], v[:, start:end], is_causal=True, scale=scale, enable_gqa=gqa)
    return out.transpose(0, 1)


class RMSNorm(nn.Module):
    """Qwen3RMSNorm; `impl` picks the implementation in ops (the model's one norm switch).
    Called with a residual, it first adds it (rounded to the input dtype, as HF does) and returns
    (normalized, sum): the sum is the residual stream the next block adds to."""

    def __init__(self, dim: int, eps: float, impl: str):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.impl = impl

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return rms_norm(x, self.weight, self.eps, self.impl)
        return fused_add_rms_norm(x, residual, self.weight, self.eps, self.impl)


class FusedLinear(nn.Linear):
    """Projections of one input computed as one matmul: the weights (and biases) of `parts`
    ({checkpoint name: rows}) stacked by rows in order, as q_proj/k_proj/v_proj -> qkv_proj."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool):
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.parts = parts

    def part_rows(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """{part name: the rows of `param` (this module's weight or bias) that belong to it}."""
        starts = [0, *torch.tensor(list(self.parts.values())).cumsum(0).tolist()]
        return {name: param[start:end] for name, start, end in zip(self.parts, starts, starts[1:])}



def linear(layer: nn.Linear, x: torch.Tensor, fused: bool, gated: bool = False) -> torch.Tensor:
    """layer(x); with gated (layer an MLP's [gate; up] projection), SwiGLU's silu(gate) * up of it.
    On the fused path a single row (a batch-1 decode step) takes the GEMV kernel, and a few rows
    (a batched decode step) the skinny GEMM where it is faster: both stream the weights faster
    than cuBLAS's kernels for those shapes and apply the gate as they round their sums
    (ops/linear/gemv.py, ops/linear/skinny_gemm.py)."""
    rows = x.numel() // x.shape[-1] if fused else 0
    if rows == 1:
        return gemv(x, layer.weight, layer.bias, gated)
    if skinny_gemm.faster_than_cublas(rows, layer.weight):
        return skinny_gemm.skinny_linear(x, layer.weight, layer.bias, gated)
    y = layer(x)
    if not gated:
        return y
    if fused:
        return silu_mul(y)
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


def normed_linear(norm: "RMSNorm", layer: nn.Linear, h: torch.Tensor, residual: torch.Tensor | None,
                  fused: bool, gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(layer, norm(s), fused, gated), s) with s = h + residual (residual None: s = h): a
    pre-norm block's entry. On the fused path a single row takes one GEMV kernel that adds and
    normalizes in its prologue (ops/linear/gemv.py's gemv_rms_norm, the norm's own arithmetic): no norm
    kernel of its own."""
    if fused and h.numel() == h.shape[-1]:
        return gemv_rms_norm(h, residual, norm.weight, norm.eps, layer.weight, layer.bias, gated)
    h, residual = norm(h, residual) if residual is not None else (norm(h), h)
    return linear(layer, h, fused, gated), residual


def stack_fused_parts(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """A load_state_dict pre-hook of a module with FusedLinear children: a state dict that holds
    the parts apart (a transformers module's: q_proj, k_proj, v_proj) has them stacked into the
    fused parameter, so `load_state_dict(hf_module.state_dict())` works."""
    for name, child in module.named_children():
        if isinstance(child, FusedLinear):
            for kind in ("weight", "bias"):
                keys = [f"{prefix}{part}.{kind}" for part in child.parts]
                if all(key in state_dict for key in keys):
                    state_dict[f"{prefix}{name}.{kind}"] = torch.cat([state_dict.pop(key) for key in keys])


def rope_frequencies(config: Qwen3Config) -> tuple[torch.Tensor, float]:
    """(inv_freq [hd/2] in fp32, attention_scaling) for plain RoPE or YaRN, as transformers computes
    them. Made on the CPU whatever device the model is being built on (the meta device included)."""
    dim, base = config.head_dim, config.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    scaling = config.rope_scaling
    if scaling is None:
        return 1.0 / pos_freqs, 1.0

    # YaRN (arXiv 2309.00071): interpolate the low frequencies by `factor`, keep the high ones,
    # blend linearly between the wavelengths that make beta_fast and beta_slow turns.
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or config.max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")

        def get_mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = correction_dim(scaling.get("beta_fast") or 32)
    high = correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def settle_cpu_trig() -> None:
    """One-element cos and sin on the CPU. torch's CPU cos/sin call MKL's VML, which picks its
    kernel on a function's first call; when that first call runs on several intra-op threads at
    once, one thread can get a low-accuracy kernel for its share (pytorch/pytorch#188792). A
    single-threaded first call settles the choice for the process."""
    one = torch.ones(1)
    one.cos(), one.sin()


class RotaryEmbedding(nn.Module):
    """cos and sin of every position's angles, as fp32 tables [P, hd/2] made once per device on
    first use, exactly as transformers computes them: angle = position * inv_freq in fp32, then
    cos/sin times the attention scaling. Plain attributes, not buffers: they stay fp32 whatever
    dtype the model is cast to, and are never saved."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.inv_freq, self.attention_scaling = rope_frequencies(config)
        self.max_positions = config.max_position_embeddings
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._tables:
            if device.type == "cpu":
                settle_cpu_trig()
            positions = torch.arange(self.max_positions, dtype=torch.float32, device=device)
            angles = positions[:, None] * self.inv_freq.to(device)[None, :]
            self._tables[device] = (angles.cos() * self.attention_scaling, angles.sin() * self.attention_scaling)
        return self._tables[device]

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, T, hd] in dtype for integer positions [B, T] (transformers' layout: halves repeated)."""
        cos, sin = self.tables(positions.device)
        cos, sin = cos[positions], sin[positions]
        return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((sin, sin), dim=-1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, heads, hd] rotated by position: x*cos + rotate_half(x)*sin, cos/sin [B, T, hd]."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


@dataclass
class ForwardBatch:
    """What every layer of one forward needs to know about its tokens, built once per forward
    (`prepare_batch`): where they sit, which path computes them, what they attend to."""

    positions: torch.Tensor  # [B, T] long: each token's rotary position, which is also its slot in its cache row
    fused: bool  # the Triton kernels (config.kernels "fused", no autograd) or transformers' operations
    cos: torch.Tensor  # fused: fp32 tables [P, hd/2]; unfused: [B, T, hd] in the activations' dtype
    sin: torch.Tensor
    slots: torch.Tensor | None  # [B * T] flat cache slot of each token (padding -> the scratch slot)
    mask: torch.Tensor | None  # [B, 1, T, keys] bool (True = attend) for SDPA; None: causal
    n_keys: int | None  # attend over cache slots [0, n_keys) of each row; None: over the new tokens only
    seq_lens: torch.Tensor | None  # [B] one-token steps on the fused path: keys per row, the new one included
    block_table: torch.Tensor | None = None  # [B, M] a PagedKVCache's blocks of each row (packed: of each sequence)
    cu_seqlens: torch.Tensor | None = None  # [N + 1] int32: packed sequences' bounds in the one row of tokens


def static_shapes(device: torch.device) -> bool:
    """Whether this forward is being captured in a CUDA graph or traced by torch.compile: then
    nothing may depend on tensor values read back to the host (no sync, no data-dependent shape)."""
    return torch.compiler.is_compiling() or (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def prepare_batch(
    rotary: RotaryEmbedding,
    positions: torch.Tensor,
    dtype: torch.dtype,
    fused: bool,
    cache: KVCache | PagedKVCache | None = None,
    valid: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> ForwardBatch:
    """The ForwardBatch of tokens at `positions` [B, T]; valid [B, T] bool marks real tokens
    (None: all); block_table [B, M] names each row's blocks of a PagedKVCache (a KVCache: None).
    cu_seqlens [N + 1]: the one row (B = 1) holds N sequences back to back, each from position 0
    (block_table [N, M]: each sequence's blocks); tokens past cu_seqlens[-1] are padding.
    Attention covers, for each token, its row's tokens at positions <= its own:
    - packed sequences: each token its own sequence's tokens, causal (packed_attention);
    - no cache, or a cache whose rows all start at position 0: the new tokens, causal, padding
      masked (the first prefill; a right-padded batch needs no mask);
    - one token per row on the fused path: the Triton decode kernel over each row's first
      position + 1 slots (no mask, no host sync: a CUDA graph replays it);
    - otherwise: cache slots [0, n_keys) through a mask. n_keys is the largest position + 1, or
      every slot under static shapes (see static_shapes).
    """
    B, T = positions.shape
    device = positions.device
    if fused:
        cos, sin = rotary.tables(device)
    else:
        cos, sin = rotary(positions, dtype)
    slots = None
    if cu_seqlens is not None:
        tokens = torch.arange(T, device=device)
        sequence = torch.searchsorted(cu_seqlens[1:], tokens, right=True)  # [T]: N for padding
        if isinstance(cache, PagedKVCache):
            slots = cache.packed_slots(positions[0], sequence.clamp(max=block_table.shape[0] - 1),
                                       tokens < cu_seqlens[-1], block_table)
        elif cache is not None:
            raise ValueError("packed sequences (cu_seqlens) are written to a PagedKVCache only")
        mask = None
        if static_shapes(device) and not varlen_supported(device, dtype):
            # Each token sees its own sequence's up to itself (the padding, a sequence of its own,
            # only itself and the padding before it: no empty row).
            mask = (sequence[:, None] == sequence[None, :]) & (tokens[:, None] >= tokens[None, :])
        return ForwardBatch(positions, fused, cos, sin, slots, mask, None, None, block_table, cu_seqlens)
    if isinstance(cache, PagedKVCache):
        slots = cache.slots(positions, valid, block_table)
    elif cache is not None:
        slots = cache.slots(positions, valid)
    static = static_shapes(device)
    if cache is not None and T == 1 and fused:
        return ForwardBatch(positions, fused, cos, sin, slots, None, None, positions[:, 0] + 1, block_table)
    if cache is None or (not static and int(positions[:, 0].max()) == 0):
        mask = None
        # Right padding only (each row's tokens first, as the serving engine batches prompts): the
        # causal rule alone keeps every real token from the padding after it, and SDPA's fused
        # kernels run without a mask (with one, a batch of long prompts took several times longer).
        right_padded = (valid is not None and not static and torch.equal(
            valid, torch.arange(T, device=device) < valid.sum(1, keepdim=True)))
        if valid is not None and not right_padded:  # causal, padding keys hidden; each token sees itself (no NaN)
            causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
            mask = ((causal & valid[:, None, :]) | torch.eye(T, dtype=torch.bool, device=device))[:, None]
        return ForwardBatch(positions, fused, cos, sin, slots, mask, None, None, block_table)
    n_keys = row_len(cache, block_table) if static else int(positions.max()) + 1
    mask = torch.arange(n_keys, device=device) <= positions[:, :, None]  # [B, T, n_keys]
    return ForwardBatch(positions, fused, cos, sin, slots, mask[:, None], n_keys, None, block_table)


def row_len(cache: KVCache | PagedKVCache, block_table: torch.Tensor | None) -> int:
    """Positions each row of the cache can hold (a paged cache's rows: their block tables' width)."""
    return cache.row_len(block_table) if isinstance(cache, PagedKVCache) else cache.max_len


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

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: KVCache | None = None) -> torch.Tensor:
        return self.attend(linear(self.qkv_proj, x, batch.fused), batch, cache)  # x [B, T, D]

    def attend(self, qkv: torch.Tensor, batch: ForwardBatch, cache: KVCache | None = None) -> torch.Tensor:
        """The rest of forward, from the projected qkv [B, T, (H + 2K) * hd]."""
        B, T, _ = qkv.shape
        H, K, hd = self.n_heads, self.n_kv_heads, self.head_dim
        k_cache, v_cache = cache.layer(self.layer_idx) if cache is not None else (None, None)  # [B*S+1, K, hd]
        if batch.fused:
            q, k = qk_norm_rope(qkv.view(B * T, -1), self.q_norm.weight, self.k_norm.weight, batch.cos, batch.sin,
                                batch.positions.reshape(-1), self.q_norm.eps, H, K, k_cache, v_cache, batch.slots)
            q, k = q.view(B, T, H, hd), k.view(B, T, K, hd)
        else:
            q, k, _ = qkv.split([H * hd, K * hd, K * hd], dim=-1)
            q = apply_rotary(self.q_norm(q.view(B, T, H, hd)), batch.cos, batch.sin)
            k = apply_rotary(self.k_norm(k.view(B, T, K, hd)), batch.cos, batch.sin)
            if cache is not None:
                cache.write(self.layer_idx, batch.slots, k, qkv[..., (H + K) * hd :])
        v = qkv[..., (H + K) * hd :].view(B, T, K, hd)

        if batch.seq_lens is not None:  # one new token per row, fused path: the split-KV kernel
            if batch.block_table is None:
                k_rows, v_rows = cache.rows(self.layer_idx)  # [B, S, K, hd]
                out = decode_attention(q.view(B, H, hd), k_rows, v_rows, batch.seq_lens, hd**-0.5)
            else:  # keys found through each row's block table
                k_blocks, v_blocks = cache.blocks(self.layer_idx)  # [n_blocks, block_size, K, hd]
                out = decode_attention(q.view(B, H, hd), k_blocks, v_blocks, batch.seq_lens, hd**-0.5,
                                       block_table=batch.block_table)
            return linear(self.o_proj, out.view(B, T, H * hd), batch.fused)
        if batch.cu_seqlens is not None:  # packed sequences, each over its own new tokens
            out = packed_attention(q[0], k[0], v[0], batch.cu_seqlens, batch.mask, hd**-0.5)  # [T, H, hd]
            return linear(self.o_proj, out.reshape(B, T, H * hd), batch.fused)
        if batch.n_keys is None:  # over the new tokens
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, K, T, hd]
        else:  # over each row's cached slots
            if batch.block_table is None:
                k_rows, v_rows = cache.rows(self.layer_idx)  # [B, S, K, hd]
            else:  # the blocks that hold positions < n_keys, gathered into rows
                n_blocks = -(-batch.n_keys // cache.block_size)
                k_rows, v_rows = cache.gather(self.layer_idx, batch.block_table[:, :n_blocks])
            k, v = k_rows[:, : batch.n_keys].transpose(1, 2), v_rows[:, : batch.n_keys].transpose(1, 2)
        gqa = K != H
        if gqa and batch.mask is not None and q.is_cuda:  # see SDPA_BACKENDS: each query head its own k/v
            k, v, gqa = k.repeat_interleave(H // K, dim=1), v.repeat_interleave(H // K, dim=1), False
        with sdpa_kernel(SDPA_BACKENDS):
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k, v,  # [B, H, T, hd] against [B, K, keys, hd]
                attn_mask=batch.mask,
                is_causal=batch.mask is None and T > 1,
                scale=hd**-0.5,
                enable_gqa=gqa,
            )
        return self.o_proj(out.transpose(1, 2).reshape(B, T, H * hd))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up as one matmul. With `tp`: this rank's F/N
    columns of gate and up, and its partial sum of down, to be all-reduced."""

    def __init__(self, config: Qwen3Config, tp: TensorParallel | None = None):
        super().__init__()
        D, F_ = config.hidden_size, config.intermediate_size // (tp.size if tp else 1)
        self.gate_up_proj = FusedLinear(D, {"gate_proj": F_, "up_proj": F_}, bias=False)
        self.down_proj = nn.Linear(F_, D, bias=False)
        self.register_load_state_dict_pre_hook(stack_fused_parts)

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        return self.down(linear(self.gate_up_proj, x, fused, gated=True), fused)

    def down(self, activation: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """The rest of forward, from silu(gate) * up [B, T, F]."""
        return linear(self.down_proj, activation, fused)


class DecoderLayer(nn.Module):
    """Pre-norm block. The residual add of each half is fused into the norm that follows it:
    (h, residual) in, (h, residual) out, the same arithmetic as HF's `residual + hidden_states`.
    With `tp`, attention and the MLP each end in a row-parallel projection: their outputs are
    the ranks' partial sums, added here by an all-reduce (two per layer)."""

    def __init__(self, config: Qwen3Config, layer_idx: int, tp: TensorParallel | None = None):
        super().__init__()
        self.tp = tp
        self.self_attn = Attention(config, layer_idx, tp)
        self.mlp = SparseMoeBlock(config) if is_sparse_layer(config, layer_idx) else MLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_impl)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_impl)

    def forward(self, h, residual, batch: ForwardBatch, cache: KVCache | None = None):
        qkv, residual = normed_linear(self.input_layernorm, self.self_attn.qkv_proj, h, residual, batch.fused)
        h = all_reduce(self.self_attn.attend(qkv, batch, cache), self.tp)
        if isinstance(self.mlp, MLP):
            activation, residual = normed_linear(self.post_attention_layernorm, self.mlp.gate_up_proj, h, residual,
                                                 batch.fused, gated=True)
            return all_reduce(self.mlp.down(activation, batch.fused), self.tp), residual
        h, residual = self.post_attention_layernorm(h, residual)  # the router and the experts read it
        return all_reduce(self.mlp(h, batch.fused), self.tp), residual


class Qwen3Model(nn.Module):
    def __init__(self, config: Qwen3Config, tp: TensorParallel | None = None):
        super().__init__()
        if tp is None:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        else:  # this rank's V/N rows; the lookup ends in an all-reduce
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, i, tp) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_impl)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(self, input_ids, batch: ForwardBatch, cache=None,
                keep: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Hidden states [B, T, D] after the final norm; keep (rows [N], columns [N]): the tokens
        wanted, [N, 1, D]."""
        h = self.embed_tokens(input_ids)  # [B, T, D]
        residual = None
        for layer in self.layers:
            h, residual = layer(h, residual, batch, cache)
        if keep is not None:  # the final norm only where logits are wanted
            h, residual = h[keep][:, None], residual[keep][:, None]
        return self.norm(h, residual)[0]


class Qwen3ForCausalLM(nn.Module):
    def __init__(self, config: Qwen3Config, tp: TensorParallel | None = None):
        """tp: this process's place in a tensor-parallel group (qwen3/parallel.py); the layers then
        hold its share of the weights (from_pretrained(tensor_parallel=True) builds and loads it)."""
        super().__init__()
        self.config = config
        self.tp = tp
        self.generation_config: dict = {}  # generation_config.json's defaults, set by the loader
        self.model = Qwen3Model(config, tp)
        # Key/value heads held here, what a KV cache stores: all, or this rank's share.
        self.kv_heads = tp.heads(config)[1] if tp else config.num_key_value_heads
        # With tp: this rank's V/N rows of the head; forward gathers the full logits.
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size // (tp.size if tp else 1), bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T] token ids
        positions: torch.Tensor | None = None,  # [B, T] each token's position in its row; default 0..T-1
        cache: KVCache | PagedKVCache | None = None,
        attention_mask: torch.Tensor | None = None,  # [B, T] 1 = token, 0 = padding
        last_only: bool = False,  # logits of each row's last real token only (what decoding needs)
        block_table: torch.Tensor | None = None,  # [B, M] long: with a PagedKVCache, each row's blocks
        cu_seqlens: torch.Tensor | None = None,  # [N + 1] int32: B = 1 row of N packed sequences (see below)
    ) -> torch.Tensor:
        """Logits [B, T, V] (with last_only [B, 1, V]). With a cache, `positions` are required: each
        token's keys and values are written to its row's slot `position`, and it attends to its
        row's slots up to its own position (earlier steps wrote the ones before). Padding tokens
        are written to a scratch slot and attended by no one but themselves. With a PagedKVCache,
        row b's slot for position p is block_table[b, p // block_size] * block_size + p % block_size.
        cu_seqlens packs several prompts' first forwards into one: input_ids [1, T] holds N
        sequences back to back, sequence i at tokens [cu_seqlens[i], cu_seqlens[i + 1]), each
        from position 0 (positions, required, restart with each) and attending to its own tokens only;
        block_table [N, M] holds each sequence's blocks; tokens past cu_seqlens[-1] are padding.
        With last_only the logits are each sequence's last token's, [N, 1, V]."""
        check_input_ids(input_ids)
        B, T = input_ids.shape
        if isinstance(cache, PagedKVCache) != (block_table is not None):
            raise ValueError("a PagedKVCache needs a block_table [B, blocks], and only it takes one")
        rows = B if cu_seqlens is None else cu_seqlens.shape[0] - 1  # a block table row per sequence
        if block_table is not None and (block_table.shape[0] != rows or block_table.dtype != torch.long):
            raise ValueError(f"block_table must be a LongTensor [{rows}, blocks], got {tuple(block_table.shape)}")
        if cu_seqlens is not None and (B != 1 or attention_mask is not None or positions is None
                                       or cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32
                                       or len(cu_seqlens) < 2):
            raise ValueError("packed sequences take input_ids [1, T], positions, no attention_mask, and "
                             "cu_seqlens, an int32 tensor [N + 1] of sequence bounds")
        device = input_ids.device
        if cache is None and not static_shapes(device):
            # The plain `model(input_ids)` call: an id outside the vocabulary would be an IndexError
            # in the embedding on the CPU and a device-side assert on CUDA. The check's one read-back
            # is a sync, acceptable once per whole no-cache forward. Not checked: a forward with a
            # cache (generate checks its prompt before the prefill; the serving engine's steps and
            # graphs are fed by checked requests), and one being captured or compiled, which
            # cannot read tensors back.
            check_in_vocab(input_ids, self.config.vocab_size)
        if positions is None:
            if cache is not None:
                raise ValueError("with a cache, pass positions: each token's position in its row")
            if T > self.config.max_position_embeddings:
                raise ValueError(f"{T} positions exceed max_position_embeddings={self.config.max_position_embeddings}")
            positions = torch.arange(T, device=device).expand(B, T)
        elif positions.shape != (B, T) or positions.dtype != torch.long:
            raise ValueError(f"positions must be a LongTensor shaped like input_ids {(B, T)}")
        elif T and not static_shapes(device):  # a captured or compiled step's caller owns its bounds
            top, limit = int(positions.max()), self.config.max_position_embeddings
            if top >= limit:
                raise ValueError(f"{top + 1} positions exceed max_position_embeddings={limit}")
            if cache is not None and top >= row_len(cache, block_table):
                raise ValueError(f"KV cache is full: position {top} does not fit its "
                                 f"{row_len(cache, block_table)} slots per row")
            if int(positions.min()) < 0:
                raise ValueError("positions must be >= 0")
        valid = None
        if attention_mask is not None:
            if attention_mask.shape != (B, T):
                raise ValueError(f"attention_mask must be shaped like input_ids {(B, T)}")
            valid = attention_mask.to(device=device, dtype=torch.bool)
        fused = resolve_kernels(self.config.kernels, device) == "fused" and not torch.is_grad_enabled()
        dtype = self.model.embed_tokens.weight.dtype
        batch = prepare_batch(self.model.rotary_emb, positions, dtype, fused, cache, valid, block_table, cu_seqlens)
        keep = None
        if last_only and cu_seqlens is not None:  # each sequence's last token (an empty one's: any)
            last = (cu_seqlens[1:] - 1).clamp(min=0).long()
            keep = torch.zeros_like(last), last
        elif last_only and T > 1:  # each row's last real token: the last column, or before right padding
            columns = torch.full((B,), T - 1, device=device) if valid is None else valid.long().cumsum(1).argmax(1)
            keep = torch.arange(B, device=device), columns
        return gather_vocab(self.lm_head(self.model(input_ids, batch, cache, keep)), self.tp)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """{Hugging Face checkpoint key: the parameter, or the rows of a fused one, it fills}. The
        loader copies each checkpoint tensor into its entry; saving these gives a HF checkpoint."""
        fused = {name: module for name, module in self.named_modules() if isinstance(module, FusedLinear)}
        experts = {name: module for name, module in self.named_modules() if isinstance(module, Experts)}
        tensors = {}
        for name, param in self.named_parameters():  # tied weights are listed once
            module, _, kind = name.rpartition(".")
            if module in fused:
                parent = module.rpartition(".")[0]
                for part, rows in fused[module].part_rows(param).items():
                    tensors[f"{parent}.{part}.{kind}"] = rows
            elif module in experts:  # stacked experts: one checkpoint tensor per expert and projection
                for key, view in experts[module].checkpoint_views(kind, param).items():
                    tensors[f"{module}.{key}"] = view
            else:
                tensors[name] = param
        return tensors

    @classmethod
    def from_pretrained(
        cls,
        path,
        dtype: torch.dtype | str | None = None,
        device: str | torch.device = "cpu",
        norm_impl: str | None = None,
        progress: bool = True,
        tensor_parallel: bool = False,
        kernels: str | None = None,
    ) -> "Qwen3ForCausalLM":
        """Load a Hugging Face Qwen3 checkpoint directory (config.json, model.safetensors or a
        sharded model.safetensors.index.json, optionally generation_config.json).

        dtype: a torch dtype or its name ("bfloat16", "float32", "float16"), or "auto" for the
            checkpoint's; None: float32 on the CPU (where 16-bit matmuls run several times
            slower), the checkpoint's on a GPU.
        device: where the weights go ("cpu", "cuda", "cuda:1", a torch.device).
        norm_impl: "auto" | "torch" | "triton" | "cuda": the RMSNorm implementation of every norm
            ("auto": triton on CUDA, torch elsewhere; default: the config's, else "auto").
        kernels: "auto" | "fused" | "reference": the fused Triton kernels of inference steps or
            transformers' operations one by one ("auto": fused on CUDA, reference elsewhere;
            default: the config's, else "auto"). The fused kernels normalize inside themselves,
            with the norm's arithmetic; norm_impl picks every other norm.
        progress: a progress bar while loading takes long.
        tensor_parallel: split the model over the ranks of the initialized torch.distributed
            default process group (torchrun; NCCL on GPUs, gloo on the CPU), each process reading
            only its part of each tensor (qwen3/parallel.py has the layout). Every rank must call
            this, and then the forward and generate, with the same arguments; each gets the full
            logits and the same tokens. "cuda" means cuda:LOCAL_RANK. Inference only (the
            parameters do not require grad). A ValueError without a process group, for a model
            whose heads (or F, V) do not divide over the ranks, and for Qwen3-MoE checkpoints.

        Every tensor's name and shape is checked against the config before anything is copied;
        a mismatch raises a ValueError naming the file and the tensor.
        """
        from .loader import load_model

        return load_model(cls, path, dtype=dtype, device=device, norm_impl=norm_impl, progress=progress,
                          tensor_parallel=tensor_parallel, kernels=kernels)

    def set_norm_impl(self, impl: str) -> None:
        """Switch every RMSNorm in the model (input, post-attention, q, k, final) to `impl`."""
        if impl not in IMPLS:
            raise ValueError(f"norm_impl must be one of {IMPLS}, got {impl!r}")
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.impl = impl
        self.config.norm_impl = impl

    def set_kernels(self, kernels: str) -> None:
        """Switch what computes inference steps: "fused" Triton kernels, "reference" operations, "auto"."""
        if kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
        self.config.kernels = kernels

    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int = 32,
        *,
        attention_mask: torch.Tensor | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        presence_penalty: float | None = None,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
        seed: int | None = None,
        on_token=None,
        cuda_graph: bool | None = None,
    ) -> torch.Tensor:
        """Token ids [B, T + n]: each prompt row followed by its n <= max_new_tokens new tokens.

        input_ids [B, T]: prompts, padded on the left or the right when their lengths differ,
            with attention_mask [B, T] (1 = token, 0 = padding). Each row generates what it would
            alone.
        temperature (0 = greedy), top_k (0 = off), top_p (1 = off), min_p (0 = off),
        repetition_penalty (1 = off), presence_penalty (0 = off): sampling, applied in
            transformers' order; unset ones come from the checkpoint's generation_config.json,
            else temperature 1 and the rest off.
        eos_token_id: stop ids (default: generation_config's, else the config's). A row stops at
            its first; it is padded with pad_token_id (default: the first eos id) until all stop.
        seed: reproducible sampling.
        on_token: called with the new ids [B] of each step (a tensor on the host), in order, for streaming.
        cuda_graph: replay the decode step from a CUDA graph (default: on for CUDA, off otherwise).
        """
        from runtime.generate import generate

        return generate(
            self, input_ids, max_new_tokens, attention_mask=attention_mask, temperature=temperature, top_k=top_k,
            top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
            eos_token_id=eos_token_id, pad_token_id=pad_token_id, seed=seed, on_token=on_token, cuda_graph=cuda_graph,
        )
