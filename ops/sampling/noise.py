"""Counter-based random numbers for sampling: u(seed, step, token) in (0, 1), the same bits in torch
(the reference sampler, any device) and in Triton (the fused sampler's kernels).

A request's draw at its n-th token depends on its seed, n and the token id only, never on what
else runs in the batch or on a generator's state: the same request gives the same tokens alone
and beside others, in a CUDA graph or eagerly. Each row's key mixes its 63-bit seed and its step;
each token's number mixes the row's key with the token id. The mixer is lowbias32 (Chris
Wellons' hash-prospector: two multiply-xorshift rounds, full avalanche), in 32-bit arithmetic
done in int64 (torch has no wrapping uint32 product) or uint64 (Triton), masked to 32 bits.
"""

import torch
import triton
import triton.language as tl

MASK32 = 0xFFFFFFFF
M1, M2 = 0x7FEB352D, 0x846CA68B  # lowbias32's multipliers
GOLDEN = 0x9E3779B9  # 2^32 / the golden ratio: spreads consecutive token ids over the 32 bits


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32) and a 32-bit constant c, without int64 overflow:
    c split into 16-bit halves, each product under 2^48."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def mix(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 of int64 x in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, M1)
    x = x ^ (x >> 15)
    x = _mul32(x, M2)
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Each row's key [B] (int64 in [0, 2^32)) from its seed [B] (int64 in [0, 2^63)) and step [B]."""
    lo, hi = seeds & MASK32, (seeds >> 32) & MASK32
    return mix(mix(lo ^ mix(hi)) ^ (steps & MASK32))


def uniform(keys: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """u in (0, 1), float32, for token ids tokens [B, K] of rows with keys [B]: 24 random bits, the
    numbers float32 holds exactly, centred in their intervals (never 0 or 1)."""
    h = mix(keys[:, None] ^ _mul32(tokens.long(), GOLDEN))
    return ((h >> 8).float() + 0.5) * (1.0 / 2**24)


@triton.jit
def _mul32_kernel(x, c: tl.constexpr):
    """(x * c) mod 2^32 for uint64 x < 2^32: the product of two 32-bit numbers fits 64 bits."""
    return (x * tl.full((), c, tl.uint64)) & 0xFFFFFFFF


@triton.jit
def _mix_kernel(x):
    """mix() for uint64 x < 2^32."""
    x = x ^ (x >> 16)
    x = _mul32_kernel(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32_kernel(x, 0x846CA68B)
    return x ^ (x >> 16)


@triton.jit
def row_key_kernel(seed, step):
    """row_keys() of one row: seed and step int64 scalars -> its key as a uint32 scalar."""
    s = seed.to(tl.uint64)
    lo = s & 0xFFFFFFFF
    hi = (s >> 32) & 0xFFFFFFFF
    return _mix_kernel(_mix_kernel(lo ^ _mix_kernel(hi)) ^ (step.to(tl.uint64) & 0xFFFFFFFF)).to(tl.uint32)


@triton.jit
def _mix32_kernel(x):
    """mix() for uint32 x, in uint32 arithmetic, whose products wrap mod 2^32 (cheaper than 64 bits
    per token)."""
    x = x ^ (x >> 16)
    x = x * tl.full((), 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full((), 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def uniform_kernel(key, tokens):
    """uniform() in a kernel: key a uint32 scalar, tokens int32/int64 ids -> float32 (0, 1)."""
    x = _mix32_kernel(key ^ (tokens.to(tl.uint32) * tl.full((), 0x9E3779B9, tl.uint32)))
    return ((x >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
