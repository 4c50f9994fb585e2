"""A Qwen3 checkpoint (bf16 or fp32, dense or MoE, one file or sharded) -> an FP8 checkpoint in
the format of Qwen's own (Qwen3-*-FP8), which `from_pretrained`, transformers and vLLM load:

    python scripts/quantize_fp8.py CHECKPOINT OUT [--block 128 128]

Every linear weight of the decoder layers (attention q/k/v/o, the MLP's or each expert's
gate/up/down) becomes float8_e4m3fn with a float32 `weight_scale_inv` per block
(qwen3/fp8.py: amax / 448); embeddings, norms, the LM head and the MoE router are copied as they
are. The shards keep their names (an index gets the scales' entries); config.json gets the
quantization_config; the tokenizer's and generation files are copied.
"""

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from qwen3.fp8 import SCALE_KEY, quantize  # noqa: E402
from qwen3.loader import checkpoint_files  # noqa: E402

# The weights quantized: a decoder layer's linear projections (an expert's too), not the router (mlp.gate).
QUANTIZED = re.compile(r"model\.layers\.\d+\."
                       r"(self_attn\.[qkvo]_proj|mlp\.(experts\.\d+\.)?(gate|up|down)_proj)\.weight")
INDEX = "model.safetensors.index.json"


def quantize_checkpoint(source: Path, out: Path, block: tuple[int, int]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for shard in checkpoint_files(source):
        tensors = {}
        with safe_open(source / shard, framework="pt") as f:
            for key in f.keys():
                tensor = f.get_tensor(key)
                if QUANTIZED.fullmatch(key):
                    tensors[key], tensors[key.removesuffix("weight") + SCALE_KEY] = quantize(tensor, block)
                else:
                    tensors[key] = tensor
        save_file(tensors, out / shard, metadata={"format": "pt"})
        weight_map |= {key: shard for key in tensors}
    if (source / INDEX).is_file():
        index = json.loads((source / INDEX).read_text())
        index["weight_map"] = dict(sorted(weight_map.items()))
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for path in source.iterdir():
        if path.is_file() and not path.name.endswith(".safetensors") and path.name not in (INDEX, "config.json"):
            shutil.copy(path, out / path.name)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--block", type=int, nargs=2, default=[128, 128], metavar=("ROWS", "COLS"))
    args = p.parse_args(argv)
    if not (args.checkpoint / "config.json").is_file():
        sys.exit(f"quantize_fp8.py: error: no config.json in {args.checkpoint}")
    if "quantization_config" in json.loads((args.checkpoint / "config.json").read_text()):
        sys.exit(f"quantize_fp8.py: error: {args.checkpoint} is already quantized")
    if min(args.block) < 1:
        sys.exit(f"quantize_fp8.py: error: --block must be two positive integers, got {args.block}")
    quantize_checkpoint(args.checkpoint, args.out, tuple(args.block))


if __name__ == "__main__":
    main()
