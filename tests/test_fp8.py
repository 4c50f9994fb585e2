"""Qwen's FP8 checkpoints (qwen3/fp8.py): scripts/quantize_fp8.py writes them, from_pretrained
loads them (dequantized as they load), on the CPU.

Reference: transformers loading the same FP8 checkpoint with its FineGrainedFP8 integration
(FineGrainedFP8Config(dequantize=True)): its weights and logits. Blocks of 32 here divide every
dimension of the test models, as Qwen's 128 divide the real ones' (transformers derives the block
from the scales' grid)."""

import json

import pytest
import torch
import transformers
from checkpoints import hf_model, save
from in_process import load_script
from test_moe import hf_moe_model
from tolerances import LOGITS_FP32_ATOL, LOGITS_FP32_RTOL

from qwen3 import Qwen3ForCausalLM
from qwen3.fp8 import E4M3_MAX, dequantize, quantize

quantize_fp8 = load_script("quantize_fp8")
BLOCK = (32, 32)


def fp8_checkpoint(model, folder, shard_size=None):
    source = save(model, folder / "source", max_shard_size=shard_size)
    quantize_fp8.main([str(source), str(folder / "fp8"), "--block", *map(str, BLOCK)])
    return folder / "fp8"


def move_a_scale_to_another_shard(path):
    """A scale moved to another shard than its weight's (the index says so): a
    checkpoint may keep a weight and its scale apart."""
    from safetensors.torch import load_file, save_file

    index = json.loads((path / "model.safetensors.index.json").read_text())
    key = next(k for k in index["weight_map"] if k.endswith("weight_scale_inv"))
    here = index["weight_map"][key]
    there = next(shard for shard in sorted(set(index["weight_map"].values())) if shard != here)
    source, target = load_file(path / here), load_file(path / there)
    target[key] = source.pop(key)
    save_file(source, path / here, metadata={"format": "pt"})
    save_file(target, path / there, metadata={"format": "pt"})
    index["weight_map"][key] = there
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def transformers_fp8(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=transformers.FineGrainedFP8Config(dequantize=True)).eval()


def test_quantizing_rounds_each_block_to_e4m3_at_its_own_scale():
    """quantize -> dequantize is the blockwise rounding of the original: each block divided by
    amax / 448 (its largest magnitude becomes 448 exactly) and rounded to float8_e4m3fn; a partial
    block at the edges and an all-zero block too."""
    torch.manual_seed(0)
    w = torch.randn(100, 70) * torch.logspace(-3, 2, 70)  # blocks of very different scales
    w[:32, :32] = 0
    q, scale_inv = quantize(w, BLOCK)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape and scale_inv.shape == (4, 3)
    back = dequantize(q, scale_inv, BLOCK, torch.float32)
    for r in range(4):
        for c in range(3):
            block = w[32 * r : 32 * (r + 1), 32 * c : 32 * (c + 1)]
            s = block.abs().max() / E4M3_MAX if block.abs().max() > 0 else torch.tensor(1.0)
            assert scale_inv[r, c] == s
            expected = (block / s).to(torch.float8_e4m3fn).float() * s
            assert torch.equal(back[32 * r : 32 * (r + 1), 32 * c : 32 * (c + 1)], expected)
            if block.abs().max() > 0:
                assert q[32 * r : 32 * (r + 1), 32 * c : 32 * (c + 1)].float().abs().max() == E4M3_MAX


@pytest.mark.parametrize("kind, shard_size", [("dense", None), ("dense", "40KB"), ("moe", None), ("moe", "40KB")])
def test_an_fp8_checkpoint_loads_as_transformers_dequantizes_it(tmp_path, kind, shard_size):
    """Single file and sharded (scales in other shards than their weights too), dense and MoE:
    every weight ours loads equals transformers' dequantized one exactly, the logits within the
    fp32 tolerance; the format is Qwen's (float8 weights, float32 scales, quantization_config)."""
    model = hf_model(seed=4) if kind == "dense" else hf_moe_model(seed=4)
    path = fp8_checkpoint(model, tmp_path, shard_size)
    if shard_size:
        move_a_scale_to_another_shard(path)
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    assert config == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                      "weight_block_size": list(BLOCK)}
    ours = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32, progress=False)
    reference = transformers_fp8(path)
    theirs = reference.state_dict()
    for key, tensor in ours.checkpoint_tensors().items():
        if key in theirs:  # transformers 5 fuses the experts: those are compared through the logits
            assert torch.equal(tensor, theirs[key]), key
    ids = torch.tensor([[3, 17, 200, 5, 9, 41, 300, 2]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), reference(ids).logits, rtol=LOGITS_FP32_RTOL, atol=LOGITS_FP32_ATOL)


def test_what_cannot_be_loaded_is_one_clear_error(tmp_path):
    """Another quantization method, a missing or misshapen scale, FP8 weights without a
    quantization_config: a ValueError naming the file and the tensor."""
    path = fp8_checkpoint(hf_model(seed=1), tmp_path)
    config = json.loads((path / "config.json").read_text())

    def load_with(change, message):
        broken = json.loads(json.dumps(config))
        change(broken)
        (path / "config.json").write_text(json.dumps(broken))
        with pytest.raises(ValueError, match=message):
            Qwen3ForCausalLM.from_pretrained(path, progress=False)

    load_with(lambda c: c["quantization_config"].update(quant_method="awq"),
              "quantization method 'awq' is not supported")
    load_with(lambda c: c["quantization_config"].update(weight_block_size=[128]), "weight_block_size")
    load_with(lambda c: c.pop("quantization_config"), "has dtype F8_E4M3.*quantization_config")
    load_with(lambda c: c["quantization_config"].update(weight_block_size=[16, 32]), "weight_scale_inv .* has shape")
    (path / "config.json").write_text(json.dumps(config))
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.0.self_attn.q_proj.weight_scale_inv"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.0.self_attn.q_proj.weight in model.safetensors has no"):
        Qwen3ForCausalLM.from_pretrained(path, progress=False)
