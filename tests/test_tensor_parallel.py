"""Tensor parallelism: the model split over two processes (gloo on the CPU, NCCL on two GPUs)
against transformers' model in one process, and the torchrun command line against one process.

The CPU cases run in one two-process spawn (module fixture `two_ranks`): each rank loads every
case's checkpoint with tensor_parallel=True and records what it saw; the tests then compare each
rank's record with transformers."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from checkpoints import SMALL, hf_config, hf_model, save
from conftest import INTERPRETED, PATHS
from tolerances import LOGITS_FP32_ATOL, LOGITS_FP32_RTOL
from tp_workers import cpu_jobs, gpu_greedy, run_ranks

from qwen3 import Qwen3ForCausalLM

ROOT = Path(__file__).resolve().parent.parent
NEW_TOKENS = 8
# checkpoint: (transformers config overrides, sharded)
CHECKPOINTS = {
    "gqa-bias": (dict(attention_bias=True), False),  # 4 query heads, 2 key/value heads: 2 + 1 per rank
    "mqa-tied-sharded": (dict(num_key_value_heads=1, tie_word_embeddings=True), True),  # k/v replicated
}
# case: (checkpoint, the model's path: conftest.PATHS)
CASES = {"gqa-bias": ("gqa-bias", "reference"), "mqa-tied-sharded": ("mqa-tied-sharded", "reference")}
if INTERPRETED:  # the fused path (Triton kernels through the interpreter) on each rank's shard, at batch 1
    CASES["gqa-bias-fused"] = ("gqa-bias", "fused")
# name: (config overrides that do not divide over 2 ranks, what the error must name)
BAD_SPLITS = {
    "odd-heads": (dict(num_attention_heads=3, num_key_value_heads=1), "num_attention_heads=3 is not a multiple of 2"),
    "three-kv-heads": (dict(num_attention_heads=6, num_key_value_heads=3), "num_key_value_heads=3 neither splits"),
    "odd-ffn-vocab": (dict(intermediate_size=161, vocab_size=385),
                      "intermediate_size=161 is not a multiple of 2; vocab_size=385 is not a multiple of 2"),
}


def prompt(vocab: int, batch: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, 7), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """({case: transformers model}, {case: inputs}, {case: [rank 0's record, rank 1's record]})."""
    root = tmp_path_factory.mktemp("tp")
    checkpoints = {}
    for i, (name, (overrides, sharded)) in enumerate(CHECKPOINTS.items()):
        checkpoints[name] = hf_model(seed=30 + i, **overrides)
        save(checkpoints[name], root / name, max_shard_size="100KB" if sharded else None)
        assert (root / name / "model.safetensors.index.json").exists() == sharded
    references, inputs, jobs = {}, {}, []
    for i, (name, (checkpoint, path)) in enumerate(CASES.items()):
        references[name] = checkpoints[checkpoint]
        inputs[name] = prompt(SMALL["vocab_size"], batch=1 if path == "fused" else 2, seed=i)
        jobs.append(dict(name=name, path=str(root / checkpoint), load=PATHS[path], ids=inputs[name], new=NEW_TOKENS,
                         sample=name == "gqa-bias"))
    for name, (overrides, _) in BAD_SPLITS.items():
        hf_config(**overrides).save_pretrained(root / name)  # config.json only: refused before any weight
        jobs.append(dict(name=name, path=str(root / name), load=PATHS["reference"]))
    run_ranks(cpu_jobs, jobs, root)
    ranks = [torch.load(root / f"rank{r}.pt") for r in range(2)]
    return references, inputs, {name: [rank[name] for rank in ranks] for name in ranks[0]}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_transformers_on_every_rank(two_ranks, case):
    references, inputs, records = two_ranks
    with torch.no_grad():
        expected = references[case](inputs[case]).logits
    for record in records[case]:
        torch.testing.assert_close(record["logits"], expected, rtol=LOGITS_FP32_RTOL, atol=LOGITS_FP32_ATOL)
    assert torch.equal(records[case][0]["logits"], records[case][1]["logits"])  # the same sums on both


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_equal_transformers_on_every_rank(two_ranks, case):
    references, inputs, records = two_ranks
    expected = references[case].generate(inputs[case], max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                         do_sample=False, pad_token_id=0)
    for record in records[case]:
        assert torch.equal(record["greedy"], expected)


def test_sampling_draws_the_same_tokens_on_every_rank(two_ranks):
    """With a seed, and without one (rank 0's seed is shared): each rank samples from the same logits."""
    _, inputs, records = two_ranks
    rank0, rank1 = records["gqa-bias"]
    for kind in ("seeded", "unseeded"):
        assert rank0[kind].shape == (2, 7 + NEW_TOKENS)
        assert torch.equal(rank0[kind], rank1[kind])
    assert not torch.equal(rank0["seeded"], rank0["greedy"])  # it did sample


@pytest.mark.parametrize("case", ["gqa-bias", "mqa-tied-sharded"])
def test_each_rank_holds_a_shard(two_ranks, case):
    """The ranks' parameters add up to the model plus what every rank holds whole: the norms, and
    in the MQA case the one key/value head; o_proj's bias lives on rank 0 only."""
    references, _, records = two_ranks
    reference = references[case]
    config = reference.config
    whole = sum(p.numel() for p in reference.parameters())  # tied weights counted once
    norms = sum(p.numel() for name, p in reference.named_parameters() if name.endswith("norm.weight"))
    replicated = norms
    if config.num_key_value_heads == 1:  # k_proj and v_proj (and their biases) on both ranks
        replicated += sum(p.numel() for name, p in reference.named_parameters() if "k_proj" in name or "v_proj" in name)
    held = [record["params"] for record in records[case]]
    assert sum(held) == whole + replicated
    assert max(held) < 0.6 * whole


@pytest.mark.parametrize("case", list(BAD_SPLITS))
def test_a_model_that_does_not_split_is_refused(two_ranks, case):
    _, _, records = two_ranks
    for record in records[case]:
        assert "cannot split this model over 2 tensor-parallel ranks" in record["error"]
        assert BAD_SPLITS[case][1] in record["error"]


def test_no_process_group_is_a_clear_error(tmp_path):
    save(hf_model(seed=40), tmp_path)
    with pytest.raises(ValueError, match="needs an initialized torch.distributed default process group"):
        Qwen3ForCausalLM.from_pretrained(tmp_path, progress=False, tensor_parallel=True)


def test_moe_is_refused_with_what_is_missing(tmp_path):
    transformers.Qwen3MoeConfig(**SMALL, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=32).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="Qwen3-MoE .* expert parallelism, which is not supported yet"):
        Qwen3ForCausalLM.from_pretrained(tmp_path, progress=False, tensor_parallel=True)


