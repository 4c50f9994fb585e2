"""Qwen3-MoE against transformers' own modules: the fused-MoE kernel, the sparse block, a decoder
layer, whole checkpoints (logits and greedy generation), and the loader's strictness on experts."""

import json

import pytest
import torch
import transformers
from checkpoints import SMALL, save, spread_weights
from conftest import DEVICE, INTERPRETED, PATHS, requires_cuda, use_path
from safetensors.torch import load_file, save_file
from test_model import assert_decoder_layer_matches, assert_layer_close, hidden, input_ids, kernels_run
from tolerances import LAYER_FP32_ATOL, LAYER_FP32_RTOL, LOGITS_FP32_ATOL, LOGITS_FP32_RTOL
from transformers.models.qwen3_moe import modeling_qwen3_moe as hf

from ops.moe.fused_moe import down_combine_config, fused_moe, fused_moe_reference, pair_config, routing_plan
from ops.moe.moe_route import moe_route
from qwen3 import Qwen3Config, Qwen3ForCausalLM
from qwen3.moe import SparseMoeBlock

SMALL_MOE = dict(
    SMALL,  # the dense tests' model, with experts
    intermediate_size=96,  # the dense layers' (mlp_only_layers, decoder_sparse_step)
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
)


def hf_moe_config(**overrides) -> transformers.Qwen3MoeConfig:
    config = transformers.Qwen3MoeConfig(**{**SMALL_MOE, **overrides})
    config._attn_implementation = "eager"
    return config


def hf_moe_model(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> transformers.Qwen3MoeForCausalLM:
    """A seeded transformers Qwen3-MoE with spread weights (checkpoints.spread_weights)."""
    torch.manual_seed(seed)
    return spread_weights(transformers.Qwen3MoeForCausalLM(hf_moe_config(**overrides))).to(dtype).eval()


def our_config(hf_cfg, path="reference") -> Qwen3Config:
    return Qwen3Config.from_dict(hf_cfg.to_dict(), **PATHS[path])


# ------------------------------------------------------------------------------ the kernel alone


def random_routing(N, k, E, dtype, seed, unused=()):
    """ids [N, k] (distinct per row, never an expert in `unused`) and weights [N, k]."""
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(E) if e not in unused])
    ids = torch.stack([allowed[torch.randperm(len(allowed), generator=gen)[:k]] for _ in range(N)])
    return ids.to(DEVICE), torch.rand(N, k, generator=gen).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "N, k, E, D, I",
    # sorted tiles (more than PAIR_PATH_MAX_PAIRS pairs): prefill-like, top-1 with odd widths;
    # one program row per pair: a decode step at batch 1 and at batch 8
    [(33, 2, 8, 64, 32), (70, 1, 4, 40, 24), (1, 8, 16, 64, 48), (8, 4, 16, 72, 40), (5, 3, 8, 48, 40)],
    ids=["prefill", "top1-odd", "decode", "decode-batch8", "decode-top3"],
)
def test_fused_moe_kernel_matches_the_torch_reference(dtype, N, k, E, D, I):  # noqa: E741
    """Random routing that leaves some experts without tokens. The kernel rounds where the reference
    does, so results differ only by the order of each dot product's fp32 sum: a few fp32 ulps, or
    in bf16 an occasional step where that sum lies at a rounding boundary. In the CPU interpreter
    (exact fp32 products, as torch's CPU bf16 matmul) these cases come out bit-identical."""
    gen = torch.Generator().manual_seed(N)
    x = torch.randn(N, D, generator=gen).to(DEVICE, dtype)
    w13 = (0.1 * torch.randn(E, 2 * I, D, generator=gen)).to(DEVICE, dtype)
    w2 = (0.1 * torch.randn(E, D, I, generator=gen)).to(DEVICE, dtype)
    ids, weights = random_routing(N, k, E, dtype, seed=N, unused=(0, E - 1))
    expected = fused_moe_reference(x, w13, w2, weights, ids)
    actual = fused_moe(x, w13, w2, weights, ids)
    assert_layer_close(actual, expected)
    if dtype == torch.bfloat16 and INTERPRETED:
        assert torch.equal(actual, expected)


def test_pair_kernel_launch_rules():
    """Qwen3-30B-A3B's decode launches (hidden 2048, I 768, top-8): 8 rows or columns a program; a
    test model's short rows fill a tile of the same size with more of them."""
    assert pair_config(2048, 768) == (8, 512) and down_combine_config(768, 8, 2048) == (8, 128, 8)
    assert pair_config(4096, 1536) == (8, 512) and down_combine_config(1536, 8, 4096) == (8, 128, 8)  # 235B-A22B
    assert pair_config(64, 32) == (32, 64) and down_combine_config(32, 2, 64) == (64, 32, 8)


