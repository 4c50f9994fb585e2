"""Serve a Qwen3 checkpoint over an OpenAI-compatible HTTP API from a checkout, without installing:
the qwen3-serve command (cli/serve.py has its flags; --help lists them).

    python scripts/serve.py [--model DIR] [--port 8000]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cli import serve_command  # noqa: E402

if __name__ == "__main__":
    serve_command(prog="serve.py")
