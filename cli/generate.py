"""Generate text with a Qwen3 checkpoint: qwen3-generate --prompt "def fibonacci(n):"
(from a checkout without installing: python scripts/generate.py --prompt ...)

One prompt's text streams to stdout as it is produced; a batch prints each prompt's text when all
are done. Prompt tokens, prefill time, decode speed and peak memory go to stderr. Without --model
it uses the small model shipped in weights/. A mistake ends in one line on stderr: exit status 2
for a bad flag (one the model or the device shows to be wrong included), 1 for any other error,
130 on Ctrl-C.

With --tensor-parallel, under torchrun, the model is split over the processes torchrun starts
(one per GPU, NCCL; or CPU processes, gloo): torchrun --nproc-per-node 2 scripts/generate.py
--tensor-parallel --prompt "def fibonacci(n):". Every rank generates the same tokens; rank 0 prints.
"""

import argparse
import os
import resource
import signal
import sys
import time
from pathlib import Path
from typing import NoReturn

from . import output
from .output import OutputError, Stdout, bad_flag, fail, interrupted, silence_stdout

try:  # these imports take seconds: Ctrl-C during them ends as it does anywhere else
    import torch
    import torch.distributed as dist

    from ops import IMPLS, KERNELS
    from qwen3 import Qwen3ForCausalLM
    from qwen3.loader import DTYPES
    from runtime.generate import pad_left, stop_ids
    from runtime.sampling import problem
    from runtime.text import TextStream, load_tokenizer, prompt_ids

    from . import model_flags
    from .model_flags import add_model_flags
except KeyboardInterrupt:
    sys.exit(interrupted())

FROM_CHECKPOINT = "default: the checkpoint's generation_config.json, else"


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """A bad flag is one line too (argparse's default prints the usage before it); status 2."""
        bad_flag(message)


def sampling_flag(name: str, parse):
    """An argparse type for the flag of sampling parameter `name`: checked by runtime.sampling's rule
    while the flags are parsed, before any model loads, and reported under the flag's name."""

    def convert(text: str):
        value = parse(text)
        wrong = problem(name, value)
        if wrong:
            raise argparse.ArgumentTypeError(wrong)
        return value

    convert.__name__ = parse.__name__  # argparse names it in "invalid float value: 'x'"
    return convert


