"""Every numerical tolerance of the test suite, in one place, with the reason for it.

RMSNorm implementations follow Hugging Face's cast order exactly, so in 16-bit dtypes the only
source of difference is the order in which the fp32 sum of squares is reduced (and rsqrt's last
bit): that can move the fp32 normalized value across a rounding boundary of the 16-bit output,
by one unit in the last place, for a small fraction of elements.
"""

import torch
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

# fp32 output: another reduction order and rsqrt's last bit move rstd by an ulp or two (relative),
# each multiply adds half an ulp, and an ulp at the bottom of a binade is twice as large relative
# to the value: a few ulps. Seen: at most 5 over 300 random shapes (D < 3000, three weight dtypes).
RMSNORM_FP32_MAX_ULPS = 8
# 16-bit input: HF rounds the fp32 normalized value n to the input dtype, then multiplies by the
# weight and rounds once more. Our n is HF's within the fp32 bound above, so our result may differ
# only where HF's n lies that close (relatively) to a 16-bit rounding boundary, by one step of n;
# everywhere else it is bit-identical. One step of n moves the output (rounded once more) by at
# most 1 ulp with a unit weight and 3 ulps with another (|w| ulp(n) <= 2 ulp(w n), plus rounding).
RMSNORM_16BIT_NORMALIZED_MAX_ULPS = 1
RMSNORM_16BIT_WEIGHTED_MAX_ULPS = 3


# Whole-model fp32 logits against transformers (eager attention): the bound. Matmuls in
# a different association order (fused vs split projections) differ at ~1e-6 relative per layer.
LOGITS_FP32_RTOL = 1e-4
LOGITS_FP32_ATOL = 1e-4

# Log-probabilities (logit - logsumexp of the row) of fp32 logits within the bounds above: the
# logsumexp moves by at most the row's largest logit difference, so a log-prob by at most twice it.
def logprobs_fp32_atol(logits: torch.Tensor) -> float:
    return 2 * (LOGITS_FP32_ATOL + LOGITS_FP32_RTOL * logits.abs().max().item())


# Layer-level fp32 parity (one module, no depth to accumulate error): a few fp32 ulps of O(1) values.
LAYER_FP32_ATOL = 1e-5
LAYER_FP32_RTOL = 1e-5
# Layer-level bf16 parity: bf16 has an 8-bit mantissa (relative step 2^-8 = 0.0039); matmul
# accumulation order differs, so allow two bf16 steps relative to the output's scale.
LAYER_BF16_REL = 2 * 2.0**-8
# FP8 x FP8 products on a GPU's tensor cores (the w8a8 path): Hopper adds a tile's products in an
# accumulator of about 14 bits (DeepSeek-V3's report, section 3.3.2; Triton's default for FP8
# dots), so even fp32 outputs carry errors of ~2^-14 per addition, up to ~2^-7 over a 128-wide
# tile (an H200's largest seen: 1.1e-3 on outputs of ~0.06): held to the bf16 bound, relative to
# the output's norm.
W8A8_GPU_REL = LAYER_BF16_REL


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in units in the last place between two tensors of one float dtype
    (NaN positions must be equal and are reported as 0)."""
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    int_type = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    lowest = torch.iinfo(int_type).min

    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.contiguous().view(int_type).long()
        return torch.where(bits < 0, lowest - bits, bits)

    both_nan = torch.isnan(a) & torch.isnan(b)
    return torch.where(both_nan, 0, (ordered(a) - ordered(b)).abs())


def _near_rounding_boundary(n: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Where the fp32 values n lie within RMSNORM_FP32_MAX_ULPS (relative) of a point at which
    rounding to dtype changes: the midpoint between two neighbouring dtype values."""
    r = n.to(dtype)
    n64, r64 = n.double(), r.double()
    inf = torch.full_like(r, float("inf"))
    up, down = torch.nextafter(r, inf).double(), torch.nextafter(r, -inf).double()
    distance = torch.minimum((n64 - (r64 + up) / 2).abs(), (n64 - (r64 + down) / 2).abs())
    return distance <= RMSNORM_FP32_MAX_ULPS * torch.finfo(torch.float32).eps * n64.abs()