def test_routing_plan_tiles_every_pair_once():
    N, k, E, block_m = 37, 2, 8, 16
    ids, _ = random_routing(N, k, E, torch.float32, seed=3, unused=(2,))
    order, tile_expert, row0, row_end = routing_plan(ids, E, block_m)
    seen = []
    for t in range(tile_expert.numel()):
        if tile_expert[t] == E:  # the grid's spare tiles
            assert t == tile_expert.numel() - 1 or tile_expert[t + 1] == E
            continue
        assert 0 < row_end[t] - row0[t] <= block_m
        rows = order[row0[t]:row_end[t]].long()
        assert (ids.reshape(-1)[rows] == tile_expert[t]).all()  # a tile holds one expert's pairs
        seen += rows.tolist()
    assert sorted(seen) == list(range(N * k))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k, norm", [(8, True), (2, False), (1, True)])
def test_routing_kernel_matches_the_transformers_router(dtype, top_k, norm):
    """ops/moe/moe_route.py against transformers' Qwen3MoeTopKRouter on the same logits: experts of
    the same logits in the same order (the same experts where no two logits tie: always in fp32;
    bf16 logits tie often, and torch orders ties as it likes), weights equal up to the fp32
    softmax's last bits (the exp and the sum's order differ), one rounding step of bf16 at most."""
    config = hf_moe_config(num_experts=40, num_experts_per_tok=top_k, norm_topk_prob=norm)
    router = hf.Qwen3MoeTopKRouter(config)
    torch.nn.init.normal_(router.weight, std=0.5, generator=torch.Generator().manual_seed(top_k))
    router = router.to(DEVICE, dtype)
    x = hidden(dtype=dtype).reshape(-1, config.hidden_size)
    with torch.no_grad():
        logits, expected_weights, expected_ids = router(x)
        weights, ids = moe_route(logits, top_k, norm)
    assert torch.equal(logits.gather(1, ids), logits.gather(1, expected_ids))
    if dtype == torch.float32 or DEVICE.type == "cpu":  # no ties, or ties in torch's CPU order
        assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, rtol=2 ** -7 if dtype == torch.bfloat16 else 1e-6, atol=0)


def test_routing_kernel_never_picks_past_the_last_expert():
    """E = 40 is not a power of two: the kernel's lanes 40-63 hold no expert. Experts whose
    probability underflows to 0 must still win over them."""
    logits = torch.full((1, 40), -200.0)
    logits[0, 0] = 0.0
    weights, ids = moe_route(logits.to(DEVICE), 3, False)
    assert ids.max() < 40 and ids[0, 0] == 0 and torch.equal(weights[0, 1:].cpu(), torch.zeros(2))


def test_sparse_block_trains_its_experts_behind_a_frozen_input():
    """Only the experts and router require grad (a frozen backbone: the block's input does not):
    the block must take the differentiable path, on CUDA too, and give them gradients."""
    block = SparseMoeBlock(our_config(hf_moe_config())).to(DEVICE)
    x = torch.randn(1, 3, 64, device=DEVICE)
    block(x.view(3, 64))[0].square().sum().backward()
    assert block.gate.weight.grad is not None and block.experts.gate_up_proj.grad is not None


def test_decode_routing_needs_no_host_sync():
    """Routing and the tile plan compile into one graph with fullgraph=True: nothing reads a
    tensor's value back to the host (.item(), nonzero, a data-dependent shape would break it)."""
    block = SparseMoeBlock(our_config(hf_moe_config(num_experts_per_tok=8, num_experts=16))).to(DEVICE)

    def plan(x):
        weights, ids = block.route(x)
        return weights, routing_plan(ids, 16, 16)

    x = torch.randn(1, 64, device=DEVICE)
    with torch.no_grad():
        compiled = torch.compile(plan, fullgraph=True, backend="eager", dynamic=False)
        for actual, expected in zip(torch.utils._pytree.tree_leaves(compiled(x)),
                                    torch.utils._pytree.tree_leaves(plan(x))):
            assert torch.equal(actual, expected)


@requires_cuda
def test_fused_sparse_block_does_not_sync_the_host_at_batch_1():
    block = SparseMoeBlock(our_config(hf_moe_config(num_experts_per_tok=8, num_experts=16))).to(DEVICE)
    x = torch.randn(1, 1, 64, device=DEVICE)
    with torch.no_grad():
        block(x.view(1, 64), fused=True)  # compile first
        torch.cuda.set_sync_debug_mode("error")
        try:
            block(x.view(1, 64), fused=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")


# ------------------------------------------------------------------------------ layer by layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("routing", [dict(norm_topk_prob=True), dict(norm_topk_prob=False),
                                     dict(num_experts_per_tok=1)], ids=["top2-norm", "top2", "top1"])
