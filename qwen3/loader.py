"""Hugging Face safetensors checkpoint -> Qwen3ForCausalLM.

The module is built on the meta device (no memory, no random init), given uninitialized storage
of the target dtype on the target device, and each checkpoint tensor is copied straight into its
parameter: peak memory is about one model. Keys map one to one (our parameter names are HF's);
every key is checked before any copy, and any mismatch names the file and the tensor. With tensor
parallelism each rank builds its part of the model and reads only its part of each tensor
(safetensors' `get_slice`), so no process ever holds the whole model.
"""

import dataclasses
import json
import warnings
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

import ops
from ops.linear.fp8 import FP8
from runtime.sampling import sampling_params

from .config import Qwen3Config
from .fp8 import SCALE_KEY, dequantize, fp8_block_size, scale_shape
from .parallel import TensorParallel, resolve_parallel_device
from .quantized import BLOCK, check_quantization, hold_fp8, quantize_weights

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
HEAD, EMBEDDINGS = "lm_head.weight", "model.embed_tokens.weight"
GENERATION_CONFIG = "generation_config.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# safetensors' names of the dtypes a parameter may be stored in; the copy casts them to the model's.
FLOAT_STORAGE = ("F32", "BF16", "F16", "F64")
FP8_STORAGE = "F8_E4M3"  # an FP8 checkpoint's quantized weights (qwen3/fp8.py)
# A progress bar appears once loading has taken this long, so that small checkpoints show none.
PROGRESS_AFTER_S = 1.0


def resolve_device(device: str | torch.device) -> torch.device:
    """torch.device(device), refused with a ValueError unless tensors can be made there."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {device!r}; expected 'cpu', 'cuda' or 'cuda:N'") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ValueError(f"device {device} is not available: {why} (torch {torch.__version__}); use 'cpu'")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(f"device {device} is not available: this machine has {count} CUDA GPU(s), "
                             f"cuda:0 to cuda:{count - 1}")
    elif device.type == "meta":  # tensors are made there, but with no data to compute on
        raise ValueError("device meta holds shapes but no data, so the model cannot run on it; "
                         "expected 'cpu', 'cuda' or 'cuda:N'")
    elif device.type != "cpu":
        try:
            torch.empty(0, device=device)
        except Exception:  # each backend fails in its own way (NotImplementedError, RuntimeError...)
            raise ValueError(f"device {device} is not available here; use 'cpu' or 'cuda'") from None
    return device


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device, checkpoint_dtype: str) -> torch.dtype:
    """The dtype to load in: `dtype` as a torch.dtype or a name ("bfloat16", "torch.bfloat16"), or
    "auto" for the checkpoint's. None means float32 on the CPU, where 16-bit matmuls run several
    times slower than fp32 ones on most processors, and the checkpoint's dtype (bf16 for Qwen3)
    on a GPU; transformers' default is "auto" on every device."""
    if dtype is None:
        dtype = "float32" if device.type == "cpu" else "auto"
    if dtype == "auto":
        dtype = checkpoint_dtype
    if isinstance(dtype, str):
        dtype = DTYPES.get(dtype.removeprefix("torch."), dtype)
    if dtype not in DTYPES.values():
        raise ValueError(f"unsupported dtype {dtype!r}; expected one of {', '.join(DTYPES)}, 'auto' "
                         "or the torch.dtype of one of them")
    return dtype


def index_shards(path: Path) -> dict[str, list[str]] | None:
    """{shard file: [tensor keys]} that the sharded index in `path` names; None without an index."""
    if not (path / INDEX_FILE).exists():
        return None
    try:
        weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:  # TypeError: not a JSON object
        raise ValueError(f"{path / INDEX_FILE} is not a valid safetensors index: {err!r}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(shard, str) for shard in weight_map.values()):
        raise ValueError(f"{path / INDEX_FILE} is not a valid safetensors index: its weight_map must map "
                         "tensor names to shard file names")
    shards: dict[str, list[str]] = {}
    for key, shard in weight_map.items():
        shards.setdefault(shard, []).append(key)
    return shards


def checkpoint_files(path: Path) -> dict[str, list[str]]:
    """{shard file: [tensor keys]} from a single model.safetensors or a sharded index."""
    shards = index_shards(path)
    if shards is not None:
        for shard in shards:
            if not (path / shard).exists():
                raise FileNotFoundError(f"shard {shard} named in {INDEX_FILE} is missing from {path}")
        return shards
    if (path / SINGLE_FILE).exists():
        return {SINGLE_FILE: None}  # keys read from the file itself
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}")