def parse_args(argv=None, chat: bool = False) -> argparse.Namespace:
    """The flags; chat: qwen3-chat's (a conversation, always): its own help, without the prompt flags."""
    from . import chat as chat_mode

    p = Parser(prog=output.PROG, description=chat_mode.__doc__ if chat else __doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    only_generate = argparse.SUPPRESS if chat else None  # hidden from qwen3-chat's help
    p.add_argument("--prompt", action="append", metavar="TEXT",
                   help=only_generate or "prompt text; repeat it for a batch")
    p.add_argument("--prompt-file", type=Path, metavar="FILE",
                   help=only_generate or "a file with one prompt per line (blank lines skipped; - reads standard "
                                         "input), added to the batch after any --prompt")
    add_model_flags(p)
    p.add_argument("--norm", choices=IMPLS, default="auto",
                   help="RMSNorm implementation of every norm; auto: triton on CUDA, torch on the CPU (default: auto)")
    p.add_argument("--kernels", choices=KERNELS, default="auto",
                   help="fused: the Triton kernels of a step (projections with their norm, q/k-norm + RoPE, "
                        "attention, sampling); reference: transformers' operations one by one; auto: fused on CUDA, "
                        "reference on the CPU (default: auto)")
    p.add_argument("--device", default=None, metavar="DEVICE",
                   help="cpu, cuda, cuda:1 ... (default: cuda if available, else cpu)")
    p.add_argument("--dtype", choices=[*DTYPES, "auto"], default=None,
                   help="auto: the checkpoint's dtype (default: float32 on the CPU, the checkpoint's on a GPU)")
    p.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                   help="at most this many new tokens a reply (default: all the room the model's context leaves)"
                   if chat else "at most this many new tokens (default: 128; with --interactive, a reply may take "
                                "all the room the model's context leaves)")
    p.add_argument("--temperature", type=sampling_flag("temperature", float), metavar="T",
                   help=f"0 = greedy ({FROM_CHECKPOINT} 1)")
    p.add_argument("--top-k", type=sampling_flag("top_k", int), metavar="K",
                   help=f"sample from the k most likely tokens; 0 = off ({FROM_CHECKPOINT} 0)")
    p.add_argument("--top-p", type=sampling_flag("top_p", float), metavar="P",
                   help=f"sample from the most likely tokens that hold this probability; 1 = off ({FROM_CHECKPOINT} 1)")
    p.add_argument("--min-p", type=sampling_flag("min_p", float), metavar="P",
                   help=f"drop tokens less likely than this fraction of the best one; 0 = off ({FROM_CHECKPOINT} 0)")
    p.add_argument("--repetition-penalty", type=sampling_flag("repetition_penalty", float), metavar="R",
                   help=f"penalize tokens already present: divide their positive logits by R, multiply "
                        f"their negative ones; 1 = off ({FROM_CHECKPOINT} 1)")
    p.add_argument("--presence-penalty", type=sampling_flag("presence_penalty", float), metavar="P",
                   help=f"subtract from the logits of tokens already present; 0 = off ({FROM_CHECKPOINT} 0)")
    p.add_argument("--seed", type=sampling_flag("seed", int), default=None, metavar="N",
                   help="makes sampling reproducible (default: none)")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="CPU threads for the model's arithmetic (default: torch's, one per core); fewer when other "
                        "programs keep cores busy: each operation waits for its slowest thread")
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="replay each decode step from a CUDA graph captured once (default: on with CUDA; "
                        "--no-cuda-graph runs the step eagerly)")
    p.add_argument("--tensor-parallel", action="store_true",
                   help=only_generate or ("split the model over the processes torchrun starts (torchrun "
                                          "--nproc-per-node N generate.py --tensor-parallel ...): one GPU each with "
                                          "NCCL, or CPU processes with gloo; rank 0 prints"))
    # None until parsed: a flag the user gave is told apart from the default (see chat_note).
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap prompts in the tokenizer's chat template when it has one (default: on)")
    p.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=None,
                   help="let the model think first (Qwen3's enable_thinking; default: on)")
    p.add_argument("--interactive", action="store_true",
                   help=only_generate or ("a conversation in the terminal (qwen3-chat): each line you type is a turn, "
                                          "the reply streams as it is made, the history kept across turns; /reset "
                                          "starts over, /exit or Ctrl-D ends, /help lists the commands, Ctrl-C stops a "
                                          "reply"))
    args = p.parse_args(argv)
    args.interactive |= chat
    mode = "the chat" if chat else "--interactive"
    if args.interactive and (args.prompt or args.prompt_file):
        p.error(f"{mode} reads its prompts from the terminal: drop --prompt and --prompt-file")
    if args.interactive and args.tensor_parallel:
        p.error(f"{mode} runs in one process: drop --tensor-parallel")
    if args.prompt and "" in args.prompt:
        p.error("--prompt must not be empty")
    if args.prompt_file:
        try:
            lines = [line for line in read_prompt_file(args.prompt_file).splitlines() if line.strip()]
        except (OSError, UnicodeDecodeError) as err:
            p.error(f"cannot read --prompt-file: {err}")
        if not lines:
            p.error(f"--prompt-file {args.prompt_file} has no prompts: it is empty or blank")
        args.prompt = (args.prompt or []) + lines
    if args.device is not None and not args.device.strip():
        p.error("--device must not be empty: cpu, cuda, cuda:1 ...")
    if not args.prompt and not args.interactive:
        p.error("give at least one --prompt (or --prompt-file), or --interactive for a conversation")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        p.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.max_new_tokens is None and not args.interactive:
        args.max_new_tokens = 128
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    if args.tensor_parallel and "WORLD_SIZE" not in os.environ:
        p.error("--tensor-parallel runs under torchrun, which starts one process per rank: "
                "torchrun --nproc-per-node 2 scripts/generate.py --tensor-parallel ...")
    return args


