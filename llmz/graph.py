"""CUDA graphs: record a piece of the training step once, replay it every step after.

A Numba launch costs 30-200 µs of Python on the host; a GPT-2 step is ~500 launches plus the cuBLAS calls,
so the host, not the GPU, would set the pace. Captured into a CUDA graph on the compute stream, the same
work replays at ~1 µs a launch. What a captured region may not do, and how llmz keeps to it:
  - allocate: every buffer (activations, scratch: Device.scratch) exists after the eager warm-up step;
  - synchronise with the host or read a value back: the loss is summed on the device and the gradient
    norm stays on the device until the step is over; the learning rate is copied in before the replay;
  - change shape or argument: a graph replays exactly what it recorded, into the same addresses, so the
    batch is copied into the same input buffers every micro-step.
NCCL calls can be captured, MPI's host-staged ones cannot. Ordering between the compute and the comm stream
is by events only, and inside a capture an event wait is an edge of the graph; so each wait must be on an
event recorded inside the same capture. ZeRO-2 broke that rule, and that was why its graphed step failed
(reported as a hang at the first replay; measured on the H200 with tools/graph_probe.py, CUDA 13, CuPy 14.2,
NCCL 2.28, one rank, the same code is refused at its capture):
  - its reduce_gradients, the first call of the captured update, made the compute stream wait on an event
    recorded on the comm stream, which at that point is idle and outside the capture. CUDA refuses that
    wait (cudaErrorStreamCaptureIsolation: "dependency created on uncaptured work in another stream"), the
    capture is invalidated, and end_capture raises. The wait was also useless: the micro-step already ends
    joined (the compute stream waits for the comm stream's last reduce-scatter), so it is gone.
  - not a cause: a new event per record/wait pair (the probe puts that back alone: the graphed run still
    gives the eager run's losses and parameters bit for bit). Events are now made once anyway.
  - found on the way: bf16's stochastic rounding in the accumulate took the micro-step number as a kernel
    argument, which a graph freezes at its capture; it is read from device memory now (set_micro_step).
With the micro-step forked to the comm stream (a reduce-scatter and an accumulate per block, beside the next
block's backward) and joined at its end, stage 2 replays as two graphs like stages 0 and 1: the graphed and
the eager runs give the same bits (fp32 and bf16 over NCCL, K = 2).

    graphs = Graphs(dev, enabled=True)
    graphs.run("micro_step", fn)      # 1st call: fn() eagerly (warm-up); 2nd: capture fn, replay; then replay
"""
from __future__ import annotations


class Graphs:
    """Named CUDA graphs on a Device's compute stream. Disabled (or not on a GPU): run() just calls fn()."""

    def __init__(self, dev, enabled: bool = True, after_launch=None):
        self.dev = dev
        self.enabled = enabled and dev.kind == "gpu"
        self.after_launch = after_launch    # after_launch(name) after each replay: the collective watchdog's
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
        if self.after_launch:
            self.after_launch(name)

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
