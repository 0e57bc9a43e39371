"""The gradient store: where backward accumulates each bucket's gradients (llmz.model asks `grads.bucket(b)`
just before it writes them and calls `grads.done(b)` the moment they are complete: the final layernorm, block
L-1 ... block 0, the embeddings last), and how they become the average over ranks.

  FullGradients     stages 0 and 1: the whole flat gradient on every rank, accumulated over the K micro-steps;
                    after the last one every bucket is all-reduced (stage 0: every rank updates everything) or
                    reduce-scattered (stage 1: the optimizer updates my slice only, so I need only its average)
  ShardedGradients  stages 2 and 3: only my slice of every bucket (the gradient shard) stays for the step.
                    Backward writes block l into slot l % 2 of two block slots (the embeddings and the final
                    layernorm into buffers of their own); when block l is done the comm stream reduce-scatters
                    the slot, and one kernel adds my part into the shard and zeroes the slot, while block l-1's
                    backward fills the other slot. Every micro-step reduce-scatters (K micro-steps: K times).
                    On CPU ranks (MPI on host memory) there is no comm stream: the reduce-scatter is started
                    (non-blocking) and left in flight while block l-1 computes, progressed at every bucket()
                    and done(); it is waited for, and my part added, only when block l-2 needs the slot
                    again, or at the end of backward.

Both answer bucket(b) and done(b) (backward), backward_done() (after each micro-step), reduce() (after the last),
owned() (the pieces of gradient this rank owns then, for the norm), slice(b, start, end) (the averaged gradient
AdamW reads), zero() (after the update) and set_micro_step(i).
"""
from __future__ import annotations

from collections import deque

import numpy as np

from ..model import FullGrads
from .context import Context, block_slot_size


class FullGradients(FullGrads):
    """Stages 0 and 1: one full-size flat buffer of gradients on every rank; backward writes into it as into
    llmz.model's plain FullGrads (bucket(b): its views; done(b): nothing to do)."""

    reduce_scatters_in_backward = 0                     # nothing is sent during backward

    def __init__(self, ctx: Context, sharded: bool):
        """sharded: the optimizer updates my slice only (stage 1), so reduce() reduce-scatters."""
        self.ctx, self.sharded = ctx, sharded
        self.grads = ctx.zeros("gradients", ctx.layout.total)
        super().__init__(ctx.layout, self.grads)

    def buffers(self) -> dict:
        return {"grads": self.grads}

    def backward_done(self) -> None:
        pass

    def set_micro_step(self, i: int) -> None:
        pass

    # ---- the update ---------------------------------------------------------------------------------------
    def reduce(self) -> None:
        """After the last micro-step's backward: every bucket averaged over the ranks, on the comm stream."""
        ctx = self.ctx
        ctx.comm_waits_for_compute()
        for b in ctx.layout.buckets:
            buf = ctx.layout.bucket_buffer(self.grads, b)
            if self.sharded:
                ctx.comm.reduce_scatter(buf, op="avg")  # my slice of the bucket: the average; the rest stale
            else:
                ctx.comm.all_reduce(buf, op="avg")
        ctx.compute_waits_for_comm()

    def owned(self) -> list:
        """The gradient this rank owns after reduce(), in the pieces the norm sums: the whole buffer at stage 0,
        my slice of every bucket at stage 1."""
        L = self.ctx.layout
        if self.sharded:
            return [self.slice(b, *L.shard_range(b, self.ctx.rank)) for b in L.buckets]
        return [self.grads]

    def slice(self, b, start: int, end: int):
        return self.ctx.layout.bucket_buffer(self.grads, b)[start:end]

    def zero(self) -> None:
        self.ctx.kernels.zero(self.ctx.dev, self.grads)