def read_generation_config(path: Path) -> dict:
    """The checkpoint's generation_config.json ({} without one), its values checked now, before
    anything runs on them: a ValueError names the file and the key."""
    file = Path(path) / GENERATION_CONFIG
    if not file.exists():
        return {}
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{file} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file} must hold a JSON object, not {type(config).__name__}")
    if not isinstance(config.get("do_sample", False), bool):
        raise ValueError(f"{file}: do_sample must be true or false, got {config['do_sample']!r}")
    eos = config.get("eos_token_id")
    if eos is not None and not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                   for t in (eos if isinstance(eos, list) else [eos])):
        raise ValueError(f"{file}: eos_token_id must be a token id or a list of them, got {eos!r}")
    try:
        sampling_params(config)  # names the parameter: "temperature must be >= 0 and finite ..., got -1"
    except ValueError as err:
        raise ValueError(f"{file}: {err}") from None
    return config


def _open(file: Path):
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as err:  # safetensors raises its own error types for corrupt headers
        raise ValueError(f"cannot read safetensors file {file}: {err}") from None


def empty_model(model_class: type, config: Qwen3Config, dtype: torch.dtype, device: torch.device,
                tp: TensorParallel | None = None, hold=None):
    """The model (with tp, this rank's part) in `dtype` on `device` with uninitialized weights:
    built on the meta device, so that nothing is allocated twice or initialized at random.
    hold: called with the model on the meta device, before any memory is given to it (to hold
    some weights in FP8: qwen3/quantized.py)."""
    with torch.device("meta"):
        model = model_class(config, tp).to(dtype)
        if hold is not None:
            hold(model)
    model.to_empty(device=device)
    if config.tie_word_embeddings:  # to_empty made new tensors: tie them again
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def load_model(
    model_class: type,
    path: str | Path,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device = "cpu",
    norm_impl: str | None = None,
    progress: bool = True,
    tensor_parallel: bool = False,
    kernels: str | None = None,
    quantization: str | None = None,
):
    """The checkpoint in directory `path` as a model_class (Qwen3ForCausalLM) in eval mode, with its
    generation_config.json (if any) as `model.generation_config`.

    dtype: a torch.dtype, its name ("bfloat16", "torch.bfloat16"), or "auto" for the checkpoint's
    dtype; default float32 on the CPU and the checkpoint's dtype on a GPU. device: "cpu", "cuda",
    "cuda:1"... norm_impl: the RMSNorm implementation (default "auto": triton on CUDA, torch on
    the CPU). kernels: the fused Triton kernels or the reference operations (default "auto": fused
    on CUDA). progress: a bar on stderr, once loading has taken over a second. tensor_parallel:
    this rank's part of the model, over the default process group (qwen3/parallel.py).
    quantization: "fp8" quantizes a floating-point checkpoint's decoder projections as it loads
    (qwen3/quantized.py); an FP8 checkpoint is FP8 whatever this says. FP8 weights stay FP8 where
    the fused kernels run them (one GPU of compute capability 8.9 or newer, or the Triton
    interpreter), and are dequantized to `dtype` everywhere else.
    Raises FileNotFoundError for missing files and ValueError for anything it cannot load,
    naming the file and the key.
    """
    path = model_directory(path)
    device = resolve_device(device)
    overrides = {key: value for key, value in (("norm_impl", norm_impl), ("kernels", kernels)) if value is not None}
    config = Qwen3Config.from_json(path, **overrides)
    generation_config = read_generation_config(path)  # before the weights: a bad value fails at once
    ops.resolve_impl(config.norm_impl, device)  # refuses, e.g., triton on a CPU before anything loads
    fused = ops.resolve_kernels(config.kernels, device) == "fused"
    check_quantization(quantization)
    device, tp = tensor_parallel_part(config, device, quantization) if tensor_parallel else (device, None)
    # What the config leaves to the weights (after every check that needs none of them):
    dtype = resolve_dtype(dtype, device, checkpoint_dtype(path, config))
    if config.tie_word_embeddings and head_stored_apart(path):  # as transformers loads it, and says so
        warnings.warn(f"{path / 'config.json'} ties the LM head to the embeddings, but the checkpoint stores a "
                      "different head: it is loaded untied (set tie_word_embeddings false to silence this)",
                      stacklevel=2)
        config = dataclasses.replace(config, tie_word_embeddings=False)

    block = fp8_block_size(json.loads((path / "config.json").read_text()), str(path / "config.json"))
    keep_fp8 = fused and tp is None and runs_fp8(device)
    model = empty_model(model_class, config, dtype, device, tp, hold=fp8_hold(path, block, keep_fp8))
    params = model.checkpoint_tensors()  # HF key -> parameter or rows of a fused one; tied weights once
    held = {key for key, param in params.items() if param.dtype == FP8}  # every other FP8 weight is dequantized
    shapes = checkpoint_shapes(model_class, config, params, tp)
    plan = copy_plan(path, config, shapes, tp, block, held)  # every key, shape and dtype checked before any copy
    copy_weights(path, plan, params, progress and (tp is None or tp.rank == 0), block)
    if quantization == "fp8" and block is None:
        quantize_weights(model, BLOCK, hold=keep_fp8)
        if device.type == "cuda":  # the bf16 weights' memory back to the device, for the KV cache to count
            torch.cuda.empty_cache()
    model.generation_config = generation_config
    if tp is not None:
        model.requires_grad_(False)  # tensor-parallel models are for inference: collectives have no autograd
        tp.use_symmetric_memory(dtype)
    return model.eval()


