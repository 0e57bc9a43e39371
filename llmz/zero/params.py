"""The parameter store: what the model reads (llmz.model asks `p.bucket(b)` just before it uses bucket b's
parameters), where AdamW writes them (slice(b, start, end)), and how they are whole again after the update.

  FullParameters      stages 0-2: the whole flat buffer on every rank. After AdamW has updated my slice of every
                      bucket (stages 1 and 2) each bucket is all-gathered; at stage 0 every rank updated all of it.
  GatheredParameters  stage 3: only my slice of every bucket (the parameter shard), and a bucket's full
                      parameters gathered just before the model uses them:
    1. block l's parameters are all-gathered into slot l % 2 of two parameter slots, on the comm stream, from
       every rank's slice (comm.all_gather(slot, src=my slice)); an event recorded there makes the compute
       stream wait before block l's first kernel, never the host;
    2. prefetch: while block l computes, block l+1's gather already runs on the comm stream (in backward: block
       l-1's). Its slot was block l-1's (l+1's): the comm stream first waits for every kernel enqueued on the
       compute stream so far. Every block is gathered twice a micro-step: before its forward and again before its
       backward (2L gathers);
    3. backward starts (its first call, grads.bucket(0) for the classifier's wte gradient: the gradient store
       passes it on, grads_asked) by gathering block L-1 under the classifier's backward; a forward's block 0
       has nothing before it to hide under (the store cannot tell a forward's first request from backward's,
       so it never guesses);
    4. the embeddings and the final layernorm are gathered once a step, right after AdamW, into buffers of their
       own, and kept for the whole next step (they are there at start-up and after a resume: every rank starts
       from the full host parameters). Why not through the slots, gathered twice: wte is used first (encoder)
       and last (classifier) in forward and first again in backward, back to back; it is the largest bucket
       (GPT-2 124M: 39M parameters, 5.5 blocks), so in a slot it would make both slots 5.5 times bigger, and in
       a buffer of its own it costs the same memory gathered once as twice. Once a step and not once a
       micro-step: with K micro-steps the step's parameters do not change, and every micro-step stays the same
       sequence of calls (one CUDA graph). lnf is 2C values and used at the same two moments: it goes with wte;
    5. AdamW updates my parameter shard; there is no all-gather of everything after the step.
    On CPU ranks (MPI on host memory) there is no comm stream: a block's gather is started (non-blocking) when
    it would be enqueued, stays in flight while the block before computes (progressed at every bucket()), and
    the host waits for it when the model asks for the block.
    Communication per micro-step: 2L block gathers (≈ 2bΨ(N-1)/N) besides the gradients' reduce-scatters,
    plus the embeddings' and lnf's gathers once a step. CUDA graphs: no host synchronisation, no allocation and
    no new event inside a step; the order of the gathers is the same in every micro-step.
"""
from __future__ import annotations

import numpy as np

from ..model import FullParams
from .context import Context, block_slot_size
from .slices import owned_values, shard_ranges


class FullParameters(FullParams):
    """Stages 0-2: one full-size flat buffer of parameters on every rank, every bucket always there; the model
    reads it as llmz.model's plain FullParams (bucket(b): its views)."""

    def __init__(self, ctx: Context, sharded: bool, values: np.ndarray):
        """sharded: AdamW updates my slice only (stages 1, 2), so every bucket is all-gathered after it.
        values: the full host parameters, in the run's dtype."""
        self.ctx, self.sharded = ctx, sharded
        self.params = ctx.zeros("parameters", ctx.layout.total)
        ctx.dev.copy_from_host(self.params, values)
        super().__init__(ctx.layout, self.params)

    def buffers(self) -> dict:
        return {"params": self.params}

    # ---- what backward tells the parameter store (nothing to do with it here) -----------------------------------
    def grads_asked(self, b: int) -> None:
        pass

    def grads_done(self, b: int) -> None:
        pass

    # ---- the update -------------------------------------------------------------------------------------------
    def slice(self, b, start: int, end: int):
        """Where AdamW writes the parameters [start, end) of bucket b: in place in the full buffer."""
        return self.ctx.layout.bucket_buffer(self.params, b)[start:end]

    def gather_after_update(self) -> None:
        """Stages 1 and 2: every rank's updated slices to every rank, bucket by bucket."""
        if not self.sharded:
            return
        ctx = self.ctx
        ctx.comm_waits_for_compute()        # the comm stream waits for the AdamW kernels (llm.c's master misses this)
        for b in ctx.layout.buckets:
            ctx.comm.all_gather(ctx.layout.bucket_buffer(self.params, b))
        ctx.compute_waits_for_comm()

    def full_parameters(self) -> np.ndarray:
        """Every parameter on the host, in the run's dtype (bf16: the uint16 bits)."""
        return self.ctx.dev.to_host(self.params)


