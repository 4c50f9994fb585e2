"""The token of each row among its K largest scaled logits: transformers' filters, then the race.

    tokens, overflow = choose_among_candidates(vals, idx, lse, best, rows, params, seeds, steps)

vals [B, K] are a row's K largest scaled logits (ops/sampling/scale.py) in decreasing order, idx
[B, K] their token ids, lse [B] the log-sum-exp of the whole row, best [B] its argmax. The filters
are transformers' warpers in their order on the whole row's distribution p = exp(x - lse): top-k
(ties with the k-th kept), renormalized; top-p (the tokens before a kept one hold at most top_p:
the one that crosses it stays); min-p (p >= min_p * the largest p). The token is the winner among
the kept of the exponential race with the clocks E = -log u of ops/sampling/noise.py: the largest
x - log E, which is a draw from the kept tokens' renormalized distribution. A greedy row
(temperature 0) takes best.

overflow [B] marks the rows whose kept tokens may lie past the candidates (no top-k below K, and
neither top-p nor min-p cuts among them): their token is not among these, and ops/sampling/
rejection.py draws it from the whole row with the same clocks.
"""

import torch
import triton
import triton.language as tl

from .noise import row_key_kernel, uniform_kernel
from .params import PARAMS

T, TOP_K, TOP_P, MIN_P = (PARAMS.index(name) for name in ("temperature", "top_k", "top_p", "min_p"))


@triton.jit
def _candidates_kernel(VALS, IDX, LSE, BEST, ROWS, PARAMS, n_params, SEEDS, STEPS, OUT, OVERFLOW, V,
                       K: tl.constexpr, T: tl.constexpr, TOP_K: tl.constexpr, TOP_P: tl.constexpr,
                       MIN_P: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    row = tl.load(ROWS + b)
    temperature = tl.load(PARAMS + row * n_params + T)
    top_k = tl.load(PARAMS + row * n_params + TOP_K).to(tl.int32)
    top_p = tl.load(PARAMS + row * n_params + TOP_P)
    min_p = tl.load(PARAMS + row * n_params + MIN_P)
    k = tl.arange(0, K)
    vals = tl.load(VALS + b * K + k)
    idx = tl.load(IDX + b * K + k)
    lse = tl.load(LSE + b)
    has_top_k = (top_k > 0) & (top_k < V)
    kth = tl.load(VALS + b * K + tl.minimum(tl.maximum(top_k, 1), K) - 1)
    # (Scalar conditions go into the thresholds: Triton's interpreter cannot or a row's bool into a tensor's.)
    in_top_k = vals >= tl.where(has_top_k, kth, float("-inf"))
    p = tl.where(in_top_k, tl.exp(vals - lse), 0.0)
    q = p / tl.where(has_top_k, tl.sum(p, axis=0), 1.0)
    in_top_p = tl.cumsum(q, axis=0) - q <= tl.where(top_p >= 1.0, float("inf"), top_p)
    q_max = tl.max(q, axis=0)
    kept = in_top_k & in_top_p & (q >= min_p * q_max)
    key = row_key_kernel(tl.load(SEEDS + row), tl.load(STEPS + row))
    race = tl.where(kept, vals - tl.log(-tl.log(uniform_kernel(key, idx))), float("-inf"))
    winner = tl.sum(tl.where(k == tl.argmax(race, axis=0), idx, 0), axis=0)
    q_last = tl.sum(tl.where(k == K - 1, q, 0.0), axis=0)
    cut_inside = (has_top_k & (top_k < K)) | ((top_p < 1.0) & (tl.sum(q, axis=0) > top_p)) | (
        (min_p > 0) & (q_last < min_p * q_max))
    greedy = temperature == 0
    tl.store(OUT + b, tl.where(greedy, tl.load(BEST + b), winner.to(tl.int64)))
    tl.store(OVERFLOW + b, ~greedy & ~cut_inside & (V > K))


@torch.library.custom_op("qwen3_ops::choose_among_candidates", mutates_args=("out", "overflow"))
def _candidates_op(vals: torch.Tensor, idx: torch.Tensor, lse: torch.Tensor, best: torch.Tensor, rows: torch.Tensor,
                   params: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int,
                   out: torch.Tensor, overflow: torch.Tensor) -> None:
    B, K = vals.shape
    if B:
        _candidates_kernel[(B,)](vals, idx, lse, best, rows, params, params.shape[1], seeds, steps, out, overflow,
                                 vocab_size, K=K, T=T, TOP_K=TOP_K, TOP_P=TOP_P, MIN_P=MIN_P, num_warps=4)


@_candidates_op.register_fake
def _(vals, idx, lse, best, rows, params, seeds, steps, vocab_size, out, overflow):
    return None


def choose_among_candidates(vals: torch.Tensor, idx: torch.Tensor, lse: torch.Tensor, best: torch.Tensor,
                            rows: torch.Tensor, params: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
                            vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B] int64, overflow [B] bool): see the module. K (vals' width) a power of two;
    seeds and steps [R] int64, the tables' rows picked by rows [B]."""
    B, K = vals.shape
    if K & (K - 1) or idx.shape != vals.shape:
        raise ValueError(f"vals and idx must be [B, K] with K a power of two, got {tuple(vals.shape)}, "
                         f"{tuple(idx.shape)}")
    out = torch.empty(B, dtype=torch.long, device=vals.device)
    overflow = torch.empty(B, dtype=torch.bool, device=vals.device)
    _candidates_op(vals.contiguous(), idx.contiguous(), lse, best, rows, params, seeds, steps, vocab_size, out,
                   overflow)
    return out, overflow
