"""Generate text with a Qwen3 checkpoint from a checkout, without installing: the qwen3-generate
command (cli/generate.py has its flags; --help lists them).

    python scripts/generate.py --prompt "def fibonacci(n):"
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cli import generate_command  # noqa: E402

if __name__ == "__main__":
    generate_command(prog="generate.py")
