"""Qwen's FP8 checkpoints (qwen3/fp8.py, qwen3/quantized.py): scripts/quantize_fp8.py writes them,
from_pretrained loads them (dequantized as they load on the reference path; held in FP8 where the
fused kernels run, here through Triton's interpreter), and quantization="fp8" quantizes a bf16
checkpoint as it loads, on the CPU. The kernels themselves: tests/test_fp8_kernels.py.

Reference: transformers loading the same FP8 checkpoint with its FineGrainedFP8 integration
(FineGrainedFP8Config(dequantize=True)): its weights and logits. Blocks of 32 here divide every
dimension of the test models, as Qwen's 128 divide the real ones' (transformers derives the block
from the scales' grid)."""

import json
import os
import re
import subprocess
import sys

import httpx
import pytest
import servers
import torch
import transformers
from checkpoints import hf_model, prompts, save, save_tokenizer
from conftest import DEVICE, requires_cuda
from in_process import ROOT, load_script
from test_moe import hf_moe_model
from tolerances import LOGITS_FP32_ATOL, LOGITS_FP32_RTOL

from qwen3 import Qwen3ForCausalLM
from qwen3.fp8 import E4M3_MAX, dequantize, quantize

FUSED = dict(kernels="fused", norm_impl="triton", device=DEVICE)  # on the CPU through Triton's interpreter
# Every decoder projection divides into 128 x 128 blocks (quantization="fp8"'s, Qwen's): q, k, v
# 2 x 64 rows, F 256.
WHOLE_BLOCKS = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=2, head_dim=64)

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
    load_with(lambda c: c["quantization_config"].update(weight_block_size=[True, True]),
              r"weight_block_size \[True, True\] is not supported")
    load_with(lambda c: c.update(quantization_config="fp8"), "quantization_config must be a JSON object, got 'fp8'")
    (path / "config.json").write_text(json.dumps(config))
    from safetensors.torch import load_file, save_file

    stored = load_file(path / "model.safetensors")
    scale = "model.layers.0.self_attn.q_proj.weight_scale_inv"
    for change, message in [
        (lambda t: t.pop(scale), "model.layers.0.self_attn.q_proj.weight in model.safetensors has no"),
        (lambda t: t[scale].fill_(float("nan")), f"{scale} in model.safetensors holds multipliers that are not finite"),
        (lambda t: t.update({"model.layers.0.foo.weight_scale_inv": t[scale].clone()}),
         "unexpected tensor model.layers.0.foo.weight_scale_inv in model.safetensors"),
    ]:
        tensors = {key: tensor.clone() for key, tensor in stored.items()}
        change(tensors)
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ValueError, match=message):
            Qwen3ForCausalLM.from_pretrained(path, progress=False)
        for kernels in ("fused", "reference"):  # also where the model holds the weights in FP8
            with pytest.raises(ValueError, match=message):
                Qwen3ForCausalLM.from_pretrained(path, progress=False, kernels=kernels, dtype=torch.bfloat16)


def test_the_quantizer_refuses_what_would_lose_or_mix_checkpoints_in_one_line(tmp_path, capsys):
    """quantize_fp8.py: OUT the source itself, or a directory with files in it, is refused before
    anything is written (the source untouched, OUT as it was); a source it cannot read is one line
    naming the problem, leaving no OUT; a bad --block is a flag error (status 2)."""
    source = save(hf_model(seed=2), tmp_path / "source")
    before = {f.name: f.read_bytes() for f in source.iterdir()}

    def refused(args, message, status=1):
        """The run ends with `status` and its last line on stderr (the one line, but for argparse's
        usage line before a flag error) matches message."""
        with pytest.raises(SystemExit) as exit:
            quantize_fp8.main([str(a) for a in args])
        code = exit.value.code  # sys.exit(line): status 1, the line printed by the interpreter
        line = code if isinstance(code, str) else capsys.readouterr().err.splitlines()[-1]
        assert (1 if isinstance(code, str) else code) == status and "\n" not in line
        assert re.search(message, line), line

    refused([source, source], "OUT .*source is the checkpoint itself")
    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / "model.safetensors.index.json").write_text("{}")
    refused([source, stale], "OUT .*stale exists and is not an empty directory")
    assert [f.name for f in stale.iterdir()] == ["model.safetensors.index.json"]
    refused([source, tmp_path / "o", "--block", "0", "128"], "--block must be two positive integers", status=2)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((source / "config.json").read_text())
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    refused([broken, tmp_path / "o"], r"cannot quantize .*broken: ")
    refused([broken, tmp_path / "a" / "b"], r"cannot quantize .*broken: ")  # the parents it made go too
    kept = tmp_path / "kept"
    kept.mkdir()
    refused([broken, kept], r"cannot quantize .*broken: ")  # an empty OUT of the user's stays, empty
    assert kept.is_dir() and not any(kept.iterdir())
    kept.rmdir()
    (broken / "config.json").write_text("[1]")
    refused([broken, tmp_path / "o"], r"config.json must hold a JSON object, not list")
    assert {f.name: f.read_bytes() for f in source.iterdir()} == before
    assert sorted(f.name for f in tmp_path.iterdir()) == ["broken", "source", "stale"]  # no OUT, nothing partial
    empty = tmp_path / "empty"
    empty.mkdir()
    umask = os.umask(0o022)
    try:
        quantize_fp8.main([str(source), str(empty), "--block", "100", "60"])  # an empty OUT is taken
    finally:
        os.umask(umask)
    assert "the fused FP8 kernels take sides that are powers of two" in capsys.readouterr().err
    assert json.loads((empty / "config.json").read_text())["quantization_config"]["weight_block_size"] == [100, 60]
    assert {f.name: f.stat().st_mode & 0o777 for f in empty.iterdir()} == {  # readable as any file the user writes
        f.name: 0o644 for f in source.iterdir()}
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "elsewhere").mkdir()
    quantize_fp8.main([str(source), str(link)])  # a link to an empty directory (or a mount point): written into
    assert link.is_symlink() and (tmp_path / "elsewhere" / "config.json").is_file()


