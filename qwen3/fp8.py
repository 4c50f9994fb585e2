"""Qwen's FP8 checkpoints (Qwen3-*-FP8): block-scaled float8 weights, as transformers'
FineGrainedFP8 integration reads and writes them.

    block = fp8_block_size(config_json)           # (128, 128), or None for a checkpoint that is not FP8
    weight = dequantize(q, scale_inv, block, dtype)
    q, scale_inv = quantize(weight, block)        # scripts/quantize_fp8.py

The format: config.json's `quantization_config` is {"quant_method": "fp8", "fmt": "e4m3",
"activation_scheme": "dynamic", "weight_block_size": [128, 128]}; each quantized linear's
`weight` is float8_e4m3fn [out, in] and its `weight_scale_inv` float32 [ceil(out / 128),
ceil(in / 128)], the multiplier that dequantizes each block (w = q * scale_inv, in fp32).
Embeddings, norms, the LM head and the MoE router stay in bf16.

Where the fused kernels run, the model holds these weights as stored (qwen3/quantized.py) and
the kernels read them (ops/linear/fp8.py). Elsewhere an FP8 checkpoint is dequantized as it loads
(qwen3/loader.py): each weight becomes the model's dtype, exactly the fp32 product rounded once,
at the bf16 model's memory (twice the FP8 weights').
"""

import torch

E4M3_MAX = 448.0  # the largest float8_e4m3fn
SCALE_KEY = "weight_scale_inv"


def fp8_block_size(raw_config: dict, source: str = "config.json") -> tuple[int, int] | None:
    """The weights' block size of a checkpoint's config.json (as a dict), None when it is not
    quantized; ValueError naming what is not supported (another method, format or block)."""
    q = raw_config.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ValueError(f"{source}: quantization_config must be a JSON object, got {q!r}")
    method = q.get("quant_method")
    if method != "fp8":
        raise ValueError(f"{source}: quantization method {method!r} is not supported; Qwen's FP8 checkpoints "
                         "(quant_method 'fp8') and unquantized ones are")
    if q.get("fmt", "e4m3") != "e4m3" or q.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"{source}: FP8 with fmt {q.get('fmt')!r} and activation_scheme "
                         f"{q.get('activation_scheme')!r} is not supported; e4m3 with dynamic activations is")
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
        raise ValueError(f"{source}: weight_block_size {block!r} is not supported; two positive integers "
                         "(Qwen's: [128, 128]) are")
    return block[0], block[1]


def scale_shape(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """The weight [out, in] of FP8 q and its per-block multipliers, in dtype (the fp32 product, rounded once)."""
    rows, cols = q.shape
    scale = scale_inv.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]
    return (q.float() * scale).to(dtype)


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale_inv) of weight [out, in]: each block scaled so that its largest magnitude is
    E4M3_MAX (scale_inv = amax / 448; an all-zero block gets 1), then rounded to float8_e4m3fn."""
    rows, cols = weight.shape
    grid = scale_shape((rows, cols), block)
    padded = torch.zeros(grid[0] * block[0], grid[1] * block[1], dtype=torch.float32, device=weight.device)
    padded[:rows, :cols] = weight.float()
    blocks = padded.unflatten(0, (grid[0], block[0])).unflatten(2, (grid[1], block[1]))  # [R, b0, C, b1]
    amax = blocks.abs().amax(dim=(1, 3))
    # Divided by a tensor on amax's device: CUDA divides by a Python number as a multiplication by
    # its reciprocal, a last bit away from the CPU's (and the kernels') quotient.
    scale_inv = torch.where(amax > 0, amax / amax.new_tensor(E4M3_MAX), torch.ones_like(amax))
    q = (blocks / scale_inv[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.flatten(2).flatten(0, 1)[:rows, :cols].contiguous(), scale_inv