@torch.no_grad()
def assert_matches_hf(actual: torch.Tensor, x: torch.Tensor, module: Qwen3RMSNorm) -> None:
    """Our RMSNorm of x against the HF module's output, by the rules above. HF's fp32 normalized
    value comes from the HF module too: an fp32 one with unit weight, applied to x in fp32 (HF
    upcasts x to fp32 before anything else)."""
    expected = module(x)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.equal(torch.isnan(actual), torch.isnan(expected)), "NaN positions differ"
    ulps = ulp_distance(actual.cpu(), expected.cpu())
    if ulps.numel() == 0:
        return
    if x.dtype == torch.float32:
        assert ulps.max().item() <= RMSNORM_FP32_MAX_ULPS, f"max {ulps.max().item()} fp32 ulps"
        return
    unit = Qwen3RMSNorm(x.shape[-1], eps=module.variance_epsilon).to(x.device)
    near = _near_rounding_boundary(unit(x.float()).cpu(), x.dtype)
    stray = (ulps > 0) & ~near
    assert not stray.any(), f"{int(stray.sum())} of {ulps.numel()} elements differ away from a rounding boundary"
    if actual.dtype == torch.float32:  # y = w * n in fp32: a 16-bit step of n moves y by |w| ulp16(n)
        bound = 2 * torch.finfo(x.dtype).eps / torch.finfo(torch.float32).eps + 1  # <= 2 eps16 / eps32 ulps
    elif bool((module.weight == 1).all()):
        bound = RMSNORM_16BIT_NORMALIZED_MAX_ULPS
    else:
        bound = RMSNORM_16BIT_WEIGHTED_MAX_ULPS
    assert ulps.max().item() <= bound, f"max {ulps.max().item()} ulps, at a rounding boundary"


# fp32 RMSNorm gradients against HF's autograd: both compute in fp32 with different association
# (fused formula vs the chain rule op by op); relative differences stay near 1e-6.
BACKWARD_FP32_RTOL = 1e-5

# 16-bit gradients against a float64 truth: ours must be no worse than HF's own 16-bit autograd.
# Both errors are dominated by the final rounding of dx to 16 bits (half an ulp per element), so
# two equally good computations differ by chance in the 4th-5th digit of the error; 1% slack.
BACKWARD_16BIT_ERROR_SLACK = 1.01


def relative_error(actual: torch.Tensor, truth: torch.Tensor) -> float:
    """||actual - truth|| / ||truth||, computed in float64."""
    truth = truth.double()
    return ((actual.double() - truth).norm() / truth.norm()).item()


# Whole-model bf16 logits against transformers in bf16: both round every activation to bf16
# (relative step 2^-8), but attention and matmul kernels differ (SDPA vs eager), so roundings
# land differently in each of the layers and compound: a few bf16 steps relative to the logits.
LOGITS_BF16_REL = 4 * 2.0**-8

# Losses of a few fp32 optimizer steps, torch vs triton norms: the norms differ by a few fp32 ulps
# per call, which Adam's normalized updates carry into the weights; after 5 steps of lr 1e-3 the
# losses agree to ~1e-6 relative. 1e-5 leaves room for reduction order, not for a wrong gradient
# (a dropped term moves the loss by > 1e-3).
TRAINING_LOSS_RTOL = 1e-5

# Sampling: a token's frequency over N independent draws (one seed each) is binomial around the
# probability p transformers' filters give it, with standard deviation sqrt(p (1 - p) / N). Five
# deviations: about one token in 1.7 million would stray that far by chance, so over the few hundred
# tokens of a test's distributions a correct sampler passes (the seeds are fixed: the test is
# deterministic), while a wrong filter moves a probability of a few percent by many deviations.
SAMPLING_MAX_DEVIATIONS = 5

# Extend (chunked-prefill) attention against SDPA over the same gathered keys, fp32: one softmax
# and two matmuls, summed in another order (key tiles, online rescaling): a few fp32 ulps of O(1)
# values, as for one layer.
EXTEND_ATTENTION_FP32_ATOL = 2e-5
EXTEND_ATTENTION_FP32_RTOL = 2e-5
# 16-bit inputs, against a float64 SDPA of the same 16-bit values: the kernel rounds the softmax's
# probabilities to the dtype before the PV product (as FlashAttention does) and the output once
# more, each within half a step (eps / 2 relative); norm-wise, rounding the output alone gives
# 0.20 eps and the kernel 0.24 eps (bf16 and fp16 alike). A dropped or extra key moves it by far
# more. Multiplied by torch.finfo(dtype).eps.
EXTEND_ATTENTION_16BIT_EPS = 0.5
