"""scripts/generate.py end to end on a checkpoint and tokenizer made here (and the --help of both
front ends, generate.py and serve.py): its main() called in this process with the text it writes to
the file descriptors of stdout and stderr and its exit status, as a shell sees them; in a process of
its own where the process is what is tested (a signal, a closed pipe, a full disk, a closed stdout)."""

import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoints import hf_model, save, save_tokenizer
from in_process import call_main

from ops import resolve_impl
from runtime.text import TextStream, load_tokenizer, prompt_ids

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli-model")
    save(hf_model(seed=21), path)
    return save_tokenizer(path)


@pytest.fixture(scope="module")
def base_model_dir(model_dir, tmp_path_factory):
    """model_dir's weights with a tokenizer that has no chat template, as a base model's."""
    path = tmp_path_factory.mktemp("cli-base-model")
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        (path / name).symlink_to(model_dir / name)
    return save_tokenizer(path, chat=False)


def test_chat_prompt_is_the_tokenizers_chat_template(model_dir):
    tok = load_tokenizer(model_dir)
    messages = [{"role": "user", "content": "Write a loop"}]
    for thinking in (True, False):
        expected = tok.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=thinking,
                                           tokenize=False)
        assert tok.decode(prompt_ids(tok, "Write a loop", chat=True, thinking=thinking)) == expected
    assert "<think>" in tok.decode(prompt_ids(tok, "x", thinking=False))
    assert "<think>" not in tok.decode(prompt_ids(tok, "x", thinking=True))
    assert tok.decode(prompt_ids(tok, "def f():", chat=False)) == "def f():"


def test_stream_never_splits_a_multibyte_character(model_dir):
    tok = load_tokenizer(model_dir)
    text = "naïve café 你好 🙂!"
    stream = TextStream(tok)
    pieces = [stream.push(t) for t in tok(text, add_special_tokens=False)["input_ids"]]
    assert "".join(pieces) + stream.flush() == text
    assert all("\ufffd" not in p for p in pieces)


def test_flush_returns_what_push_held_back():
    """The stream ends inside a character (é's last byte-token never comes): flush gives it out."""
    tok = load_tokenizer(ROOT / "weights" / "qwen3-stdlib-tiny")  # byte-level BPE: é is two byte-tokens
    ids = tok("café", add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(ids[-2:]) == ["Ã", "©"]  # é's bytes C3 A9
    stream = TextStream(tok)
    assert [stream.push(t) for t in ids[:-1]] == ["ca", "f", ""]
    assert stream.flush() == "\ufffd"
    assert stream.flush() == ""
    whole = TextStream(tok)
    assert "".join(whole.push(t) for t in ids) == "café" and whole.flush() == ""


def test_generates_and_reports_timing(model_dir, run_cli):
    result = run_cli("--model", str(model_dir), "--prompt", "def add(a, b):", "--max-new-tokens", "12",
                     "--temperature", "0", "--no-chat", "--norm", "triton", "--kernels", "fused")
    assert result.returncode == 0, result.stderr
    assert "prompt tokens" in result.stderr and "prefill" in result.stderr and "tok/s" in result.stderr
    assert "norm triton, kernels fused]" in result.stderr
    greedy = result.stdout
    again = run_cli("--model", str(model_dir), "--prompt", "def add(a, b):", "--max-new-tokens", "12",
                    "--temperature", "0", "--no-chat", "--norm", "torch", "--kernels", "reference")
    assert again.stdout == greedy  # neither the norm switch nor the kernels switch changes greedy text
    assert len(greedy.strip()) > 0
    one_thread = run_cli("--model", str(model_dir), "--prompt", "def add(a, b):", "--max-new-tokens", "12",
                         "--temperature", "0", "--no-chat", "--threads", "1")
    assert one_thread.stdout == greedy


def test_batch_prints_each_prompts_text_as_it_is_generated_alone(model_dir, tmp_path, run_cli):
    """Each row of a batch (one --prompt, one from --prompt-file, of different lengths) prints the
    text that its prompt alone prints; the summary counts the real prompt tokens, not padding."""
    prompts = ["def add(a, b):", "x"]
    greedy = ["--model", str(model_dir), "--max-new-tokens", "12", "--temperature", "0", "--no-chat",
              "--device", "cpu"]
    alone = [run_cli(*greedy, "--prompt", p) for p in prompts]
    for result in alone:
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip(), "no text generated"
    (tmp_path / "prompts.txt").write_text(prompts[1] + "\n")
    batch = run_cli(*greedy, "--prompt", prompts[0], "--prompt-file", str(tmp_path / "prompts.txt"))
    assert batch.returncode == 0, batch.stderr
    assert batch.stdout == "".join(f"=== [{i}] {p}\n{r.stdout}" for i, (p, r) in enumerate(zip(prompts, alone)))
    tok = load_tokenizer(model_dir)
    n_tokens = sum(len(prompt_ids(tok, p, chat=False)) for p in prompts)
    assert f"[2 prompt(s), {n_tokens} prompt tokens," in batch.stderr
    assert "norm torch, kernels reference]" in batch.stderr  # auto, resolved for the CPU


def test_a_batch_header_shows_a_multiline_prompt_on_one_line(model_dir, run_cli):
    """A prompt whose characters do not all print as themselves (a line break) is shown as a
    Python string literal, so that its `=== [i]` header stays one line; a plain one as typed."""
    prompts = ["def add(a, b):\n    return", "x"]
    result = run_cli("--model", str(model_dir), "--prompt", prompts[0], "--prompt", prompts[1],
                     "--max-new-tokens", "2", "--temperature", "0", "--no-chat")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"=== [0] {prompts[0]!r}\n"), result.stdout
    assert "\n=== [1] x\n" in result.stdout, result.stdout


