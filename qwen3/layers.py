"""Qwen3's building blocks, each with Hugging Face's parameter names: RMSNorm, the fused projections,
the MLP, rotary embeddings. Shapes: N tokens, D hidden_size, F intermediate_size, hd head_dim, P
max_position_embeddings.

Two paths compute each (the model's `fused` flag, config.kernels): transformers' operations one by
one, or the Triton kernels of ops/, which round where transformers' ops round.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from ops import fused_add_rms_norm, rms_norm
from ops.linear import skinny_gemm
from ops.linear.fp8 import FP8, dequantize_fp8
from ops.linear.gemv import gemv, gemv_rms_norm
from ops.linear.silu_mul import silu_mul

from .config import Qwen3Config
from .fp8 import dequantize
from .parallel import TensorParallel


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
        """{part name: the rows of `param` (this module's weight or bias, or an FP8 weight's block
        scales, a row per block of rows) that belong to it}."""
        per_row = param.shape[0] / self.out_features  # 1, or 1 / block rows for FP8 scales
        starts = [round(start * per_row) for start in [0, *torch.tensor(list(self.parts.values())).cumsum(0).tolist()]]
        return {name: param[start:end] for name, start, end in zip(self.parts, starts, starts[1:])}


def fp8_scales(layer: nn.Module, weight: str = "weight") -> tuple[torch.Tensor | None, tuple[int, int] | None]:
    """(weight_scale_inv, block) of a projection whose weight is held in FP8 (qwen3/quantized.py),
    (None, None) for one in the activations' dtype. ValueError for FP8 weights that a cast
    (model.to(dtype), .half(), .float()) turned into numbers of another dtype: torch counts
    float8 as a floating-point dtype, and would cast the stored values without their scales."""
    block = getattr(layer, "weight_block", None)
    if block is not None and getattr(layer, weight).dtype != FP8:
        raise ValueError(f"this model's FP8 weights were cast to {getattr(layer, weight).dtype} (model.to(dtype), "
                         ".half() or .float()), which drops their scales; load it in the dtype you want instead "
                         "(from_pretrained(..., dtype=...))")
    return getattr(layer, "weight_scale_inv" if weight == "weight" else f"{weight}_scale_inv", None), block


def dequantized(layer: nn.Linear, dtype: torch.dtype, fused: bool) -> torch.Tensor:
    """The layer's weight in dtype: as it is, or an FP8 one dequantized (a Triton kernel on the
    fused path, torch operations otherwise: the same arithmetic)."""
    scale, block = fp8_scales(layer)
    if scale is None:
        return layer.weight
    return dequantize_fp8(layer.weight, scale, block, dtype) if fused else dequantize(layer.weight, scale, block, dtype)


def linear(layer: nn.Linear, x: torch.Tensor, fused: bool, gated: bool = False) -> torch.Tensor:
    """layer(x); with gated (layer an MLP's [gate; up] projection), SwiGLU's silu(gate) * up of it.
    On the fused path a single row (a batch-1 decode step) takes the GEMV kernel, and a few rows
    (a batched decode step) the skinny GEMM where it is faster: both stream the weights faster
    than cuBLAS's kernels for those shapes and apply the gate as they round their sums
    (ops/linear/gemv.py, ops/linear/skinny_gemm.py). An FP8 weight (qwen3/quantized.py): one row,
    the GEMV reads it as stored (bf16 activations); 2-64 rows, the skinny GEMM with the rows
    quantized to FP8 too (w8a8, FP8 tensor cores); more rows (a prefill) dequantize it for
    cuBLAS's matmul."""
    rows = x.numel() // x.shape[-1] if fused else 0
    scale, block = fp8_scales(layer)
    if rows == 1:
        return gemv(x, layer.weight, layer.bias, gated, scale, block)
    if scale is not None and skinny_gemm.takes_fp8(rows):
        return skinny_gemm.skinny_linear(x, layer.weight, layer.bias, gated, scale, block, fp8_activations=True)
    if skinny_gemm.faster_than_cublas(rows, layer.weight):
        return skinny_gemm.skinny_linear(x, layer.weight, layer.bias, gated)
    y = F.linear(x, dequantized(layer, x.dtype, fused), layer.bias)
    if not gated:
        return y
    if fused:
        return silu_mul(y)
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


def normed_linear(norm: "RMSNorm | None", layer: nn.Linear, h: torch.Tensor, residual: torch.Tensor | None,
                  fused: bool, gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(layer, norm(s), fused, gated), s) with s = h + residual (residual None: s = h): a
    pre-norm block's entry. On the fused path a single row takes one GEMV kernel that adds and
    normalizes in its prologue (ops/linear/gemv.py's gemv_rms_norm, the norm's own arithmetic): no
    norm kernel of its own. norm None: the block alone, h projected as it is (residual None)."""
    if norm is None:
        return linear(layer, h, fused, gated), h
    if fused and h.numel() == h.shape[-1]:
        return gemv_rms_norm(h, residual, norm.weight, norm.eps, layer.weight, layer.bias, gated, *fp8_scales(layer))
    h, residual = norm(h, residual) if residual is not None else (norm(h), h)
    return linear(layer, h, fused, gated), residual


def stack_fused_parts(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """A load_state_dict pre-hook of a module with FusedLinear children: a state dict that holds
    the parts apart (a transformers module's: q_proj, k_proj, v_proj) has them stacked into the
    fused parameter, so `load_state_dict(hf_module.state_dict())` works."""
    for name, child in module.named_children():
        if isinstance(child, FusedLinear):
            for kind in ("weight", "bias", "weight_scale_inv"):
                keys = [f"{prefix}{part}.{kind}" for part in child.parts]
                if all(key in state_dict for key in keys):
                    state_dict[f"{prefix}{name}.{kind}"] = torch.cat([state_dict.pop(key) for key in keys])


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up as one matmul. With `tp`: this rank's F/N
    columns of gate and up, and its partial sum of down, to be all-reduced. Called by the decoder
    layer with its post-attention norm and the residual stream (normed_linear: the norm fused into
    the gate/up projection at one row), or alone with neither."""

    def __init__(self, config: Qwen3Config, tp: TensorParallel | None = None):
        super().__init__()
        D, F_ = config.hidden_size, config.intermediate_size // (tp.size if tp else 1)
        self.gate_up_proj = FusedLinear(D, {"gate_proj": F_, "up_proj": F_}, bias=False)
        self.down_proj = nn.Linear(F_, D, bias=False)
        self.register_load_state_dict_pre_hook(stack_fused_parts)

    def forward(self, x: torch.Tensor, fused: bool = False, residual: torch.Tensor | None = None,
                norm: "RMSNorm | None" = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the MLP of norm(x + residual) [N, D], x + residual): x [N, D]."""
        activation, residual = normed_linear(norm, self.gate_up_proj, x, residual, fused, gated=True)  # [N, F]
        return linear(self.down_proj, activation, fused), residual


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
        """cos, sin [..., hd] in dtype for integer positions [...] (transformers' layout: halves repeated)."""
        cos, sin = self.tables(positions.device)
        cos, sin = cos[positions], sin[positions]
        return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((sin, sin), dim=-1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., heads, hd] rotated by position: x*cos + rotate_half(x)*sin, cos/sin [..., hd]."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


