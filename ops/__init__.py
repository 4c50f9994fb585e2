"""Kernels and their torch references, by kind: norm (RMSNorm: torch, Triton, CUDA), attention (q/k
norm + RoPE + cache write, decode attention), linear (GEMV, skinny GEMM, SiLU-and-multiply), moe
(routing, fused experts), sampling (the next token from logits). No model code: the model and the
runtime call these.

The public API is the RMSNorm's:

    y = rms_norm(x, weight, eps=1e-6, impl="auto")
    y, s = fused_add_rms_norm(x, residual, weight, eps=1e-6, impl="auto")   # s = x + residual
"""

from .norm import IMPLS, fused_add_rms_norm, resolve_impl, rms_norm

__all__ = ["IMPLS", "fused_add_rms_norm", "resolve_impl", "rms_norm"]