def test_one_new_token_reports_no_decode_rate(model_dir, run_cli):
    """--max-new-tokens 1: the prefill gives the only token, so there is no decode step to time."""
    result = run_cli("--model", str(model_dir), "--prompt", "x", "--max-new-tokens", "1", "--no-chat")
    assert result.returncode == 0, result.stderr
    [summary] = result.stderr.splitlines()
    assert "no decode steps" in summary and "nan" not in summary and "steps/s" not in summary, summary


def test_chat_flags_on_a_model_without_a_chat_template_say_so(base_model_dir, run_cli):
    """--chat or --thinking asked of a base model: one note on stderr, and the plain prompt's text,
    as the defaults give it; the defaults themselves say nothing."""
    greedy = ["--model", str(base_model_dir), "--prompt", "def add(a, b):", "--max-new-tokens", "4",
              "--temperature", "0"]
    default = run_cli(*greedy)
    assert default.returncode == 0, default.stderr
    assert "chat template" not in default.stderr, default.stderr
    for flags, named in ((["--chat", "--no-thinking"], "--chat and --no-thinking change"),
                         (["--thinking"], "--thinking changes")):
        result = run_cli(*greedy, *flags)
        assert result.returncode == 0, result.stderr
        assert result.stdout == default.stdout
        note, _summary = result.stderr.splitlines()
        assert note == (f"generate.py: note: {base_model_dir} has no chat template, so {named} nothing: "
                        "the prompt is used as plain text"), note


def test_seeded_sampling_repeats(model_dir, run_cli):
    args = ["--model", str(model_dir), "--prompt", "import os", "--prompt", "for i in range(3):",
            "--max-new-tokens", "8", "--seed", "7", "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9",
            "--chat", "--no-thinking"]
    first, second = run_cli(*args), run_cli(*args)
    assert first.returncode == 0, first.stderr
    assert "=== [0] import os\n" in first.stdout and "=== [1] for i in range(3):\n" in first.stdout
    assert first.stdout == second.stdout


def test_auto_norm_is_triton_on_cuda_and_torch_on_the_cpu():
    assert resolve_impl("auto", torch.device("cuda")) == "triton"
    assert resolve_impl("auto", torch.device("cuda", 1)) == "triton"
    assert resolve_impl("auto", torch.device("cpu")) == "torch"


@pytest.mark.parametrize("script, without_default", [
    ("generate", {"--help", "--prompt", "--prompt-file", "--tensor-parallel", "--interactive"}),
    ("serve", {"--help"}),
])
def test_help_shows_every_flags_default(script, without_default, capfd):
    """Each flag that --help lists says its default (but those that have none: the prompts, a switch)."""
    module = importlib.import_module(f"cli.{script}")
    result = call_main(module.parse_args, ["--help"], capfd)
    assert result.returncode == 0, result.stderr
    entries = re.split(r"\n  (?=-)", result.stdout.split("options:")[1])  # a flag's entry is indented by two
    shown = {}
    for entry in entries[1:]:
        flag = re.search(r"--[\w-]+", entry).group()  # its long name: -h, --help -> --help
        shown[flag] = " ".join(entry.split())
    assert "--model" in shown and without_default <= set(shown), sorted(shown)
    for flag, text in shown.items():
        if flag not in without_default:
            assert "(default: " in text or "; default: " in text, f"{script}.py {flag} does not say its default: {text}"


