"""ZeRO stages 0, 1, 2, 3: what happens to a bucket's gradients when backward finishes it, to the parameters
after the optimizer step, and (stage 3) to a bucket's parameters before the model uses them
(Rajbhandari et al. 2019; llm.c's zero.cuh and PR #593).

Stages 0-2 keep the full parameters on every rank; stage 3 shards those too. They differ in what each rank
keeps, with Ψ parameters and N ranks (fp32 training, no master copy):

  stage 0  gradients 4Ψ,  m and v 8Ψ     all-reduce every bucket after backward; every rank runs AdamW on all
  stage 1  gradients 4Ψ,  m and v 8Ψ/N   reduce-scatter every bucket at the last micro-step; AdamW on my
                                         shard; all-gather every bucket's parameters
  stage 2  gradients 4Ψ/N + two block slots + embedding grads, m and v 8Ψ/N
                                         during backward, block l's gradients go into slot l % 2; when the
                                         block is done the comm stream reduce-scatters the slot and one kernel
                                         adds my part into my gradient shard and zeroes the slot
  stage 3  parameters 4Ψ/N + two block slots + embeddings + lnf, gradients as stage 2, m and v 8Ψ/N
                                         before block l runs (forward, then again in backward) its
                                         parameters are all-gathered into slot l % 2, block l+1's (l-1's in
                                         backward) while block l computes; the embeddings and the final
                                         layernorm are gathered once a step, after AdamW, and kept; gradients
                                         go exactly as at stage 2 (see Stage3)

Rank r owns slice r of every bucket (llmz.layout). All communication goes through llmz.comm; ordering
between the compute stream and the comm stream is by events only (record on one, wait on the other) —
never a host synchronisation inside backward.
"""
from __future__ import annotations

import numpy as np

from .bf16 import f32_to_bf16, f32_to_bf16_stochastic
from .kernels.norm import NORM_BLOCKS
from .layout import Layout
from .model import FullParams
from .optim import AdamW


