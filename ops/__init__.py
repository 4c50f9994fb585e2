"""Kernels and their torch references, by kind: norm (RMSNorm: torch, Triton, CUDA), attention (q/k
norm + RoPE + cache write, decode attention), linear (GEMV, skinny GEMM, SiLU-and-multiply), moe
(routing, fused experts), sampling (the next token from logits). No model code: the model and the
runtime call these.

The public API is the RMSNorm's:

    y = rms_norm(x, weight, eps=1e-6, impl="auto")
    y, s = fused_add_rms_norm(x, residual, weight, eps=1e-6, impl="auto")   # s = x + residual
"""

import os

from .norm import IMPLS, fused_add_rms_norm, resolve_impl, rms_norm

__all__ = ["IMPLS", "KERNELS", "fused_add_rms_norm", "resolve_impl", "resolve_kernels", "rms_norm"]

# What computes the model's inference steps: "fused", the Triton kernels of ops/ (a projection with
# the norm in front, q/k-norm + RoPE + cache write, decode attention, the fused MoE); "reference",
# transformers' operations one by one; "auto": fused on CUDA, reference elsewhere. Training (autograd)
# always takes the reference operations, whose every norm is the norm_impl's.
KERNELS = ("auto", "fused", "reference")


def resolve_kernels(kernels: str, device) -> str:
    """The concrete choice `kernels` means for a model on `device` ("fused" or "reference")."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
    if kernels == "auto":
        return "fused" if device.type == "cuda" else "reference"
    if kernels == "fused" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"kernels='fused' needs a CUDA device (got {device}); to run the Triton kernels on the "
                         "CPU set TRITON_INTERPRET=1 before triton is imported, or use kernels='reference'")
    return kernels

