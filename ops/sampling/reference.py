"""The whole choice of the next tokens in torch operations, on each row's whole vocabulary sorted:
the reference the kernels of ops/sampling/ are tested against, and what runs where they do not
(the CPU without TRITON_INTERPRET, a row with top-k of CANDIDATES or more and top-p)."""

import torch

from .noise import row_keys, uniform
from .params import PARAMS
from .scale import scaled_logits_reference

T, TOP_K, TOP_P, MIN_P = (PARAMS.index(name) for name in ("temperature", "top_k", "top_p", "min_p"))


def kept(vals: torch.Tensor, lse: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """[B, V] bool: which of each row's scaled logits vals [B, V] (in decreasing order; lse [B] their
    log-sum-exp) transformers' warpers keep, in their order: top-k (ties with the k-th kept),
    renormalized; top-p (the token that crosses top_p stays); min-p (p >= min_p * the largest p)."""
    V = vals.shape[1]
    top_k = params[:, TOP_K].long()
    top_p, min_p = params[:, TOP_P, None], params[:, MIN_P, None]
    has_top_k = ((top_k > 0) & (top_k < V))[:, None]
    kth = vals.gather(1, (top_k.clamp(1, V) - 1)[:, None])
    in_top_k = (vals >= kth) | ~has_top_k
    p = torch.exp(vals - lse[:, None]) * in_top_k
    q = p / torch.where(has_top_k, p.sum(-1, keepdim=True), 1.0)
    in_top_p = (q.cumsum(-1) - q <= top_p) | (top_p >= 1)
    return in_top_k & in_top_p & (q >= min_p * q.amax(-1, keepdim=True))


def choose_tokens_reference(logits: torch.Tensor, rows: torch.Tensor, params: torch.Tensor, seeds: torch.Tensor,
                            steps: torch.Tensor, seen: torch.Tensor | None) -> torch.Tensor:
    """Tokens [B] of logits [B, V] of sampler rows `rows`: see ops/sampling/__init__.py."""
    x = scaled_logits_reference(logits, rows, params, seen)
    p = params[rows]
    vals, idx = x.sort(-1, descending=True)
    keys = row_keys(seeds[rows], steps[rows])
    race = torch.where(kept(vals, x.logsumexp(-1), p), vals - torch.log(-torch.log(uniform(keys, idx))),
                       float("-inf"))
    winner = idx.gather(1, race.argmax(-1, keepdim=True))[:, 0]
    return torch.where(p[:, T] == 0, x.argmax(-1), winner)