class ZeroStage:
    """State and step logic shared by the three stages; subclasses say where gradients live."""

    stage = -1

    def __init__(self, layout: Layout, dev, comm, opt: AdamW, params_host: np.ndarray,
                 overlap: bool = True, tracer=None, seed: int = 0, start_step: int = 0):
        self.layout, self.dev, self.comm, self.opt = layout, dev, comm, opt
        self.rank, self.world_size = comm.rank, comm.world_size
        assert layout.world_size == self.world_size
        self.overlap = overlap
        self.tracer = tracer
        self.kernels = dev.ops                       # the layer functions, as in llmz.model
        self.allocated: dict[str, int] = {}          # category -> bytes this object allocated (memory report)
        # bf16 (parameters, gradients and activations as uint16 bit patterns): AdamW updates an fp32 master
        # copy of what this rank owns and writes the bf16 parameters from it with stochastic rounding; the
        # rounding draws from (seed, element, step)
        self.bf16 = dev.dtype == np.uint16
        self.seed = seed
        # on the compute stream, in order with the kernels. bf16: params_host is the fp32 master; the bf16
        # parameters are its rounding to nearest at the start, and after `start_step` updates (a resume) the
        # stochastic rounding that step's AdamW wrote, recomputed from the same (seed, element, step)
        if self.bf16:
            host32 = params_host.astype(np.float32)
            bits = f32_to_bf16_stochastic(host32, seed, start_step - 1, 0) if start_step else f32_to_bf16(host32)
        self.alloc_parameters(bits if self.bf16 else params_host)
        n_opt = layout.total if self.stage == 0 else layout.shard_total
        opt_dtype = np.float32 if self.bf16 else None
        self.master = None
        if self.bf16:
            self.master = self._alloc("optimizer_state", n_opt, opt_dtype)
            dev.copy_from_host(self.master, self._owned(params_host).astype(np.float32))
        self.m = self._alloc("optimizer_state", n_opt, opt_dtype)
        self.v = self._alloc("optimizer_state", n_opt, opt_dtype)
        self.scalars = dev.zeros(5, np.float64)       # [lr, grad_scale, 1-beta1^t, 1-beta2^t, step]
        # the micro-step whose gradients are being accumulated (bf16 stage 2: the rounding draws), on the
        # device like the scalars, so a replayed CUDA graph reads the current one (set_micro_step)
        self.micro_step = dev.zeros(1, np.uint64)
        # the two events that order the streams, made once: a captured graph records them as edges, and
        # recording an event again moves it (a wait uses the latest record at the time of the call)
        self.compute_done, self.comm_done = dev.event(), dev.event()
        self.norm_sq = dev.zeros(1, np.float64)
        self.norm_scratch = dev.zeros(NORM_BLOCKS, np.float64)

    def alloc_parameters(self, values: np.ndarray) -> None:
        """The parameters the model reads, from `values` (the full host buffer, in the run's dtype), and the
        store it asks them from (self.pviews, llmz.model). Stages 0-2: whole on every rank."""
        self.params = self._alloc("parameters", self.layout.total)
        self.dev.copy_from_host(self.params, values)
        self.pviews = FullParams(self.layout, self.params)

    def param_slice(self, b, start: int, end: int):
        """Where AdamW writes the parameters [start, end) of bucket b: in place in the full buffer."""
        return self.layout.bucket_buffer(self.params, b)[start:end]

    def full_parameters(self) -> np.ndarray:
        """Every parameter on the host, in the run's dtype (bf16: the uint16 bits). Stage 3 gathers them:
        call it on every rank."""
        return self.dev.to_host(self.params)

    def _owned(self, full: np.ndarray) -> np.ndarray:
        """The stretches of a full host buffer this rank's optimizer holds, one after another."""
        return np.concatenate([full[b.offset + s:b.offset + e] for b, s, e in self.owned_ranges()])

    def _alloc(self, category: str, n: int, dtype=None):
        a = self.dev.zeros(n, dtype=dtype)
        self.allocated[category] = self.allocated.get(category, 0) + a.nbytes
        return a

    # ---- ordering between the two streams (no host synchronisation) -----------------------------
    def comm_waits_for_compute(self) -> None:
        self.compute_done.record(self.dev.compute_stream)
        self.compute_done.wait(self.dev.comm_stream)

    def compute_waits_for_comm(self) -> None:
        self.comm_done.record(self.dev.comm_stream)
        self.comm_done.wait(self.dev.compute_stream)

    def set_micro_step(self, i: int) -> None:
        """Before micro-step i (counted over the whole run: step * K + micro) starts: its number to the device,
        on the compute stream (outside any captured graph; bf16 stage 2 draws its rounding words from it)."""
        if self.bf16:
            self.dev.copy_from_host(self.micro_step, np.array([i & 0xFFFFFFFF], np.uint64))

    # ---- the training step -------------------------------------------------------------------------
    def reduce_gradients(self) -> None:
        """After the last micro-step's backward: make the (owned) gradients the average over ranks."""
        raise NotImplementedError

    def owned_grads(self) -> list:
        """The pieces of gradient this rank owns after reduce_gradients (for the norm)."""
        raise NotImplementedError

    def backward_done(self) -> None:
        """After each micro-step's backward: the compute stream may go on (stage 2 overrides this)."""

    def update(self, step: int) -> float:
        """The optimizer step after the last micro-step: reduce, norm, clip, AdamW, gather, zero the
        gradients. Returns the global gradient norm (reading it is the one host synchronisation)."""
        self.set_scalars(step)
        self.optimize()
        return self.grad_norm()

    def set_scalars(self, step: int) -> None:
        """Copy this step's [lr, 1, 1-beta1^t, 1-beta2^t, step] to the device (outside any captured graph)."""
        self.dev.copy_from_host(self.scalars, np.array(self.opt.scalars(step), dtype=np.float64))

    def optimize(self) -> None:
        """Everything of the update that runs on the device, with no host synchronisation (a CUDA graph
        can capture it): make the gradients the average over ranks, the global norm from each rank's owned
        sum of squares (all-reduced), the clip factor, AdamW on what this rank owns, full parameters
        everywhere again, gradients zeroed for the next step."""
        dev = self.dev
        self.reduce_gradients()
        for i, g in enumerate(self.owned_grads()):
            self.kernels.norm_squared(dev, self.norm_sq, g, self.norm_scratch, accumulate=i > 0)
        if self.stage > 0:
            self.comm_waits_for_compute()
            self.comm.all_reduce(self.norm_sq, op="sum")
            self.compute_waits_for_comm()
        self.kernels.clip_scale(dev, self.scalars, self.norm_sq, self.opt.grad_clip)
        self.adamw()
        self.gather_parameters()
        self.zero_grad()

    def grad_norm(self) -> float:
        """The global gradient norm of the last optimize() (a host read: synchronises the compute stream)."""
        return float(np.sqrt(self.dev.to_host(self.norm_sq)[0]))

    def grad_slice(self, b, start: int, end: int):
        """The averaged gradient of [start, end) of bucket b, after reduce_gradients."""
        raise NotImplementedError

    def adamw(self) -> None:
        """AdamW on what this rank owns: every bucket whole at stage 0, my slice of each at stages 1-3.
        m and v hold those stretches one after another (owned_ranges)."""
        L, o, k = self.layout, self.opt, self.kernels
        at = 0
        for b, s, e in self.owned_ranges():
            n = e - s
            p, g, m, v = self.param_slice(b, s, e), self.grad_slice(b, s, e), self.m[at:at + n], \
                self.v[at:at + n]
            if self.bf16:
                # the fp32 master moves; the bf16 parameter is its stochastic rounding, element i of the
                # whole buffer drawing at hash index b.offset + s + i (the same bits on every rank and stage)
                k.adamw_update_bf16(self.dev, p, self.master[at:at + n], g, m, v, L.decay_size_in(b, s, e),
                                    self.scalars, o.beta1, o.beta2, o.eps, o.weight_decay, self.seed,
                                    offset=b.offset + s)
            else:
                k.adamw_update(self.dev, p, g, m, v, L.decay_size_in(b, s, e), self.scalars, o.beta1, o.beta2,
                               o.eps, o.weight_decay)
            at += n

    def gather_parameters(self) -> None:
        pass

    def zero_grad(self) -> None:
        pass

    def _all_gather_parameters(self) -> None:
        # the comm stream must wait for the AdamW kernels (llm.c's master misses this wait)
        self.comm_waits_for_compute()
        for b in self.layout.buckets:
            self.comm.all_gather(self.layout.bucket_buffer(self.params, b))
        self.compute_waits_for_comm()

    # ---- training state (llmz.state): slices per bucket, so another world size can re-shard them ------
    def owned_ranges(self) -> list[tuple]:
        """(bucket, start, end) of what m and v hold, in their order: every bucket whole at stage 0, my
        slice of every bucket at stages 1-3."""
        L = self.layout
        if self.stage == 0:
            return [(b, 0, b.padded_size) for b in L.buckets]
        return [(b, *L.shard_range(b, self.rank)) for b in L.buckets]

    def state_slices(self, params_host: np.ndarray) -> dict[str, np.ndarray]:
        """params, m and v of my slice r of every bucket, bucket by bucket, on the host (whatever the
        stage: at stage 0 the N ranks' slices make the whole). params_host: the full host parameters."""
        L = self.layout
        m, v = self.dev.to_host(self.m), self.dev.to_host(self.v)
        master = self.dev.to_host(self.master) if self.bf16 else None
        out: dict[str, list] = {"params": [], "m": [], "v": []}
        at = 0
        for b, s0, e0 in self.owned_ranges():
            s, e = L.shard_range(b, self.rank)
            # bf16: the full-precision parameters are the fp32 master, which holds slice r at every stage
            out["params"].append(master[at + s - s0:at + e - s0] if self.bf16
                                 else params_host[b.offset + s:b.offset + e])
            out["m"].append(m[at + s - s0:at + e - s0])
            out["v"].append(v[at + s - s0:at + e - s0])
            at += e0 - s0
        return {k: np.concatenate(x) for k, x in out.items()}

    def load_optimizer_state(self, m_owned: np.ndarray, v_owned: np.ndarray) -> None:
        """Set m and v from host arrays laid out as owned_ranges() (llmz.state.Checkpoint.assemble)."""
        assert m_owned.shape == self.m.shape and v_owned.shape == self.v.shape, (m_owned.shape, self.m.shape)
        self.dev.copy_from_host(self.m, m_owned)
        self.dev.copy_from_host(self.v, v_owned)

    # ---- memory report --------------------------------------------------------------------------
    def state_bytes(self) -> dict[str, int]:
        return dict(self.allocated)