def model_directory(path: str | Path) -> Path:
    """Path(path), refused with a FileNotFoundError unless it is a directory: a checkpoint is one."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} " + ("is a file, not a directory" if path.exists()
                                                                else "does not exist"))
    return path


def tensor_parallel_part(config: Qwen3Config, device: torch.device,
                         quantization: str | None) -> tuple[torch.device, TensorParallel]:
    """This rank's device and its TensorParallel (which part of the model it holds), over the default
    process group. Refuses quantization on load (each rank would quantize its own slices, whose
    blocks are not the checkpoint's), a missing process group and a model that does not split."""
    if quantization is not None:
        raise ValueError(f"quantization={quantization!r} with tensor_parallel=True is not supported: each rank would "
                         "quantize its own slices, whose blocks are not the checkpoint's; quantize with "
                         "scripts/quantize_fp8.py and load that checkpoint")
    device = resolve_parallel_device(device)
    return device, TensorParallel.from_default_group(config, device)


def fp8_hold(path: Path, block: tuple[int, int] | None, keep_fp8: bool):
    """empty_model's `hold` for an FP8 checkpoint (block: its block size; None: not FP8) when the
    fused kernels read FP8 weights here (keep_fp8): the modules whose weights it stores in float8
    are given FP8 weights and scales (qwen3/quantized.py), copied as stored. None otherwise: the
    loader dequantizes each FP8 weight to the model's dtype as it loads."""
    stored_fp8 = fp8_weight_keys(path) if block is not None and keep_fp8 else set()
    return (lambda model: hold_fp8(model, block, stored_fp8)) if stored_fp8 else None


def checkpoint_shapes(model_class: type, config: Qwen3Config, params: dict[str, torch.Tensor],
                      tp: TensorParallel | None) -> dict[str, tuple]:
    """{key: shape} the checkpoint must have: the parameters' own, or with tensor parallelism the
    whole model's, since the checkpoint holds the whole model (from a model on the meta device: no memory)."""
    if tp is None:
        return {key: tuple(param.shape) for key, param in params.items()}
    with torch.device("meta"):
        whole = model_class(config)
    return {key: tuple(t.shape) for key, t in whole.checkpoint_tensors().items()}


def runs_fp8(device: torch.device) -> bool:
    """Whether the fused kernels can read FP8 weights on `device`: Triton converts float8_e4m3fn
    on GPUs of compute capability 8.9 (Ada, Hopper) or newer, and in its CPU interpreter."""
    return device.type == "cpu" or (device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9))


STORED_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}  # safetensors' names


def checkpoint_dtype(path: Path, config: Qwen3Config) -> str:
    """The checkpoint's dtype, as dtype "auto" loads it (transformers' rule): config.json's, else
    that of the first floating-point tensor stored (float32 if there is none)."""
    if config.dtype is not None:
        return config.dtype
    for shard in checkpoint_files(path):
        with _open(path / shard) as f:
            for key in f.keys():
                if (stored := f.get_slice(key).get_dtype()) in STORED_DTYPES:
                    return STORED_DTYPES[stored]
    return "float32"


