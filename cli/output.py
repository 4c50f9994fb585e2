"""How the commands talk to the user: the text on stdout, and each mistake or interruption as one
line on stderr that starts with the command's name (PROG: the installed command's own, or the
script's), with the exit status a shell reports."""

import os
import sys
from typing import NoReturn

PROG = "generate.py"  # set by each command's main (and entry point) before anything can fail


def interrupted() -> int:
    print(f"{PROG}: interrupted", file=sys.stderr)
    return 130  # 128 + SIGINT, what a shell reports for a command stopped by Ctrl-C


def fail(message: object) -> NoReturn:
    """Exit with status 1 and the message on one line of stderr."""
    sys.exit(f"{PROG}: error: {' '.join(str(message).split())}")


def bad_flag(message: object) -> NoReturn:
    """Exit with status 2, --help's status for a bad flag, and the message on one line of stderr:
    also for a flag that only the model or the device shows to be wrong."""
    print(f"{PROG}: error: {' '.join(str(message).split())} (see --help)", file=sys.stderr)
    sys.exit(2)


def leave(status: int) -> NoReturn:
    """Exit with status at once, stdout and stderr flushed: the command is done, and the
    interpreter's teardown of torch's and transformers' modules would add most of a second to a
    run (seconds to a server's stop) for nothing."""
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # a reader gone, a stream closed: nothing more can be said
            pass
    os._exit(status)


class OutputError(Exception):
    """Writing the text to stdout failed (a full disk): not the reader leaving, a BrokenPipeError."""


class Stdout:
    """The text's way out: stdout, flushed at each piece, remembering whether its last line is
    unfinished (so that an interruption can end it before stderr's line)."""

    def __init__(self):
        self.line_open = False

    def write(self, text: str) -> None:
        if not text:
            return
        self.line_open = not text.endswith("\n")  # first: Ctrl-C may land as soon as the text is out
        try:
            sys.stdout.write(text)
            sys.stdout.flush()
        except BrokenPipeError:
            raise
        except OSError as err:
            raise OutputError(err.strerror or str(err)) from err

    def end_line(self) -> None:
        if self.line_open:
            self.write("\n")


def silence_stdout() -> None:
    """Point stdout at devnull, so that the interpreter's last flush of what is still buffered
    does not fail again (and print a second error) at exit."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