# A user's mistakes, each ending in one line on stderr (no traceback) and the exit status --help
# promises: 2 for a bad flag (also one that only the model or the machine shows to be wrong), 1 for
# another error (a damaged checkpoint).
ABSENT_CUDA = ["cuda", "cuda:1"] if not torch.cuda.is_available() else [f"cuda:{torch.cuda.device_count()}"]
MISTAKES = {
    "empty prompt": (["--prompt", ""], "--prompt must not be empty", 2),
    **{f"device {d}": (["--device", d], f"device {d} is not available", 2) for d in ABSENT_CUDA},
    "device gpu": (["--device", "gpu"], "unknown device 'gpu'", 2),
    "device mps": (["--device", "mps"], "device mps is not available", 2),
    "device meta": (["--device", "meta"], "--device: device meta holds shapes but no data", 2),
    "device empty": (["--device", ""], "--device must not be empty", 2),
    "temperature nan": (["--temperature", "nan"], "argument --temperature: must be >= 0 and finite", 2),
    "temperature inf": (["--temperature", "inf"], "argument --temperature: must be >= 0 and finite", 2),
    "temperature < 0": (["--temperature", "-0.5"], "argument --temperature: must be >= 0 and finite", 2),
    # Named as typed, and checked before any model loads: the missing model is never reached.
    "top-p 0, no model": (["--top-p", "0", "--model", "{no_config}"], "argument --top-p: must be in (0, 1]", 2),
    "max-new-tokens 0": (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0", 2),
    "max-new-tokens < 0": (["--max-new-tokens", "-5"], "--max-new-tokens must be >= 1, got -5", 2),
    "max-new-tokens past the context": (["--max-new-tokens", "100000"], "--max-new-tokens 100000: the longest "
                                        "prompt (1 tokens) and 100000 new tokens exceed the model's context of 512 "
                                        "tokens; at most 511 fit", 2),
    "cuda graph on the cpu": (["--device", "cpu", "--cuda-graph"], "--cuda-graph needs a CUDA device, and the "
                              "model runs on cpu", 2),
    "threads 0": (["--threads", "0"], "--threads must be >= 1, got 0", 2),
    "kernels unknown": (["--kernels", "fastest"], "argument --kernels: invalid choice: 'fastest'", 2),
    "empty prompt file": (["--prompt-file", "{empty}"], "has no prompts", 2),
    "no config.json": (["--model", "{no_config}"], "it has no config.json", 2),
    "no tokenizer.json": (["--model", "{no_tokenizer}"], "no tokenizer.json in", 1),
    "config key missing": (["--model", "{no_hidden_size}"], "config.json is missing 'hidden_size'", 1),
    "config disagrees with the tensors": (["--model", "{narrow_mlp}"],
                                          "model.layers.0.mlp.down_proj.weight in model.safetensors has shape "
                                          "(64, 160), expected (64, 128)", 1),
    "config transformers refuses": (["--model", "{fewer_layers}"], "num_hidden_layers", 1),
}


def broken_copy(model_dir, path, drop=None, **config_changes):
    """A copy of model_dir without the file `drop`, its config.json changed (None: key removed)."""
    shutil.copytree(model_dir, path)
    raw = json.loads((path / "config.json").read_text())
    raw.update(config_changes)
    (path / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if v is not None}))
    if drop:
        (path / drop).unlink()
    return path


