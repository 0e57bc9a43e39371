"""What the parts of one ZeRO stage share: the layout, the device, the communicator, the kernel set and the
precision; the two events that order the compute and the comm stream; the bytes each part allocated, by
memory category (llmz.memory's measured side); the tracer's spans (llmz.trace), nothing when not traced.

Ordering between the two streams is by events only (record on one, wait on the other), never a host
synchronisation. The two events are made once: a captured CUDA graph records them as edges, and recording an
event again moves it (a wait uses the latest record at the time of the call).
"""
from __future__ import annotations

from ..layout import Layout


def block_slot_size(layout: Layout) -> int:
    """Elements of one block slot (stages 2 and 3): the largest block bucket."""
    return max(b.padded_size for b in layout.buckets[1:-1])


class Context:
    def __init__(self, layout: Layout, dev, comm, bf16: bool, seed: int, overlap: bool, tracer=None):
        assert layout.world_size == comm.world_size
        self.layout, self.dev, self.comm, self.rank = layout, dev, comm, comm.rank
        self.kernels = dev.ops                          # the layer functions, as in llmz.model
        # bf16: parameters and gradients are uint16 bit patterns, AdamW keeps an fp32 master copy and writes the
        # bf16 values from it with stochastic rounding drawn from (seed, element, step)
        self.bf16, self.seed = bf16, seed
        self.overlap = overlap                          # False (--no-overlap): compute waits for each collective
        self.tracer = tracer
        self.allocated: dict[str, int] = {}             # category -> bytes allocated by the parts
        self.compute_done, self.comm_done = dev.event(), dev.event()

    def zeros(self, category: str, n: int, dtype=None):
        """A zeroed device buffer of n values (default: the run's dtype), counted under `category`."""
        a = self.dev.zeros(n, dtype=dtype)
        self.allocated[category] = self.allocated.get(category, 0) + a.nbytes
        return a

    # ---- ordering between the two streams (no host synchronisation) --------------------------------------
    def comm_waits_for_compute(self) -> None:
        """The comm stream goes on once every kernel enqueued so far on the compute stream has run."""
        self.compute_done.record(self.dev.compute_stream)
        self.compute_done.wait(self.dev.comm_stream)

    def compute_waits_for_comm(self) -> None:
        """The compute stream goes on once every collective enqueued so far on the comm stream has run."""
        self.comm_done.record(self.dev.comm_stream)
        self.comm_done.wait(self.dev.compute_stream)

    # ---- the timeline (llmz.trace): a span per bucket on each stream, when traced ---------------------------
    def begin(self, name: str, stream: str) -> None:
        if self.tracer:
            self.tracer.begin(name, stream)

    def end(self, name: str, stream: str, at: float | None = None) -> None:
        """at: when it ended, if not now (an MPI collective that this rank saw complete earlier)."""
        if self.tracer:
            self.tracer.end(name, stream, at)
