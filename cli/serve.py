"""Serve a Qwen3 checkpoint over an OpenAI-compatible HTTP API: qwen3-serve [--model DIR]
(from a checkout without installing: python scripts/serve.py ...)

Continuous batching over a paged KV cache (serve/engine.py) in a process of its own
(serve/engine_process.py), FastAPI + uvicorn (serve/server.py).
Without --model it serves the small model shipped in weights/, so it runs on a fresh checkout,
on the CPU too. Then:

    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "def fibonacci(n):", "max_tokens": 32, "temperature": 0}'

Ctrl-C or SIGTERM stops it gracefully (open requests get --shutdown-timeout to finish) and it
exits 0; a second signal stops it at once. If the engine process dies it exits with status 1.
"""

import argparse
import errno
import os
import signal
import socket
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from ops import IMPLS, KERNELS
from qwen3.config import Qwen3Config
from qwen3.loader import DTYPES, checkpoint_dtype, read_generation_config, resolve_dtype
from runtime.text import load_tokenizer
from serve.engine import PREFILL_TOKENS, PREFILL_TOKENS_CPU
from serve.engine_process import ANSWER_TIMEOUT_S, HEARTBEAT_S, EngineProcess, EngineSpec
from serve.steps import PREFILL_GRAPH_TOKENS

from . import model_flags, output
from .model_flags import add_model_flags
from .output import bad_flag, fail

BACKLOG = 2048  # connections the kernel queues before uvicorn accepts them: uvicorn's own default
SHUTDOWN_TIMEOUT_S = 30.0  # systemd's and Kubernetes' own waits before a SIGKILL are 90 and 30 s


class Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """A bad flag is one line (argparse's default prints the usage before it); status 2."""
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parse_args(argv=None, prog: str = "serve.py") -> argparse.Namespace:
    """The flags, checked; a mistake is one line that starts with prog, and status 2."""
    output.PROG = prog
    p = Parser(prog=output.PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(p)
    p.add_argument("--served-model-name", default=None,
                   help="the name clients ask for (default: the repo id, or the directory's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=8000,
                   help="port to listen on; 0: any free one, named in the line serve.py prints (default: 8000)")
    p.add_argument("--max-batch", type=int, default=16, help="sequences decoded together at most (default: 16)")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="requests that may wait for a place in the batch; more get 429 (default: 256)")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV-cache blocks (default: CUDA: 80%% of free GPU memory, at most what max-batch full-"
                        "context sequences use; CPU: the context or 2048 tokens, whichever is less, per batch row)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block (default: 16)")
    p.add_argument("--prefill-tokens", type=int, default=None,
                   help="prefill work per engine step, in prompt tokens, beside the running sequences' decode step; "
                        "a longer prompt is prefilled in chunks, one a step, a token's attention to the tokens "
                        "before it counting too, so that a chunk deep in a long prompt is shorter "
                        f"(default: {PREFILL_TOKENS} on a GPU, {PREFILL_TOKENS_CPU} on the CPU)")
    p.add_argument("--chat-template", type=Path, default=None, metavar="FILE",
                   help="a Jinja chat template for chat requests in place of the tokenizer's; a base model has "
                        "none: examples/qwen3-chat-template.jinja is Qwen3's format (default: the tokenizer's)")
    p.add_argument("--no-reasoning-parser", dest="reasoning", action="store_false",
                   help="leave a chat reply's reasoning (<think>...</think>) in content, as the model wrote it "
                        "(default: in message.reasoning_content / delta.reasoning_content, where the chat "
                        "template has think tags)")
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="do not keep the KV-cache blocks of earlier prompts and replies for later prompts that "
                        "start with the same tokens (default: kept, least recently used evicted first)")
    p.add_argument("--norm", choices=IMPLS, default="auto", help="RMSNorm implementation (default: auto)")
    p.add_argument("--kernels", choices=KERNELS, default="auto",
                   help="fused Triton kernels or transformers' reference operations; auto: fused on CUDA, reference "
                        "on the CPU (default: auto)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available, else cpu)")
    p.add_argument("--dtype", choices=[*DTYPES, "auto"], default=None,
                   help="auto: the checkpoint's dtype (default: float32 on the CPU, the checkpoint's on a GPU)")
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="replay decode steps from CUDA graphs, one per batch-size bucket, and a step's prompts, "
                        f"packed, up to {PREFILL_GRAPH_TOKENS} tokens, from one per token-count bucket "
                        "(default: on CUDA)")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="CPU threads for the engine's arithmetic (default: 1 on CUDA; on the CPU torch's, one per "
                        "core, less one for the HTTP server's process)")
    p.add_argument("--shutdown-timeout", type=float, default=SHUTDOWN_TIMEOUT_S, metavar="S",
                   help="on SIGINT or SIGTERM, seconds open requests get to finish before they end with an error "
                        f"(default: {SHUTDOWN_TIMEOUT_S:g})")
    p.add_argument("--engine-timeout", type=float, default=ANSWER_TIMEOUT_S, metavar="S",
                   help="an engine process silent this long (one step that never ends) is taken as hung: it is "
                        f"killed and the server exits with status 1 (default: {ANSWER_TIMEOUT_S:g})")
    args = p.parse_args(argv)
    if args.max_batch < 1 or args.max_waiting < 0 or args.block_size < 1 or (
            args.prefill_tokens is not None and args.prefill_tokens < 1):
        p.error("--max-batch, --block-size and --prefill-tokens must be >= 1, --max-waiting >= 0")
    if args.num_blocks is not None and args.num_blocks < 1:
        p.error(f"--num-blocks must be >= 1, got {args.num_blocks}")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    if not args.shutdown_timeout >= 0:
        p.error(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout:g}")
    if not args.engine_timeout > 2 * HEARTBEAT_S:  # the engine's heartbeat must fit in it
        p.error(f"--engine-timeout must be > {2 * HEARTBEAT_S:g} s, got {args.engine_timeout:g}")
    if not 0 <= args.port <= 65535:
        p.error(f"--port must be in [0, 65535], got {args.port}")
    if args.served_model_name is not None and not args.served_model_name.strip():
        p.error("--served-model-name must not be empty (leave it out for the checkpoint's name)")
    return args


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port as uvicorn binds one (IPv6 when the host has a colon,
    SO_REUSEADDR), or the exit with one line that says why not. It is bound first: a port in use
    ends here, before a download or minutes of loading, and with no engine process."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:  # socket.gaierror (an unknown host name) is one too
        sock.close()
        if err.errno == errno.EADDRINUSE:
            fail(f"port {port} on {host} is in use; pick another with --port")
        fail(f"cannot listen on {host} port {port}: {err.strerror or err} (see --host, --port)")
    return sock


