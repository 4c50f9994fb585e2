"""The decode step's Triton kernels (ops/attention/qk_norm_rope.py, decode_attention.py, silu_mul.py, gemv.py,
skinny_gemm.py) against transformers' own modules and functions (Qwen3RMSNorm, apply_rotary_pos_emb,
eager attention, SiLU, Qwen3MLP) and torch's nn.Linear."""

from types import SimpleNamespace

import pytest
import torch
from checkpoints import hf_config
from conftest import DEVICE
from tolerances import LAYER_BF16_REL, LAYER_FP32_ATOL, LAYER_FP32_RTOL, relative_error
from transformers.activations import ACT2FN
from transformers.models.qwen3 import modeling_qwen3 as hf

from ops.attention.decode_attention import (
    MAX_SPLITS,
    decode_attention,
    keys_per_step,
    num_splits,
    shared_memory_per_program,
)
from ops.attention.qk_norm_rope import qk_norm_rope
from ops.linear.gemv import MIN_TILE, GemvLaunch, gemv, gemv_config, gemv_rms_norm
from ops.linear.silu_mul import silu_mul
from ops.linear.skinny_gemm import skinny_linear
from qwen3.config import Qwen3Config
from qwen3.model import RotaryEmbedding


def assert_close(actual, expected):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=LAYER_FP32_RTOL, atol=LAYER_FP32_ATOL)
    else:
        assert relative_error(actual, expected) < LAYER_BF16_REL


