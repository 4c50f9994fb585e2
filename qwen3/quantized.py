"""Which of the model's weights are held in FP8, and how they get there: from an FP8 checkpoint
(the loader copies its float8 weights and scales as they are), or quantized as a bf16 checkpoint
loads (`from_pretrained(quantization="fp8")`, the CLIs' `--quantization fp8`).

    hold_fp8(model, block, stored_fp8)    # before loading: these modules' weights become FP8
    quantize_weights(model, block, hold)  # after loading a bf16 checkpoint

A held projection (an nn.Linear or FusedLinear of a decoder layer, not the MoE router) keeps
`weight` in float8_e4m3fn [out, in] beside `weight_scale_inv` float32 [out / block[0],
in / block[1]] and `weight_block`; stacked experts keep `gate_up_proj` / `down_proj` in FP8
beside `gate_up_proj_scale_inv` / `down_proj_scale_inv` (a row of scales per expert block row).
The parameter names follow the checkpoint's, so `checkpoint_tensors()` lists the scales under
their checkpoint keys and the loader fills them as any other tensor.

Held weights are what the fused kernels read (ops/linear/fp8.py: half the bytes of bf16 per
decode step). Where the reference operations run (the CPU by default), an FP8 checkpoint is
dequantized as it loads (the bf16 model's memory), and `quantization="fp8"` replaces each weight
by its blockwise rounding: the same numbers the FP8 model computes with.
"""

import torch
from torch import nn

from ops.linear.fp8 import FP8, kernel_block

from .fp8 import SCALE_KEY, dequantize, quantize, scale_shape
from .layers import FusedLinear
from .moe import Experts

QUANTIZATIONS = ("fp8",)
BLOCK = (128, 128)  # Qwen's FP8 checkpoints' weight block, which quantization="fp8" uses too


def check_quantization(quantization: str | None) -> None:
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r} is not supported; {', '.join(map(repr, QUANTIZATIONS))} "
                         "(or None) is")


def fp8_candidates(model: nn.Module) -> dict[str, nn.Module]:
    """{module name: module} of the weights an FP8 checkpoint quantizes: every linear projection of
    the decoder layers and every expert stack; not the router (mlp.gate), embeddings or LM head."""
    found = {}
    for name, module in model.named_modules():
        if ".layers." not in f".{name}" or name.endswith("mlp.gate"):
            continue
        if isinstance(module, (nn.Linear, Experts)):
            found[name] = module
    return found


def checkpoint_weight_keys(name: str, module: nn.Module) -> list[str]:
    """The checkpoint keys of the weights that fill `module` (named `name` in the model)."""
    if isinstance(module, FusedLinear):
        parent = name.rpartition(".")[0]
        return [f"{parent}.{part}.weight" for part in module.parts]
    if isinstance(module, Experts):
        return [f"{name}.{e}.{p}.weight" for e in range(module.num_experts)
                for p in ("gate_proj", "up_proj", "down_proj")]
    return [f"{name}.weight"]


def fits(module: nn.Module, block: tuple[int, int]) -> bool:
    """Whether the kernels can read `module` in FP8 with this block: block sides they take, and
    every stacked part (q/k/v, gate/up, an expert's projections) whole blocks of rows, so that
    the parts' scales stack as their weights do."""
    if not kernel_block(block):
        return False
    if isinstance(module, FusedLinear):
        return all(rows % block[0] == 0 for rows in module.parts.values())
    if isinstance(module, Experts):
        return module.intermediate_size % block[0] == 0 and module.down_proj.shape[1] % block[0] == 0
    return True


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


def _hold(module: nn.Module, name: str, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> None:
    """module.<name> becomes the FP8 weight q, beside its scales (named as the checkpoint names them)."""
    setattr(module, name, _frozen(q))
    module.register_parameter(SCALE_KEY if name == "weight" else f"{name}_scale_inv", _frozen(scale))
    module.weight_block = block


def _projections(module: nn.Module) -> list[str]:
    return ["gate_up_proj", "down_proj"] if isinstance(module, Experts) else ["weight"]


def hold_fp8(model: nn.Module, block: tuple[int, int], stored_fp8: set[str]) -> None:
    """Give every candidate module whose checkpoint weights are all stored in FP8 (`stored_fp8`:
    their keys) and that `fits` the block FP8 weights and empty scales, in place (the meta device
    too: nothing is allocated twice). The loader dequantizes the checkpoint's other FP8 weights."""
    for name, module in fp8_candidates(model).items():
        keys = checkpoint_weight_keys(name, module)
        if not (fits(module, block) and all(key in stored_fp8 for key in keys)):
            continue
        for projection in _projections(module):
            weight = getattr(module, projection)
            grid = weight.shape[:-2] + scale_shape(tuple(weight.shape[-2:]), block)
            _hold(module, projection, torch.empty(weight.shape, dtype=FP8, device=weight.device),
                  torch.empty(grid, dtype=torch.float32, device=weight.device), block)


def _checkpoint_parts(module: nn.Module, projection: str, weight: torch.Tensor) -> list[torch.Tensor]:
    """The views of `weight` that are separate tensors in a checkpoint (each quantized on its own):
    a FusedLinear's parts, each expert of a stack, or the whole weight."""
    if isinstance(module, FusedLinear):
        return list(module.part_rows(weight).values())
    if weight.dim() == 2:
        return [weight]
    if projection == "gate_up_proj":  # each expert's [gate; up]: two tensors
        return [half for expert in weight for half in expert.chunk(2)]
    return list(weight)


@torch.no_grad()
def quantize_weights(model: nn.Module, block: tuple[int, int], hold: bool) -> None:
    """Quantize each candidate's weights (loaded in floating point) blockwise, each checkpoint
    tensor on its own as scripts/quantize_fp8.py does. A module that `fits` the block is then held
    in FP8 if `hold` (for the fused kernels); otherwise its weights are replaced in place by their
    dequantized rounding (the same numbers, in the model's dtype)."""
    for module in fp8_candidates(model).values():
        if getattr(module, "weight_block", None) is not None:
            continue  # already FP8
        keep = hold and fits(module, block)
        for projection in _projections(module):
            weight = getattr(module, projection)
            parts = _checkpoint_parts(module, projection, weight)
            pairs = [quantize(part, block) for part in parts]
            if keep:  # parts of whole blocks of rows: their scales stack as their weights do
                q, scale = torch.cat([q for q, _ in pairs]), torch.cat([s for _, s in pairs])
                _hold(module, projection, q.view(weight.shape), scale.view(*weight.shape[:-2], -1, scale.shape[-1]),
                      block)
            else:
                for part, (q, s) in zip(parts, pairs):
                    part.copy_(dequantize(q, s, block, part.dtype))