class GatheredParameters:
    """Stage 3: my parameter shard (what AdamW updates), two block slots that the blocks are gathered into, and
    the embeddings and the final layernorm whole for the step (see the module docstring)."""

    def __init__(self, ctx: Context, sharded: bool, values: np.ndarray):
        assert sharded, "a parameter shard needs an optimizer that updates only my slice"
        L, dev = ctx.layout, ctx.dev
        self.ctx = ctx
        self.param_shard = ctx.zeros("parameters", L.shard_total)     # my slice of every bucket, one after another
        dev.copy_from_host(self.param_shard, owned_values(values, shard_ranges(L, ctx.rank)))
        slot = block_slot_size(L)
        self.slots = [ctx.zeros("parameters", slot), ctx.zeros("parameters", slot)]   # block l into slot l % 2
        self.ends = {}                                                  # the embeddings and lnf, whole
        for b in (L.embeddings, L.lnf):
            self.ends[b.index] = ctx.zeros("parameters", b.padded_size)
            dev.copy_from_host(self.ends[b.index], L.bucket_buffer(values, b))
        # the named views the model gets, made once; and where each bucket's slice sits in my shard (what I
        # contribute to its all-gathers)
        self.views = {b.index: b.views(self.ends[b.index] if b.index in self.ends else self.slots[(b.index - 1) % 2])
                      for b in L.buckets}
        self.mine = {b.index: self.param_shard[L.shard_offset(b):L.shard_offset(b) + b.shard_size]
                     for b in L.buckets}
        self.gathered = [dev.event(), dev.event()]     # on the comm stream: slot s holds its block
        self.in_flight = [None, None]                   # MPI: slot s's gather, (span, request), until waited for
        self.prefetched = None                          # the block whose gather is already under way
        self.in_backward = False                        # between backward's first call and its last
        self.forward_span = None                        # (tracer) the block whose forward is being timed
        self.all_gathers: list[str] = []                # the buckets gathered, in order (lessons, tests)

    def buffers(self) -> dict:
        return {"param_shard": self.param_shard}

    # ---- what the model asks (llmz.model) ------------------------------------------------------------------
    def bucket(self, b: int) -> dict:
        """Bucket b's full parameters as named views, once they are on this rank (for the compute stream: it
        waits on the gather's event here); starts gathering the block the model will ask for next."""
        ctx = self.ctx
        self.end_forward_span()
        ctx.comm.progress()                             # MPI: move the gathers in flight on
        if b in self.ends:
            return self.views[b]                        # gathered for the step (gather_after_update)
        layer = b - 1
        if self.prefetched != layer:                    # not gathered ahead (a forward's block 0, --no-overlap)
            self.gather_block(layer)
        self.wait_gathered(layer % 2)
        nxt = layer - 1 if self.in_backward else layer + 1
        self.prefetched = None
        if ctx.overlap and 0 <= nxt < ctx.layout.config.num_layers:
            self.gather_block(nxt)                      # on the comm stream, while this block computes
            self.prefetched = nxt
        if not self.in_backward:
            self.forward_span = f"forward {ctx.layout.buckets[b].name}"
            ctx.begin(self.forward_span, "compute")
        return self.views[b]

    def grads_asked(self, b: int) -> None:
        """The gradient store is asked for bucket b: its first call (the classifier's wte gradient) begins
        backward, from here on blocks come in reverse order, and block L-1's gather can run under the
        classifier's backward."""
        if b == 0 and not self.in_backward:
            self.end_forward_span()
            self.in_backward = True
            last = self.ctx.layout.config.num_layers - 1
            if self.ctx.overlap:
                self.gather_block(last)
                self.prefetched = last

    def grads_done(self, b: int) -> None:
        if b == 0:
            self.in_backward = False                    # the embeddings' gradient is backward's last

    def gather_block(self, layer: int) -> None:
        """Block `layer`'s parameters into slot layer % 2, on the comm stream, once the compute stream is done
        with what the slot held (every kernel enqueued so far). MPI: in flight until wait_gathered."""
        self.ctx.comm_waits_for_compute()
        bucket = self.ctx.layout.block(layer)
        self.in_flight[layer % 2] = self.start_gather(bucket, self.slots[layer % 2][:bucket.padded_size])
        self.gathered[layer % 2].record(self.ctx.dev.comm_stream)

    def wait_gathered(self, slot: int) -> None:
        """The compute stream waits until slot `slot` holds its block (MPI: the host waits for the gather)."""
        self.finish_gather(self.in_flight[slot])
        self.in_flight[slot] = None
        self.gathered[slot].wait(self.ctx.dev.compute_stream)

    def start_gather(self, bucket, buf):
        """Start buf <- bucket's full parameters, every rank contributing its slice from its shard (comm stream).
        Returns (span, request) while it is in flight (MPI on host memory), else None (done: its span ended)."""
        span = f"all-gather {bucket.name}"
        self.ctx.begin(span, "comm")
        request = self.ctx.comm.start_all_gather(buf, src=self.mine[bucket.index])
        self.all_gathers.append(bucket.name)
        if not request.done:
            return span, request
        self.ctx.end(span, "comm")
        return None

    def finish_gather(self, started) -> None:
        """Wait for a gather start_gather left in flight (within the deadline); its span ends where it completed."""
        if started is not None:
            span, request = started
            request.wait()
            self.ctx.end(span, "comm", at=request.completed_at)

    def end_forward_span(self) -> None:
        if self.forward_span:
            self.ctx.end(self.forward_span, "compute")
            self.forward_span = None

    # ---- the update -------------------------------------------------------------------------------------------
    def slice(self, b, start: int, end: int):
        """Where AdamW writes the parameters [start, end) of bucket b: my shard."""
        at = self.ctx.layout.shard_offset(b)
        return self.param_shard[at:at + end - start]

    def gather_after_update(self) -> None:
        """After AdamW: the embeddings and the final layernorm, gathered for the next step and kept."""
        ctx = self.ctx
        ctx.comm_waits_for_compute()                    # the comm stream waits for the AdamW kernels
        for b in self.ends:
            self.finish_gather(self.start_gather(ctx.layout.buckets[b], self.ends[b]))
        ctx.compute_waits_for_comm()

    def full_parameters(self) -> np.ndarray:
        """Every bucket gathered (blocks through slot 0 or 1) and copied to the host: a collective."""
        L, dev = self.ctx.layout, self.ctx.dev
        out = np.zeros(L.total, dtype=dev.dtype)
        for b in L.buckets:
            if b.index in self.ends:
                buf = self.ends[b.index]
            else:
                self.gather_block(b.index - 1)
                self.wait_gathered((b.index - 1) % 2)
                buf = self.slots[(b.index - 1) % 2]
            out[b.offset:b.offset + b.padded_size] = dev.to_host(buf[:b.padded_size])
        return out
