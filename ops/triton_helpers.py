"""Small @triton.jit helpers shared by the Triton kernels of ops/."""

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")
PDL_ENABLED = True  # False: every kernel launches without programmatic dependent launch (for comparisons)


def use_pdl(device: torch.device) -> bool:
    """Whether the decode kernels on `device` launch with programmatic dependent launch (Hopper and
    newer; `launch_pdl=` of a Triton launch): a kernel is started while the one before it in the
    stream finishes, and waits for it in `wait_for_prior_kernels`, so each of the ~200 small
    launches of a decode step hides its start-up behind the previous kernel's tail, in a CUDA graph too."""
    return PDL_ENABLED and device.type == "cuda" and not INTERPRETED and _hopper_or_newer(device.index)


@functools.cache
def _hopper_or_newer(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


@triton.jit
def wait_for_prior_kernels(PDL: tl.constexpr):
    """The first statement of a kernel launched with launch_pdl=PDL: wait until the kernel before it
    has finished and its writes are visible, then let the next one start. Every program passes
    here before it can exit, so a kernel never finishes before its predecessor: the order holds
    across any chain of launches."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """fp32 x rounded to nearest-even in dtype, as torch rounds the result of every 16-bit op.
    Triton's CPU interpreter truncates fp32 -> bf16 where the GPU rounds: round the bits by hand
    there, so that the CPU tests check the GPU's arithmetic."""
    if INTERPRETED and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = tl.where(x == x, bits.to(tl.float32, bitcast=True), x)  # leave NaN payloads alone
    return x.to(dtype)


@triton.jit
def to_e4m3(x, dtype: tl.constexpr):
    """fp32 x (within +-448) rounded to nearest-even in float8_e4m3fn (`dtype`), as the GPU's
    conversion rounds. Triton's CPU interpreter rounds some values wrongly (3.9: 126.8 -> 64); there
    the rounding is done by hand in fp32 first: 3 mantissa bits for normal values (|x| >= 2^-6),
    multiples of 2^-9 below (adding and taking away 1.5 * 2^14 rounds there), then converted exactly."""
    if INTERPRETED:
        bits = x.to(tl.uint32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
        x = tl.where(tl.abs(x) >= 0.015625, normal, (x + 24576.0) - 24576.0)
    return x.to(dtype)


@triton.jit
def swiglu(gate, up, dtype: tl.constexpr):
    """silu(gate) * up in fp32 from fp32 gate and up, rounded as transformers' `act_fn(gate) * up`
    rounds in dtype: gate and up to dtype (as the projections' outputs are), silu to dtype; the
    caller rounds the product."""
    gate = round_to(gate, dtype).to(tl.float32)
    silu = round_to(gate / (1.0 + tl.exp(-gate)), dtype).to(tl.float32)
    return silu * round_to(up, dtype).to(tl.float32)


@triton.jit
def dot(a, b, IEEE: tl.constexpr):
    """tl.dot accumulating in fp32; IEEE: fp32 operands multiplied in full fp32, not TF32 (fp32
    models are held to fp32 parity). Triton's CPU interpreter multiplies 16-bit operands wrongly
    (3.9); there they are upcast first, which is exact: a product of two 16-bit floats fits fp32."""
    if INTERPRETED:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)