def read_prompt_file(path: Path) -> str:
    """The text of --prompt-file: standard input for "-", as tools take it; UTF-8, a byte-order
    mark (which editors on Windows write first) dropped rather than kept in the first prompt."""
    data = sys.stdin.buffer.read() if str(path) == "-" else path.read_bytes()
    return data.decode("utf-8-sig")


def header_text(prompt: str) -> str:
    """A prompt as its batch header shows it, on one line: as typed when every character prints
    as itself, else as a Python string literal (a line break shows as \\n, a tab as \\t), so that
    the header stays one line and the prompt can still be read exactly."""
    return prompt if prompt.isprintable() else repr(prompt)


def chat_note(args: argparse.Namespace, tokenizer) -> str | None:
    """What to tell a user who asked for the chat template (--chat, or --thinking/--no-thinking
    without --no-chat) of a model that has none; None when there is nothing to say. The defaults
    ask for nothing: a base model (the shipped one) runs its plain prompt without a word."""
    if tokenizer.chat_template:
        return None
    asked = ["--chat"] if args.chat else []
    if args.thinking is not None and args.chat is not False:
        asked.append("--thinking" if args.thinking else "--no-thinking")
    if not asked:
        return None
    return (f"{args.model} has no chat template, so {' and '.join(asked)} "
            f"{'changes' if len(asked) == 1 else 'change'} nothing: "
            "the prompt is used as plain text")


def run(args: argparse.Namespace, out: Stdout) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        device, norm, kernels = model_flags.resolve_run_flags(args)
    except ValueError as err:
        bad_flag(str(err))
    if args.tensor_parallel:  # torchrun's environment names the ranks; one GPU per process
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                device_id=device if device.type == "cuda" else None)
    show = not args.tensor_parallel or dist.get_rank() == 0  # what one process prints, only rank 0 prints
    checkpoint = find_checkpoint(args.model, args.revision)
    try:
        tokenizer = load_tokenizer(checkpoint)
        model = Qwen3ForCausalLM.from_pretrained(checkpoint, dtype=args.dtype, device=device, norm_impl=args.norm,
                                                 kernels=args.kernels, progress=show,
                                                 tensor_parallel=args.tensor_parallel, quantization=args.quantization)
    except (OSError, ValueError, torch.OutOfMemoryError) as err:
        fail(f"cannot load {args.model}: {err}")

    if args.interactive:
        from .chat import converse

        converse(model, tokenizer, args, out)
        return
    note = chat_note(args, tokenizer)
    if note and show:
        print(f"{output.PROG}: note: {note}", file=sys.stderr)
    chat, thinking = args.chat is not False, args.thinking is not False  # both on by default
    rows = [prompt_ids(tokenizer, p, chat=chat, thinking=thinking) for p in args.prompt]
    for prompt, row in zip(args.prompt, rows):
        if not row:
            bad_flag(f"--prompt: the prompt {prompt!r} encodes to no tokens")
    check_context(max(len(row) for row in rows), args.max_new_tokens, model.config.max_position_embeddings)
    eos = stop_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos, default=0)
    input_ids, attention_mask = pad_left(rows, pad)

    streams = [TextStream(tokenizer) for _ in rows]
    texts: list[list[str]] = [[] for _ in rows]  # each row's text, piece by piece
    stamps: list[float] = []
    finished = [False] * len(rows)

    def on_token(new: torch.Tensor) -> None:
        stamps.append(time.perf_counter())
        for i, token in enumerate(new.tolist()):
            if finished[i]:
                continue
            finished[i] = token in eos
            texts[i].append(streams[i].push(token))
        if len(rows) == 1 and show:
            out.write(texts[0][-1])

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    try:
        model.generate(
            input_ids, max_new_tokens=args.max_new_tokens, attention_mask=attention_mask,
            eos_token_id=sorted(eos) or None, pad_token_id=pad, seed=args.seed, on_token=on_token,
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
            repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
            cuda_graph=args.cuda_graph,
        )
    except (ValueError, torch.OutOfMemoryError) as err:
        fail(err)
    for stream, text in zip(streams, texts):
        text.append(stream.flush())  # what push held back: an unfinished multi-byte character
    if not show:
        return
    if len(rows) == 1:
        out.write(texts[0][-1] + "\n")
    else:
        for i, (prompt, text) in enumerate(zip(args.prompt, texts)):
            out.write(f"=== [{i}] {header_text(prompt)}\n{''.join(text)}\n")

    prefill_ms = (stamps[0] - start) * 1e3
    decode_steps = len(stamps) - 1  # the prefill gives the first token; every later one is a decode step
    decode = "no decode steps"  # one new token (--max-new-tokens 1, or an end at the first): no rate to give
    if decode_steps:
        rate = decode_steps / (stamps[-1] - stamps[0])
        decode = f"{decode_steps} decode steps at {rate:.1f} steps/s ({rate * len(rows):.1f} tok/s)"
    if device.type == "cuda":
        peak = f"{torch.cuda.max_memory_allocated(device) / 2**20:.0f} MiB GPU"
    else:
        peak = f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:.0f} MiB RSS"
    dtype = str(model.lm_head.weight.dtype).removeprefix("torch.")
    if model.fp8_block is not None:
        dtype += " with FP8 projections"
    parallel = f", tensor parallel over {model.tp.size} ranks" if model.tp else ""
    print(
        f"[{len(rows)} prompt(s), {int(attention_mask.sum())} prompt tokens, prefill {prefill_ms:.1f} ms, "
        f"{decode}, peak {peak}, {device} {dtype}, norm {norm}, kernels {kernels}{parallel}]",
        file=sys.stderr,
    )


