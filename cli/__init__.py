"""The command-line front ends, installed as commands by pip (pyproject's [project.scripts]):

    qwen3-generate --prompt "def fibonacci(n):"   # cli/generate.py; from a checkout: python scripts/generate.py
    qwen3-chat                                    # qwen3-generate --interactive: a conversation in the terminal
    qwen3-serve --port 8000                       # cli/serve.py; from a checkout: python scripts/serve.py

Each function here is one command: it does what must come before the heavy imports (torch's take
seconds, and a signal during them must still end in one line), then imports its module and runs it.
"""

import os
import signal
import sys


def generate_command(prog: str = "qwen3-generate") -> None:
    from . import output

    output.PROG = prog  # the name of a Ctrl-C's line during the imports below
    from . import generate  # a Ctrl-C during its imports ends in one line there

    output.leave(generate.main(prog=prog))


def chat_command(prog: str = "qwen3-chat") -> None:
    from . import output

    output.PROG = prog
    from . import generate

    output.leave(generate.main(sys.argv[1:], prog=prog, chat=True))


def serve_command(prog: str = "qwen3-serve") -> None:
    def stop_at_once(sig: int, frame) -> None:
        """SIGINT or SIGTERM while the modules import: nothing to clean up yet."""
        os.write(2, f"{prog}: {signal.Signals(sig).name} while starting: stopped\n".encode())
        os._exit(0)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop_at_once)
    from . import serve

    serve.main(prog=prog)
