"""Host data onto the GPU without the host waiting for it. A copy from pageable memory waits for
the stream (the host would stall until the step in flight is done); one from pinned memory is
queued behind that step, and torch keeps the pinned buffer until the copy has run. The engine and
the sampler write their per-step inputs this way between steps, so that the host prepares step
t + 1 while the GPU runs step t.

    ids = to_device([3, 1, 4], device)                # a device tensor, the copy queued
    table.copy_(staged(rows, device), non_blocking=True)
"""

import torch


def staged(data, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """data (a list, or a host tensor) as a host tensor for a copy to device: pinned when that is a GPU."""
    pinned = device.type == "cuda"
    if isinstance(data, torch.Tensor):
        host = data.to(dtype) if dtype is not None else data
        return host.pin_memory() if pinned else host
    return torch.tensor(data, dtype=dtype, pin_memory=pinned)


def to_device(data, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """data on device, its copy queued behind the work in flight (see the module docstring); a
    tensor already on a GPU is copied from there."""
    if isinstance(data, torch.Tensor) and data.device.type != "cpu":
        return data.to(device=device, dtype=dtype, non_blocking=True)
    if device.type != "cuda":
        return torch.as_tensor(data, dtype=dtype, device=device)
    return staged(data, device, dtype).to(device, non_blocking=True)
