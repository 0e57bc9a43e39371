"""CUDA graphs: record a piece of the training step once, replay it every step after.

A Numba launch costs 30-200 µs of Python on the host; a GPT-2 step is ~500 launches plus the cuBLAS calls,
so the host, not the GPU, would set the pace. Captured into a CUDA graph on the compute stream, the same
work replays at ~1 µs a launch. What a captured region may not do, and how llmz keeps to it:
  - allocate: every buffer (activations, scratch: Device.scratch) exists after the eager warm-up step;
  - synchronise with the host or read a value back: the loss is summed on the device and the gradient
    norm stays on the device until the step is over; the learning rate is copied in before the replay;
  - change shape or argument: a graph replays exactly what it recorded, into the same addresses, so the
    batch is copied into the same input buffers every micro-step.
NCCL calls can be captured (ZeRO-1's all-reduce of the norm and its all-gathers are: on the H200, one rank
over NCCL at stage 1, graphed, gives the single process's losses exactly, and the 50-step fast-path curve
follows the teaching kernels within 1.2e-7), MPI's host-staged ones cannot. Not yet ZeRO-2: its micro-step
forks every block's reduce-scatter and accumulate to the comm stream and joins at the end, which CUDA
allows, but the captured graph hung at its first replay (H200, one rank, NCCL); llmz.train runs stage 2
eagerly until that is understood.

    graphs = Graphs(dev, enabled=True)
    graphs.run("micro_step", fn)      # 1st call: fn() eagerly (warm-up); 2nd: capture fn, replay; then replay
"""
from __future__ import annotations


class Graphs:
    """Named CUDA graphs on a Device's compute stream. Disabled (or not on a GPU): run() just calls fn()."""

    def __init__(self, dev, enabled: bool = True):
        self.dev = dev
        self.enabled = enabled and dev.kind == "gpu"
        self.calls: dict[str, int] = {}
        self.graphs: dict = {}

    def run(self, name: str, fn) -> None:
        n = self.calls.get(name, 0)
        self.calls[name] = n + 1
        if not self.enabled or n == 0:
            fn()                         # eager: the first call compiles every kernel and allocates scratch
            return
        graph = self.graphs.get(name)
        if graph is None:
            graph = self.graphs[name] = self.capture(fn)
        graph.launch(stream=self.dev.compute_stream.cupy)

    def capture(self, fn):
        import cupy
        stream = self.dev.compute_stream.cupy
        # relaxed: calls that are unsafe during capture (a lazy module load, say) are allowed, not refused
        stream.begin_capture(getattr(cupy.cuda.runtime, "streamCaptureModeRelaxed", 2))
        try:
            fn()
        finally:
            graph = stream.end_capture()
        return graph
