"""The flags every command shares: --model and --revision (a checkpoint directory, or a Hugging Face
repo id resolved through huggingface_hub's cache: qwen3/hub.py), and where and how the model runs
(--device, --cuda-graph, --norm, --kernels), checked alike."""

import argparse
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from ops import resolve_impl, resolve_kernels
from qwen3.hub import resolve_checkpoint
from qwen3.loader import resolve_device

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "weights" / "qwen3-stdlib-tiny"  # in a checkout


def add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=str(DEFAULT_MODEL), metavar="DIR|REPO",
                   help="a checkpoint directory in Hugging Face layout, or a Hugging Face repo id (Qwen/Qwen3-8B): "
                        "downloaded once into huggingface_hub's cache (HF_HOME), only the files the model needs; "
                        "HF_HUB_OFFLINE=1 reads the cache alone. A directory that exists wins over a repo id "
                        "(default: weights/qwen3-stdlib-tiny, the shipped model)")
    p.add_argument("--revision", default=None, metavar="REV",
                   help="the branch, tag or commit of a --model repo id (default: its main branch)")
    p.add_argument("--quantization", choices=["fp8"], default=None,
                   help="fp8: quantize a floating-point checkpoint's decoder projections as it loads, in Qwen's "
                        "FP8 format (128 x 128 blocks): on a GPU of compute capability 8.9+ with the fused kernels, "
                        "half the weights' memory and bytes per decode step. An FP8 checkpoint (Qwen3-*-FP8) "
                        "is FP8 without it (default: the checkpoint's weights as they are)")


def resolve_run_flags(args: argparse.Namespace) -> tuple:
    """(device, norm, kernels) from --device (default: cuda where there is one), --norm and
    --kernels, with --cuda-graph checked against the device. ValueError naming the flag: a bad
    flag's one line (status 2)."""
    try:
        device = resolve_device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except ValueError as err:
        raise ValueError(f"--device: {err}") from None
    if args.cuda_graph and device.type != "cuda":
        raise ValueError(f"--cuda-graph needs a CUDA device, and the model runs on {device} (use --device cuda)")
    resolved = []
    for flag, value, resolve in (("--norm", args.norm, resolve_impl), ("--kernels", args.kernels, resolve_kernels)):
        try:
            resolved.append(resolve(value, device))
        except ValueError as err:
            raise ValueError(f"{flag} {value}: {err}") from None
    return device, *resolved


def find_checkpoint(model: str, revision: str | None, stop: Callable[[int], None]) -> Path:
    """The checkpoint directory --model names. ValueError, a bad flag's one line (status 2), when
    there is none: the default outside a checkout (installed from a wheel), no such directory or
    repo, a repo offline and not in the cache, a directory with no config.json. OSError when a
    download fails (status 1).

    While a repo downloads, SIGINT and SIGTERM call stop(signal), which must end the process at once
    (os._exit): huggingface_hub answers Ctrl-C only once the files in flight have finished, minutes
    for a model's shards; what a download leaves behind resumes the next time."""
    if model == str(DEFAULT_MODEL) and not DEFAULT_MODEL.is_dir():
        raise ValueError("no --model given, and the shipped model (weights/qwen3-stdlib-tiny) is only in a checkout "
                         "of the repository: pass --model DIR, or a Hugging Face repo id such as Qwen/Qwen3-0.6B")
    main_thread = threading.current_thread() is threading.main_thread()  # where Python runs signal handlers
    signals = (signal.SIGINT, signal.SIGTERM) if main_thread else ()
    before = {sig: signal.signal(sig, lambda sig, frame: stop(sig)) for sig in signals}
    try:
        checkpoint = resolve_checkpoint(model, revision)
    except (ValueError, FileNotFoundError) as err:
        raise ValueError(f"--model: {err}") from None
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    if not (checkpoint / "config.json").is_file():
        raise ValueError(f"--model: no model at {model}: it has no config.json (pass --model DIR with a Hugging "
                         "Face Qwen3 checkpoint, or train one with scripts/train_tiny.py)")
    return checkpoint
