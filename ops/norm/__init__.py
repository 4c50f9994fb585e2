"""RMSNorm: the one switch between the torch reference, Triton and CUDA implementations.

    y = rms_norm(x, weight, eps=1e-6, impl="auto")
    y, s = fused_add_rms_norm(x, residual, weight, eps=1e-6, impl="auto")   # s = x + residual

impl is "torch" | "triton" | "cuda" | "auto" ("triton" for CUDA tensors, "torch" otherwise).
Inputs are checked here, once, for every implementation; a bad input raises a ValueError or
TypeError that names the problem. Nothing falls back silently to another implementation.
"torch" and "triton" support autograd (and torch.compile); "cuda" is forward only and raises
NotImplementedError where autograd would record the call.
"""

import os
from types import ModuleType

import torch

from .rmsnorm_torch import fused_add_rms_norm_torch, rms_norm_torch

__all__ = ["IMPLS", "fused_add_rms_norm", "resolve_impl", "rms_norm"]

IMPLS = ("auto", "torch", "triton", "cuda")
_KERNEL_DTYPES = frozenset((torch.float32, torch.float16, torch.bfloat16))


def resolve_impl(impl: str, device: torch.device) -> str:
    """The concrete implementation `impl` means for tensors on `device`."""
    if impl not in IMPLS:
        raise ValueError(f"unknown RMSNorm impl {impl!r}; expected one of {IMPLS}")
    if impl == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if impl == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"impl='triton' needs CUDA tensors (got device {device}); to run the Triton kernels on "
            "the CPU set TRITON_INTERPRET=1 before triton is imported, or use impl='torch'"
        )
    if impl == "cuda" and device.type != "cuda":
        raise ValueError(f"impl='cuda' needs CUDA tensors, got device {device}")
    return impl


# (impl, then the dtype and device of x, weight and the residual if any) -> the concrete impl, for the
# combinations that passed the checks below: a model calls the op with a handful of them, thousands
# of times.
_checked: dict[tuple, str] = {}


def _check(x: torch.Tensor, weight: torch.Tensor, eps: float, impl: str, residual: torch.Tensor | None = None) -> str:
    # Ordered so that a valid call costs few attribute reads: this runs on every norm of every step.
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError(f"x and weight must be tensors, got {type(x).__name__} and {type(weight).__name__}")
    shape = x.shape
    if not shape or not shape[-1]:
        raise ValueError(f"x must have a non-empty last dimension (..., D), got shape {tuple(shape)}")
    if weight.shape != shape[-1:]:
        raise ValueError(f"weight must be 1-D of size D={shape[-1]} (x's last dim), got shape {tuple(weight.shape)}")
    if not isinstance(eps, (int, float)) or eps < 0:
        raise ValueError(f"eps must be a non-negative number, got {eps!r}")
    if residual is None:
        key = (impl, x.dtype, weight.dtype, x.device, weight.device)
    elif residual.shape == shape:
        key = (impl, x.dtype, weight.dtype, x.device, weight.device, residual.dtype, residual.device)
    else:
        raise _residual_mismatch(x, residual)
    try:
        return _checked[key]
    except (KeyError, TypeError):  # not seen yet, or an unhashable impl (which resolve_impl rejects)
        concrete = _check_kinds(x, weight, impl, residual)
    _checked[key] = concrete
    return concrete


def _check_kinds(x: torch.Tensor, weight: torch.Tensor, impl: str, residual: torch.Tensor | None) -> str:
    """The checks that depend only on the impl, dtypes and devices; returns the concrete impl."""
    if not x.is_floating_point() or not weight.is_floating_point():
        raise TypeError(f"x and weight must be floating point, got {x.dtype} and {weight.dtype}")
    device = x.device
    if device != weight.device:
        raise ValueError(f"x and weight must be on the same device, got {device} and {weight.device}")
    if residual is not None and residual.device != device:
        raise _residual_mismatch(x, residual)
    concrete = resolve_impl(impl, device)
    if concrete != "torch" and (x.dtype not in _KERNEL_DTYPES or weight.dtype not in _KERNEL_DTYPES):
        raise TypeError(
            f"impl={concrete!r} supports float32, float16 and bfloat16, got x {x.dtype} and weight {weight.dtype}"
        )
    if residual is not None and (
        not residual.is_floating_point() or (concrete != "torch" and residual.dtype not in _KERNEL_DTYPES)
    ):
        raise TypeError(f"residual must be float32, float16 or bfloat16, got {residual.dtype}")
    return concrete


def _residual_mismatch(x: torch.Tensor, residual: torch.Tensor) -> ValueError:
    return ValueError(
        f"residual must match x in shape and device: got {tuple(residual.shape)} on {residual.device} "
        f"for x {tuple(x.shape)} on {x.device}"
    )


def _kernels(impl: str) -> ModuleType:
    """The module of a kernel impl, imported on first use: importing triton takes seconds, and the
    torch impl never needs it. (`import a.b as m`, unlike `from . import b`, skips the fromlist
    handling on every call; this runs once per norm.)"""
    if impl == "cuda":
        import ops.norm.rmsnorm_cuda as module
    else:
        import ops.norm.rmsnorm_triton as module
    return module


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, impl: str = "auto") -> torch.Tensor:
    """Hugging Face Qwen3RMSNorm: weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype), fp32 inside."""
    concrete = _check(x, weight, eps, impl)
    if concrete == "torch":
        return rms_norm_torch(x, weight, eps)
    return _kernels(concrete).rms_norm(x, weight, float(eps))


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, impl: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(s), s) with s = x + residual in one pass over memory. s has torch's dtype for
    `x + residual` (x's dtype when both share it, as in the HF decoder; fp32 when an autocast
    branch output meets an fp32 residual stream)."""
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"residual must be a tensor, got {type(residual).__name__}")
    concrete = _check(x, weight, eps, impl, residual)
    if concrete == "torch":
        return fused_add_rms_norm_torch(x, residual, weight, eps)
    return _kernels(concrete).fused_add_rms_norm(x, residual, weight, float(eps))
