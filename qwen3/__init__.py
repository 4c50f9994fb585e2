"""A hand-written Qwen3 decoder that loads Hugging Face checkpoints."""

from .cache import KVCache, PagedKVCache
from .config import Qwen3Config
from .model import Qwen3ForCausalLM

__all__ = ["KVCache", "PagedKVCache", "Qwen3Config", "Qwen3ForCausalLM"]