class Stop(BaseException):
    """SIGINT or SIGTERM once the modules are in, before the HTTP server has taken the signals over
    (while the model loads): raised, so that the engine process is ended on the way out.
    A BaseException, like KeyboardInterrupt: no `except Exception` on the way turns it into an error."""

    def __init__(self, sig: int):
        super().__init__(signal.Signals(sig).name)


def stop(sig: int, frame) -> None:
    raise Stop(sig)


def served_name(model: str, checkpoint: Path) -> str:
    """What clients call the model: the repo id it came from ("Qwen/Qwen3-8B", as vLLM names it),
    else its directory's name."""
    return checkpoint.resolve().name if Path(model).expanduser().exists() else model


def check_model(args: argparse.Namespace) -> tuple[torch.device, torch.dtype]:
    """What serve.py checks before it starts the engine: the device, --model (a repo id is fetched
    here), the checkpoint's config.json and generation_config.json; each mistake is one line that
    names the file and the key (SystemExit). The tokenizer is checked as it loads (tokenizer_of), the
    weights in the engine process."""
    try:  # the flags' mistakes: status 2, as generate.py's
        device, _, _ = model_flags.resolve_run_flags(args)
    except ValueError as err:
        bad_flag(str(err))
    args.checkpoint = find_checkpoint(args.model, args.revision)
    try:
        dtype = resolve_dtype(args.dtype, device, checkpoint_dtype(args.checkpoint,
                                                                   Qwen3Config.from_json(args.checkpoint)))
        read_generation_config(args.checkpoint)
    except (OSError, ValueError) as err:
        fail(f"cannot load {args.model}: {err}")
    return device, dtype


def find_checkpoint(model: str, revision: str | None) -> Path:
    """The checkpoint directory --model names, or the exit with one line: status 2 as for a bad
    flag, 1 for a failed download."""
    def stop_at_once(sig: int) -> None:
        say(f"{signal.Signals(sig).name} while downloading {model}: stopped")
        os._exit(0)

    try:
        return model_flags.find_checkpoint(model, revision, stop=stop_at_once)
    except ValueError as err:
        bad_flag(str(err))
    except OSError as err:
        fail(f"cannot load {model}: {err}")


def tokenizer_of(args: argparse.Namespace):
    """The checkpoint's tokenizer, or the exit with one line that names its broken file."""
    try:
        tokenizer = load_tokenizer(args.checkpoint)
    except (OSError, ValueError) as err:
        fail(f"cannot load {args.model}: {err}")
    if args.chat_template is not None:
        try:
            tokenizer.chat_template = args.chat_template.read_text()
            tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                          add_generation_prompt=True)
        except OSError as err:
            fail(f"cannot read --chat-template {args.chat_template}: {err.strerror or err}")
        except Exception as err:  # jinja's own errors: a template that does not render
            fail(f"--chat-template {args.chat_template} does not render a conversation: {err}")
    return tokenizer


