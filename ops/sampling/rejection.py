"""The token of rows whose kept tokens may lie anywhere in the vocabulary (top-p or min-p that the
candidates do not settle, a top-k of K or more, or no filter at all), drawn by rejection without
sorting the vocabulary.

    sample_by_rejection(x, lse, best, rows, params, seeds, steps, active, out)

x [B, V] float32 are the rows' scaled logits (ops/sampling/scale.py), lse [B] their log-sum-exp,
best [B] their argmax. A token t is kept when its x is at least min-p's floor (x_max + log min_p),
fewer than top_k tokens have a larger x, and their mass, the sum of exp(x_i - lse) over x_i > x_t,
is at most top_p (the token that crosses top_p stays). All three hold for a prefix of the tokens
in decreasing x. (top-p after a top-k that cuts would need the top-k set's mass: Sampler.how keeps
such rows away from here.) The token is the winner, among the kept, of the exponential race whose
clock for token i is E_i = -log u_i (ops/sampling/noise.py): the kept token of the largest
x_i - log E_i, the same race as ops/sampling/candidates.py runs.

A program per active row finds it by rounds over the row: draw the race's winner among tokens
above the previous winner's x (the first round: all of them at or above the floor), and weigh the
previous winner in the same pass; stop at the first winner that is kept. A rejected winner is not
kept, so neither is anything at or below its x, and the race's next finisher above it is its
winner among the rest: the result is exactly the kept set's winner, with the same clocks in every
round. With top-p at 0.95 the first winner is kept with probability about 0.95: two passes;
without top-p or top-k, one. A row that is not active is left untouched.
"""

import torch
import triton
import triton.language as tl

from .noise import row_key_kernel, uniform_kernel
from .params import PARAMS

BLOCK = 2048
TOP_K, TOP_P, MIN_P = (PARAMS.index(name) for name in ("top_k", "top_p", "min_p"))


@triton.jit
def _rejection_kernel(X, LSE, BEST, ROWS, PARAMS, n_params, SEEDS, STEPS, ACTIVE, OUT, V, TOP_K: tl.constexpr,
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
    pivot = tl.full((), float("-inf"), tl.float32)  # the round's race runs over x > pivot
    prev = tl.full((), -1, tl.int64)  # the previous round's winner, weighed in this round
    result = tl.full((), 0, tl.int64)
    done = tl.where(active, 0, 1)  # a row that is not active runs no round
    while done == 0:
        best = tl.full((), float("-inf"), tl.float32)
        best_token = tl.full((), -1, tl.int64)
        best_x = tl.full((), float("-inf"), tl.float32)
        mass = tl.full((), 0.0, tl.float32)
        above = tl.full((), 0, tl.int32)
        for v0 in range(0, V, BLOCK):
            v = v0 + tl.arange(0, BLOCK)
            ok = v < V
            x = tl.load(base + v, mask=ok, other=float("-inf"))
            over = ok & (x > pivot)
            mass += tl.sum(tl.where(over, tl.exp(x - lse), 0.0), axis=0)
            above += tl.sum(over.to(tl.int32), axis=0)
            race = tl.where(over & (x >= floor), x - tl.log(-tl.log(uniform_kernel(key, v))), float("-inf"))
            chunk_best = tl.max(race, axis=0)
            at = tl.argmax(race, axis=0)
            take = chunk_best > best
            best_token = tl.where(take, v0 + at, best_token)
            best_x = tl.where(take, tl.sum(tl.where(v == v0 + at, x, 0.0), axis=0), best_x)
            best = tl.maximum(best, chunk_best)
        # mass and above count the tokens over the pivot: the previous winner's x
        if (prev >= 0) & (mass <= top_p) & (above < top_k):
            result = prev
            done = 1
        elif best_token < 0:  # nothing left to draw (NaN logits): the previous winner, or the argmax
            result = tl.where(prev >= 0, prev, tl.load(BEST + b))
            done = 1
        elif (top_p >= 1.0) & (top_k == V):  # only the floor, which the race already holds: kept
            result = best_token
            done = 1
        else:
            prev = best_token
            pivot = best_x
    tl.store(OUT + b, result, mask=active)


@torch.library.custom_op("qwen3_ops::sample_by_rejection", mutates_args=("out",))
def _rejection_op(x: torch.Tensor, lse: torch.Tensor, best: torch.Tensor, rows: torch.Tensor, params: torch.Tensor,
                  seeds: torch.Tensor, steps: torch.Tensor, active: torch.Tensor, out: torch.Tensor) -> None:
    B, V = x.shape
    if B:
        _rejection_kernel[(B,)](x, lse, best, rows, params, params.shape[1], seeds, steps, active, out, V,
                                TOP_K=TOP_K, TOP_P=TOP_P, MIN_P=MIN_P, BLOCK=BLOCK, num_warps=8)


@_rejection_op.register_fake
def _(x, lse, best, rows, params, seeds, steps, active, out):
    return None


def sample_by_rejection(x: torch.Tensor, lse: torch.Tensor, best: torch.Tensor, rows: torch.Tensor,
                        params: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, active: torch.Tensor,
                        out: torch.Tensor) -> torch.Tensor:
    """Write the token of each active row (see the module) to out [B] (int64) and return it; the
    other rows' entries are kept. Device-side only: a CUDA graph captures it."""
    if x.dim() != 2 or x.dtype != torch.float32 or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous float32 [B, V], got {tuple(x.shape)} {x.dtype}")
    _rejection_op(x, lse, best, rows, params, seeds, steps, active, out)
    return out
