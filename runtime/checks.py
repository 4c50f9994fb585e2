"""Checks of what callers hand the model and the runtime, each in one place: token ids, their range."""

import torch


def check_input_ids(input_ids) -> None:
    """TypeError unless a LongTensor [batch, seq_len]."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype != torch.long or input_ids.dim() != 2:
        raise TypeError("input_ids must be a LongTensor of shape [batch, seq_len]")


def check_in_vocab(input_ids: torch.Tensor, vocab_size: int) -> None:
    """ValueError unless every id is in [0, vocab_size) (reads the ids' smallest and largest back to
    the host: one sync on a GPU)."""
    if not input_ids.numel():
        return
    low, high = torch.stack(torch.aminmax(input_ids)).tolist()  # one read-back for both
    if not 0 <= low <= high < vocab_size:
        raise ValueError(f"input_ids must be token ids in [0, {vocab_size}), got ids from {low} to {high}")
