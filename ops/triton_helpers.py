"""Small @triton.jit helpers shared by the Triton kernels of ops/."""

import os

import triton
import triton.language as tl

INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


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
