"""qwen3.model against transformers' own modules: layer by layer, then whole checkpoints end to end."""

import pytest
import torch
from checkpoints import hf_config, hf_model, save
from conftest import DEVICE, PATHS, requires_cuda
from tolerances import (
    LAYER_BF16_REL,
    LAYER_FP32_ATOL,
    LAYER_FP32_RTOL,
    LOGITS_BF16_REL,
    LOGITS_FP32_ATOL,
    LOGITS_FP32_RTOL,
    TRAINING_LOSS_RTOL,
    relative_error,
)
from transformers.models.qwen3 import modeling_qwen3 as hf

from qwen3 import Qwen3Config, Qwen3ForCausalLM
from qwen3 import model as ours
from qwen3.attention import Attention, token_batch
from qwen3.layers import MLP, RMSNorm, RotaryEmbedding
from runtime import metadata
from runtime.graphs import warm_up_on


def our_config(hf_cfg, path="reference") -> Qwen3Config:
    return Qwen3Config.from_dict(hf_cfg.to_dict(), **PATHS[path])


def hf_causal_mask(T: int, dtype) -> torch.Tensor:
    return torch.full((T, T), torch.finfo(dtype).min, dtype=dtype, device=DEVICE).triu(1)[None, None]


def assert_layer_close(actual, expected):
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=LAYER_FP32_RTOL, atol=LAYER_FP32_ATOL)
    else:
        assert relative_error(actual, expected) < LAYER_BF16_REL


def hidden(B=2, T=11, D=64, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, D, generator=gen).to(device=DEVICE, dtype=dtype)


def rows_batch(config: Qwen3Config, B: int, T: int, dtype, fused: bool):
    """The TokenBatch of B rows of T tokens from position 0 (the plain forward's), our layers' input."""
    positions = metadata.rows_positions(B, T, DEVICE)
    return token_batch(metadata.plain(B, T, DEVICE), positions, RotaryEmbedding(config), dtype, fused)


def hf_rotary(config: Qwen3Config, B: int, T: int, dtype):
    """transformers' layers' position_embeddings for rows from position 0, from our tables (equal:
    test_rotary_embedding)."""
    positions = torch.arange(T, device=DEVICE).expand(B, T)
    return RotaryEmbedding(config)(positions, dtype)


# ------------------------------------------------------------------------------ layer by layer


