"""scripts/bench_generate.py's share of the copy counts the weight bytes a decode step reads."""

import sys
from pathlib import Path

import pytest
from checkpoints import hf_config

from qwen3 import Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from bench_generate import step_weight_bytes  # noqa: E402


def nbytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


@pytest.mark.parametrize("tied", [False, True])
def test_a_step_reads_every_weight_but_an_untied_input_embedding(tied):
    """An untied input embedding is read only at the step's tokens' rows; a tied one is the LM
    head's weight, which the step reads whole."""
    model = Qwen3ForCausalLM(Qwen3Config.from_dict(hf_config(tie_word_embeddings=tied).to_dict()))
    every_weight = sum(nbytes(p) for p in model.parameters())
    embedding = nbytes(model.model.embed_tokens.weight)
    assert step_weight_bytes(model, batch=4) == every_weight - (0 if tied else embedding)