def start_engine(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> EngineProcess:
    """The engine process, started: it loads the model while serve.py loads its tokenizer."""
    spec = EngineSpec(args.checkpoint, dtype, str(device), norm=args.norm, kernels=args.kernels,
                      quantization=args.quantization,
                      n_blocks=args.num_blocks, block_size=args.block_size, max_batch=args.max_batch,
                      max_waiting=args.max_waiting, cuda_graph=args.cuda_graph, prefill_tokens=args.prefill_tokens,
                      prefix_cache=args.prefix_cache, threads=args.threads)
    try:
        return EngineProcess(spec, answer_timeout_s=args.engine_timeout, wait=False)
    except OSError as err:
        fail(f"cannot start the engine process: {err}")


def wait_for_engine(engine: EngineProcess, model: Path) -> None:
    """Until the engine has loaded the model, or the exit with one line that says why it could not."""
    try:
        engine.wait_until_ready()
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        fail(f"cannot load {model}: {err}")


def serve(args: argparse.Namespace) -> None:
    sock = bind(args.host, args.port)  # a port in use is known before a model downloads or loads
    device, dtype = check_model(args)
    engine = None
    try:
        # A signal mid-start would leave a child half-sent its start-up data, and one raised inside
        # an import was seen lost (the server started anyway): both held to the block's end.
        with signals_held():
            engine = start_engine(args, device, dtype)
            from serve.app import create_app  # FastAPI and uvicorn import while the model loads
            from serve.http_server import HTTPServer

            tokenizer = tokenizer_of(args)  # imports too (transformers' lazy modules)
        wait_for_engine(engine, args.model)
        name = args.served_model_name or served_name(args.model, args.checkpoint)
        limits = engine.limits
        port = sock.getsockname()[1]  # --port 0: the one the system chose
        url = f"http://[{args.host}]:{port}" if ":" in args.host else f"http://{args.host}:{port}"
        # Listening before the line that says so: a client that connects as soon as it reads it
        # waits in the kernel's queue for uvicorn to start, not refused (a refusal before the
        # engine was ready would tell a supervisor's check the truth: not up yet).
        sock.listen(BACKLOG)
        print(f"serving {name} at {url} on {device} {str(dtype).removeprefix('torch.')}: {limits.n_blocks} KV "
              f"blocks of {limits.block_size} tokens, batch <= {engine.max_batch}, queue <= {engine.max_waiting}",
              file=sys.stderr, flush=True)
        # uvicorn listens on the socket bound above (uvicorn.run would bind its own).
        app = create_app(engine, tokenizer, name, args.reasoning)
        server = HTTPServer(app, args.host, port, args.shutdown_timeout, say)
        server.run(sockets=[sock])
    finally:
        if engine is not None:
            engine.kill()  # already stopped by the app, unless it never started or a signal came first
    if not server.started:  # the app's startup failed; uvicorn has logged why
        sys.exit(1)
    if server.death is not None:
        fail(f"{server.death}; the server exits so that its supervisor can restart it")


@contextmanager
def signals_held():
    """SIGINT and SIGTERM held back for the block's length, then delivered: starting the engine
    process writes its start-up data down a pipe, and a Stop raised in the middle of that write
    would leave the child to die of the half it read, with a traceback on the server's stderr.
    Blocked in this thread (the child inherits the mask) and, since the kernel may hand a signal
    to another thread whose mask lets it through (then Python runs the handler in this one, at
    once), caught by a handler that only notes it until the block ends."""
    signals = (signal.SIGINT, signal.SIGTERM)
    noted: list[int] = []
    handlers = {sig: signal.signal(sig, lambda sig, frame: noted.append(sig)) for sig in signals}
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)  # one blocked meanwhile is noted now
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        if noted and callable(handlers[noted[0]]):
            handlers[noted[0]](noted[0], None)


def say(line: str) -> None:
    """One line for the user on stderr; safe in a signal handler (one write, no buffer). A stderr
    that is gone (a pipe whose reader has exited) loses the line, never the shutdown it announces."""
    try:
        os.write(2, f"{output.PROG}: {line}\n".encode())
    except OSError:
        pass


def main(argv=None, prog: str = "serve.py") -> None:
    args = parse_args(argv, prog)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    try:
        serve(args)
    except Stop as signalled:
        say(f"{signalled} while starting: stopped")
    output.leave(0)  # stopped: the engine process has ended, the sockets are closed
