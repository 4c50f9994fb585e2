"""SwiGLU's gate: silu(gate) * up from one fused gate/up projection, in one pass.

    y = silu_mul(gate_up)        # gate_up [..., 2F] = [gate | up]  ->  y [..., F]

Rounding follows transformers' `act_fn(gate_proj(x)) * up_proj(x)`: silu is computed in fp32
and rounded to the input dtype, then multiplied by up and rounded again.
"""

import torch
import triton
import triton.language as tl

from ..triton_helpers import round_to, swiglu

__all__ = ["silu_mul"]

BLOCK = 1024


@triton.jit
def _silu_mul_kernel(GATE_UP, OUT, F, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < F
    dtype = OUT.dtype.element_ty
    gate = tl.load(GATE_UP + row * 2 * F + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(GATE_UP + row * 2 * F + F + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(OUT + row * F + cols, round_to(swiglu(gate, up, dtype), dtype), mask=ok)


@torch.library.custom_op("qwen3_ops::silu_mul", mutates_args=())
def _silu_mul_op(gate_up: torch.Tensor) -> torch.Tensor:
    F = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], F)
    rows = out.numel() // F if F else 0
    if rows:
        _silu_mul_kernel[(rows, triton.cdiv(F, BLOCK))](gate_up, out, F, BLOCK=BLOCK, num_warps=4)
    return out


@_silu_mul_op.register_fake
def _(gate_up):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


def _check(gate_up: torch.Tensor) -> None:
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up must be [..., 2F], got {tuple(gate_up.shape)}")


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate_up[..., :F]) * gate_up[..., F:], the Triton kernel (no backward: inference only)."""
    _check(gate_up)
    return _silu_mul_op(gate_up.contiguous())
