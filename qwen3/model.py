"""Qwen3, top to bottom: RMSNorm, rotary embedding, attention, MLP, decoder layer, model, LM head.

Shapes: B batch, T new tokens, S cached + new tokens, D hidden_size, H query heads,
K key/value heads (H % K == 0: grouped-query attention), hd head_dim, V vocab_size.
Parameter names equal Hugging Face's, so checkpoint keys map onto modules one to one.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from ops import IMPLS, fused_add_rms_norm, rms_norm

from .cache import KVCache
from .config import Qwen3Config


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


def rope_frequencies(config: Qwen3Config) -> tuple[torch.Tensor, float]:
    """(inv_freq [hd/2] in fp32, attention_scaling) for plain RoPE or YaRN, as transformers computes them."""
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
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """cos/sin [B, T, hd] for integer positions [B, T]: fp32 angles, cast to the activations' dtype."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        # A plain attribute, not a buffer: it must stay fp32 whatever dtype the model is cast to.
        self.inv_freq, self.attention_scaling = rope_frequencies(config)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[..., None].float() * self.inv_freq  # [B, T, hd/2]
        angles = torch.cat((freqs, freqs), dim=-1)  # split-halves convention: [f0..f_{n-1}, f0..f_{n-1}]
        cos = angles.cos() * self.attention_scaling
        sin = angles.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, heads, hd] rotated by position: x*cos + rotate_half(x)*sin, cos/sin [B, T, hd]."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    """Grouped-query attention with per-head RMSNorm on q and k (Qwen3's QK-norm) before RoPE."""

    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, config.head_dim
        )
        D, hd, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.q_proj = nn.Linear(D, self.n_heads * hd, bias=bias)
        self.k_proj = nn.Linear(D, self.n_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(D, self.n_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hd, D, bias=bias)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps, config.norm_impl)
        self.k_norm = RMSNorm(hd, config.rms_norm_eps, config.norm_impl)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, D]
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,  # [B, 1, T, S] bool (True = attend), or None for plain causal
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.n_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim))
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, hd]
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)  # [B, K, S, hd]: everything cached so far
        out = F.scaled_dot_product_attention(
            q, k, v,
            attn_mask=mask,
            is_causal=mask is None and T > 1,
            scale=self.head_dim**-0.5,
            enable_gqa=self.n_kv_heads != self.n_heads,
        )
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        D, F_ = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(D, F_, bias=False)
        self.up_proj = nn.Linear(D, F_, bias=False)
        self.down_proj = nn.Linear(F_, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block. The residual add of each half is fused into the norm that follows it:
    (h, residual) in, (h, residual) out, the same arithmetic as HF's `residual + hidden_states`."""

    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_impl)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_impl)

    def forward(self, h, residual, cos, sin, mask, cache=None):
        if residual is None:
            h, residual = self.input_layernorm(h), h
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(h, cos, sin, mask, cache)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class Qwen3Model(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_impl)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(self, input_ids, positions, mask, cache=None) -> torch.Tensor:
        h = self.embed_tokens(input_ids)  # [B, T, D]
        cos, sin = self.rotary_emb(positions, h.dtype)
        residual = None
        for layer in self.layers:
            h, residual = layer(h, residual, cos, sin, mask, cache)
        return self.norm(h, residual)[0]


def build_attention_mask(T: int, start: int, key_valid: torch.Tensor | None, device) -> torch.Tensor | None:
    """[B or 1, 1, T, start + T] bool mask for T new tokens at slots start.., or None for plain
    causal attention over the new tokens only (no padding, and nothing cached or one new token)."""
    if key_valid is None and (start == 0 or T == 1):
        return None
    return slot_attention_mask(torch.arange(start, start + T, device=device), start + T, key_valid)


def slot_attention_mask(q_slots: torch.Tensor, n_slots: int, key_valid: torch.Tensor | None) -> torch.Tensor:
    """[B or 1, 1, T, n_slots] bool mask for queries at cache slots q_slots [T]: a query sees key
    slot j if j <= its own slot and the key is not padding. Every query sees its own slot, so a
    padding row never attends to nothing (NaN). Built on the device from q_slots, so a replayed
    CUDA graph follows a static-shape step's `cache.slot`."""
    q = q_slots[:, None]
    k = torch.arange(n_slots, device=q_slots.device)[None, :]
    allowed = k <= q  # [T, S]
    if key_valid is not None:
        allowed = (allowed & key_valid[:, None, :n_slots].bool()) | (k == q)
    else:
        allowed = allowed[None]
    return allowed[:, None]


class Qwen3ForCausalLM(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        self.generation_config: dict = {}  # generation_config.json's defaults, set by the loader
        self.model = Qwen3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T] token ids
        positions: torch.Tensor | None = None,  # [B, T] rotary positions; default 0..T-1 (+ cache length)
        cache: KVCache | None = None,
        attention_mask: torch.Tensor | None = None,  # [B, S] 1 = token, 0 = padding, over all cache slots
        last_only: bool = False,  # logits of the last position only (what decoding needs)
    ) -> torch.Tensor:
        """Logits [B, T, V] (or [B, 1, V] with last_only). With a cache, the new tokens' keys and
        values are written at the cache's next slots and attention covers everything cached; with
        `cache.slot` set (a static-shape step, see KVCache), at those slots, attention masked past
        them, and the caller advances the cache."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dtype != torch.long or input_ids.dim() != 2:
            raise TypeError("input_ids must be a LongTensor of shape [batch, seq_len]")
        B, T = input_ids.shape
        start = cache.length if cache is not None else 0
        if start + T > self.config.max_position_embeddings:
            raise ValueError(
                f"{start + T} tokens exceed max_position_embeddings={self.config.max_position_embeddings}"
            )
        if positions is None:
            positions = torch.arange(start, start + T, device=input_ids.device).expand(B, T)
        static = cache is not None and cache.slot is not None  # a static-shape step (see KVCache)
        if static:
            mask = slot_attention_mask(cache.slot, cache.max_len, attention_mask)
        else:
            mask = build_attention_mask(T, start, attention_mask, input_ids.device)
        h = self.model(input_ids, positions, mask, cache)
        if cache is not None and not static:
            cache.advance(T)
        if last_only:
            h = h[:, -1:]
        return self.lm_head(h)

    @classmethod
    def from_pretrained(
        cls,
        path,
        dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
        norm_impl: str | None = None,
        progress: bool = True,
    ) -> "Qwen3ForCausalLM":
        """Load a Hugging Face Qwen3 checkpoint directory (see qwen3/loader.py)."""
        from .loader import load_model

        return load_model(path, dtype=dtype, device=device, norm_impl=norm_impl, progress=progress)

    def set_norm_impl(self, impl: str) -> None:
        """Switch every RMSNorm in the model (input, post-attention, q, k, final) to `impl`."""
        if impl not in IMPLS:
            raise ValueError(f"norm_impl must be one of {IMPLS}, got {impl!r}")
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.impl = impl
        self.config.norm_impl = impl

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 32, **kwargs) -> torch.Tensor:
        """Token ids [B, T + new] (see qwen3/generation.py for sampling, padding and stopping)."""
        from .generation import generate

        return generate(self, input_ids, max_new_tokens=max_new_tokens, **kwargs)
