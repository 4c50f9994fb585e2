"""scripts/bench_generate.py's share of the copy counts the weight bytes a decode step reads."""

import importlib.util
from pathlib import Path

import pytest
import transformers
from checkpoints import SMALL, hf_config

from qwen3 import Qwen3Config, Qwen3ForCausalLM

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_generate.py"


@pytest.fixture(scope="module")
def step_weight_bytes():
    spec = importlib.util.spec_from_file_location("bench_generate", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.step_weight_bytes


def nbytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


@pytest.mark.parametrize("tied", [False, True])
def test_a_step_reads_every_weight_but_an_untied_input_embedding(step_weight_bytes, tied):
    """An untied input embedding is read only at the step's tokens' rows; a tied one is the LM
    head's weight, which the step reads whole."""
    model = Qwen3ForCausalLM(Qwen3Config.from_dict(hf_config(tie_word_embeddings=tied).to_dict()))
    every_weight = sum(nbytes(p) for p in model.parameters())
    embedding = nbytes(model.model.embed_tokens.weight)
    assert step_weight_bytes(model, batch=4) == every_weight - (0 if tied else embedding)


def test_a_moe_step_reads_the_experts_its_tokens_are_expected_to_hit(step_weight_bytes):
    """Of the experts, the share 1 - (1 - k/E)^batch that batch x k uniformly routed tokens hit."""
    hf_cfg = transformers.Qwen3MoeConfig(**SMALL, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    model = Qwen3ForCausalLM(Qwen3Config.from_dict(hf_cfg.to_dict()))
    experts = sum(nbytes(p) for name, p in model.named_parameters() if ".experts." in name)
    others = sum(nbytes(p) for p in model.parameters()) - experts - nbytes(model.model.embed_tokens.weight)
    hit = 1 - (1 - 2 / 8) ** 3
    assert experts and step_weight_bytes(model, batch=3) == pytest.approx(others + experts * hit)