def test_torchrun_prints_what_one_process_prints(run_cli):
    """torchrun with two CPU processes (gloo) prints, from rank 0 only, the text one process prints."""
    args = ["--prompt", "def fibonacci(n):", "--temperature", "0", "--max-new-tokens", "12", "--device", "cpu"]
    single = run_cli(*args)
    split = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            "scripts/generate.py", *args, "--tensor-parallel"], capture_output=True, text=True,
                           timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT)
    assert single.returncode == 0, single.stderr
    assert split.returncode == 0, split.stderr
    assert single.stdout.strip()
    assert split.stdout == single.stdout
    assert split.stderr.count("decode steps at") == 1  # the timing line from rank 0 only
    assert "tensor parallel over 2 ranks" in split.stderr


def test_tensor_parallel_flag_outside_torchrun_is_refused(run_cli, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    result = run_cli("--prompt", "x", "--tensor-parallel")
    assert result.returncode == 2
    assert "--tensor-parallel" in result.stderr and "torchrun" in result.stderr


@pytest.mark.skipif(INTERPRETED or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs and TRITON_INTERPRET=0")
def test_cuda_graph_tp2_greedy_equals_tp1_greedy(tmp_path):
    """fp32, Triton norms (the fused decode path), decode steps replayed from CUDA graphs with the
    all-reduces inside (symmetric memory's where it sets up, and NCCL's): greedy tokens of the model
    split over two GPUs equal the whole model's on one GPU, on both ranks; at batch 1 (GEMV
    projections) and batch 3."""
    save(hf_model(seed=41, num_hidden_layers=3, attention_bias=True), tmp_path)
    prompts = [prompt(SMALL["vocab_size"], batch=1, seed=1), prompt(SMALL["vocab_size"], batch=3, seed=2)]
    run_ranks(gpu_greedy, str(tmp_path), prompts, 24, tmp_path, backend="nccl")
    for rank in range(2):
        record = torch.load(tmp_path / f"rank{rank}.pt")
        for tp1, tp2, tp2_nccl in zip(record["tp1"], record["tp2"], record["tp2_nccl"], strict=True):
            assert tp2.shape == tp1.shape
            assert torch.equal(tp2, tp1)
            assert torch.equal(tp2_nccl, tp1)
    print("symmetric-memory all-reduce:", "used" if record["symmetric"] else "unavailable, NCCL only")
