"""A request to the serving engine, the outputs it gets back, and the checks it must pass.

    engine.add(Request(prompt_ids, max_tokens, SamplingParams(...), seed=...), on_output)   # serve/engine.py
    process.submit(request, on_output)   # the server's: serve/engine_process.py, after process.check(request)
"""

import itertools
from dataclasses import dataclass

from runtime import checks
from runtime.logprobs import MAX_LOGPROBS, TokenLogprobs
from runtime.sampling import ParameterError, SamplingParams


@dataclass(frozen=True)
class Request:
    """What a client asks for: token ids to continue, and how."""

    prompt_ids: list[int]
    max_tokens: int
    params: SamplingParams = SamplingParams(temperature=0.0)
    seed: int | None = None  # its tokens' random stream, whatever else runs beside it (None: one of its own)
    stop: tuple[str, ...] = ()  # stop strings: output ends before the first one
    eos_ids: tuple[int, ...] | None = None  # stop tokens; None: the engine's (the checkpoint's)
    # Each token's log-probability and the `logprobs` most likely tokens' (runtime/logprobs.py); None: none
    logprobs: int | None = None
    # The output's grammar: an xgrammar structural tag's JSON (runtime/grammar.py); None: free text
    grammar: str | None = None


@dataclass
class Output:
    """One event of a request: the text and tokens new since the last one; the last event has a
    finish_reason: "stop" (a stop token or string), "length" (max_tokens), "cancelled", or "error"
    (the engine failed: see its log). logprobs: one per token of token_ids, when the request asked."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprobs] | None = None


class QueueFull(Exception):
    """More requests wait than the engine's queue bound allows."""


@dataclass(frozen=True)
class Limits:
    """What bounds a request: the vocabulary, the context, the KV cache."""

    vocab_size: int
    max_len: int
    n_blocks: int
    block_size: int


def check_request(request: Request, limits: Limits) -> None:
    """ValueError naming the field and the numbers unless the request can ever run within limits:
    runtime/checks.py's checks of every generation, then the KV cache's."""
    n = len(request.prompt_ids)
    checks.check_request(n, request.max_tokens, limits.max_len, request.seed)
    k = request.logprobs
    if k is not None and not (type(k) is int and 0 <= k <= MAX_LOGPROBS):
        raise ParameterError("logprobs", f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {k!r}")
    ids = request.prompt_ids  # checked on the server's event loop for every request: C loops, not a genexpr
    if not (all(map(isinstance, ids, itertools.repeat(int))) and 0 <= min(ids) and max(ids) < limits.vocab_size):
        raise ParameterError("prompt", f"prompt token ids must be integers in [0, {limits.vocab_size})")
    blocks = -(-(n + 1) // limits.block_size)  # the prompt and one token: a prompt too long for the cache
    if blocks > limits.n_blocks:
        raise ParameterError("prompt", f"the prompt's {n} tokens and one generated need {blocks} KV-cache blocks of "
                             f"{limits.block_size} tokens; the cache has {limits.n_blocks}")
    blocks = -(-(n + request.max_tokens) // limits.block_size)
    if blocks > limits.n_blocks:
        raise ParameterError("max_tokens", f"the request needs {blocks} KV-cache blocks of {limits.block_size} "
                             f"tokens ({n} + {request.max_tokens} tokens); the cache has {limits.n_blocks}")
