"""A Qwen3 checkpoint (bf16 or fp32, dense or MoE, one file or sharded) -> an FP8 checkpoint in
the format of Qwen's own (Qwen3-*-FP8), which `from_pretrained`, transformers and vLLM load:

    python scripts/quantize_fp8.py CHECKPOINT OUT [--block 128 128]

Every linear weight of the decoder layers (attention q/k/v/o, the MLP's or each expert's
gate/up/down) becomes float8_e4m3fn with a float32 `weight_scale_inv` per block
(qwen3/fp8.py: amax / 448); embeddings, norms, the LM head and the MoE router are copied as they
are. The shards keep their names (an index gets the scales' entries); config.json gets the
quantization_config; the tokenizer's and generation files are copied.

OUT must be a new (or empty) directory: the checkpoint is written inside it under a hidden
name and moved up once whole; a run that fails or is stopped (Ctrl-C, SIGTERM) removes what it
wrote and the directories it made, and never changes the source's files. Blocks: this project loads
any size; its fused FP8 kernels take sides that are powers of two >= 16 (other sizes load
dequantized, at the bf16 model's memory), and transformers' FP8 loader reads the block size
from the scales' grid, so it needs every weight's sides to be whole blocks (Qwen's models are,
at 128).
"""

import argparse
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path

from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ops.linear.fp8 import kernel_block  # noqa: E402
from qwen3.fp8 import SCALE_KEY, quantize  # noqa: E402
from qwen3.loader import checkpoint_files  # noqa: E402

# The weights quantized: a decoder layer's linear projections (an expert's too), not the router (mlp.gate).
QUANTIZED = re.compile(r"model\.layers\.\d+\."
                       r"(self_attn\.[qkvo]_proj|mlp\.(experts\.\d+\.)?(gate|up|down)_proj)\.weight")
INDEX = "model.safetensors.index.json"


def quantize_checkpoint(source: Path, out: Path, block: tuple[int, int]) -> None:
    """Write the FP8 checkpoint of source into the existing, empty directory out."""
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


def read_config(checkpoint: Path) -> dict:
    """The checkpoint's config.json; ValueError naming what is wrong."""
    file = checkpoint / "config.json"
    if not file.is_file():
        raise ValueError(f"no config.json in {checkpoint}")
    try:
        config = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{file} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file} must hold a JSON object, not {type(config).__name__}")
    if "quantization_config" in config:
        raise ValueError(f"{checkpoint} is already quantized (its config.json has a quantization_config)")
    return config


def check_out(checkpoint: Path, out: Path) -> None:
    """ValueError unless out is a directory that may be written: not the checkpoint's, new or empty."""
    if out.resolve() == checkpoint.resolve():
        raise ValueError(f"OUT {out} is the checkpoint itself: write the FP8 checkpoint to a new directory")
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise ValueError(f"OUT {out} exists and is not an empty directory: pick a new one (or empty it)")


class Output:
    """OUT as the run writes it: the checkpoint goes to a hidden folder inside OUT (OUT may be a
    mount point or a link: never replaced) and moves up once whole; `remove()` takes away what
    the run wrote and the folders it made, leaving OUT as it found it."""

    def __init__(self, out: Path):
        self.out, self.made, self.moved = out, [], []
        path = out
        while not path.exists():
            self.made.append(path)  # deepest first
            path = path.parent
        out.mkdir(parents=True, exist_ok=True)
        self.partial = Path(tempfile.mkdtemp(prefix=".partial-", dir=out))

    def publish(self) -> None:
        """Move the files up into OUT, each readable as config.json is (written under the user's
        umask; safetensors writes its files for their owner alone)."""
        mode = (self.partial / "config.json").stat().st_mode & 0o777
        for path in sorted(self.partial.iterdir()):
            path.chmod(mode)
            path.replace(self.out / path.name)
            self.moved.append(self.out / path.name)
        self.partial.rmdir()

    def remove(self) -> None:
        shutil.rmtree(self.partial, ignore_errors=True)
        for path in self.moved:
            path.unlink(missing_ok=True)
        for path in self.made:
            try:
                path.rmdir()
            except OSError:
                break  # not empty: someone else's files, or an ancestor of those


def terminated(sig: int, frame) -> None:
    """SIGTERM (kill, a supervisor) as Ctrl-C is: the run stops, cleaning up what it wrote, and
    exits with the status a shell reports for it."""
    os.write(2, f"quantize_fp8.py: {signal.Signals(sig).name}: stopped\n".encode())
    raise SystemExit(128 + sig)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="quantize_fp8.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--block", type=int, nargs=2, default=[128, 128], metavar=("ROWS", "COLS"))
    args = p.parse_args(argv)
    if min(args.block) < 1:
        p.error(f"--block must be two positive integers, got {' '.join(map(str, args.block))}")
    block = tuple(args.block)
    try:
        read_config(args.checkpoint)
        check_out(args.checkpoint, args.out)
    except (OSError, ValueError) as err:
        sys.exit(f"quantize_fp8.py: error: {err}")
    in_main = threading.current_thread() is threading.main_thread()  # only its handlers can be set
    previous = signal.signal(signal.SIGTERM, terminated) if in_main else None
    stops = {signal.SIGINT, signal.SIGTERM}
    output = None
    try:
        output = Output(args.out)
        quantize_checkpoint(args.checkpoint, output.partial, block)
        if in_main:  # a stop midway through the moves would leave a half checkpoint: held off till done
            signal.pthread_sigmask(signal.SIG_BLOCK, stops)
        output.publish()
    except BaseException as err:
        if in_main:
            signal.pthread_sigmask(signal.SIG_BLOCK, stops)  # a second stop must not cut the cleanup short
        if output is not None:
            output.remove()
        if isinstance(err, (OSError, ValueError, SafetensorError)):
            sys.exit(f"quantize_fp8.py: error: cannot quantize {args.checkpoint}: {' '.join(str(err).split())}")
        raise
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)  # a stop held off now lands: the checkpoint is whole
    if not kernel_block(block):
        print(f"quantize_fp8.py: note: blocks of {block[0]} x {block[1]}: the fused FP8 kernels take sides that "
              "are powers of two >= 16, so this checkpoint loads dequantized (the bf16 model's memory)",
              file=sys.stderr)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # what it wrote is gone (main), or the checkpoint was already whole
        print("quantize_fp8.py: interrupted", file=sys.stderr)
        sys.exit(130)  # 128 + SIGINT, as a shell reports it
