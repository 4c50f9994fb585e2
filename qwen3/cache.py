"""KV cache: keys and values of every layer, preallocated for batch x max_len, filled in place.

Slots are shared by the batch: a step writes slot `length` of every row (left padding lines the
rows up), and per-row rotary positions and the attention mask handle different prompt lengths.

With `slot` set (a device tensor of slot indices), a step has static shapes, as a CUDA graph
needs: it writes the slots `slot` names and attends over all of them, the model masking the
ones past it, and the caller advances `length`.
"""

import torch


class KVCache:
    def __init__(
        self,
        n_layers: int,
        batch: int,
        n_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        shape = (n_layers, batch, n_kv_heads, max_len, head_dim)
        # torch.empty: slots past `length` are never read, so they need no zero fill.
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.length = 0  # slots filled so far
        self.slot: torch.Tensor | None = None  # static-shape steps: the slots to write (see update)

    @classmethod
    def for_model(cls, model, batch: int, max_len: int) -> "KVCache":
        c = model.config
        weight = model.lm_head.weight
        return cls(c.num_hidden_layers, batch, c.num_key_value_heads, max_len, c.head_dim, weight.dtype, weight.device)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, K, T, hd] at slots length..length+T of `layer`; return all slots so far.
        A static-shape step writes at `slot` instead and returns every slot."""
        if self.slot is not None:
            self.k[layer].index_copy_(2, self.slot, k)
            self.v[layer].index_copy_(2, self.slot, v)
            return self.k[layer], self.v[layer]
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache is full: {end} tokens do not fit its {self.max_len} slots")
        self.k[layer, :, :, self.length : end] = k
        self.v[layer, :, :, self.length : end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def advance(self, n: int) -> None:
        """Mark n more slots filled; called by the model after all layers have written them."""
        self.length += n