def find_checkpoint(model: str, revision: str | None) -> Path:
    """The checkpoint directory --model names, or the exit with one line: a bad flag (status 2), a
    failed download (1)."""
    try:
        checkpoint = model_flags.find_checkpoint(model, revision, stop=stop_at_once)
    except ValueError as err:
        bad_flag(err)
    except OSError as err:
        fail(f"cannot load {model}: {err}")
    return checkpoint


def stop_at_once(sig: int) -> None:
    """Ctrl-C (or SIGTERM) while a model downloads: the one line, and the exit without waiting for
    the download's threads."""
    os.write(2, f"{output.PROG}: interrupted\n".encode())
    os._exit(130 if sig == signal.SIGINT else 128 + sig)


def check_context(longest_prompt: int, max_new_tokens: int, context: int) -> None:
    """A bad flag (status 2) unless the longest prompt and its new tokens fit the model's context."""
    if longest_prompt >= context:
        bad_flag(f"--prompt: a prompt of {longest_prompt} tokens exceeds the model's context of {context} "
                 "tokens (max_position_embeddings), with no room for a new one")
    if longest_prompt + max_new_tokens > context:
        bad_flag(f"--max-new-tokens {max_new_tokens}: the longest prompt ({longest_prompt} tokens) and "
                 f"{max_new_tokens} new tokens exceed the model's context of {context} tokens; at most "
                 f"{context - longest_prompt} fit")


def main(argv=None, prog: str = "generate.py", chat: bool = False) -> int:
    """The command; chat: qwen3-chat's (parse_args)."""
    output.PROG = prog
    if sys.stdout is None:  # started with stdout closed (`>&-`): the text has nowhere to go
        print(f"{output.PROG}: error: standard output is closed, so the text has nowhere to go", file=sys.stderr)
        return 1
    out = Stdout()
    try:
        run(parse_args(argv, chat), out)
        if dist.is_initialized():
            dist.destroy_process_group()
    except KeyboardInterrupt:
        try:
            out.end_line()  # the interruption's line does not start on a line of text
        except (OSError, OutputError):
            pass
        return interrupted()
    except BrokenPipeError:
        # The reader of stdout has gone (`| head`): stop quietly, as cat does.
        silence_stdout()
        return 141  # 128 + SIGPIPE, what a shell reports for cat stopped the same way
    except OutputError as err:  # `> /dev/full`
        silence_stdout()
        print(f"{output.PROG}: error: cannot write to standard output: {err}", file=sys.stderr)
        return 1
    return 0
