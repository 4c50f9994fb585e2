"""How the Python interpreters of the server's and the engine's processes are set while they serve:
a heap frozen out of the garbage collector's sight, and (the server's) a short GIL switch interval."""

import gc
import sys
from contextlib import contextmanager

# The thread that receives the engine's outputs and the event loop share the GIL. The receiver
# waits on the pipe with the GIL released; getting it back from a busy event loop takes up to
# Python's switch interval, 5 ms by default, which would hold a decode step's tokens back for
# longer than the step took. While serving, the interval is 0.1 ms.
GIL_SWITCH_INTERVAL_S = 1e-4


@contextmanager
def frozen_heap():
    """What the process has built by now (the server's tokenizer, app and modules; the engine's
    model modules and tokenizer) lives as long as it does, and Python's full collections, which
    the token stream's allocations set off, would walk all of it each time, holding the event loop
    or the step loop meanwhile (docs/benchmarks/serve-notes.md). Frozen (gc.freeze, as vLLM and
    SGLang do), it is out of the collector's sight; unfrozen at the end, for the collection at exit
    (extensions such as Triton's nanobind report objects left behind). Not nested: the freeze is
    the interpreter's, one at a time."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextmanager
def short_switch_interval():
    """Python's GIL switch interval at GIL_SWITCH_INTERVAL_S for the block (see there)."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)
