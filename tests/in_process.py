"""The command-line scripts run in the test process: their main(argv), with what they write to the
file descriptors of stdout and stderr and the exit status a shell would see. The tests whose subject
is the process itself (a signal, a closed pipe, torchrun) start one instead."""

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def load_script(name: str):
    """scripts/NAME.py as a module (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GENERATE = importlib.import_module("cli.generate")  # what scripts/generate.py and qwen3-generate run


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def call_main(main, argv: list[str], capfd) -> Result:
    """main(argv) as the interpreter runs a script: its return value or SystemExit's code is the
    exit status, and a SystemExit message goes to stderr with status 1. The output is what reached
    the file descriptors (pytest's capfd), so a library's log line on stderr counts, as the user
    sees it. Torch's thread count, which --threads sets for the process, is restored after."""
    threads = torch.get_num_threads()
    capfd.readouterr()
    try:
        status = main(argv)
    except SystemExit as exit_:
        status = exit_.code
        if isinstance(status, str):
            print(status, file=sys.stderr)
            status = 1
    finally:
        torch.set_num_threads(threads)
    out, err = capfd.readouterr()
    return Result(0 if status is None else status, out, err)