def test_sparse_block(dtype, fused, routing):
    model = hf_moe_model(seed=2, dtype=dtype, **routing).to(DEVICE)
    theirs = model.model.layers[0].mlp
    assert isinstance(theirs, hf.Qwen3MoeSparseMoeBlock)
    mine = SparseMoeBlock(our_config(model.config)).to(DEVICE, dtype)
    mine.load_state_dict(theirs.state_dict())  # transformers' stacked experts: the same layout
    x = hidden(dtype=dtype)
    with torch.no_grad():
        expected = theirs(x)
        actual = mine(x.view(-1, x.shape[-1]), fused)[0].view(x.shape)
    assert_layer_close(actual, expected)
    if not fused and dtype == torch.bfloat16:  # the same operations in the same order
        assert torch.equal(actual, expected)


def test_sparse_block_gradients_match_transformers():
    """The unfused path is the training path: gradients of the input, the router and the stacked
    experts equal those of transformers' block (fp32)."""
    model = hf_moe_model(seed=10).to(DEVICE)
    theirs = model.model.layers[0].mlp
    mine = SparseMoeBlock(our_config(model.config)).to(DEVICE)
    mine.load_state_dict(theirs.state_dict())
    probe = hidden(seed=1)
    grads = []
    for block, fused in ((theirs, None), (mine, False)):
        x = hidden().requires_grad_()
        out = block(x) if fused is None else block(x.view(-1, x.shape[-1]), fused)[0].view(x.shape)
        (out * probe).sum().backward()
        grads.append([x.grad] + [block.get_parameter(name).grad for name in
                                 ("gate.weight", "experts.gate_up_proj", "experts.down_proj")])
    for actual, expected in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(actual, expected, rtol=LAYER_FP32_RTOL, atol=LAYER_FP32_ATOL)


def test_sparse_block_loads_a_checkpoint_layout_state_dict(tmp_path):
    """A state dict with one tensor per expert (the hub's layout) loads through the pre-hook."""
    model = hf_moe_model(seed=3, num_hidden_layers=1)
    save(model, tmp_path)
    prefix = "model.layers.0.mlp."
    block = {k[len(prefix):]: v for k, v in load_file(tmp_path / "model.safetensors").items() if k.startswith(prefix)}
    assert "experts.7.up_proj.weight" in block and "experts.gate_up_proj" not in block
    mine = SparseMoeBlock(our_config(model.config))
    mine.load_state_dict(block)
    for name, param in model.model.layers[0].mlp.state_dict().items():
        assert torch.equal(mine.state_dict()[name], param), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["reference", "fused"])
def test_decoder_layer(dtype, path):
    mine = assert_decoder_layer_matches(hf_moe_model(seed=4, dtype=dtype).to(DEVICE), dtype, path)
    assert isinstance(mine.mlp, SparseMoeBlock)


# ------------------------------------------------------------------------------ end to end

E2E_CASES = {
    "top1": dict(num_experts_per_tok=1),
    "top2-norm": dict(),
    "top2-no-norm": dict(norm_topk_prob=False),
    "mlp-only-layers": dict(num_hidden_layers=3, mlp_only_layers=[0, 2]),
    "sparse-step-2-tied": dict(num_hidden_layers=3, decoder_sparse_step=2, tie_word_embeddings=True),
}


@pytest.mark.parametrize("case", list(E2E_CASES))
@pytest.mark.parametrize("path", ["reference", "fused"])
def test_logits_match_transformers(tmp_path, case, path):
    reference = hf_moe_model(seed=5, **E2E_CASES[case])
    save(reference, tmp_path)
    model = Qwen3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, device=DEVICE,
                                             **PATHS[path], progress=False)
    sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers]
    assert sparse == [isinstance(layer.mlp, hf.Qwen3MoeSparseMoeBlock) for layer in reference.model.layers]
    ids = input_ids(reference.config.vocab_size)
    with torch.no_grad():
        expected = reference.to(DEVICE)(ids).logits
        actual = model(ids)
    torch.testing.assert_close(actual, expected, rtol=LOGITS_FP32_RTOL, atol=LOGITS_FP32_ATOL)


def test_which_path_runs_the_fused_moe_kernel():
    """The sparse block runs the Triton kernel on the fused path (triton norms, no autograd: so the
    triton cases above test it), and on CUDA whenever no gradient is needed (the torch loop syncs
    the host, which a CUDA graph cannot capture); the torch loop otherwise."""
    model = Qwen3ForCausalLM(our_config(hf_moe_config(num_hidden_layers=1))).to(DEVICE)
    ids = input_ids(model.config.vocab_size, B=1, T=4)
    with torch.no_grad():
        assert ("qwen3_ops::fused_moe" in kernels_run(lambda: model(ids))) == (DEVICE.type == "cuda")
        use_path(model, "fused")
        assert "qwen3_ops::fused_moe" in kernels_run(lambda: model(ids))
    assert "qwen3_ops::fused_moe" not in kernels_run(lambda: model(ids))  # autograd: the torch loop


