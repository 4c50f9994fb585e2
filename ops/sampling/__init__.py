"""Choosing the next token of every row of a batch, each row with its own sampling parameters and
random stream, on the device, with nothing read back to the host (a CUDA graph captures it).

    tokens = choose_tokens(logits, rows, params, seeds, steps, seen, fused=True)

logits [B, V] belong to rows `rows` [B] of per-row tables: params [R, len(PARAMS)] float32
(params.py), seeds [R] and steps [R] int64 (a row's n-th token is drawn with its seed and n), seen
[R, V] bool (the tokens each row has seen, for the penalties; None: no penalties). The tables are
read, never written (runtime/sampler.py keeps them). The filters are transformers', in its order:
repetition and presence penalties on the seen tokens, temperature, top-k, top-p, min-p; the draw
is an exponential race with counter-based clocks (noise.py), so a row's token depends on its
logits, parameters, seed and step only. Temperature 0 is the argmax of the penalized logits.

fused: the Triton kernels. One pass scales each row and runs the race over all of it, by chunks
(scale.py); torch.topk takes its CANDIDATES largest; a kernel runs the filters and the race among
them (candidates.py); and for the rows whose kept tokens may go past them a rejection kernel
weighs the whole row's winner and goes on from it (rejection.py): no sort of the vocabulary.
Otherwise (reference.py) the same choice in torch operations over each row sorted. Both give the
same tokens; rows with top-k of CANDIDATES or more together with top-p need the reference.
"""

import torch

from .candidates import choose_among_candidates
from .params import NEUTRAL, PARAMS
from .reference import choose_tokens_reference
from .rejection import sample_by_rejection
from .scale import scaled_logits

__all__ = ["CANDIDATES", "NEUTRAL", "PARAMS", "choose_tokens", "fused_supports"]

# Logits each row of the fused path keeps as candidates: more than any top-k in common use (20, 40,
# 50, 64, 100), and a power of two (a kernel's width).
CANDIDATES = 128


def fused_supports(top_k: int, top_p: float) -> bool:
    """Whether the fused path samples a row with these filters: not top-p after a top-k past the
    candidates (the rejection kernel would need the top-k set's mass to renormalize)."""
    return not (CANDIDATES <= top_k and top_p < 1)


def choose_tokens(logits: torch.Tensor, rows: torch.Tensor, params: torch.Tensor, seeds: torch.Tensor,
                  steps: torch.Tensor, seen: torch.Tensor | None, fused: bool) -> torch.Tensor:
    """Tokens [B] (int64) of logits [B, V]: see the module."""
    if not fused:
        return choose_tokens_reference(logits, rows, params, seeds, steps, seen)
    V = logits.shape[1]
    x, chunks = scaled_logits(logits, rows, params, seeds, steps, seen)
    vals, idx = x.topk(min(CANDIDATES, V), dim=-1)
    if V < CANDIDATES:  # a small vocabulary: the kernel's width, padded with tokens that never win
        vals = torch.nn.functional.pad(vals, (0, CANDIDATES - V), value=float("-inf"))
        idx = torch.nn.functional.pad(idx, (0, CANDIDATES - V))
    tokens, overflow, whole = choose_among_candidates(vals, idx, chunks, rows, params, seeds, steps, V)
    return sample_by_rejection(x, whole, rows, params, seeds, steps, overflow, tokens)
