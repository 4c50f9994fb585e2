"""The reference RMSNorm: Hugging Face's Qwen3RMSNorm arithmetic in plain torch ops.

Every other implementation in ops/ is tested to agree with this cast order:
the sum of squares is taken in fp32, the normalized value is rounded to the
input dtype *before* the weight multiply, and the output dtype is whatever
torch's type promotion gives for `weight * normalized`.
"""

import torch


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    normalized = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normalized.to(x.dtype)


def fused_add_rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual), the sum in torch's promoted dtype, exactly
    as the Hugging Face decoder computes `hidden_states = residual + hidden_states`."""
    summed = residual + x
    return rms_norm_torch(summed, weight, eps), summed
