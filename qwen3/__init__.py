"""A hand-written Qwen3 decoder that loads Hugging Face checkpoints."""

from .config import Qwen3Config
from .model import Qwen3ForCausalLM

__all__ = ["Qwen3Config", "Qwen3ForCausalLM"]