def randn(*shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


HEADS = {"gqa": (4, 2, 32), "mqa-hd24": (4, 1, 24), "mha-hd128": (2, 2, 128)}
FP32, BF16 = torch.float32, torch.bfloat16
# A decode step's tokens (a program per head) in every head layout and dtype; a prefill's (over 256
# tokens: several heads a program) in the odd head size in both dtypes and the others in bf16.
QK_NORM_ROPE_CASES = [(dtype, name, 7) for name in HEADS for dtype in (FP32, BF16)] + [
    (FP32, "mqa-hd24", 300), (BF16, "mqa-hd24", 300), (BF16, "gqa", 300), (BF16, "mha-hd128", 300)]


@pytest.mark.parametrize("dtype, heads, N", [(dtype, HEADS[name], N) for dtype, name, N in QK_NORM_ROPE_CASES],
                         ids=[f"{'decode' if N == 7 else 'prefill'}-{name}-{str(dtype)[6:]}"
                              for dtype, name, N in QK_NORM_ROPE_CASES])
def test_qk_norm_rope_equals_transformers_and_writes_the_cache(dtype, heads, N):
    H, K, hd = heads
    cfg = hf_config(num_attention_heads=H, num_key_value_heads=K, head_dim=hd, rope_theta=1_000_000.0)
    eps = cfg.rms_norm_eps
    qkv = randn(N, (H + 2 * K) * hd, dtype=dtype, seed=0)
    q_norm, k_norm = hf.Qwen3RMSNorm(hd, eps).to(DEVICE, dtype), hf.Qwen3RMSNorm(hd, eps).to(DEVICE, dtype)
    with torch.no_grad():
        q_norm.weight.copy_(1 + 0.2 * randn(hd, dtype=dtype, seed=1))
        k_norm.weight.copy_(1 + 0.2 * randn(hd, dtype=dtype, seed=2))
    gen = torch.Generator().manual_seed(N)
    positions = torch.cat([torch.tensor([0, 511]), torch.randint(0, 512, (N - 2,), generator=gen)]).to(DEVICE)
    rotary = RotaryEmbedding(Qwen3Config.from_dict(cfg.to_dict()))
    cos_table, sin_table = rotary.tables(DEVICE)
    n_slots = N + 13
    k_cache = torch.zeros(n_slots, K, hd, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(n_slots, generator=gen)[:N].to(DEVICE)
    with torch.no_grad():
        q, k = qk_norm_rope(qkv, q_norm.weight, k_norm.weight, cos_table, sin_table, positions, eps, H, K,
                            k_cache, v_cache, slots)
        q_hf, k_hf, v_hf = qkv.split([H * hd, K * hd, K * hd], dim=-1)
        cos, sin = hf.Qwen3RotaryEmbedding(cfg).to(DEVICE)(qkv, positions[None])  # [1, N, hd] in dtype
        q_hf = q_norm(q_hf.view(1, N, H, hd)).transpose(1, 2)  # [1, H, N, hd], as HF's attention holds it
        k_hf = k_norm(k_hf.view(1, N, K, hd)).transpose(1, 2)
        q_hf, k_hf = hf.apply_rotary_pos_emb(q_hf, k_hf, cos, sin)
    assert_close(q, q_hf[0].transpose(0, 1))
    assert_close(k, k_hf[0].transpose(0, 1))
    assert torch.equal(k_cache[slots], k)  # the cache holds exactly what was returned
    assert torch.equal(v_cache[slots], v_hf.view(N, K, hd))
    untouched = torch.ones(n_slots, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


def test_qk_norm_rope_without_a_cache_and_bad_shapes():
    H, K, hd = 2, 1, 16
    qkv = randn(3, (H + 2 * K) * hd, dtype=torch.float32, seed=0)
    w = torch.ones(hd, device=DEVICE)
    cos = sin = torch.zeros(8, hd // 2, device=DEVICE)
    positions = torch.zeros(3, dtype=torch.long, device=DEVICE)
    q, k = qk_norm_rope(qkv, w, w, cos, sin, positions, 1e-6, H, K)
    assert q.shape == (3, H, hd) and k.shape == (3, K, hd)
    # positions of stride 0 (one position expanded over the tokens) read as the tokens' own
    cos, sin = torch.rand(8, hd // 2, device=DEVICE), torch.rand(8, hd // 2, device=DEVICE)
    expanded = torch.tensor([5], device=DEVICE).expand(3)
    assert torch.equal(qk_norm_rope(qkv, w, w, cos, sin, expanded, 1e-6, H, K)[0],
                       qk_norm_rope(qkv, w, w, cos, sin, expanded.clone(), 1e-6, H, K)[0])
    with pytest.raises(ValueError, match="qkv must be"):
        qk_norm_rope(qkv, w, w, cos, sin, positions, 1e-6, H + 1, K)
    with pytest.raises(ValueError, match="positions must be"):
        qk_norm_rope(qkv, w, w, cos, sin, positions[:2], 1e-6, H, K)
    with pytest.raises(ValueError, match="go together"):
        qk_norm_rope(qkv, w, w, cos, sin, positions, 1e-6, H, K, k_cache=torch.zeros(4, K, hd, device=DEVICE))


def assert_attention_close(actual, q, k_cache, v_cache, seq_lens, scale):
    """actual against transformers' eager attention of the same inputs: in fp32, or for 16-bit
    inputs computed in fp32 (the exact result of those inputs), to which a 16-bit kernel must come
    as close as transformers' own 16-bit attention comes to it (two steps; transformers rounds the
    scores and the probabilities to 16 bits, the kernel rounds the probabilities relative to a
    running maximum: each lands its roundings elsewhere)."""
    expected = hf_attention(q.float(), k_cache.float(), v_cache.float(), seq_lens, scale)
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=LAYER_FP32_RTOL, atol=LAYER_FP32_ATOL)
    else:
        assert relative_error(actual, expected) < LAYER_BF16_REL


def hf_attention(q, k_cache, v_cache, seq_lens, scale):
    """transformers' eager attention of one query per row over each row's first seq_lens keys."""
    B, H, hd = q.shape
    K = k_cache.shape[2]
    keys = torch.arange(k_cache.shape[1], device=q.device)
    mask = torch.where(keys < seq_lens[:, None], 0.0, torch.finfo(q.dtype).min).to(q.dtype)[:, None, None]
    module = SimpleNamespace(num_key_value_groups=H // K, training=False)
    out, _ = hf.eager_attention_forward(module, q[:, :, None], k_cache.transpose(1, 2), v_cache.transpose(1, 2),
                                        mask, scaling=scale)
    return out[:, 0]  # [B, 1, H, hd] -> [B, H, hd]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(8, 2, 64), (4, 1, 24), (2, 2, 128)], ids=["gqa", "mqa-hd24", "mha-hd128"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("splits", [1, 4], ids=["one-slice", "four-slices"])
def test_decode_attention_equals_transformers(dtype, heads, batch, splits):
    """Rows of 1 key, a key block and one more, and the whole cache: in one slice per row (the
    output written by the slice itself) or in four, merged by their log-sum-exp (the row of one
    key leaves three slices empty)."""
    H, K, hd = heads
    S = 200
    q = randn(batch, H, hd, dtype=dtype, seed=0)
    k_cache, v_cache = randn(batch, S, K, hd, dtype=dtype, seed=1), randn(batch, S, K, hd, dtype=dtype, seed=2)
    seq_lens = torch.tensor([1, 65, 200][:batch] if batch > 1 else [137], device=DEVICE)
    with torch.no_grad():
        actual = decode_attention(q, k_cache, v_cache, seq_lens, hd**-0.5, splits=splits)
        assert_attention_close(actual, q, k_cache, v_cache, seq_lens, hd**-0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_of_rows_that_can_hold_1024_keys_equals_transformers(dtype):
    """Rows that can hold 1,024 keys, in one slice each, which 16-bit kernels read 128 keys a loop
    trip (fp32 ones 64): a row of one key, one ending inside a trip and a full row."""
    B, H, K, hd, S = 3, 4, 2, 16, 1024
    assert keys_per_step(1, S, dtype, hd, shared_memory_per_program(DEVICE)) == (64 if dtype == torch.float32 else 128)
    q = randn(B, H, hd, dtype=dtype, seed=0)
    k_cache, v_cache = randn(B, S, K, hd, dtype=dtype, seed=1), randn(B, S, K, hd, dtype=dtype, seed=2)
    seq_lens = torch.tensor([1, 300, S], device=DEVICE)
    with torch.no_grad():
        actual = decode_attention(q, k_cache, v_cache, seq_lens, hd**-0.5, splits=1)
        assert_attention_close(actual, q, k_cache, v_cache, seq_lens, hd**-0.5)


def test_decode_attention_splits_rows_to_fill_a_gpu_and_not_the_interpreter():
    """On a GPU a row is split into slices while batch x key/value heads leave it short of
    TARGET_PROGRAMS programs (at most MAX_SPLITS); the interpreter runs one slice per row."""
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    assert num_splits(1, 8, gpu) == MAX_SPLITS and num_splits(16, 8, gpu) == 4
    assert num_splits(32, 8, gpu) == 2 and num_splits(64, 8, gpu) == 1 and num_splits(256, 8, gpu) == 1
    assert num_splits(1, 8, cpu) == 1
    q = torch.zeros(1, 4, 32, device=DEVICE)
    cache = torch.zeros(1, 10, 2, 32, device=DEVICE)
    for bad in (0, MAX_SPLITS + 1, 2.0):
        with pytest.raises(ValueError, match="splits must be an integer in"):
            decode_attention(q, cache, cache, torch.ones(1, dtype=torch.long, device=DEVICE), 1.0, splits=bad)


def test_decode_attention_reads_nothing_past_a_row_length():
    """NaN in every slot past each row's length changes nothing: those slots are never read."""
    q = randn(2, 4, 32, dtype=torch.float32, seed=0)
    k_cache, v_cache = randn(2, 100, 2, 32, dtype=torch.float32, seed=1), randn(2, 100, 2, 32, dtype=torch.float32,
                                                                                 seed=2)
    seq_lens = torch.tensor([30, 77], device=DEVICE)
    clean = decode_attention(q, k_cache, v_cache, seq_lens, 0.1, splits=4)  # slices ending past a row's keys
    for row, n in enumerate(seq_lens.tolist()):
        k_cache[row, n:] = float("nan")
        v_cache[row, n:] = float("nan")
    assert torch.equal(decode_attention(q, k_cache, v_cache, seq_lens, 0.1, splits=4), clean)


def test_decode_attention_key_steps_follow_row_capacity_slices_dtype_and_shared_memory():
    """128 keys a loop trip only for 16-bit rows that can hold 1,024 keys or more, in few slices,
    where a program can hold two stages of 128-key tiles (128 KB at head_dim 128)."""
    h200, rtx4090 = 232_448, 101_376  # shared memory a program may opt into, in bytes
    bf16 = torch.bfloat16
    assert keys_per_step(1, 40_960, bf16, 128, h200) == 128
    assert keys_per_step(4, 1_024, bf16, 128, h200) == 128
    assert keys_per_step(1, 40_960, bf16, 128, rtx4090) == 64  # the tiles would not fit
    assert keys_per_step(1, 384, bf16, 128, h200) == 64  # short rows: occupancy first
    assert keys_per_step(8, 40_960, bf16, 128, h200) == 64  # many slices
    assert keys_per_step(1, 40_960, torch.float32, 128, h200) == 64
    assert keys_per_step(1, 40_960, bf16, 256, None) == 64  # wide heads
    assert keys_per_step(1, 40_960, bf16, 128, None) == 128  # the interpreter: no limit


def test_decode_attention_refuses_mismatched_shapes():
    q = torch.zeros(2, 4, 32, device=DEVICE)
    cache = torch.zeros(2, 10, 3, 32, device=DEVICE)
    with pytest.raises(ValueError, match="H a multiple of K"):
        decode_attention(q, cache, cache, torch.ones(2, dtype=torch.long, device=DEVICE), 1.0)
    cache = torch.zeros(2, 10, 2, 32, device=DEVICE)
    with pytest.raises(ValueError, match="seq_lens must be"):
        decode_attention(q, cache, cache, torch.ones(3, dtype=torch.long, device=DEVICE), 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(3, 160), (2, 5, 1500)])
def test_silu_mul_equals_transformers(dtype, shape):
    gate_up = 3 * randn(*shape[:-1], 2 * shape[-1], dtype=dtype, seed=0)
    gate, up = gate_up.chunk(2, dim=-1)
    with torch.no_grad():
        assert_close(silu_mul(gate_up), ACT2FN["silu"](gate) * up)
    with pytest.raises(ValueError, match="gate_up must be"):
        silu_mul(gate_up[..., :-1])


def test_gemv_launch_rule():
    """2 rows per program of 1024-wide strides for matrices under 8M weights of up to 4096 rows, 4
    above; rows shorter than a stride take as many rows as a tile of MIN_TILE weights holds."""
    assert gemv_config(4096, 1024) == GemvLaunch(2, 1024, 4)  # Qwen3-0.6B's qkv projection
    assert gemv_config(6144, 1024) == GemvLaunch(4, 1024, 4)  # its gate/up projection: over 4096 rows
    assert gemv_config(1024, 3072) == GemvLaunch(2, 1024, 4)  # its down projection
    assert gemv_config(6144, 4096) == GemvLaunch(4, 1024, 4)  # Qwen3-8B's qkv projection: over 8M weights
    assert gemv_config(256, 64) == GemvLaunch(MIN_TILE // 64, 64, 4)  # a test model's
    assert gemv_config(77, 300) == GemvLaunch(MIN_TILE // 512, 512, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, bias", [((77, 300), False), ((77, 300), True), ((10, 1024), False),
                                         ((96, 2048), True), ((9, 1_000_003), True)],
                         ids=["short-rows", "short-rows-bias", "one-stride", "two-strides-bias", "over-8m-bias"])
def test_gemv_equals_linear(dtype, shape, bias):
    """One row through a linear layer, as a batch-1 decode step's projections are computed: each
    launch of gemv_config's rule (short rows: 4 rows a program; 2 rows of one or two 1024-wide
    strides; 4 rows over 8M weights), with masked tails of rows and columns."""
    N, K = shape
    torch.manual_seed(0)  # the layer's weights the same whatever ran before in this process
    layer = torch.nn.Linear(K, N, bias=bias).to(DEVICE, dtype)
    x = randn(1, 1, K, dtype=dtype, seed=0)
    with torch.no_grad():
        ours, want = gemv(x, layer.weight, layer.bias), layer(x)
        if dtype == torch.float32 and K > 100_000:
            # A million-term fp32 dot: torch's own sum strays from the exact one by more than
            # assert_close's fp32 bound (seen: 4e-3), so ours must be as close to the float64 dot as torch's.
            exact = torch.nn.functional.linear(x.double(), layer.weight.double(), layer.bias.double())
            assert (ours.double() - exact).abs().max() <= max((want.double() - exact).abs().max(), LAYER_FP32_ATOL)
        else:
            assert_close(ours, want)
    with pytest.raises(ValueError, match="one row"):
        gemv(randn(2, K, dtype=dtype, seed=1), layer.weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, N, K", [(2, 77, 300), (5, 96, 2048), (3, 40, 1100), (64, 1024, 2048), (70, 40, 160)],
                         ids=["two-rows", "split-k", "last-split-past-k", "64-rows-split-k", "two-row-blocks"])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_equals_linear(dtype, rows, N, K, bias):
    """A few rows through a linear layer, as a batched decode step's projections are computed;
    with K split over programs where N alone gives few (their partial sums added in order)."""
    layer = torch.nn.Linear(K, N, bias=bias).to(DEVICE, dtype)
    x = randn(rows, 1, K, dtype=dtype, seed=0)
    with torch.no_grad():
        assert_close(skinny_linear(x, layer.weight, layer.bias), layer(x))
        if bias:  # a strided bias is read as its values, not its memory
            strided = torch.stack([layer.bias, -layer.bias], dim=1)[:, 0]
            assert_close(skinny_linear(x, layer.weight, strided), layer(x))
    with pytest.raises(ValueError, match="skinny_linear takes"):
        skinny_linear(x[..., :-1], layer.weight)


def hf_mlp(D: int, F: int, dtype, seed: int) -> hf.Qwen3MLP:
    """transformers' Qwen3MLP with seeded weights."""
    torch.manual_seed(seed)
    return hf.Qwen3MLP(hf_config(hidden_size=D, intermediate_size=F)).to(DEVICE, dtype).eval()


def swiglu(mlp: hf.Qwen3MLP, x: torch.Tensor) -> torch.Tensor:
    """transformers' Qwen3MLP up to its down projection: act_fn(gate_proj(x)) * up_proj(x)."""
    return mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)


def gate_up_weight(mlp: hf.Qwen3MLP) -> torch.Tensor:
    """The [gate; up] weight [2F, D] of our fused gate_up_proj."""
    return torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D, F", [(64, 160), (1100, 40)], ids=["small", "looped"])
def test_gated_gemv_equals_transformers_swiglu(dtype, D, F):
    """gemv(x, [gate; up], gated=True) = act_fn(gate_proj(x)) * up_proj(x), transformers' Qwen3MLP
    before its down projection (one row, as a batch-1 decode step computes it)."""
    mlp = hf_mlp(D, F, dtype, seed=0)
    x = 3 * randn(1, 1, D, dtype=dtype, seed=1)
    with torch.no_grad():
        assert_close(gemv(x, gate_up_weight(mlp), gated=True), swiglu(mlp, x))
    with pytest.raises(ValueError, match="N even"):
        gemv(x, gate_up_weight(mlp)[:-1], gated=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, D, F", [(5, 64, 160), (64, 2048, 48), (3, 300, 3000)],
                         ids=["small", "split-k", "wide"])
def test_gated_skinny_linear_equals_transformers_swiglu(dtype, rows, D, F):
    """skinny_linear(x, [gate; up], gated=True) = transformers' act_fn(gate_proj(x)) * up_proj(x),
    with its K split over programs (the gate applied after the partial sums are added) or not."""
    mlp = hf_mlp(D, F, dtype, seed=2)
    x = 3 * randn(rows, 1, D, dtype=dtype, seed=3)
    with torch.no_grad():
        assert_close(skinny_linear(x, gate_up_weight(mlp), gated=True), swiglu(mlp, x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K, N", [(64, 96), (1024, 300), (2560, 40)], ids=["small", "one-chunk", "looped"])
@pytest.mark.parametrize("residual", [True, False])
def test_gemv_rms_norm_equals_transformers_residual_add_norm_and_projection(dtype, K, N, residual):
    """gemv_rms_norm(x, r, norm, eps, W) = W(Qwen3RMSNorm(r + x)) with the sum r + x, as the HF
    decoder computes `residual + hidden_states` and the next layer's norm and projection."""
    norm = hf.Qwen3RMSNorm(K, eps=1e-6).to(DEVICE, dtype)
    layer = torch.nn.Linear(K, N, bias=True).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * randn(K, dtype=dtype, seed=1))
    x, r = 4 * randn(1, 1, K, dtype=dtype, seed=2), 4 * randn(1, 1, K, dtype=dtype, seed=3)
    with torch.no_grad():
        summed = r + x if residual else x
        y, s = gemv_rms_norm(x, r if residual else None, norm.weight, norm.variance_epsilon, layer.weight, layer.bias)
        assert torch.equal(s, summed)  # one rounding, as torch's add
        assert_close(y, layer(norm(summed)))
    with pytest.raises(ValueError, match="norm_weight must be"):
        gemv_rms_norm(x, None, norm.weight[:-1], 1e-6, layer.weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_gemv_rms_norm_equals_transformers_norm_and_swiglu(dtype):
    """The batch-1 MLP entry: gemv_rms_norm(x, r, norm, eps, [gate; up], gated=True) =
    act_fn(gate_proj(n)) * up_proj(n) with n = Qwen3RMSNorm(r + x)."""
    D, F = 1024, 96
    norm = hf.Qwen3RMSNorm(D, eps=1e-6).to(DEVICE, dtype)
    mlp = hf_mlp(D, F, dtype, seed=4)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * randn(D, dtype=dtype, seed=5))
    x, r = 4 * randn(1, 1, D, dtype=dtype, seed=6), 4 * randn(1, 1, D, dtype=dtype, seed=7)
    with torch.no_grad():
        y, s = gemv_rms_norm(x, r, norm.weight, norm.variance_epsilon, gate_up_weight(mlp), gated=True)
        assert torch.equal(s, r + x)
        assert_close(y, swiglu(mlp, norm(r + x)))