class ShardedGradients:
    """Stages 2 and 3: my gradient shard, plus two block slots and the embeddings' and final layernorm's buffers
    that backward writes into and the comm stream empties. The streams are ordered by events, never the host:
      done(b)    the comm stream waits for bucket b's last kernel (an event on the compute stream), runs the
                 reduce-scatter and the accumulate-and-zero kernel, and records the buffer's `free` event;
      bucket(b)  before backward writes a buffer again (block l-2 reuses block l's slot), the compute stream
                 waits on that event; with --no-overlap it waits at once, in done(b) (the same numbers).
    MPI on host memory (CPU ranks): done(b) only starts the reduce-scatter; the host waits for it in bucket(b)
    of the block that reuses the buffer (then accumulates), or in backward_done(); with --no-overlap at once.
    The embeddings' gradient is backward's last (wte starts in the classifier, ends in the encoder); after it,
    backward_done() makes the compute stream wait for the comm stream, so a micro-step ends joined (a captured
    CUDA graph must) and every buffer is free again."""

    def __init__(self, ctx: Context, sharded: bool = True):
        assert sharded, "a gradient shard needs an optimizer that updates only my slice"
        L, dev = ctx.layout, ctx.dev
        self.ctx = ctx
        self.grad_shard = ctx.zeros("gradients", L.shard_total)       # my slice of every bucket, for the step
        slot = block_slot_size(L)
        self.reusable = {"slot0": ctx.zeros("gradients", slot), "slot1": ctx.zeros("gradients", slot),
                         "embeddings": ctx.zeros("gradients", L.embeddings.padded_size),
                         "lnf": ctx.zeros("gradients", L.lnf.padded_size)}
        # bucket -> the buffer it writes into: block l (bucket l+1) slot l % 2, the two ends their own
        self.buffer_of = {b.index: f"slot{(b.index - 1) % 2}" if 0 < b.index < L.lnf.index else b.name
                          for b in L.buckets}
        self.views = {b.index: b.views(self.reusable[self.buffer_of[b.index]]) for b in L.buckets}
        # per buffer, the event the comm stream records once it has zeroed it; `pending`: the buffers whose event
        # the compute stream must wait on before it writes them again
        self.free = {key: dev.event() for key in self.reusable}
        self.pending: set = set()
        # the reduce-scatters started and not yet accumulated, oldest first: (buffer, bucket, its part of the
        # buffer, its span on the timeline, the request); only MPI's on host memory stay here past done(b)
        self.in_flight: deque = deque()
        # the micro-step whose gradients are being accumulated (bf16: the rounding draws), on the device like
        # AdamW's scalars, so a replayed CUDA graph reads the current one (set_micro_step)
        self.micro_step = dev.zeros(1, np.uint64)
        self.reduce_scatters_in_backward = 0

    def buffers(self) -> dict:
        return {"grad_shard": self.grad_shard}

    # ---- backward (llmz.model) ----------------------------------------------------------------------------
    def bucket(self, b: int) -> dict:
        ctx, key = self.ctx, self.buffer_of[b]
        ctx.comm.progress()                             # MPI: move the reduce-scatters in flight on
        self.finish(key)                                # MPI: the buffer's last reduce-scatter, waited for
        if key in self.pending:
            self.pending.discard(key)
            self.free[key].wait(ctx.dev.compute_stream)    # the comm stream has drained and zeroed it
        ctx.begin(ctx.layout.buckets[b].name, "compute")
        return self.views[b]

    def done(self, b: int) -> None:
        """Bucket b's gradients are complete: start reduce-scattering it (the comm stream; MPI: in flight on the
        host) and accumulate my part once it has arrived."""
        ctx = self.ctx
        bucket, key = ctx.layout.buckets[b], self.buffer_of[b]
        buf = self.reusable[key][:bucket.padded_size]
        ctx.end(bucket.name, "compute")
        ctx.comm.progress()                             # MPI: those in flight, while this block computed
        ctx.comm_waits_for_compute()
        span = f"reduce-scatter {bucket.name}"
        ctx.begin(span, "comm")
        request = ctx.comm.start_reduce_scatter(buf, op="avg")
        self.in_flight.append((key, bucket, buf, span, request))
        self.reduce_scatters_in_backward += 1
        if request.done or not ctx.overlap:             # done: NCCL's is on the comm stream, local's is nothing
            self.finish(key)

    def finish(self, key: str) -> None:
        """If buffer `key` has a reduce-scatter not yet accumulated: wait for it and every one started before it
        (MPI: within the deadline), and for each add my part into the shard and zero the buffer (the comm
        stream), then record the buffer's `free` event."""
        if all(k != key for k, *_ in self.in_flight):
            return
        ctx, dev = self.ctx, self.ctx.dev
        while True:
            k, bucket, buf, span, request = self.in_flight.popleft()
            request.wait()
            self.accumulate(bucket, buf)
            ctx.end(span, "comm", at=request.completed_at)     # MPI: where this rank saw it complete
            self.free[k].record(dev.comm_stream)
            if ctx.overlap:
                self.pending.add(k)                     # compute waits only before it reuses the buffer
            else:
                self.free[k].wait(dev.compute_stream)   # serialised: compute waits right away
            if k == key:
                return

    def accumulate(self, bucket, buf) -> None:
        """shard += my averaged slice of buf, and buf = 0: one kernel, on the comm stream."""
        ctx, L = self.ctx, self.ctx.layout
        at = L.shard_offset(bucket)
        mine = self.grad_shard[at:at + bucket.shard_size]
        if ctx.bf16:
            # add in fp32, round back to bf16 stochastically: element j of the shard draws at its place in the
            # whole buffer, a fresh word every micro-step
            ctx.kernels.accumulate_shard_bf16(ctx.dev, mine, buf, ctx.rank, ctx.seed, self.micro_step,
                                              stream=ctx.dev.comm_stream,
                                              offset=bucket.offset + L.shard_range(bucket, ctx.rank)[0])
        else:
            ctx.kernels.accumulate_shard(ctx.dev, mine, buf, ctx.rank, stream=ctx.dev.comm_stream)

    def backward_done(self) -> None:
        """The compute stream waits for the last reduce-scatter of this micro-step (the embeddings'; MPI: the host
        waits for those still in flight and accumulates them)."""
        while self.in_flight:
            self.finish(self.in_flight[-1][0])
        self.ctx.compute_waits_for_comm()
        self.pending.clear()

    def set_micro_step(self, i: int) -> None:
        """Before micro-step i (counted over the run: step * K + micro): its number to the device, on the compute
        stream (outside any captured graph). Only bf16's rounding draws from it."""
        if self.ctx.bf16:
            self.ctx.dev.copy_from_host(self.micro_step, np.array([i & 0xFFFFFFFF], np.uint64))

    # ---- the update ---------------------------------------------------------------------------------------
    def reduce(self) -> None:
        """Nothing is left to reduce: every bucket was reduce-scattered during backward, and backward_done made
        the compute stream wait for the last of it. (No wait here: in the captured update it would wait on an
        event recorded on the idle comm stream outside the capture, which CUDA refuses; llmz/graph.py.)"""

    def owned(self) -> list:
        """The gradient this rank owns: the shard, in one piece."""
        return [self.grad_shard]

    def slice(self, b, start: int, end: int):
        at = self.ctx.layout.shard_offset(b)
        return self.grad_shard[at:at + end - start]

    def zero(self) -> None:
        self.ctx.kernels.zero(self.ctx.dev, self.grad_shard)
