"""Checkpoint loading: config field names, and every refusal by its message."""

import json

import pytest
import torch
import transformers
from checkpoints import hf_config, hf_model, save
from safetensors.torch import load_file, save_file
from tolerances import LOGITS_FP32_ATOL, LOGITS_FP32_RTOL

import qwen3.loader
from qwen3 import Qwen3Config, Qwen3ForCausalLM


def load(path, **kwargs):
    return Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32, progress=False, **kwargs)


@pytest.fixture
def checkpoint(tmp_path):
    return save(hf_model(seed=0), tmp_path / "ckpt")


@pytest.fixture
def sharded(tmp_path):
    return save(hf_model(seed=0), tmp_path / "sharded", max_shard_size="100KB")


def edit_config(path, **changes):
    raw = json.loads((path / "config.json").read_text())
    raw.update(changes)
    (path / "config.json").write_text(json.dumps(raw))


def test_old_and_new_config_field_names_agree():
    new = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 384, "hidden_size": 64,
           "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 32, "dtype": "bfloat16",
           "rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0,
                               "original_max_position_embeddings": 32768}}
    old = {**{k: v for k, v in new.items() if k not in ("rope_parameters", "dtype")},
           "torch_dtype": "bfloat16", "rope_theta": 5e5,
           "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    a, b = Qwen3Config.from_dict(new), Qwen3Config.from_dict(old)
    assert a == b
    assert a.rope_theta == 5e5 and a.dtype == "bfloat16"
    assert a.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    sizes = {k: new[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                 "num_attention_heads")}
    assert Qwen3Config.from_dict(sizes).head_dim == 16


def test_yarn_without_its_original_context_takes_transformers_default():
    raw = {**hf_config().to_dict(), "max_position_embeddings": 2048,
           "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}
    theirs = transformers.Qwen3Config(**raw).rope_parameters["original_max_position_embeddings"]
    assert Qwen3Config.from_dict(raw).rope_scaling["original_max_position_embeddings"] == theirs == 2048


def test_a_missing_size_is_named_with_the_file(checkpoint):
    raw = json.loads((checkpoint / "config.json").read_text())
    del raw["hidden_size"]
    (checkpoint / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"ckpt/config.json is missing 'hidden_size'"):
        load(checkpoint)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3"), "unsupported model"),
        (dict(architectures=["LlamaForCausalLM"], model_type="llama"),
         r"runs Qwen3ForCausalLM \(model_type 'qwen3'\) and Qwen3MoeForCausalLM \(model_type 'qwen3_moe'\)"),
        (dict(hidden_act="gelu"), "unsupported hidden_act 'gelu'"),
        (dict(use_sliding_window=True, sliding_window=64), "sliding-window attention"),
        (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), "'longrope' is not implemented"),
        (dict(num_key_value_heads=3), "multiple of num_key_value_heads"),
        # a wrong value: one line naming the file and the field, never a traceback from the arithmetic
        (dict(hidden_size="128"), r"ckpt/config.json: hidden_size must be an integer >= 1, got '128'"),
        (dict(num_key_value_heads=0), r"ckpt/config.json: num_key_value_heads must be an integer >= 1, got 0"),
        (dict(max_position_embeddings=0), r"config.json: max_position_embeddings must be an integer >= 1"),
        (dict(rope_parameters={"rope_theta": "1e4"}), r"config.json: rope_theta must be a finite number > 0"),
        (dict(rms_norm_eps=-1), r"config.json: rms_norm_eps must be a finite number >= 0, got -1"),
    ],
)
def test_unsupported_configs_are_refused(checkpoint, changes, message):
    edit_config(checkpoint, **changes)
    with pytest.raises(ValueError, match=message):
        load(checkpoint)


@pytest.mark.parametrize("override", [dict(norm_impl="fast"), dict(norm_impl=""), dict(norm_impl=False),
                                      dict(kernels=""), dict(kernels=0)])
def test_unknown_norm_impl_or_kernels_is_refused(checkpoint, override):
    """Every value but None (the default) is checked: an empty or false one is no request for "auto"."""
    with pytest.raises(ValueError, match=f"{next(iter(override))} must be one of"):
        load(checkpoint, **override)


def test_missing_directory_and_files(tmp_path, checkpoint):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="config.json is a file, not a directory"):
        load(checkpoint / "config.json")
    (checkpoint / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors or model.safetensors.index.json"):
        load(checkpoint)
    (checkpoint / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load(checkpoint)


def rewrite(path, mutate, file="model.safetensors"):
    tensors = load_file(path / file)
    mutate(tensors)
    save_file(tensors, path / file, metadata={"format": "pt"})


def test_missing_tensor(checkpoint):
    rewrite(checkpoint, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(ValueError, match="missing tensor.*model.layers.1.self_attn.k_norm.weight"):
        load(checkpoint)


def test_untied_checkpoint_without_lm_head_is_missing_it(checkpoint):
    rewrite(checkpoint, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ValueError, match="missing tensor.*lm_head.weight"):
        load(checkpoint)


def test_unexpected_tensor(checkpoint):
    rewrite(checkpoint, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match="unexpected tensor model.layers.0.mlp.extra.weight in model.safetensors"):
        load(checkpoint)


def test_wrong_shape(checkpoint):
    def shrink(t):
        t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"][:-1]

    rewrite(checkpoint, shrink)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.up_proj.weight in model.safetensors has shape "
                                         r"\(159, 64\), expected \(160, 64\)"):
        load(checkpoint)


def test_unreadable_file(checkpoint):
    (checkpoint / "model.safetensors").write_bytes(b"\x00not a safetensors file")
    with pytest.raises(ValueError, match="cannot read safetensors file .*model.safetensors"):
        load(checkpoint)


def test_shard_named_in_index_but_absent(sharded):
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (sharded / shard).unlink()
    with pytest.raises(FileNotFoundError, match=f"shard {shard} named in model.safetensors.index.json is missing"):
        load(sharded)


@pytest.mark.parametrize("index", [[], {"weight_map": []}, {"weight_map": {"lm_head.weight": 3}}])
def test_an_index_of_the_wrong_shape_is_one_line(sharded, index):
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="model.safetensors.index.json is not a valid safetensors index"):
        load(sharded)


def test_index_pointing_to_the_wrong_shard(sharded):
    path = sharded / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    shards = sorted(set(index["weight_map"].values()))
    key = next(k for k, v in index["weight_map"].items() if v == shards[0])
    index["weight_map"][key] = shards[1]
    path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"maps {key} to {shards[1]}, which does not contain it"):
        load(sharded)