@pytest.mark.parametrize(
    "rope",
    [
        dict(rope_theta=10000.0),
        dict(rope_theta=1_000_000.0),
        dict(rope_theta=1_000_000.0, max_position_embeddings=4096,
             rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}),
    ],
    ids=["theta1e4", "theta1e6", "yarn"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_embedding(rope, dtype):
    cfg = hf_config(**rope)
    theirs = hf.Qwen3RotaryEmbedding(cfg).to(DEVICE)
    mine = RotaryEmbedding(our_config(cfg))
    positions = torch.tensor([[0, 1, 2, 500, 511], [7, 8, 9, 10, 11]], device=DEVICE)  # up to P - 1
    x = torch.empty(1, dtype=dtype, device=DEVICE)
    cos, sin = mine(positions, dtype)
    cos_hf, sin_hf = theirs(x, positions)
    assert torch.equal(cos, cos_hf) and torch.equal(sin, sin_hf)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 2), (4, 1), (4, 4)], ids=["gqa", "mqa", "mha"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_attention(dtype, heads, bias, fused):
    cfg = hf_config(num_attention_heads=heads[0], num_key_value_heads=heads[1], attention_bias=bias, head_dim=24)
    torch.manual_seed(1)
    theirs = hf.Qwen3Attention(cfg, layer_idx=0).to(DEVICE, dtype).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.1) if p.dim() > 1 or p.shape[0] != 24 else p.copy_(1 + 0.2 * torch.randn_like(p))
    config = our_config(cfg, "fused" if fused else "reference")
    mine = Attention(config, layer_idx=0).to(DEVICE, dtype)
    mine.load_state_dict(theirs.state_dict())  # q_proj, k_proj, v_proj stacked into qkv_proj
    x = hidden(dtype=dtype)
    B, T, D = x.shape
    with torch.no_grad():
        expected = theirs(x, hf_rotary(config, B, T, dtype), hf_causal_mask(T, dtype))[0]
        actual, _ = mine(x.view(B * T, D), rows_batch(config, B, T, dtype, fused))
    assert_layer_close(actual.view(B, T, D), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_mlp(dtype, fused):
    cfg = hf_config()
    torch.manual_seed(2)
    theirs = hf.Qwen3MLP(cfg).to(DEVICE, dtype)
    mine = MLP(our_config(cfg)).to(DEVICE, dtype)
    mine.load_state_dict(theirs.state_dict())  # gate_proj, up_proj stacked into gate_up_proj
    x = hidden(dtype=dtype)
    with torch.no_grad():
        assert_layer_close(mine(x.view(-1, x.shape[-1]), fused)[0].view(x.shape), theirs(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["reference", "fused"])
def test_decoder_layer(dtype, path):
    assert_decoder_layer_matches(hf_model(seed=3, dtype=dtype).to(DEVICE), dtype, path)


def assert_decoder_layer_matches(model, dtype: torch.dtype, path: str) -> ours.DecoderLayer:
    """Our DecoderLayer, loaded with the first layer of transformers' `model`, gives its output
    (ours: (h, residual), whose sum is HF's `residual + hidden_states`). Returns our layer."""
    theirs = model.model.layers[0]
    cfg = our_config(model.config, path)
    mine = ours.DecoderLayer(cfg, layer_idx=0).to(DEVICE, dtype)
    mine.load_state_dict(theirs.state_dict())
    x = hidden(dtype=dtype)
    B, T, D = x.shape
    with torch.no_grad():
        expected = theirs(x, attention_mask=hf_causal_mask(T, dtype), position_embeddings=hf_rotary(cfg, B, T, dtype))
        expected = expected[0] if isinstance(expected, tuple) else expected
        h, residual = mine(x.view(B * T, D), None, rows_batch(cfg, B, T, dtype, fused=path == "fused"))
    assert_layer_close((h + residual).view(B, T, D), expected)
    return mine


# ------------------------------------------------------------------------------ end to end

E2E_CASES = {
    "untied-gqa": dict(),
    "tied": dict(tie_word_embeddings=True),
    "mqa-bias": dict(num_key_value_heads=1, attention_bias=True),
    "mha-headdim-unrelated": dict(num_key_value_heads=4, head_dim=40, rope_theta=1_000_000.0),
    "eps-1e-5-theta-5e5": dict(rms_norm_eps=1e-5, rope_theta=500_000.0, num_hidden_layers=3),
}


def input_ids(vocab: int, B: int = 2, T: int = 13, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


@pytest.mark.parametrize("case", list(E2E_CASES))
@pytest.mark.parametrize("path", ["reference", "fused"])
@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_logits_match_transformers(tmp_path, case, path, sharded):
    reference = hf_model(seed=4, **E2E_CASES[case])
    save(reference, tmp_path, max_shard_size="100KB" if sharded else None)
    assert (tmp_path / "model.safetensors.index.json").exists() == sharded
    model = Qwen3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, device=DEVICE,
                                             **PATHS[path], progress=False)
    ids = input_ids(reference.config.vocab_size)
    with torch.no_grad():
        expected = reference.to(DEVICE)(ids).logits
        actual = model(ids)
    torch.testing.assert_close(actual, expected, rtol=LOGITS_FP32_RTOL, atol=LOGITS_FP32_ATOL)


@pytest.mark.parametrize("path", ["reference", "fused"])
def test_a_batch_of_single_tokens_matches_transformers(tmp_path, path):
    """The plain call with B rows of one token each: its default positions are a stride-0 view
    ([0] expanded to B rows), which the kernels must not index past."""
    reference = hf_model(seed=4)
    save(reference, tmp_path)
    model = Qwen3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, device=DEVICE, **PATHS[path],
                                             progress=False)
    ids = input_ids(reference.config.vocab_size, B=3, T=1)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference.to(DEVICE)(ids).logits, rtol=LOGITS_FP32_RTOL,
                                   atol=LOGITS_FP32_ATOL)


def test_no_tokens_give_no_logits(tmp_path):
    """Rows of no token, or no rows: logits of that shape (transformers raises from inside its
    attention: a reshape of 0 elements), empty in, empty out."""
    reference = hf_model(seed=4)
    save(reference, tmp_path)
    model = Qwen3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, device=DEVICE, progress=False)
    V = reference.config.vocab_size
    for B, T in ((1, 0), (0, 3)):
        with torch.no_grad():
            assert model(torch.zeros(B, T, dtype=torch.long, device=DEVICE)).shape == (B, T, V)


def test_bf16_logits_close_to_transformers_bf16(tmp_path):
    """Both in bf16: same casts, different matmul/attention kernels (SDPA vs eager)."""
    reference = hf_model(seed=5, dtype=torch.bfloat16)
    save(reference, tmp_path)
    model = Qwen3ForCausalLM.from_pretrained(tmp_path, dtype="auto", device=DEVICE, progress=False)
    assert model.lm_head.weight.dtype == torch.bfloat16  # the checkpoint's dtype, with dtype="auto"
    ids = input_ids(reference.config.vocab_size, T=32)
    with torch.no_grad():
        expected = reference.to(DEVICE)(ids).logits.float()
        actual = model(ids).float()
    assert relative_error(actual, expected) < LOGITS_BF16_REL
    assert (actual.argmax(-1) == expected.argmax(-1)).float().mean() > 0.95


QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                 rope_theta=1_000_000.0, tie_word_embeddings=True)
QWEN3_8B = dict(QWEN3_0_6B, vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, tie_word_embeddings=False)


@pytest.mark.parametrize("real", [QWEN3_0_6B, QWEN3_8B], ids=["qwen3-0.6b", "qwen3-8b"])
def test_real_configs_hold_transformers_tensors(real):
    """At the real Qwen3-0.6B and 8B configs (built on the meta device: shapes, no memory), the
    checkpoint keys and shapes our model fills are transformers' (a tied LM head is the embedding,
    so it is not a key of its own)."""
    with torch.device("meta"):
        theirs = hf.Qwen3ForCausalLM(hf_config(**real))
        mine = Qwen3ForCausalLM(our_config(hf_config(**real)))
    expected = {k: tuple(v.shape) for k, v in theirs.state_dict().items()
                if not (real["tie_word_embeddings"] and k == "lm_head.weight")}
    assert {k: tuple(v.shape) for k, v in mine.checkpoint_tensors().items()} == expected


def test_real_layer_dims_match_transformers(tmp_path):
    """Two layers at Qwen3-0.6B's widths (16 x 128 query heads over a 1024 hidden: head_dim is not
    hidden / heads), tied embeddings, a small vocabulary, transformers' own init, fp32: the logits."""
    dims = dict(QWEN3_0_6B, vocab_size=4096, num_hidden_layers=2)
    torch.manual_seed(6)
    reference = hf.Qwen3ForCausalLM(hf_config(**dims)).eval()
    save(reference, tmp_path)
    model = Qwen3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, norm_impl="torch", progress=False)
    ids = input_ids(dims["vocab_size"], B=1, T=24)
    with torch.no_grad():
        expected = reference(ids.cpu()).logits
        actual = model(ids.cpu())
    torch.testing.assert_close(actual, expected, rtol=LOGITS_FP32_RTOL, atol=LOGITS_FP32_ATOL)


def kernels_run(fn) -> set[str]:
    """Names of this project's custom ops (qwen3_ops::...) that fn() calls, from the profiler."""
    with torch.profiler.profile() as prof:
        fn()
    return {event.name for event in prof.events() if event.name.startswith("qwen3_ops::")}


def test_norm_switch_and_kernels_switch_change_the_kernels_not_the_logits(tmp_path):
    """norm_impl swaps every norm module's implementation (the torch reference, or Triton's norm
    ops) and nothing else; kernels swaps transformers' operations for the fused Triton kernels
    (q/k-norm + RoPE, SiLU-and-multiply: a batch of 13 tokens takes no GEMV). The logits stay."""
    reference = hf_model(seed=7)
    save(reference, tmp_path)
    model = Qwen3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, device=DEVICE,
                                             norm_impl="torch", kernels="reference", progress=False)
    ids = input_ids(reference.config.vocab_size)
    norm_ops = {"qwen3_ops::rms_norm", "qwen3_ops::fused_add_rms_norm"}
    with torch.no_grad():
        with_torch = model(ids)
        assert kernels_run(lambda: model(ids)) == set()
        model.set_norm_impl("triton")
        with_triton_norms = model(ids)
        assert kernels_run(lambda: model(ids)) == norm_ops
        model.set_norm_impl("torch")
        model.set_kernels("fused")
        fused = model(ids)
        assert {"qwen3_ops::qk_norm_rope", "qwen3_ops::silu_mul"} <= kernels_run(lambda: model(ids))
    for logits in (with_triton_norms, fused):
        torch.testing.assert_close(logits, with_torch, rtol=LOGITS_FP32_RTOL, atol=LOGITS_FP32_ATOL)
    with pytest.raises(ValueError, match="norm_impl must be one of"):
        model.set_norm_impl("fastest")
    with pytest.raises(ValueError, match="kernels must be one of"):
        model.set_kernels("fastest")