def head_stored_apart(path: Path) -> bool:
    """Whether the checkpoint stores an LM head of its own that differs from its embeddings (its
    config may say they are tied: transformers then keeps the stored head, untied)."""
    found = {}
    for shard in checkpoint_files(path):
        with _open(path / shard) as f:
            found.update({key: f.get_tensor(key) for key in (HEAD, EMBEDDINGS) if key in f.keys()})
    return HEAD in found and (EMBEDDINGS not in found or found[HEAD].shape != found[EMBEDDINGS].shape
                              or not torch.equal(found[HEAD], found[EMBEDDINGS]))


def fp8_weight_keys(path: Path) -> set[str]:
    """The keys of the weights an FP8 checkpoint stores in float8."""
    keys = set()
    for shard in checkpoint_files(path):
        with _open(path / shard) as f:
            keys.update(key for key in f.keys() if f.get_slice(key).get_dtype() == FP8_STORAGE)
    return keys


def copy_plan(path: Path, config: Qwen3Config, shapes: dict[str, tuple], tp: TensorParallel | None,
              block: tuple[int, int] | None = None, held: set[str] = frozenset()) -> list[tuple[str, list[tuple]]]:
    """[(shard, [(key, index, scale)])]: what to copy from each checkpoint file (index: this rank's
    part of the tensor, None for all of it; scale: (shard, key) of an FP8 weight's multipliers,
    qwen3/fp8.py, for one to dequantize as it loads, None for one copied as stored), once every
    key, shape and dtype has been checked against `shapes` (the whole model's). block: an FP8
    checkpoint's weight block size (None: not FP8); held: its weights the model holds in FP8
    (their scales are then parameters of their own). ValueError naming the file and the key otherwise."""
    shards = checkpoint_files(path)
    scales = checkpoint_scales(path, shards) if block is not None else {}
    plan: list[tuple[str, list[tuple]]] = []  # (shard, [(key, index, scale)])
    seen: set[str] = set()
    for shard, listed in shards.items():
        with _open(path / shard) as f:
            keys = list(f.keys())
            if listed is not None and set(listed) - set(keys):
                missing = sorted(set(listed) - set(keys))[0]
                raise ValueError(f"{INDEX_FILE} maps {missing} to {shard}, which does not contain it")
            to_copy = []
            for key in keys:
                if not_loaded(key, config, shapes, block):
                    continue
                scale = check_tensor(key, shard, f.get_slice(key), shapes, block, held, scales)
                seen.add(key)
                if tp is None:
                    to_copy.append((key, None, scale))  # the whole tensor
                elif (index := tp.checkpoint_index(key, config)) is not None:  # None: this rank holds none of it
                    to_copy.append((key, index, scale))
            plan.append((shard, to_copy))
    for weight, (shard, _, _) in scales.items():
        if weight not in shapes and not not_loaded(weight, config, shapes, block):
            raise ValueError(f"unexpected tensor {weight.removesuffix('weight') + SCALE_KEY} in {shard}: the "
                             "model config.json describes has no weight it could scale")
    missing = sorted(set(shapes) - seen)
    if missing:
        raise ValueError(f"checkpoint {path} is missing tensor(s): {', '.join(missing[:5])}"
                         + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    return plan


def checkpoint_scales(path: Path, shards: dict[str, list[str] | None]) -> dict[str, tuple[str, tuple, str]]:
    """An FP8 checkpoint's {weight key: (shard, shape, dtype) of its scale}, from every file's
    header: a checkpoint may keep a scale in another shard than its weight's."""
    scales = {}
    for shard in shards:
        with _open(path / shard) as f:
            for key in f.keys():
                if key.endswith(SCALE_KEY):
                    stored = f.get_slice(key)
                    scales[key.removesuffix(SCALE_KEY) + "weight"] = (shard, tuple(stored.get_shape()),
                                                                      stored.get_dtype())
    return scales


def not_loaded(key: str, config: Qwen3Config, shapes: dict[str, tuple], block: tuple[int, int] | None) -> bool:
    """Whether checkpoint tensor `key` is no parameter of the model, and so stays out of the checks and
    the plan: a buffer we derive, an FP8 weight's scale (read with its weight), a tied head."""
    if key.endswith("rotary_emb.inv_freq"):
        return True  # a derived buffer some exporters save; we compute it
    if block is not None and key.endswith(SCALE_KEY) and key not in shapes:
        return True  # read with its weight, to dequantize it
    return key == "lm_head.weight" and config.tie_word_embeddings  # tied: the head is the embedding matrix


def check_tensor(key: str, shard: str, stored, shapes: dict[str, tuple], block: tuple[int, int] | None,
                 held: set[str], scales: dict[str, tuple[str, tuple, str]]) -> tuple[str, str] | None:
    """Check checkpoint tensor `key` of `shard` (`stored`: its safetensors slice, header only)
    against the model: a parameter of that shape, stored in a floating-point dtype, or in FP8 with
    its scale in an FP8 checkpoint. Returns (shard, key) of the scale to dequantize it with as it
    loads, None to copy it as stored (a floating-point tensor, or an FP8 weight the model holds in
    FP8, its scale beside it). ValueError naming the file and the key otherwise."""
    if key not in shapes:
        raise ValueError(f"unexpected tensor {key} in {shard}: the model config.json describes "
                         "has no such parameter")
    shape = tuple(stored.get_shape())
    if shape != shapes[key]:
        raise ValueError(f"tensor {key} in {shard} has shape {shape}, expected {shapes[key]}")
    if block is not None and stored.get_dtype() == FP8_STORAGE:
        scale = fp8_scale(key, shard, shape, block, scales)
        return None if key in held else scale  # held: copied as stored, its scale beside it
    if stored.get_dtype() not in FLOAT_STORAGE:
        fp8 = " (an FP8 checkpoint's config.json has a quantization_config)" if stored.get_dtype() == \
            FP8_STORAGE else ""
        raise ValueError(f"tensor {key} in {shard} has dtype {stored.get_dtype()}, expected a "
                         f"floating-point one ({', '.join(FLOAT_STORAGE)}){fp8}")
    if key in scales:
        raise ValueError(f"{key} in {shard} has a {SCALE_KEY} but is stored as {stored.get_dtype()}, "
                         "not FP8")
    return None


def fp8_scale(key: str, shard: str, shape: tuple, block: tuple[int, int],
              scales: dict[str, tuple[str, tuple, str]]) -> tuple[str, str]:
    """(shard, key) of the scale of FP8 weight `key`, checked; ValueError naming what is wrong."""
    if key not in scales:
        raise ValueError(f"FP8 tensor {key} in {shard} has no {SCALE_KEY} beside it")
    scale_shard, stored_shape, dtype = scales[key]
    scale_key = key.removesuffix("weight") + SCALE_KEY
    if len(shape) != 2 or stored_shape != scale_shape(shape, block):
        raise ValueError(f"{scale_key} in {scale_shard} has shape {stored_shape}, expected "
                         f"{scale_shape(shape, block) if len(shape) == 2 else 'a 2-D weight'} for blocks of {block}")
    if dtype not in FLOAT_STORAGE:
        raise ValueError(f"{scale_key} in {scale_shard} has dtype {dtype}, expected a floating-point one")
    return scale_shard, scale_key


def finite_scale(f, scale: tuple[str, str]) -> torch.Tensor:
    """The FP8 scale (shard, key) of open file f; ValueError naming it if a multiplier is inf or NaN
    (every weight of its block would be: the model's output NaN)."""
    tensor = f.get_tensor(scale[1])
    if not bool(torch.isfinite(tensor).all()):
        raise ValueError(f"{scale[1]} in {scale[0]} holds multipliers that are not finite numbers")
    return tensor


def copy_weights(path: Path, plan, params: dict[str, torch.Tensor], progress: bool,
                 block: tuple[int, int] | None = None) -> None:
    """Copy each planned tensor (or this rank's part of it) into its parameter, an FP8 one
    dequantized first (qwen3/fp8.py), with a progress bar once loading has taken over a second."""
    total = sum(params[key].nbytes for _, keys in plan for key, _, _ in keys)
    with torch.no_grad(), tqdm(total=total, desc="loading weights", unit="B", unit_scale=True,
                               delay=PROGRESS_AFTER_S, disable=not progress) as bar:
        for shard, keys in plan:
            with _open(path / shard) as f:
                for key, index, scale in keys:
                    if scale is not None:
                        with _open(path / scale[0]) as g:
                            whole = dequantize(f.get_tensor(key), finite_scale(g, scale), block, params[key].dtype)
                        part = whole if index is None else whole[index]
                    else:
                        part = f.get_tensor(key) if index is None else f.get_slice(key)[index]
                        if key.endswith(SCALE_KEY):
                            finite_scale(f, (shard, key))
                    if part.shape != params[key].shape:  # a slicing rule of qwen3/parallel.py gone wrong
                        raise RuntimeError(f"{key}: read {tuple(part.shape)}, expected {tuple(params[key].shape)}")
                    params[key].copy_(part)
                    bar.update(params[key].nbytes)