class Stage0(ZeroStage):
    """Data parallelism: every rank keeps everything and all-reduces the gradients."""

    stage = 0

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.grads = self._alloc("gradients", self.layout.total)
        self.gviews = self.layout.views(self.grads)

    # the gradient store backward writes into (see llmz.model)
    def bucket(self, b: int) -> dict:
        return self.gviews[b]

    def done(self, b: int) -> None:
        pass

    def reduce_gradients(self) -> None:
        self.comm_waits_for_compute()
        for b in self.layout.buckets:
            self.comm.all_reduce(self.layout.bucket_buffer(self.grads, b), op="avg")
        self.compute_waits_for_comm()

    def owned_grads(self) -> list:
        return [self.grads]

    def grad_slice(self, b, start: int, end: int):
        # stage 0: the all-reduced bucket; stage 1: my reduce-scattered slice, in place in the full buffer
        return self.layout.bucket_buffer(self.grads, b)[start:end]

    def zero_grad(self) -> None:
        self.kernels.zero(self.dev, self.grads)


class Stage1(Stage0):
    """Optimizer-state sharding: full gradients accumulate locally; at the last micro-step each bucket is
    reduce-scattered (my slice = the average over ranks), AdamW updates my shard, all-gather restores."""

    stage = 1

    def reduce_gradients(self) -> None:
        self.comm_waits_for_compute()
        for b in self.layout.buckets:
            self.comm.reduce_scatter(self.layout.bucket_buffer(self.grads, b), op="avg")
        self.compute_waits_for_comm()

    def owned_grads(self) -> list:
        return [self.grad_slice(b, s, e) for b, s, e in self.owned_ranges()]

    def gather_parameters(self) -> None:
        self._all_gather_parameters()