def test_a_quantizer_run_stopped_midway_leaves_nothing_behind(tmp_path):
    """SIGTERM (a supervisor's stop) while the weights are being written: the run exits non-zero in
    one line and removes what it wrote, OUT and the parents it made included; the source is as it was."""
    source = save(hf_model(seed=2), tmp_path / "source")
    before = {f.name: f.read_bytes() for f in source.iterdir()}
    stop_at_the_first_weight = (  # the script run as a user runs it, a SIGTERM arriving mid-run
        "import os, runpy, signal, sys, qwen3.fp8 as fp8\n"
        "real = fp8.quantize\n"
        "def quantize(*args):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return real(*args)\n"
        "fp8.quantize = quantize\n"
        "sys.argv = sys.argv[1:]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    out = tmp_path / "new" / "deeper" / "fp8"
    run = subprocess.run([sys.executable, "-c", stop_at_the_first_weight, str(ROOT / "scripts" / "quantize_fp8.py"),
                          str(source), str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 128 + 15 and run.stderr.splitlines() == ["quantize_fp8.py: SIGTERM: stopped"], run.stderr
    assert sorted(f.name for f in tmp_path.iterdir()) == ["source"]
    assert {f.name: f.read_bytes() for f in source.iterdir()} == before


def fp8_params(model) -> dict[str, torch.Tensor]:
    return {name: p for name, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn}


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_the_fused_path_holds_fp8_weights_and_computes_the_dequantized_model(tmp_path, kind):
    """Where the fused kernels run, an FP8 checkpoint's projections (and experts) stay FP8, beside
    their scales; the router, norms, embeddings and head do not. Logits of a decode step (one row:
    the weight-only GEMV) and of a 70-token prefill (dequantized for the matmul; the MoE's sorted
    tiles read FP8) equal transformers' dequantized model; so do greedy tokens after that prompt."""
    model = hf_model(seed=5) if kind == "dense" else hf_moe_model(seed=5)
    path = fp8_checkpoint(model, tmp_path, "40KB")
    ours = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32, progress=False, **FUSED)
    held = fp8_params(ours)
    expected = {"self_attn.qkv_proj.weight", "self_attn.o_proj.weight"} | (
        {"mlp.gate_up_proj.weight", "mlp.down_proj.weight"} if kind == "dense" else
        {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"})
    assert {name.split(".", 3)[3] for name in held} == expected
    scales = {name: p.dtype for name, p in ours.named_parameters() if name.endswith("scale_inv")}
    assert len(scales) == len(held) and set(scales.values()) == {torch.float32}
    assert ours.fp8_block == BLOCK
    reference = transformers_fp8(path)
    prompt = torch.tensor([prompts([70], 384, seed=2)[0]])
    with torch.no_grad():
        for ids in (prompt, prompt[:, :1]):
            torch.testing.assert_close(ours(ids.to(DEVICE)).cpu(), reference(ids).logits, rtol=LOGITS_FP32_RTOL,
                                       atol=LOGITS_FP32_ATOL)
    theirs = reference.generate(prompt, max_new_tokens=6, do_sample=False, attention_mask=torch.ones_like(prompt),
                                pad_token_id=0)
    assert torch.equal(ours.generate(prompt.to(DEVICE), 6, temperature=0).cpu(), theirs)


def test_what_fp8_weights_cannot_do_is_one_clear_error(tmp_path):
    """A cast of a model holding FP8 weights (torch would cast the stored values without their
    scales) fails at the next forward, naming the cast; quantizing under tensor parallelism (each
    rank would quantize its own slices) is refused before anything loads. The per-expert layout of
    an FP8 MoE checkpoint, scales included, loads through load_state_dict as through the loader."""
    path = fp8_checkpoint(hf_moe_model(seed=9), tmp_path)
    held = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32, progress=False, **FUSED)
    fresh = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32, progress=False, **FUSED)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    from safetensors.torch import load_file

    fresh.load_state_dict(load_file(path / "model.safetensors"))
    for (name, a), b in zip(held.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a.float(), b.float()), name
    ids = torch.tensor([[3, 17]], device=DEVICE)
    with pytest.raises(ValueError, match="FP8 weights were cast to torch.float16"), torch.no_grad():
        held.half()(ids)
    with pytest.raises(ValueError, match="quantization='fp8' with tensor_parallel=True is not supported"):
        Qwen3ForCausalLM.from_pretrained(path, progress=False, quantization="fp8", tensor_parallel=True)


def test_quantizing_on_load_is_the_quantizer_script(tmp_path):
    """from_pretrained(quantization="fp8") of a floating-point checkpoint is scripts/quantize_fp8.py's
    checkpoint (blocks of 128) loaded: on the fused path the same FP8 weights and scales, exactly;
    on the reference path the same dequantized weights, so the same logits exactly. A MoE whose
    experts are not whole blocks (I = 32) is quantized per checkpoint tensor too (gate and up
    apart) and computed in its dtype."""
    dense = save(hf_model(seed=6, **WHOLE_BLOCKS), tmp_path / "dense")
    moe = save(hf_moe_model(seed=6), tmp_path / "moe")
    for source in (dense, moe):
        quantize_fp8.main([str(source), str(source.with_name(source.name + "-fp8"))])
    quantized = Qwen3ForCausalLM.from_pretrained(dense, dtype=torch.float32, progress=False, quantization="fp8",
                                                 **FUSED)
    stored = Qwen3ForCausalLM.from_pretrained(tmp_path / "dense-fp8", dtype=torch.float32, progress=False, **FUSED)
    assert fp8_params(quantized).keys() == fp8_params(stored).keys() and fp8_params(quantized)
    for (name, a), b in zip(quantized.state_dict().items(), stored.state_dict().values()):
        assert a.dtype == b.dtype and torch.equal(a.float(), b.float()), name
    ids = torch.tensor([prompts([9], 384, seed=3)[0]])
    for source in (dense, moe):
        ours = Qwen3ForCausalLM.from_pretrained(source, dtype=torch.float32, progress=False, quantization="fp8")
        theirs = Qwen3ForCausalLM.from_pretrained(source.with_name(source.name + "-fp8"), dtype=torch.float32,
                                                  progress=False)
        assert not fp8_params(ours)
        with torch.no_grad():
            assert torch.equal(ours(ids), theirs(ids))
    with pytest.raises(ValueError, match="quantization 'int4' is not supported; 'fp8'"):
        Qwen3ForCausalLM.from_pretrained(dense, progress=False, quantization="int4")


def test_generate_cli_quantizes_with_a_flag(tmp_path, run_cli):
    """scripts/generate.py --quantization fp8 writes what it writes for the quantizer's checkpoint,
    and says in its summary that the projections are FP8 where they are held so (the fused path)."""
    source = save(hf_model(seed=7, **WHOLE_BLOCKS), tmp_path / "source")
    save_tokenizer(source)
    quantize_fp8.main([str(source), str(tmp_path / "fp8")])
    args = ["--prompt", "hello there", "--max-new-tokens", "6", "--temperature", "0"]
    flagged = run_cli("--model", str(source), "--quantization", "fp8", *args)
    stored = run_cli("--model", str(tmp_path / "fp8"), *args)
    assert flagged.returncode == stored.returncode == 0, flagged.stderr + stored.stderr
    assert flagged.stdout == stored.stdout
    plain = run_cli("--model", str(source), *args)
    fused = run_cli("--model", str(source), "--quantization", "fp8", "--kernels", "fused", "--norm", "triton",
                    "--device", DEVICE.type, *args)
    assert "with FP8 projections" in fused.stderr and "with FP8 projections" not in plain.stderr
    bad = run_cli("--model", str(source), "--quantization", "int4", *args)
    assert bad.returncode == 2 and "invalid choice: 'int4'" in bad.stderr


@requires_cuda
def test_serving_an_fp8_checkpoint_on_the_gpu(tmp_path, run_cli, monkeypatch):
    """serve.py on the GPU with an FP8 checkpoint (held in FP8: the fused path) answers a greedy
    completion with what generate.py writes for the same prompt on the same checkpoint."""
    source = save(hf_model(seed=8, **WHOLE_BLOCKS), tmp_path / "source")
    save_tokenizer(source)
    quantize_fp8.main([str(source), str(tmp_path / "fp8")])
    cli = run_cli("--model", str(tmp_path / "fp8"), "--device", "cuda", "--prompt", "hello there", "--no-chat",
                  "--max-new-tokens", "8", "--temperature", "0")
    assert cli.returncode == 0 and "with FP8 projections" in cli.stderr, cli.stderr
    monkeypatch.setattr(servers, "ENV", {**servers.ENV, "TRITON_INTERPRET": "0"})  # compiled kernels
    with servers.serving(tmp_path / "fp8", tmp_path, "--device", "cuda") as served:
        reply = httpx.post(f"{served.url}/v1/completions", timeout=120, json={
            "prompt": "hello there", "max_tokens": 8, "temperature": 0}).json()
    assert reply["choices"][0]["text"] == cli.stdout.removesuffix("\n")
