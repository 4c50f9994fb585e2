"""The one CUDA-graph runner: a step captured once per bucket of its size, and replayed.

    runner = GraphRunner(step, buckets=[1, 2, 4, 8, 16], device=device, capture=True)
    out = runner(n)          # step(bucket >= n) replayed from its graph; eagerly, step(n)

`step(size)` reads its inputs from, and writes its outputs to, tensors that the caller owns and
fills before each call (static buffers: a graph replays on the same memory); it computes `size`
rows of them. Every bucket's graph is captured at construction, largest first, in one memory pool
(each later capture fits in what the largest reserved: nano-vllm's scheme), after a warm-up that
compiles and loads every kernel the step launches (Triton's included), as torch.cuda.graph asks.
The warm-up runs on the stream the graphs are captured on, the runner's own: cuBLAS keeps a
workspace per stream, and one first asked for inside a capture would live in that graph's pool,
to be freed, or cleared under a later graph, with the graph (pytorch/pytorch#193402): a second
runner capturing on torch's shared capture stream then broke with CUBLAS_STATUS_EXECUTION_FAILED.
Without `capture` (the CPU, or a caller that wants eager steps) a call runs step(n) itself, at the
caller's size: one code path for both.

generate's decode step (one bucket, its batch), the serving engine's decode steps (batch-size
buckets) and its packed prefills (token-count buckets) all run through it.
"""

import gc
from collections.abc import Callable, Sequence

import torch


def resolve_cuda_graph(cuda_graph: bool | None, device: torch.device) -> bool:
    """Whether steps replay from CUDA graphs: the caller's choice, by default on CUDA."""
    if cuda_graph is None:
        return device.type == "cuda"
    if cuda_graph and device.type != "cuda":
        raise ValueError(f"cuda_graph=True needs the model on a CUDA device, it is on {device}")
    return cuda_graph


def warm_up_on(stream: torch.cuda.Stream, fn: Callable[[], object], times: int = 2) -> None:
    """Run fn on `stream` so that every kernel it launches (Triton's included) is compiled and
    loaded, and every library workspace it needs allocated, before a CUDA graph captures it."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(times):
            fn()
    torch.cuda.current_stream().wait_stream(stream)


class GraphRunner:
    def __init__(self, step: Callable[[int], object], buckets: Sequence[int], device: torch.device, capture: bool,
                 warm_up: Callable[[int], object] | None = None):
        """warm_up(size): what runs before a capture (default: step), for a step whose state must
        not advance twice: it must run every kernel the step compiles on first use (Triton's)."""
        self.step, self.buckets, self.capture = step, sorted(buckets), capture
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, object]] = {}
        if not capture:
            return
        # Graphs of earlier runners that nothing references any more are freed now, not by a
        # garbage collection in the middle of a capture (freeing one clears its stream's workspace).
        gc.collect()
        pool = torch.cuda.graph_pool_handle()
        with torch.cuda.device(device), torch.inference_mode():
            stream = torch.cuda.Stream()
            for size in reversed(self.buckets):
                warm_up_on(stream, lambda size=size: (warm_up or step)(size))
                graph = torch.cuda.CUDAGraph()
                collecting = gc.isenabled()
                gc.disable()  # and none runs during a capture
                try:
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        out = step(size)
                finally:
                    if collecting:
                        gc.enable()
                self.graphs[size] = (graph, out)

    def bucket(self, n: int) -> int:
        """The size a call of n rows runs at: the smallest bucket that holds them (eagerly, n)."""
        if not self.capture:
            return n
        return next(b for b in self.buckets if b >= n)

    def fits(self, n: int) -> bool:
        """Whether n rows are replayed from a graph (eagerly: never)."""
        return self.capture and n <= self.buckets[-1]

    def __call__(self, n: int):
        """step's output for n rows: replayed from the graph of bucket(n) (its output covers the
        bucket's rows: the caller reads the first n), or step(n) run eagerly."""
        if not self.capture:
            return self.step(n)
        graph, out = self.graphs[self.bucket(n)]
        graph.replay()
        return out