class Stage2(ZeroStage):
    """Gradient sharding: each rank keeps only its gradient shard, plus two block slots and the
    embedding (and final layernorm) gradients, which are reduce-scattered as soon as backward completes
    them. Every micro-step reduce-scatters (K micro-steps: K reduce-scatters)."""

    stage = 2

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        L = self.layout
        self.grad_shard = self._alloc("gradients", L.shard_total)          # persistent, my slice of all
        slot_size = max(b.padded_size for b in L.buckets[1:-1])
        # the reusable gradient buffers: two block slots, the embeddings', the final layernorm's
        self.buffers = {0: self._alloc("gradients", slot_size), 1: self._alloc("gradients", slot_size),
                        "emb": self._alloc("gradients", L.embeddings.padded_size),
                        "lnf": self._alloc("gradients", L.lnf.padded_size)}
        # an event per reusable buffer, recorded on the comm stream once the buffer is zeroed again; `pending`
        # names the buffers whose event the compute stream must wait on before it writes them again
        self.free = {key: self.dev.event() for key in self.buffers}
        self.pending: set = set()
        self.reduce_scatters_in_backward = 0

    def _key(self, b: int):
        """Which buffer bucket b writes into: block l (bucket l+1) uses slot l % 2."""
        return "emb" if b == 0 else "lnf" if b == len(self.layout.buckets) - 1 else (b - 1) % 2

    def _buffer(self, b: int):
        return self.buffers[self._key(b)]

    # the gradient store backward writes into (see llmz.model)
    def bucket(self, b: int) -> dict:
        key = self._key(b)
        if key in self.pending:
            self.pending.discard(key)
            self.free[key].wait(self.dev.compute_stream)   # the comm stream has drained and zeroed it
        if self.tracer:
            self.tracer.begin(self.layout.buckets[b].name, "compute")
        return self.layout.buckets[b].views(self._buffer(b))

    def done(self, b: int) -> None:
        """Bucket b's gradients are complete: reduce-scatter it on the comm stream and accumulate my part."""
        dev, L, k = self.dev, self.layout, self.kernels
        bucket = L.buckets[b]
        buf = self._buffer(b)[:bucket.padded_size]
        if self.tracer:
            self.tracer.end(bucket.name, "compute")
        self.comm_waits_for_compute()
        if self.tracer:
            self.tracer.begin(f"reduce-scatter {bucket.name}", "comm")
        self.comm.reduce_scatter(buf, op="avg")
        at = L.shard_offset(bucket)
        if self.bf16:
            # add in fp32, round back to bf16 stochastically: element j of the shard draws at its place in
            # the whole buffer, a fresh word every micro-step
            k.accumulate_shard_bf16(dev, self.grad_shard[at:at + bucket.shard_size], buf, self.rank, self.seed,
                                    self.micro_step, stream=dev.comm_stream,
                                    offset=bucket.offset + L.shard_range(bucket, self.rank)[0])
        else:
            k.accumulate_shard(dev, self.grad_shard[at:at + bucket.shard_size], buf, self.rank,
                               stream=dev.comm_stream)
        if self.tracer:
            self.tracer.end(f"reduce-scatter {bucket.name}", "comm")
        self.reduce_scatters_in_backward += 1
        key = self._key(b)
        self.free[key].record(dev.comm_stream)
        if self.overlap:
            self.pending.add(key)                    # compute waits only before it reuses the buffer
        else:
            self.free[key].wait(dev.compute_stream)  # serialised: compute waits right away

    def backward_done(self) -> None:
        """The compute stream waits for the last reduce-scatter of this micro-step (the embeddings'), so
        every buffer is free again and nothing is left on the comm stream (a captured graph must end
        joined)."""
        self.compute_waits_for_comm()
        self.pending.clear()

    def reduce_gradients(self) -> None:
        """Nothing is left to reduce: every bucket was reduce-scattered during backward, and backward_done
        made the compute stream wait for the last of it at the end of every micro-step. (No wait here: in
        the captured update it would wait on an event recorded on the idle comm stream outside the capture,
        which CUDA refuses in a capture; llmz/graph.py.)"""

    def owned_grads(self) -> list:
        return [self.grad_shard]

    def grad_slice(self, b, start: int, end: int):
        at = self.layout.shard_offset(b)
        return self.grad_shard[at:at + end - start]

    def gather_parameters(self) -> None:
        self._all_gather_parameters()

    def zero_grad(self) -> None:
        self.kernels.zero(self.dev, self.grad_shard)