@pytest.fixture(scope="module")
def broken(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("broken")
    (tmp / "empty.txt").write_text("\n  \n")
    return {
        "empty": tmp / "empty.txt",
        "no_config": broken_copy(model_dir, tmp / "no_config", drop="config.json"),
        "no_tokenizer": broken_copy(model_dir, tmp / "no_tokenizer", drop="tokenizer.json"),
        "no_hidden_size": broken_copy(model_dir, tmp / "no_hidden_size", hidden_size=None),
        "narrow_mlp": broken_copy(model_dir, tmp / "narrow_mlp", intermediate_size=128),
        "fewer_layers": broken_copy(model_dir, tmp / "fewer_layers", num_hidden_layers=1),
    }


@pytest.mark.parametrize("case", MISTAKES)
def test_a_mistake_ends_in_one_line_on_stderr(model_dir, broken, case, run_cli):
    args, message, status = MISTAKES[case]
    result = run_cli("--model", str(model_dir), "--prompt", "x", "--max-new-tokens", "2", "--no-chat",
                     *[a.format(**broken) for a in args])
    assert result.returncode == status, result.stderr
    assert result.stdout == "" and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith("generate.py: error: ") and message in result.stderr, result.stderr


def start_cli(*args, **popen) -> subprocess.Popen:
    """generate.py in a process of its own, with Ctrl-C's default action (a shell may start it
    ignored); stdout and stderr piped unless `popen` says otherwise."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **popen}
    return subprocess.Popen([sys.executable, str(ROOT / "scripts" / "generate.py"), *args], env=env, cwd=ROOT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL), **popen)


LONG_GREEDY = ["--prompt", "def add(a, b):", "--no-chat", "--temperature", "0", "--max-new-tokens", "400",
               "--device", "cpu"]


def test_ctrl_c_while_generating_ends_the_text_line_then_says_so_with_status_130(model_dir):
    """The text so far, its line ended (so that the shell's prompt, or the message on a terminal
    that shows both streams, starts a line of its own), and one line on stderr."""
    cli = start_cli("--model", str(model_dir), *LONG_GREEDY)
    first = cli.stdout.read(1)
    assert first, "no text before the interrupt"  # generating
    cli.send_signal(signal.SIGSTOP)  # held mid-text, so that a fast machine cannot finish first
    cli.send_signal(signal.SIGINT)
    cli.send_signal(signal.SIGCONT)
    rest, stderr = cli.stdout.read(), cli.stderr.read()  # buffered: what read(1) took in comes first
    assert cli.wait(timeout=120) == 130
    assert stderr.decode() == "generate.py: interrupted\n"
    assert (first + rest).endswith(b"\n")


def test_a_reader_that_stops_early_ends_it_quietly(model_dir):
    """As `| head -c 1`: the reader closes the pipe while text still comes."""
    cli = start_cli("--model", str(model_dir), *LONG_GREEDY)
    assert cli.stdout.read(1)
    cli.send_signal(signal.SIGSTOP)  # held mid-text, so that a fast machine cannot finish first
    cli.stdout.close()
    cli.send_signal(signal.SIGCONT)
    stderr = cli.stderr.read().decode()
    assert cli.wait(timeout=120) == 141  # 128 + SIGPIPE, as the shell reports for cat
    assert stderr == ""


def test_a_full_disk_or_a_closed_stdout_is_one_line(model_dir):
    """`> /dev/full` (every write fails: no space) and `>&-` (no stdout at all): one line each
    and status 1, not a traceback (nor a second error from the interpreter's last flush)."""
    args = ("--model", str(model_dir), "--prompt", "def add(a, b):", "--no-chat", "--max-new-tokens", "8",
            "--device", "cpu")  # start_cli's interpreter runs kernels on CPU tensors
    with open("/dev/full", "w") as full:
        cli = start_cli(*args, stdout=full)
        _, stderr = cli.communicate(timeout=120)
    assert cli.returncode == 1
    assert stderr.decode() == "generate.py: error: cannot write to standard output: No space left on device\n"
    cli = subprocess.run(["sh", "-c", 'exec "$0" "$@" >&-', sys.executable, str(ROOT / "scripts" / "generate.py"),
                          *args], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert cli.returncode == 1
    assert cli.stderr == "generate.py: error: standard output is closed, so the text has nowhere to go\n"


def test_prompt_longer_than_the_context_is_refused(model_dir, run_cli):
    result = run_cli("--model", str(model_dir), "--prompt", "x " * 600, "--no-chat")
    assert result.returncode == 2
    [line] = result.stderr.splitlines()  # one line: not the tokenizer's warning beside ours
    assert line.startswith("generate.py: error: --prompt: a prompt of ") and "exceeds the model's context" in line


def test_a_prompt_file_of_dash_is_standard_input_and_a_byte_order_mark_is_not_text(model_dir, tmp_path, run_cli):
    """--prompt-file - reads the prompts from standard input; a file saved with a UTF-8 byte-order
    mark gives the prompts typed, without the mark in the first one."""
    greedy = ["--model", str(model_dir), "--max-new-tokens", "3", "--temperature", "0", "--no-chat"]
    typed = run_cli(*greedy, "--prompt", "def add(a, b):", "--prompt", "x")
    assert typed.returncode == 0, typed.stderr
    piped = run_cli(*greedy, "--prompt-file", "-", stdin=b"def add(a, b):\nx\n")
    assert piped.stdout == typed.stdout
    (tmp_path / "bom.txt").write_bytes("\ufeffdef add(a, b):\nx\n".encode())
    assert run_cli(*greedy, "--prompt-file", str(tmp_path / "bom.txt")).stdout == typed.stdout
