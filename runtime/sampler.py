"""The one sampler: the next token of every row of a batch, each row with its own sampling
parameters and seed, on the device, with no loop over rows and nothing read back to the host, so
that a CUDA graph captures it with the step that makes the logits.

    sampler = Sampler(rows=16, vocab_size=V, device=device)
    sampler.set_row(row, params, seed, seen_ids)     # at admission (the engine) or once (generate)
    tokens = sampler(logits, rows, how)              # [B]; each row's state advances by its token
    tokens = sampler(sampler.mask(logits, rows), rows, how)   # only among the tokens each row's mask allows

The sampler holds each row's state: its parameters, its seed, the tokens it has drawn (its step)
and, for the penalties, the tokens it has seen, and the tokens its grammar allows next
(runtime/grammar.py: every token, unless a caller writes a mask with `allow_rows` before a
step, and applies it with `mask`). ops/sampling/ chooses the tokens from that state:
transformers' filters, and a draw from counter-based random numbers, so that a row's n-th token
depends on its logits, its seed and n, never on the rest of the batch.

`how` is the caller's, per step, from the rows' parameters (`Sampler.how`): "greedy" (every row an
unpenalized argmax: one argmax over the raw logits), "fused" (ops/sampling's Triton kernels) or
"reference" (its torch operations over each row sorted: the CPU, and rows the kernels do not take).
"""

import secrets

import torch

from ops.sampling import NEUTRAL, PARAMS, choose_tokens, fused_supports

from .grammar import allow, mask_words
from .sampling import SamplingParams
from .staging import staged, to_device

HOWS = ("greedy", "fused", "reference")


def random_seed() -> int:
    """A seed for a request that gave none: its tokens still come from a stream of its own."""
    return secrets.randbits(63)


class Sampler:
    def __init__(self, rows: int, vocab_size: int, device: torch.device, penalties: bool = True):
        """rows: the rows the caller chooses tokens for (an engine's batch rows, generate's batch),
        plus one scratch row (`scratch`) for the padding rows of a captured step. penalties: keep
        the tokens seen per row ([rows, V] bool), as repetition and presence penalties need."""
        self.vocab_size, self.scratch = vocab_size, rows
        self.params = torch.tensor([[float(NEUTRAL[name]) for name in PARAMS]] * (rows + 1), device=device)
        self.params[rows, PARAMS.index("temperature")] = 0.0  # padding rows take the cheapest way: an argmax
        self.seeds = torch.zeros(rows + 1, dtype=torch.long, device=device)
        self.steps = torch.zeros(rows + 1, dtype=torch.long, device=device)  # tokens drawn so far per row
        self.seen = torch.zeros(rows + 1, vocab_size, dtype=torch.bool, device=device) if penalties else None
        self.true = torch.ones((), dtype=torch.bool, device=device)  # written without a host copy (graphs)
        # The tokens each row may choose next, 32 to an int32 word (-1: all 32 allowed)
        self.allowed = torch.full((rows + 1, mask_words(vocab_size)), -1, dtype=torch.int32, device=device)

    @staticmethod
    def how(params: list[SamplingParams], fused: bool) -> str:
        """How to choose tokens for rows with these parameters (one of HOWS): "greedy" when every
        row is an unpenalized argmax; else "fused" on the fused path unless a row's filters need the
        reference (ops.sampling.fused_supports); else "reference"."""
        if all(p.greedy and not p.penalized for p in params):
            return "greedy"
        supported = all(fused_supports(p.top_k, p.top_p) for p in params if not p.greedy)
        return "fused" if fused and supported else "reference"

    def set_row(self, row: int, params: SamplingParams, seed: int, seen_ids=(), step: int = 0) -> None:
        """Row `row` samples with params from the stream of `seed`, at its step-th token, having seen
        seen_ids (the prompt and the tokens generated so far: a list, or a tensor on any device).
        Written between steps, not inside a
        captured one, and without waiting for the GPU: the host data is staged in pinned memory and
        its copies queued behind the step in flight (a copy from pageable memory would wait for it)."""
        if params.penalized and self.seen is None:
            raise ValueError("this sampler keeps no seen tokens (penalties=False): it cannot penalize")
        values = [float(getattr(params, name)) for name in PARAMS]
        self.params[row].copy_(staged(values, self.params.device), non_blocking=True)
        # fill_, not `self.seeds[row] = seed`: that copies a host scalar from pageable memory, which
        # waits for every step in flight (the engine's host would stall behind the GPU).
        self.seeds[row].fill_(seed)
        self.steps[row].fill_(step)
        self.allowed[row].fill_(-1)
        if self.seen is not None:
            self.seen[row] = False
            if len(seen_ids):
                seen = seen_ids if isinstance(seen_ids, torch.Tensor) else list(seen_ids)
                self.seen[row].index_fill_(0, to_device(seen, self.seen.device, torch.long), True)

    def allow_rows(self, rows: torch.Tensor, words: torch.Tensor) -> None:
        """Rows `rows` (on the device) may choose only the tokens of words [len(rows), W] (host int32,
        pinned on CUDA: the copy is queued behind the step in flight) in their masked steps."""
        self.allowed[rows] = words.to(self.allowed.device, non_blocking=True)

    def mask(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """logits [B, V] of sampler rows `rows` with the tokens their masks do not allow at -inf."""
        return allow(logits, self.allowed[rows])

    def choose(self, logits: torch.Tensor, rows: torch.Tensor, how: str) -> torch.Tensor:
        """Tokens [B] for logits [B, V] of sampler rows `rows` [B] (long, on the device); the rows'
        state is read, not advanced (a warm-up before a graph capture calls this)."""
        if logits.shape[-1] != self.vocab_size:  # the kernels index the seen tokens by the logits' width
            raise ValueError(f"logits of {logits.shape[-1]} tokens for a sampler of {self.vocab_size}")
        if how == "greedy":
            return logits.argmax(-1)  # exact in any dtype: no float copy of [B, V]
        if how not in HOWS:
            raise ValueError(f"how must be one of {HOWS}, got {how!r}")
        return choose_tokens(logits, rows, self.params, self.seeds, self.steps, self.seen, fused=how == "fused")

    def advance(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """The rows have drawn tokens [B]: their steps advance, and their tokens are seen."""
        self.steps[rows] += 1
        if self.seen is not None:
            self.seen.index_put_((rows, tokens), self.true)

    def __call__(self, logits: torch.Tensor, rows: torch.Tensor, how: str) -> torch.Tensor:
        tokens = self.choose(logits, rows, how)
        if how != "greedy":  # greedy rows use no state: a row's parameters are its own for its life
            self.advance(rows, tokens)
        return tokens