class Stage3(Stage2):
    """Parameter sharding: each rank keeps only its slice of the parameters too (bf16: of the bf16
    parameters and of the fp32 master), and gathers a bucket's full parameters just before the model uses
    them (llmz.model asks `p.bucket(b)`; self.pviews answers through param_bucket):

      1. block l's parameters are all-gathered into slot l % 2 of two parameter slots, on the comm stream,
         from every rank's slice (comm.all_gather(slot, src=my slice)); an event recorded there makes the
         compute stream wait before block l's first kernel, never the host;
      2. prefetch: while block l computes, block l+1's gather already runs on the comm stream (in backward:
         block l-1's). Its slot was block l-1's (l+1's): the comm stream first waits on an event recorded on
         the compute stream after that block's last kernel. Every block is gathered twice a micro-step:
         before its forward and again before its backward (2L gathers);
      3. backward starts (its first call, grads.bucket(0) for the classifier's wte gradient) by gathering
         block L-1, under the classifier's backward; a forward's block 0 has nothing before it to hide under
         (the store cannot tell a forward's first request from the backward's, so it never guesses);
      4. the embeddings and the final layernorm are gathered once a step, right after AdamW, into buffers of
         their own, and kept for the whole next step (they are there at start-up and after a resume: every
         rank starts from the full host parameters). Why not through the slots, gathered twice: wte is used
         first (encoder) and last (classifier) in forward and first again in backward, back to back; it is
         the largest bucket (GPT-2 124M: 39M parameters, 5.5 blocks), so in a slot it would make both slots
         5.5 times bigger, and in a buffer of its own it costs the same memory gathered once as twice. Once
         a step and not once a micro-step: with K micro-steps the step's parameters do not change, and every
         micro-step stays the same sequence of calls (one CUDA graph). lnf is 2C values and used at the same
         two moments: it goes with wte;
      5. gradients go exactly as at stage 2 (Stage2: two gradient slots, reduce-scatter + accumulate on the
         comm stream, which also carries the gathers, in program order);
      6. AdamW updates my parameter shard (Stage1's sharded update); no full all-gather after the step.

    Memory per rank: parameters bΨ/N + two slots + embeddings + lnf, gradients the same (as stage 2), m and
    v 2bΨ/N (bf16: + the fp32 master shard). Communication per micro-step: 2L block gathers and L+2
    reduce-scatters (≈ 3bΨ(N-1)/N), plus the embeddings' and lnf's gathers once a step.
    CUDA graphs: no host synchronisation, no allocation and no new event inside a step; the order of the
    gathers is the same in every micro-step."""

    stage = 3

    def alloc_parameters(self, values: np.ndarray) -> None:
        L, dev = self.layout, self.dev
        # my slice of every bucket, one after another (as the gradient shard, m and v): what AdamW updates
        self.param_shard = self._alloc("parameters", L.shard_total)
        dev.copy_from_host(self.param_shard, self._owned(values))
        # two block slots: block l is gathered into slot l % 2
        slot_size = max(b.padded_size for b in L.buckets[1:-1])
        self.slots = [self._alloc("parameters", slot_size), self._alloc("parameters", slot_size)]
        # the embeddings and the final layernorm, whole for the step
        self.ends = {}
        for b in (L.embeddings, L.lnf):
            self.ends[b.index] = self._alloc("parameters", b.padded_size)
            dev.copy_from_host(self.ends[b.index], L.bucket_buffer(values, b))
        # the named views the model gets, made once: block l's into slot l % 2, the ends' into their buffers;
        # and where each bucket's slice sits in my shard (what I contribute to its all-gathers)
        self.views = {b.index: b.views(self.ends[b.index] if b.index in self.ends else self.slots[(b.index - 1) % 2])
                      for b in L.buckets}
        self.mine = {b.index: self.param_shard[L.shard_offset(b):L.shard_offset(b) + b.shard_size]
                     for b in L.buckets}
        self.pviews = GatheredParams(self)
        # events, made once and reused (their record/wait pairs can be captured into a CUDA graph)
        self.gathered = [dev.event(), dev.event()]     # on the comm stream: slot s holds its block
        self.ends_gathered = dev.event()                # on the comm stream: embeddings and lnf gathered
        self.compute_mark = dev.event()                 # on the compute stream: everything enqueued so far
        self.prefetched = None                          # the block whose gather is already under way
        self.in_backward = False                        # between backward's first call and its last
        self.forward_span = None                        # (tracer) the block whose forward is being timed
        self.all_gathers: list[str] = []                # the buckets gathered, in order (lessons, tests)

    # ---- the parameter store the model asks (llmz.model) -------------------------------------------------
    def param_bucket(self, b: int) -> dict:
        """Bucket b's full parameters as named views, once they are on this rank (for the compute stream:
        it waits on the gather's event here); starts gathering the block the model will ask for next."""
        L = self.layout
        self._end_forward_span()
        if b in self.ends:
            return self.views[b]                        # gathered for the step (gather_parameters)
        layer = b - 1
        if self.prefetched != layer:                    # not gathered ahead (a forward's block 0, --no-overlap)
            self._gather_block(layer)
        self.gathered[layer % 2].wait(self.dev.compute_stream)
        nxt = layer - 1 if self.in_backward else layer + 1
        self.prefetched = None
        if self.overlap and 0 <= nxt < L.config.num_layers:
            self._gather_block(nxt)                     # on the comm stream, while this block computes
            self.prefetched = nxt
        if self.tracer and not self.in_backward:
            self.forward_span = f"forward {L.buckets[b].name}"
            self.tracer.begin(self.forward_span, "compute")
        return self.views[b]

    def _gather_block(self, layer: int) -> None:
        """Block `layer`'s parameters into slot layer % 2, on the comm stream, once the compute stream is done
        with what the slot held (every kernel enqueued so far)."""
        dev = self.dev
        self.compute_mark.record(dev.compute_stream)
        self.compute_mark.wait(dev.comm_stream)
        bucket = self.layout.block(layer)
        self._all_gather(bucket, self.slots[layer % 2][:bucket.padded_size])
        self.gathered[layer % 2].record(dev.comm_stream)

    def _all_gather(self, bucket, buf) -> None:
        """buf <- bucket's full parameters: every rank contributes its slice from its shard (comm stream)."""
        if self.tracer:
            self.tracer.begin(f"all-gather {bucket.name}", "comm")
        self.comm.all_gather(buf, src=self.mine[bucket.index])
        self.all_gathers.append(bucket.name)
        if self.tracer:
            self.tracer.end(f"all-gather {bucket.name}", "comm")

    def _end_forward_span(self) -> None:
        if self.forward_span:
            self.tracer.end(self.forward_span, "compute")
            self.forward_span = None

    # ---- the gradient store (Stage2's), which also tells where backward is -----------------------------
    def bucket(self, b: int) -> dict:
        if b == 0 and not self.in_backward:
            # backward's first call (the classifier's wte gradient): from here on blocks come in reverse
            # order, and block L-1's gather can run under the classifier's backward
            self._end_forward_span()
            self.in_backward = True
            if self.overlap:
                self._gather_block(self.layout.config.num_layers - 1)
                self.prefetched = self.layout.config.num_layers - 1
        return super().bucket(b)

    def done(self, b: int) -> None:
        super().done(b)
        if b == 0:
            self.in_backward = False                    # the embeddings' gradient is backward's last

    # ---- the step ---------------------------------------------------------------------------------------
    def param_slice(self, b, start: int, end: int):
        at = self.layout.shard_offset(b)
        return self.param_shard[at:at + end - start]

    def gather_parameters(self) -> None:
        """After AdamW: the embeddings and the final layernorm, gathered for the next step and kept."""
        dev = self.dev
        self.compute_mark.record(dev.compute_stream)    # the comm stream waits for the AdamW kernels
        self.compute_mark.wait(dev.comm_stream)
        for b in self.ends:
            self._all_gather(self.layout.buckets[b], self.ends[b])
        self.ends_gathered.record(dev.comm_stream)
        self.ends_gathered.wait(dev.compute_stream)

    def full_parameters(self) -> np.ndarray:
        """Every bucket gathered (blocks through slot 0) and copied to the host: a collective."""
        L = self.layout
        out = np.zeros(L.total, dtype=self.dev.dtype)
        for b in L.buckets:
            if b.index in self.ends:
                buf = self.ends[b.index]
            else:
                self._gather_block(b.index - 1)
                self.gathered[(b.index - 1) % 2].wait(self.dev.compute_stream)
                buf = self.slots[(b.index - 1) % 2]
            out[b.offset:b.offset + b.padded_size] = self.dev.to_host(buf[:b.padded_size])
        return out


class GatheredParams:
    """Stage 3's parameter store: llmz.model's `p.bucket(b)` is Stage3.param_bucket(b)."""

    def __init__(self, stage: Stage3):
        self.stage = stage

    def bucket(self, b: int) -> dict:
        return self.stage.param_bucket(b)


STAGES = {0: Stage0, 1: Stage1, 2: Stage2, 3: Stage3}


def make_stage(stage: int, *args, **kw) -> ZeroStage:
    return STAGES[stage](*args, **kw)