def test_sharded_checkpoint_with_hub_config_names(tmp_path):
    """Sharded (experts of one layer split across files), and config.json in the hub's spelling
    (num_experts, as Qwen3-30B-A3B's says, where transformers 5 writes num_local_experts)."""
    reference = hf_moe_model(seed=6)
    save(reference, tmp_path, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["num_experts"] = raw.pop("num_local_experts")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    model = Qwen3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, device=DEVICE, progress=False)
    assert model.config.num_experts == 8
    ids = input_ids(reference.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference.to(DEVICE)(ids).logits,
                                   rtol=LOGITS_FP32_RTOL, atol=LOGITS_FP32_ATOL)


@pytest.fixture(scope="module")
def generation_models(tmp_path_factory):
    reference = hf_moe_model(seed=7, num_hidden_layers=3, mlp_only_layers=[1]).to(DEVICE)
    path = save(reference, tmp_path_factory.mktemp("moe-gen"))
    return reference, Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32, device=DEVICE, progress=False)


@pytest.mark.parametrize("path", ["reference", "fused"])
def test_greedy_generation_equals_transformers(generation_models, path):
    """A left-padded batch of two prompts, 20 new tokens, KV cache; on triton the decode steps run
    the fused path (Triton attention, the fused-MoE kernel), 8 tokens through the interpreter."""
    reference, model = generation_models
    gen = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 384, (n,), generator=gen).tolist() for n in (7, 3)]
    ids = torch.tensor([[0] * (7 - len(r)) + r for r in rows], device=DEVICE)
    mask = torch.tensor([[0] * (7 - len(r)) + [1] * len(r) for r in rows], device=DEVICE)
    n = 8 if path == "fused" and INTERPRETED else 20  # the interpreter runs a program at a time
    expected = reference.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, pad_token_id=0)
    use_path(model, path)
    try:
        actual = model.generate(ids, attention_mask=mask, max_new_tokens=n, temperature=0.0)
    finally:
        use_path(model, None)
    assert torch.equal(actual, expected)


@requires_cuda
def test_cuda_graph_decoding_equals_transformers(generation_models):
    """Decode steps replayed from a CUDA graph (the fused-MoE kernel's routing plan inside it)."""
    reference, model = generation_models
    ids = torch.randint(0, 384, (1, 9), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    expected = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, min_new_tokens=20,
                                  do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, max_new_tokens=20, temperature=0.0, cuda_graph=True), expected)


# ------------------------------------------------------------------------------ loading


def edit_checkpoint(path, drop=None, reshape=None):
    tensors = load_file(path / "model.safetensors")
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = tensors[reshape][:-1]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_or_misshaped_expert_tensor_is_named(tmp_path):
    save(hf_moe_model(seed=8, num_hidden_layers=1), tmp_path)
    edit_checkpoint(tmp_path, reshape="model.layers.0.mlp.experts.5.up_proj.weight")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.5\.up_proj\.weight .* has shape "
                                         r"\(31, 64\), expected \(32, 64\)"):
        Qwen3ForCausalLM.from_pretrained(tmp_path, progress=False)
    edit_checkpoint(tmp_path, drop="model.layers.0.mlp.experts.5.up_proj.weight")
    with pytest.raises(ValueError, match=r"missing tensor\(s\): model\.layers\.0\.mlp\.experts\.5\.up_proj\.weight"):
        Qwen3ForCausalLM.from_pretrained(tmp_path, progress=False)


def test_checkpoint_tensors_round_trip_to_the_hub_layout(tmp_path):
    """checkpoint_tensors() saved is the checkpoint transformers wrote (keys, shapes, values)."""
    save(hf_moe_model(seed=9), tmp_path)
    written = load_file(tmp_path / "model.safetensors")
    model = Qwen3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, progress=False)
    ours_ = model.checkpoint_tensors()
    assert set(ours_) == set(written)
    for key, tensor in written.items():
        assert torch.equal(ours_[key], tensor), key


def test_moe_config_fields_and_refusals():
    cfg = Qwen3Config.from_dict(hf_moe_config(mlp_only_layers=[1], decoder_sparse_step=1).to_dict())
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob,
            cfg.mlp_only_layers) == (8, 2, 32, True, [1])
    with pytest.raises(ValueError, match=r"num_experts_per_tok must be in \[1, num_experts=8\], got 9"):
        Qwen3Config.from_dict(hf_moe_config().to_dict(), num_experts_per_tok=9)
    raw = {**hf_moe_config().to_dict(), "architectures": ["Qwen3ForCausalLM"]}  # a dense class with qwen3_moe
    with pytest.raises(ValueError, match="unsupported model"):
        Qwen3Config.from_dict(raw)
