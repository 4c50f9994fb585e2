"""The token of rows whose kept tokens may lie anywhere in the vocabulary (top-p or min-p that the
candidates do not settle, a top-k of K or more, or no filter at all), drawn by rejection without
sorting the vocabulary.

    sample_by_rejection(x, whole, rows, params, seeds, steps, active, out)

x [B, V] float32 are the rows' scaled logits (ops/sampling/scale.py), `whole` their log-sum-exp,
argmax and race winner over every token (ops/sampling/candidates.py). A token t is kept when its x
is at least min-p's floor (x_max + log min_p), fewer than top_k tokens have a larger x, and their
mass, the sum of exp(x_i - lse) over x_i > x_t, is at most top_p (the token that crosses top_p
stays). Each holds for a prefix of the tokens in decreasing x, and so do all three. (top-p after
a top-k that cuts would need the top-k set's mass: Sampler.how keeps such rows away from here.)
The token is the winner, among the kept, of the exponential race whose clock for token i is
E_i = -log u_i (ops/sampling/noise.py): the kept token of the largest x_i - log E_i, the same race
as the candidates' kernel runs.

A program per active row goes by rounds over the row, starting from the race's winner over every
token (found by the scaling pass): weigh the current winner (the mass and count above it) and, in
the same pass, find the race's winner among the tokens above it; stop at the first winner that is
kept. A rejected winner is not kept, so neither is anything at or below its x, and the race's next
finisher above it is its winner among the rest: the result is exactly the kept set's winner, with
the same clocks in every round. With top-p at 0.95 the first winner is kept with probability about
0.95: one pass. A row that is not active is left untouched.
"""

import torch
import triton
import triton.language as tl

from .candidates import WholeRow
from .noise import row_key_kernel, uniform_kernel
from .params import PARAMS

BLOCK = 2048
TOP_K, TOP_P, MIN_P = (PARAMS.index(name) for name in ("top_k", "top_p", "min_p"))


@triton.jit
def _rejection_kernel(X, LSE, BEST, FIRST, ROWS, PARAMS, n_params, SEEDS, STEPS, ACTIVE, OUT, V, TOP_K: tl.constexpr,
                      TOP_P: tl.constexpr, MIN_P: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    active = tl.load(ACTIVE + b) != 0
    row = tl.load(ROWS + b)
    base = X + b * V
    lse = tl.load(LSE + b)
    top_k = tl.load(PARAMS + row * n_params + TOP_K).to(tl.int32)
    top_k = tl.where((top_k > 0) & (top_k < V), top_k, V)
    top_p = tl.load(PARAMS + row * n_params + TOP_P)
    min_p = tl.load(PARAMS + row * n_params + MIN_P)
    x_max = tl.load(base + tl.load(BEST + b))
    floor = tl.where(min_p > 0, x_max + tl.log(tl.where(min_p > 0, min_p, 1.0)), float("-inf"))  # p >= min_p p_max
    key = row_key_kernel(tl.load(SEEDS + row), tl.load(STEPS + row))
    current = tl.load(FIRST + b)  # the winner being weighed
    result = current
    done = tl.where(active, 0, 1)  # a row that is not active runs no round
    while done == 0:
        pivot = tl.load(base + current)
        best = tl.full((), float("-inf"), tl.float32)
        best_token = tl.full((), -1, tl.int64)
        mass = tl.full((), 0.0, tl.float32)
        above = tl.full((), 0, tl.int32)
        for v0 in range(0, V, BLOCK):
            v = v0 + tl.arange(0, BLOCK)
            x = tl.load(base + v, mask=v < V, other=float("-inf"))
            over = x > pivot
            mass += tl.sum(tl.where(over, tl.exp(x - lse), 0.0), axis=0)
            above += tl.sum(over.to(tl.int32), axis=0)
            race = tl.where(over, x - tl.log(-tl.log(uniform_kernel(key, v))), float("-inf"))
            chunk_best = tl.max(race, axis=0)
            best_token = tl.where(chunk_best > best, v0 + tl.argmax(race, axis=0), best_token)
            best = tl.maximum(best, chunk_best)
        # It stops at a kept winner, or at one with nothing above it (the largest: kept, unless the
        # logits are NaN); else the race goes on above it. (Written without branches.)
        stop = ((pivot >= floor) & ((mass <= top_p) | (top_p >= 1.0)) & (above < top_k)) | (best_token < 0)
        result = tl.where(stop, current, result)
        current = tl.where(stop, current, best_token)
        done = stop.to(tl.int32)
    tl.store(OUT + b, result, mask=active)


@torch.library.custom_op("qwen3_ops::sample_by_rejection", mutates_args=("out",))
def _rejection_op(x: torch.Tensor, lse: torch.Tensor, best: torch.Tensor, first: torch.Tensor, rows: torch.Tensor,
                  params: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, active: torch.Tensor,
                  out: torch.Tensor) -> None:
    B, V = x.shape
    if B:
        _rejection_kernel[(B,)](x, lse, best, first, rows, params, params.shape[1], seeds, steps, active, out, V,
                                TOP_K=TOP_K, TOP_P=TOP_P, MIN_P=MIN_P, BLOCK=BLOCK, num_warps=8)


@_rejection_op.register_fake
def _(x, lse, best, first, rows, params, seeds, steps, active, out):
    return None


def sample_by_rejection(x: torch.Tensor, whole: WholeRow, rows: torch.Tensor, params: torch.Tensor,
                        seeds: torch.Tensor, steps: torch.Tensor, active: torch.Tensor, out: torch.Tensor
                        ) -> torch.Tensor:
    """Write the token of each active row (see the module) to out [B] (int64) and return it; the
    other rows' entries are kept. Device-side only: a CUDA graph captures it."""
    if x.dim() != 2 or x.dtype != torch.float32 or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous float32 [B, V], got {tuple(x.shape)} {x.dtype}")
    _rejection_op(x, whole.lse, whole.argmax, whole.winner, rows, params, seeds, steps, active, out)
    return out
