"""The first pass of sampling over each row's logits: its penalties on the tokens it has seen and
its temperature, as transformers applies them, into float32, with the row's log-sum-exp and argmax
found in the same pass.

    x, lse, best = scaled_logits(logits, rows, params, seen)

logits [B, V] (any float dtype) belong to sampler rows `rows` [B] of the per-row tables params
[R, len(PARAMS)] (ops/sampling/__init__.py) and seen [R, V] bool (or None: no penalties). A seen
token's logit is divided by the repetition penalty when positive and multiplied when negative
(transformers' RepetitionPenaltyLogitsProcessor), then the presence penalty is subtracted; every
logit is then divided by the temperature (a greedy row's, 0, by 1). best [B] is the argmax of x,
the first on ties, as torch's: a greedy row's token.
"""

import torch
import triton
import triton.language as tl

from .params import PARAMS

BLOCK = 2048
T, REPETITION, PRESENCE = (PARAMS.index(name) for name in ("temperature", "repetition_penalty", "presence_penalty"))


@triton.jit
def _scale_kernel(LOGITS, stride_l, ROWS, PARAMS, n_params, SEEN, X, LSE, BEST, V, HAS_SEEN: tl.constexpr,
                  T: tl.constexpr, REPETITION: tl.constexpr, PRESENCE: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    row = tl.load(ROWS + b)
    temperature = tl.load(PARAMS + row * n_params + T)
    temperature = tl.where(temperature > 0, temperature, 1.0)
    if HAS_SEEN:
        repetition = tl.load(PARAMS + row * n_params + REPETITION)
        presence = tl.load(PARAMS + row * n_params + PRESENCE)
    m = tl.full((), float("-inf"), tl.float32)  # the running maximum, and the sum of exp(x - m)
    s = tl.full((), 0.0, tl.float32)
    best = tl.full((), 0, tl.int64)
    for v0 in range(0, V, BLOCK):
        v = v0 + tl.arange(0, BLOCK)
        ok = v < V
        x = tl.load(LOGITS + b * stride_l + v, mask=ok, other=float("-inf")).to(tl.float32)
        if HAS_SEEN:
            seen = tl.load(SEEN + row * V + v, mask=ok, other=0) != 0
            x = tl.where(seen, tl.where(x < 0, x * repetition, x / repetition) - presence, x)
        x = x / temperature
        tl.store(X + b * V + v, x, mask=ok)
        chunk_max = tl.max(x, axis=0)
        best = tl.where(chunk_max > m, v0 + tl.argmax(x, axis=0), best)  # strictly: the first maximum stays
        new_m = tl.maximum(m, chunk_max)
        s = s * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), axis=0)
        m = new_m
    tl.store(LSE + b, m + tl.log(s))
    tl.store(BEST + b, best)


@torch.library.custom_op("qwen3_ops::scaled_logits", mutates_args=("x", "lse", "best"))
def _scaled_logits_op(logits: torch.Tensor, rows: torch.Tensor, params: torch.Tensor, seen: torch.Tensor | None,
                      x: torch.Tensor, lse: torch.Tensor, best: torch.Tensor) -> None:
    B, V = logits.shape
    if B:
        _scale_kernel[(B,)](logits, logits.stride(0), rows, params, params.shape[1], seen if seen is not None else rows,
                            x, lse, best, V, HAS_SEEN=seen is not None, T=T, REPETITION=REPETITION,
                            PRESENCE=PRESENCE, BLOCK=BLOCK, num_warps=8)


@_scaled_logits_op.register_fake
def _(logits, rows, params, seen, x, lse, best):
    return None


def scaled_logits(logits: torch.Tensor, rows: torch.Tensor, params: torch.Tensor, seen: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x [B, V] float32, lse [B] float32, best [B] int64): see the module. Device-side only."""
    B, V = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("logits must have unit stride along the vocabulary")
    x = torch.empty(B, V, dtype=torch.float32, device=logits.device)
    lse = torch.empty(B, dtype=torch.float32, device=logits.device)
    best = torch.empty(B, dtype=torch.long, device=logits.device)
    _scaled_logits_op(logits, rows, params, seen, x, lse, best)
    return x, lse, best


def scaled_logits_reference(logits: torch.Tensor, rows: torch.Tensor, params: torch.Tensor,
                            seen: torch.Tensor | None) -> torch.Tensor:
    """x [B, V] float32 of scaled_logits, in torch operations."""
    x = logits.float()
    p = params[rows]
    if seen is not None:
        seen = seen[rows]
        repetition, presence = p[:, REPETITION, None], p[:, PRESENCE, None]
        x = torch.where(seen, torch.where(x < 0, x * repetition, x / repetition) - presence, x)
    temperature = p[:, T, None]
    return x / torch.where(temperature > 0, temperature, 1.0)
