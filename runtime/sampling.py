"""Sampling parameters: what each one must be, a request's values, and where unset ones come from.

The filters are transformers', applied in its order (runtime/sampler.py, ops/sampling/):
repetition/presence penalties, temperature, top-k, top-p, min-p. Temperature 0 (or below
GREEDY_BELOW) means greedy (the argmax of the penalized logits).
"""

import math
import numbers
from dataclasses import dataclass, fields

from ops.sampling.params import NEUTRAL


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# A temperature below this is greedy: logits divided by it overflow float32 (to inf, then NaN
# probabilities), and a draw that cold is the argmax but for exact ties (vLLM's rule).
GREEDY_BELOW = 1e-5


# What each parameter must be: a test and its wording. SamplingParams checks its fields with these,
# generate and the engine the seed, and cli/generate.py each flag before it loads a model.
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


def plain(value):
    """A number of any type (numpy's scalars) as Python's int or float; anything else as it is."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return value
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def problem(name: str, value) -> str | None:
    """What is wrong with `value` for the sampling parameter `name` ("must be ..., got ..."), or None."""
    test, must = RULES[name]
    return None if test(plain(value)) else f"must be {must}, got {value!r}"


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
            object.__setattr__(self, field.name, plain(getattr(self, field.name)))
            wrong = problem(field.name, getattr(self, field.name))
            if wrong:
                raise ParameterError(field.name, f"{field.name} {wrong}")
        if self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether tokens already in the sequence change the logits (so they must be tracked)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0


# What `model.generate` uses when neither the caller nor the checkpoint's generation_config says.
LIBRARY_DEFAULTS = dict(NEUTRAL)  # each parameter's value that changes nothing


def sampling_params(generation_config: dict, **overrides) -> SamplingParams:
    """Caller's values over the checkpoint's generation_config.json over the library defaults.
    A generation_config with do_sample false means greedy, as in transformers."""
    values = dict(LIBRARY_DEFAULTS)
    values.update({k: generation_config[k] for k in LIBRARY_DEFAULTS if generation_config.get(k) is not None})
    if generation_config.get("do_sample") is False:
        values["temperature"] = 0.0
    values.update({k: v for k, v in overrides.items() if v is not None})
    return SamplingParams(**values)
