"""Hugging Face safetensors checkpoint -> Qwen3ForCausalLM.

The module is built on the meta device (no memory, no random init), given uninitialized storage
of the target dtype on the target device, and each checkpoint tensor is copied straight into its
parameter: peak memory is about one model. Keys map one to one (our parameter names are HF's);
every key is checked before any copy, and any mismatch names the file and the tensor.
"""

import json
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from .config import Qwen3Config
from .model import Qwen3ForCausalLM

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(path: Path) -> dict[str, list[str]]:
    """{shard file: [tensor keys]} from a single model.safetensors or a sharded index."""
    if (path / INDEX_FILE).exists():
        try:
            weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as err:
            raise ValueError(f"{path / INDEX_FILE} is not a valid safetensors index: {err!r}") from None
        shards: dict[str, list[str]] = {}
        for key, shard in weight_map.items():
            shards.setdefault(shard, []).append(key)
        for shard in shards:
            if not (path / shard).exists():
                raise FileNotFoundError(f"shard {shard} named in {INDEX_FILE} is missing from {path}")
        return shards
    if (path / SINGLE_FILE).exists():
        return {SINGLE_FILE: None}  # keys read from the file itself
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}")


def _open(file: Path):
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as err:  # safetensors raises its own error types for corrupt headers
        raise ValueError(f"cannot read safetensors file {file}: {err}") from None


def load_model(
    path: str | Path,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    norm_impl: str | None = None,
    progress: bool = True,
) -> Qwen3ForCausalLM:
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist")
    config = Qwen3Config.from_json(path, **({"norm_impl": norm_impl} if norm_impl else {}))
    dtype = dtype or getattr(torch, config.dtype)

    with torch.device("meta"):
        model = Qwen3ForCausalLM(config).to(dtype)
    model.to_empty(device=device)
    if config.tie_word_embeddings:  # to_empty made new tensors: tie them again
        model.lm_head.weight = model.model.embed_tokens.weight
    params = model.checkpoint_tensors()  # HF key -> parameter or rows of a fused one; tied weights once

    # Check every key and shape before copying anything.
    shards = checkpoint_files(path)
    plan: list[tuple[str, list[str]]] = []
    seen: set[str] = set()
    for shard, listed in shards.items():
        with _open(path / shard) as f:
            keys = list(f.keys())
            if listed is not None and set(listed) - set(keys):
                missing = sorted(set(listed) - set(keys))[0]
                raise ValueError(f"{INDEX_FILE} maps {missing} to {shard}, which does not contain it")
            to_copy = []
            for key in keys:
                if key.endswith("rotary_emb.inv_freq"):
                    continue  # a derived buffer some exporters save; we compute it
                if key == "lm_head.weight" and config.tie_word_embeddings:
                    continue  # tied: the head is the embedding matrix
                if key not in params:
                    raise ValueError(f"unexpected tensor {key} in {shard}: no such parameter in Qwen3")
                shape = tuple(f.get_slice(key).get_shape())
                if shape != tuple(params[key].shape):
                    raise ValueError(
                        f"tensor {key} in {shard} has shape {shape}, expected {tuple(params[key].shape)}"
                    )
                to_copy.append(key)
            seen.update(to_copy)
            plan.append((shard, to_copy))
    missing = sorted(set(params) - seen)
    if missing:
        raise ValueError(f"checkpoint {path} is missing tensor(s): {', '.join(missing[:5])}"
                         + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))

    with torch.no_grad():
        for shard, keys in tqdm(plan, desc="loading shards", unit="shard", disable=not progress):
            with _open(path / shard) as f:
                for key in keys:
                    params[key].copy_(f.get_tensor(key))
    generation_config = path / "generation_config.json"
    if generation_config.exists():
        model.generation_config = json.loads(generation_config.read_text())
    return model.eval()
