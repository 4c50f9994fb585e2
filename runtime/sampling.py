"""Next-token choice from logits: penalties, temperature, top-k, top-p, min-p, then a draw.

The order is transformers': repetition/presence penalties, temperature, top-k, top-p, min-p.
Temperature 0 means greedy (argmax of the penalized logits).
"""

import math
from dataclasses import dataclass, fields

import torch


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


# What each parameter must be: a test and its wording. SamplingParams checks its fields with these,
# generate and the engine the seed, and scripts/generate.py each flag before it loads a model.
RULES = {
    "temperature": (lambda v: _finite(v) and v >= 0, ">= 0 and finite (0 = greedy)"),
    "top_k": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "an integer >= 0 (0 = off)"),
    "top_p": (lambda v: _finite(v) and 0 < v <= 1, "in (0, 1] (1 = off)"),
    "min_p": (lambda v: _finite(v) and 0 <= v <= 1, "in [0, 1] (0 = off)"),
    "repetition_penalty": (lambda v: _finite(v) and v > 0, "> 0 and finite (1 = off)"),
    "presence_penalty": (lambda v: _finite(v), "a finite number (0 = off)"),
    "seed": (lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63, "an integer in [0, 2**63)"),
}


class ParameterError(ValueError):
    """A ValueError about one named parameter (the server reports the name as OpenAI's `param`)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def problem(name: str, value) -> str | None:
    """What is wrong with `value` for the sampling parameter `name` ("must be ..., got ..."), or None."""
    test, must = RULES[name]
    return None if test(value) else f"must be {must}, got {value!r}"


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    min_p: float = 0.0  # 0.0: off
    repetition_penalty: float = 1.0  # >1 discourages tokens already in the sequence (HF's rule)
    presence_penalty: float = 0.0  # subtracted once from the logit of every token already present

    def __post_init__(self) -> None:
        for field in fields(self):
            wrong = problem(field.name, getattr(self, field.name))
            if wrong:
                raise ParameterError(field.name, f"{field.name} {wrong}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether tokens already in the sequence change the logits (so they must be tracked)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0


def apply_penalties(logits: torch.Tensor, seen: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [B, V] fp32; seen [B, V] bool marks tokens in the prompt or generated so far."""
    if params.repetition_penalty != 1.0:
        penalized = torch.where(logits < 0, logits * params.repetition_penalty, logits / params.repetition_penalty)
        logits = torch.where(seen, penalized, logits)
    if params.presence_penalty != 0.0:
        logits = logits - params.presence_penalty * seen.to(logits.dtype)
    return logits


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p; filtered tokens get -inf. Keeps >= 1 token per row."""
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens before it already hold top_p: the one that crosses stays in.
        drop_sorted = probs.cumsum(-1) - probs > params.top_p
        drop_sorted[..., 0] = False
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    if params.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(-1, keepdim=True).values, float("-inf"))
    return logits


def next_token(
    logits: torch.Tensor, seen: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Token ids [B] chosen from logits [B, V]."""
    logits = apply_penalties(logits.float(), seen, params)
    if params.greedy:
        return logits.argmax(-1)
    return draw(filter_logits(logits, params).softmax(-1), generator)


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of probs [B, V], drawn with probability probs[b, i]: argmax of
    probs / q with q ~ Exp(1) per entry (the first of independent exponential clocks to ring).
    It is torch.multinomial(probs, 1)'s own algorithm, the same draws from the same generator,
    without the check that first reads the probabilities back to the host: that wait for the GPU
    would come once a token and leave the GPU idle while the host queues the next step. So a row
    that is not a distribution (NaN logits from a broken model) yields some token instead of an
    error."""
    clocks = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / clocks).argmax(-1)


# What `model.generate` uses when neither the caller nor the checkpoint's generation_config says.
LIBRARY_DEFAULTS = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0)


def sampling_params(generation_config: dict, **overrides) -> SamplingParams:
    """Caller's values over the checkpoint's generation_config.json over the library defaults.
    A generation_config with do_sample false means greedy, as in transformers."""
    values = dict(LIBRARY_DEFAULTS)
    values.update({k: generation_config[k] for k in LIBRARY_DEFAULTS if generation_config.get(k) is not None})
    if generation_config.get("do_sample") is False:
        values["temperature"] = 0.0
    values.update({k: v for k, v in overrides.items() if v is not None})
    return SamplingParams(**values)
