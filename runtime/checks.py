"""Checks of what callers hand the model and the runtime, each in one place: token ids, their range,
a request's lengths and seed (model.generate and the serving engine make the same checks here)."""

import operator

import torch

from .sampling import ParameterError, plain, problem


def check_input_ids(input_ids) -> None:
    """TypeError unless a LongTensor [batch, seq_len]."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype != torch.long or input_ids.dim() != 2:
        raise TypeError("input_ids must be a LongTensor of shape [batch, seq_len]")


def token_id(value, name: str) -> int:
    """value as a token id (a Python int from any integer type: numpy's, a 0-d tensor); TypeError
    naming `name` for anything else (a float, a bool)."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(f"{name} must be an integer token id (or a list of them), got {value!r}")


def check_in_vocab(input_ids: torch.Tensor, vocab_size: int) -> None:
    """ValueError unless every id is in [0, vocab_size) (reads the ids' smallest and largest back to
    the host: one sync on a GPU)."""
    if not input_ids.numel():
        return
    low, high = torch.stack(torch.aminmax(input_ids)).tolist()  # one read-back for both
    if not 0 <= low <= high < vocab_size:
        raise ValueError(f"input_ids must be token ids in [0, {vocab_size}), got ids from {low} to {high}")


def check_request(n_prompt: int, new, max_len: int, seed=None, new_name: str = "max_tokens", least: int = 1) -> None:
    """ParameterError (a ValueError naming the field) unless a prompt of n_prompt tokens (at least
    one) and `new` tokens to generate (an integer >= least; new_name: what the caller's API calls
    it) fit max_len positions, and the seed, if any, is one."""
    if n_prompt == 0:
        raise ParameterError("prompt", "the prompt is empty: generation needs at least one token")
    new = plain(new)  # numpy's integers as Python's: no wrap-around in the sums below
    if isinstance(new, bool) or not isinstance(new, int) or new < least:
        raise ParameterError(new_name, f"{new_name} must be an integer >= {least}, got {new!r}")
    if seed is not None and (wrong := problem("seed", seed)):
        raise ParameterError("seed", f"seed {wrong}")
    if n_prompt + new > max_len:
        raise ParameterError(new_name, f"This model's maximum context length is {max_len} tokens. However, you "
                             f"requested {n_prompt + new} tokens ({n_prompt} in the prompt, {new} for the completion).")
