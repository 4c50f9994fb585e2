"""Qwen3Config: the hyperparameters of a Qwen3 (dense or Qwen3-MoE), read from a Hugging Face config.json.

Accepts both the old field names (rope_theta, rope_scaling, torch_dtype) and transformers 5's
(rope_parameters, dtype). What the model cannot run is refused here, at load time, with a
message that says why, never run wrongly.
"""

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import ops

SUPPORTED_ROPE_TYPES = ("default", "yarn")
# The sizes a config.json must state; every other field has Qwen3's default, as in transformers.
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
SUPPORTED_MODELS = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}  # model_type: architecture
SIZES = REQUIRED + ("num_key_value_heads", "head_dim", "max_position_embeddings")  # integers >= 1
NUMBERS = {"rms_norm_eps": (0.0, ">= 0"), "rope_theta": (None, "> 0")}  # finite numbers: (least, wording)


def size_problem(values: dict) -> str | None:
    """What is wrong with the sizes and positive numbers among values (a config's fields), or None."""
    for key in SIZES:
        value = values.get(key, 1)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            return f"{key} must be an integer >= 1, got {value!r}"
    for key, (least, must) in NUMBERS.items():
        value = values.get(key, 1.0)
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not number or (value < least if least is not None else value <= 0):
            return f"{key} must be a finite number {must}, got {value!r}"
    return None
@dataclass
class Qwen3Config:
    vocab_size: int = 151936
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 128  # explicit: Qwen3-0.6B has 16 heads x 128 = 2048, not hidden_size 1024
    max_position_embeddings: int = 40960
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    # None for plain RoPE, or {"rope_type": "yarn", "factor": ..., "original_max_position_embeddings": ...}
    rope_scaling: dict | None = None
    attention_bias: bool = False
    tie_word_embeddings: bool = True
    dtype: str | None = None  # the checkpoint's dtype, as config.json states it (None: it does not)
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    norm_impl: str = "auto"  # "auto" | "torch" | "triton" | "cuda": every RMSNorm module in the model
    kernels: str = "auto"  # "auto" | "fused" | "reference" (ops.KERNELS): what computes inference steps

    # Mixture of experts (Qwen3-MoE, model_type "qwen3_moe"); num_experts = 0: every MLP is dense.
    # Layer i is sparse unless i is in mlp_only_layers, when (i + 1) % decoder_sparse_step == 0.
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k experts per token
    moe_intermediate_size: int = 0  # each expert's SwiGLU width (intermediate_size: the dense layers')
    norm_topk_prob: bool = False  # renormalize the top-k routing probabilities to sum to 1
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if (wrong := size_problem(asdict(self))) is not None:
            raise ValueError(wrong)
        if self.norm_impl not in ops.IMPLS:
            raise ValueError(f"norm_impl must be one of {ops.IMPLS}, got {self.norm_impl!r}")
        if self.kernels not in ops.KERNELS:
            raise ValueError(f"kernels must be one of {ops.KERNELS}, got {self.kernels!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope scaling type {rope_type!r} is not implemented; supported: {SUPPORTED_ROPE_TYPES}"
            )
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                                 f"got {self.num_experts_per_tok}")
            if self.moe_intermediate_size < 1 or self.decoder_sparse_step < 1:
                raise ValueError(
                    f"moe_intermediate_size ({self.moe_intermediate_size}) and decoder_sparse_step "
                    f"({self.decoder_sparse_step}) must be >= 1"
                )

    @classmethod
    def from_dict(cls, raw: dict, source: str = "the config", **overrides) -> "Qwen3Config":
        """Build from a config.json dict, checking that it describes a model this code can run.
        `source` names the dict in error messages (from_json passes the file's path)."""
        raw = dict(raw)
        model_type = raw.get("model_type", "qwen3")
        architectures = raw.get("architectures") or [SUPPORTED_MODELS.get(model_type)]
        if model_type not in SUPPORTED_MODELS or architectures != [SUPPORTED_MODELS[model_type]]:
            raise ValueError(
                f"unsupported model: architectures={architectures}, model_type={model_type!r}; this code runs "
                + " and ".join(f"{arch} (model_type {kind!r})" for kind, arch in SUPPORTED_MODELS.items())
                + " checkpoints only"
            )
        missing = [key for key in REQUIRED if key not in raw]
        if missing:
            raise ValueError(f"{source} is missing {', '.join(map(repr, missing))}")
        rope_theta = (raw.get("rope_parameters") or raw.get("rope_scaling") or {}).get("rope_theta")
        if (wrong := size_problem({**raw, **({"rope_theta": rope_theta} if rope_theta is not None else {})})):
            raise ValueError(f"{source}: {wrong}")
        if model_type == "qwen3_moe":  # transformers 5 writes num_experts as num_local_experts; its defaults
            experts = raw.pop("num_local_experts", None)
            raw["num_experts"] = experts if experts is not None else raw.get("num_experts", 128)
            raw.setdefault("num_experts_per_tok", 8)
            raw.setdefault("moe_intermediate_size", 768)
            raw["mlp_only_layers"] = list(raw.get("mlp_only_layers") or [])
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {raw['hidden_act']!r}; Qwen3 uses 'silu'")
        layer_types = set(raw.get("layer_types") or ["full_attention"])
        if raw.get("use_sliding_window") or layer_types != {"full_attention"}:
            raise ValueError("sliding-window attention is switched on in this config; it is not implemented")

        # transformers 5 folds rope_theta and rope_scaling into rope_parameters.
        rope = dict(raw.pop("rope_parameters", None) or raw.get("rope_scaling") or {})
        rope_theta = rope.pop("rope_theta", raw.get("rope_theta", cls.rope_theta))
        rope_type = rope.pop("rope_type", rope.pop("type", "default"))
        if rope_type == "yarn":  # transformers' default for the pretraining context YaRN stretches
            rope.setdefault("original_max_position_embeddings",
                            raw.get("original_max_position_embeddings",
                                    raw.get("max_position_embeddings", cls.max_position_embeddings)))
        raw["rope_theta"] = rope_theta
        raw["rope_scaling"] = {"rope_type": rope_type, **rope} if rope_type != "default" else None
        raw["dtype"] = raw.get("dtype") or raw.pop("torch_dtype", None)
        raw.setdefault("head_dim", raw["hidden_size"] // raw["num_attention_heads"])
        raw.setdefault("num_key_value_heads", raw["num_attention_heads"])
        raw.update(overrides)

        known = {f.name for f in fields(cls)}  # other config.json fields do not affect the model
        return cls(**{k: v for k, v in raw.items() if k in known})

    @classmethod
    def from_json(cls, path: str | Path, **overrides) -> "Qwen3Config":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"no config.json at {path}") from None
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON: {err}") from None
        return cls.from_dict(raw, source=str(path), **overrides)

    def to_dict(self) -> dict:
        return asdict(self)
