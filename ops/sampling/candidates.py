"""The token of each row among its K largest scaled logits: transformers' filters, then the race.

    tokens, overflow, whole = choose_among_candidates(vals, idx, chunks, rows, params, seeds, steps, V)

vals [B, K] are a row's K largest scaled logits (ops/sampling/scale.py) in decreasing order, idx
[B, K] their token ids, chunks the scaling pass's per-chunk summaries. A program per row first
combines those into the whole row's log-sum-exp, argmax and race winner (`whole`: what
ops/sampling/rejection.py continues from). The filters are transformers' warpers in their order on
the whole row's distribution p = exp(x - lse): top-k (ties with the k-th kept), renormalized; top-p
(the tokens before a kept one hold at most top_p: the one that crosses it stays); min-p (p >=
min_p * the largest p). The token is the winner among the kept of the exponential race with the
clocks E = -log u of ops/sampling/noise.py: the largest x - log E, which is a draw from the kept
tokens' renormalized distribution. A greedy row (temperature 0) takes the argmax.

overflow [B] marks the rows whose kept tokens may lie past the candidates (no top-k below K, and
neither top-p nor min-p cuts among them): their token is not among these, and the rejection
kernel draws it from the whole row with the same clocks.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .noise import row_key_kernel, uniform_kernel
from .params import PARAMS
from .scale import Chunks

T, TOP_K, TOP_P, MIN_P = (PARAMS.index(name) for name in ("temperature", "top_k", "top_p", "min_p"))


@dataclass
class WholeRow:
    """What the whole of each scaled row gives: [B] tensors."""

    lse: torch.Tensor  # float32 log-sum-exp
    argmax: torch.Tensor  # int64: the first largest
    winner: torch.Tensor  # int64: the race's winner over every token (a greedy row's: any)


@triton.jit
def _candidates_kernel(VALS, IDX, MAX, SUM, ARGMAX, RACE, WINNER, ROWS, PARAMS, n_params, SEEDS, STEPS, OUT,
                       OVERFLOW, LSE, BEST, FIRST, V, C, K: tl.constexpr, CP: tl.constexpr, T: tl.constexpr,
                       TOP_K: tl.constexpr, TOP_P: tl.constexpr, MIN_P: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    # The whole row from its chunks: log-sum-exp, the first argmax (the first chunk holding the
    # maximum), the race's winner.
    c = tl.arange(0, CP)
    in_row = c < C
    chunk_max = tl.load(MAX + b * C + c, mask=in_row, other=float("-inf"))
    m = tl.max(chunk_max, axis=0)
    chunk_sum = tl.load(SUM + b * C + c, mask=in_row, other=0.0)
    lse = m + tl.log(tl.sum(tl.where(chunk_max > float("-inf"), chunk_sum * tl.exp(chunk_max - m), 0.0), axis=0))
    best = tl.load(ARGMAX + b * C + tl.argmax(chunk_max, axis=0))
    race_chunks = tl.load(RACE + b * C + c, mask=in_row, other=float("-inf"))
    first = tl.load(WINNER + b * C + tl.argmax(race_chunks, axis=0))
    tl.store(LSE + b, lse)
    tl.store(BEST + b, best)
    tl.store(FIRST + b, first)

    row = tl.load(ROWS + b)
    temperature = tl.load(PARAMS + row * n_params + T)
    top_k = tl.load(PARAMS + row * n_params + TOP_K).to(tl.int32)
    top_p = tl.load(PARAMS + row * n_params + TOP_P)
    min_p = tl.load(PARAMS + row * n_params + MIN_P)
    k = tl.arange(0, K)
    vals = tl.load(VALS + b * K + k)
    idx = tl.load(IDX + b * K + k)
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
    # A top-k settles here unless tokens tied with its k-th run to the candidates' end (the rest
    # of the tie may lie past them: the rejection kernel counts ties as transformers keeps them).
    vals_last = tl.sum(tl.where(k == K - 1, vals, 0.0), axis=0)
    cut_inside = (has_top_k & (top_k < K) & (vals_last < kth)) | ((top_p < 1.0) & (tl.sum(q, axis=0) > top_p)) | (
        (min_p > 0) & (q_last < min_p * q_max))
    greedy = temperature == 0
    tl.store(OUT + b, tl.where(greedy, best, winner.to(tl.int64)))
    tl.store(OVERFLOW + b, ~greedy & ~cut_inside & (V > K))


@torch.library.custom_op("qwen3_ops::choose_among_candidates",
                         mutates_args=("out", "overflow", "lse", "argmax", "first"))
def _candidates_op(vals: torch.Tensor, idx: torch.Tensor, chunk_max: torch.Tensor, chunk_sum: torch.Tensor,
                   chunk_argmax: torch.Tensor, chunk_race: torch.Tensor, chunk_winner: torch.Tensor,
                   rows: torch.Tensor, params: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
                   vocab_size: int, out: torch.Tensor, overflow: torch.Tensor, lse: torch.Tensor,
                   argmax: torch.Tensor, first: torch.Tensor) -> None:
    B, K = vals.shape
    C = chunk_max.shape[1]
    if B:
        _candidates_kernel[(B,)](vals, idx, chunk_max, chunk_sum, chunk_argmax, chunk_race, chunk_winner, rows, params,
                                 params.shape[1], seeds, steps, out, overflow, lse, argmax, first, vocab_size, C, K=K,
                                 CP=triton.next_power_of_2(C), T=T, TOP_K=TOP_K, TOP_P=TOP_P, MIN_P=MIN_P,
                                 num_warps=4)


@_candidates_op.register_fake
def _(vals, idx, chunk_max, chunk_sum, chunk_argmax, chunk_race, chunk_winner, rows, params, seeds, steps,
      vocab_size, out, overflow, lse, argmax, first):
    return None


def choose_among_candidates(vals: torch.Tensor, idx: torch.Tensor, chunks: Chunks, rows: torch.Tensor,
                            params: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int
                            ) -> tuple[torch.Tensor, torch.Tensor, WholeRow]:
    """(tokens [B] int64, overflow [B] bool, the WholeRow): see the module. K (vals' width) a power
    of two; seeds and steps [R] int64, the tables' rows picked by rows [B]."""
    B, K = vals.shape
    if K & (K - 1) or idx.shape != vals.shape:
        raise ValueError(f"vals and idx must be [B, K] with K a power of two, got {tuple(vals.shape)}, "
                         f"{tuple(idx.shape)}")
    device = vals.device
    out = torch.empty(B, dtype=torch.long, device=device)
    overflow = torch.empty(B, dtype=torch.bool, device=device)
    whole = WholeRow(*(torch.empty(B, dtype=dtype, device=device) for dtype in (torch.float32, torch.long, torch.long)))
    _candidates_op(vals.contiguous(), idx.contiguous(), chunks.max, chunks.sum_exp, chunks.argmax, chunks.race,
                   chunks.winner, rows, params, seeds, steps, vocab_size, out, overflow, whole.lse, whole.argmax,
                   whole.winner)
    return out, overflow, whole