def test_tied_checkpoint_shares_the_embedding(tmp_path):
    path = save(hf_model(seed=1, tie_word_embeddings=True), tmp_path)
    model = load(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not model.lm_head.weight.is_meta


def test_a_head_stored_apart_from_embeddings_said_tied_is_loaded_as_transformers_does(tmp_path):
    """config.json says tied, the checkpoint stores a different head: transformers keeps the stored
    head (untied) and warns; so do we: the same logits, and a warning naming the file."""
    path = save(hf_model(seed=3, tie_word_embeddings=False), tmp_path)
    edit_config(path, tie_word_embeddings=True)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with pytest.warns(UserWarning, match="config.json ties the LM head to the embeddings"):
        ours = load(path)
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), reference(ids).logits, rtol=LOGITS_FP32_RTOL, atol=LOGITS_FP32_ATOL)


def test_auto_dtype_without_one_in_the_config_is_the_stored_tensors(tmp_path):
    """dtype "auto" and a config.json that states none: the stored tensors' dtype, as transformers
    reads it (not a default of ours)."""
    for dtype in (torch.float32, torch.bfloat16):
        path = save(hf_model(seed=4, dtype=dtype), tmp_path / str(dtype))
        raw = json.loads((path / "config.json").read_text())
        raw.pop("dtype", None), raw.pop("torch_dtype", None)
        (path / "config.json").write_text(json.dumps(raw))
        reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype="auto")
        ours = Qwen3ForCausalLM.from_pretrained(path, dtype="auto", progress=False)
        assert ours.lm_head.weight.dtype == reference.lm_head.weight.dtype == dtype


def test_default_dtype_is_float32_on_the_cpu_and_names_are_accepted(tmp_path):
    path = save(hf_model(seed=2, dtype=torch.bfloat16), tmp_path)

    def loaded_dtype(**kwargs) -> torch.dtype:
        return Qwen3ForCausalLM.from_pretrained(path, progress=False, **kwargs).lm_head.weight.dtype

    assert loaded_dtype() == torch.float32  # on the CPU, the default device
    assert loaded_dtype(dtype="auto") == torch.bfloat16  # the checkpoint's
    assert loaded_dtype(dtype="float16") == torch.float16
    assert loaded_dtype(dtype="torch.bfloat16") == torch.bfloat16
    assert loaded_dtype(dtype=torch.float16) == torch.float16
    for bad in ("fp32", "float64", torch.int32):
        with pytest.raises(ValueError, match="expected one of float32, bfloat16, float16, 'auto'"):
            loaded_dtype(dtype=bad)


def test_unknown_or_absent_devices_are_refused(checkpoint):
    with pytest.raises(ValueError, match="unknown device 'gpu'; expected 'cpu', 'cuda' or 'cuda:N'"):
        load(checkpoint, device="gpu")
    for meta in ("meta", torch.device("meta")):  # refused here, not in generate's first step
        with pytest.raises(ValueError, match="device meta holds shapes but no data.* expected 'cpu', 'cuda' or"):
            load(checkpoint, device=meta)
    absent = "cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(ValueError, match=f"device {absent} is not available"):
        load(checkpoint, device=absent)


def test_a_non_float_tensor_is_refused(checkpoint):
    key = "model.layers.0.post_attention_layernorm.weight"
    rewrite(checkpoint, lambda t: t.update({key: t[key].to(torch.int32)}))
    with pytest.raises(ValueError, match=f"tensor {key} in model.safetensors has dtype I32, expected a floating-point"):
        load(checkpoint)


def test_progress_shows_only_when_loading_takes_long(checkpoint, capfd, monkeypatch):
    Qwen3ForCausalLM.from_pretrained(checkpoint, progress=True)
    assert capfd.readouterr().err == ""  # a small checkpoint loads in well under the delay
    monkeypatch.setattr(qwen3.loader, "PROGRESS_AFTER_S", 0.0)
    Qwen3ForCausalLM.from_pretrained(checkpoint, progress=True)
    assert "loading weights: 100%" in capfd.readouterr().err


def test_generation_config_is_read_and_used_by_generate(checkpoint):
    """do_sample false means greedy, and the file's repetition penalty applies: as in transformers."""
    settings = {"do_sample": False, "temperature": 0.7, "repetition_penalty": 1.3}
    (checkpoint / "generation_config.json").write_text(json.dumps(settings))
    model = load(checkpoint)
    assert model.generation_config == settings
    reference = hf_model(seed=0)  # the checkpoint's model
    prompt = torch.tensor([[5, 17, 42, 99, 7]])
    expected = reference.generate(prompt, max_new_tokens=24, do_sample=False, repetition_penalty=1.3)
    assert torch.equal(model.generate(prompt, max_new_tokens=24), expected)
    greedy = reference.generate(prompt, max_new_tokens=24, do_sample=False)
    assert not torch.equal(expected, greedy)  # the penalty matters here