def test_yarn_checkpoint_loads_and_matches_transformers_past_the_original_context(tmp_path):
    """Qwen3's documented way to 128k tokens: YaRN rope scaling in config.json, saved by
    transformers, loaded by from_pretrained, compared at positions past
    original_max_position_embeddings."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    reference = hf_model(seed=8, max_position_embeddings=256, rope_scaling=yarn)
    save(reference, tmp_path)
    model = Qwen3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, device=DEVICE, progress=False)
    assert model.config.rope_scaling["rope_type"] == "yarn"
    ids = input_ids(reference.config.vocab_size, B=1, T=150)
    with torch.no_grad():
        expected = reference.to(DEVICE)(ids).logits
        actual = model(ids)
    torch.testing.assert_close(actual, expected, rtol=LOGITS_FP32_RTOL, atol=LOGITS_FP32_ATOL)


def test_forward_refuses_bad_input(tmp_path):
    model = Qwen3ForCausalLM(Qwen3Config.from_dict(hf_config().to_dict(), max_position_embeddings=16))
    with pytest.raises(TypeError, match="LongTensor"):
        model(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="exceed max_position_embeddings=16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    vocab = model.config.vocab_size
    for bad in (vocab, -1):  # not the embedding's IndexError (on CUDA, a device-side assert)
        with pytest.raises(ValueError, match=rf"input_ids must be token ids in \[0, {vocab}\), got ids from "):
            model(torch.tensor([[1, bad, 2]]))


def test_training_steps_give_the_same_losses_with_either_norm():
    """A few AdamW steps through the whole decoder: triton forward + backward kernels (fused add
    included) against the torch reference norm, from identical weights and batches."""
    config = Qwen3Config.from_dict(hf_config().to_dict())
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, config.vocab_size, (2, 17), generator=gen).to(DEVICE)] * 5  # fit one batch
    torch.manual_seed(0)
    initial = {k: v.clone() for k, v in Qwen3ForCausalLM(config).state_dict().items()}
    losses = {}
    for impl in ("torch", "triton"):
        model = Qwen3ForCausalLM(config).to(DEVICE)
        model.load_state_dict(initial)
        model.set_norm_impl(impl)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses[impl] = []
        for ids in batches:
            logits = model(ids[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[impl].append(loss.item())
    assert losses["triton"] == pytest.approx(losses["torch"], rel=TRAINING_LOSS_RTOL)
    assert losses["torch"][-1] < losses["torch"][0]  # it is training


# ------------------------------------------------------------------ torch.compile and CUDA graphs


def triton_decoder(dtype: torch.dtype = torch.float32) -> Qwen3ForCausalLM:
    """A small decoder on the triton norms, its norm weights moved off ones (a weight applied
    wrongly would hide behind ones)."""
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(our_config(hf_config(), "fused"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.2 * torch.randn_like(param))
    return model.to(device=DEVICE, dtype=dtype)


def test_whole_decoder_compiles_to_one_graph_with_triton_norms():
    """torch.compile(fullgraph=True) of the whole decoder on norm_impl="triton": one graph, no
    break (every norm is one custom-op node, its backward another), and the compiled logits and
    gradients equal eager ones."""
    model = triton_decoder()
    ids = input_ids(model.config.vocab_size)
    explanation = torch._dynamo.explain(model)(ids)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    norm_ops = {torch.ops.qwen3_ops.rms_norm.default, torch.ops.qwen3_ops.fused_add_rms_norm.default}
    # Each norm is an autograd Function: the op node lies in the Function's forward subgraph.
    graphs = [m.graph for m in explanation.graphs[0].modules() if isinstance(m, torch.fx.GraphModule)]
    nodes = [n for graph in graphs for n in graph.nodes if n.target in norm_ops]
    assert len(nodes) == sum(isinstance(m, RMSNorm) for m in model.modules())  # one node per norm
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")

    def logits_and_grads(forward):
        model.zero_grad(set_to_none=True)
        logits = forward(ids)
        logits.logsumexp(-1).mean().backward()
        return [logits.detach()] + [p.grad for p in model.parameters()]

    for actual, expected in zip(logits_and_grads(compiled), logits_and_grads(model), strict=True):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)


@requires_cuda
def test_cuda_graph_captures_the_whole_decoder_with_triton_norms():
    """The decoder's forward captured once in a CUDA graph (every norm launched from the cached
    path) and replayed on new token ids: the logits equal an eager forward's on the same ids."""
    model = triton_decoder(torch.bfloat16)
    static_ids = input_ids(model.config.vocab_size)
    with torch.no_grad():
        stream = torch.cuda.Stream()  # warmed and captured on one stream (runtime/graphs.py)
        warm_up_on(stream, lambda: model(static_ids))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            static_logits = model(static_ids)
        for seed in (1, 2):
            static_ids.copy_(input_ids(model.config.vocab_size, seed=seed))
            graph.replay()
            assert torch.equal(static_logits, model(static_ids))
