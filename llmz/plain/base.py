"""What every plain stage shares, none of it a stage's mechanism: the collectives made blocking, the buffers
counted for the memory report (llmz.memory), the update's three steps every stage runs alike (the gradient
norm, the clip factor, AdamW on a stretch of a bucket: the ops llmz.zero calls), and the Trainer's calls that
have nothing to do in a stage where every collective has finished when it returns."""
from __future__ import annotations

import numpy as np


class Blocking:
    """The run's Communicator (llmz.comm) with every collective blocking. On CPU ranks (MPI on the host's
    arrays) each call already returns finished. On a GPU the device first finishes every kernel it was given,
    and the collective has run when the call returns: the comm stream never runs beside the compute stream."""

    def __init__(self, comm, dev):
        self.comm, self.dev, self.rank, self.world_size = comm, dev, comm.rank, comm.world_size

    def all_reduce(self, buf, op: str = "sum") -> None:
        """Every rank ends with the sum (op="avg": the average) of every rank's buf."""
        self.dev.synchronize()
        self.comm.all_reduce(buf, op)
        self.dev.synchronize()

    def reduce_scatter(self, buf, op: str = "avg") -> None:
        """Rank r ends with slice r of the average (op="sum": the sum) of every rank's buf, in its place in
        buf. The other slices hold nothing defined (llmz.comm); here they are set to NaN, so that code which
        reads one shows it (its losses turn NaN) instead of passing by luck (MPI's happen to hold copies)."""
        self.dev.synchronize()
        self.comm.reduce_scatter(buf, op)
        n, r = buf.size // self.world_size, self.rank
        for other in (buf[:r * n], buf[(r + 1) * n:]):
            self.dev.ops.fill(self.dev, other, np.nan)
        self.dev.synchronize()

    def all_gather(self, buf, src=None) -> None:
        """Every rank ends with every rank's slice r of buf (or src, rank r's slice kept elsewhere)."""
        self.dev.synchronize()
        self.comm.all_gather(buf, src)
        self.dev.synchronize()


class PlainStage:
    """The plumbing under every plain stage. llmz/plain/step.py's OneDevice adds `stage`, what a rank holds
    (`param_store` among it), bucket(b), done(b) and optimize(); each later stage replaces some of its parts."""

    master = None                                   # no fp32 master copy: the values are fp32 or fp64

    def __init__(self, layout, dev, comm, opt):
        from ..kernels.norm import NORM_BLOCKS  # numba: imported once the device is chosen (the simulator)
        assert not dev.precision.bf16, "the plain stages keep fp32 or fp64 values (llmz.zero's do bf16)"
        self.layout, self.dev, self.opt, self.rank = layout, dev, opt, comm.rank
        self.comm = Blocking(comm, dev)
        self.k = dev.ops                            # the layer functions (llmz.model's and llmz.zero's)
        self.allocated: dict[str, int] = {}         # memory category -> bytes of the buffers made by alloc()
        self.scalars = dev.zeros(5, np.float64)     # AdamW's [lr, grad_scale, 1-beta1^t, 1-beta2^t, step]
        self.norm_sq = dev.zeros(1, np.float64)     # the gradient norm, squared
        self.scratch = dev.zeros(NORM_BLOCKS, np.float64)

    def alloc(self, category: str, n: int, values=None):
        """A buffer of n values in the run's dtype, counted under `category` (parameters, gradients,
        optimizer_state): zeros, or `values` (a host array) copied in."""
        a = self.dev.zeros(n)
        if values is not None:
            self.dev.copy_from_host(a, values)
        self.allocated[category] = self.allocated.get(category, 0) + a.nbytes
        return a

    # ---- the update's steps, alike in every stage ----------------------------------------------------------
    def norm_squared(self, pieces: list) -> None:
        """norm_sq = the sum of the squares of every value of the pieces, piece after piece (in float64)."""
        for i, g in enumerate(pieces):
            self.k.norm_squared(self.dev, self.norm_sq, g, self.scratch, accumulate=i > 0)

    def clip(self) -> None:
        """scalars[1], the factor AdamW scales the gradient by: clip / norm where norm > clip, else 1."""
        self.k.clip_scale(self.dev, self.scalars, self.norm_sq, self.opt.grad_clip)

    def adamw(self, b, s: int, e: int, params, grads, m, v) -> None:
        """AdamW on the stretch [s, e) of bucket b: params, grads, m and v hold those e - s values."""
        o = self.opt
        self.k.adamw_update(self.dev, params, grads, m, v, self.layout.decay_size_in(b, s, e), self.scalars,
                            o.beta1, o.beta2, o.eps, o.weight_decay)

    # ---- what llmz.trainer.Trainer calls -----------------------------------------------------------------
    def update(self, step: int) -> float:
        """The update after the last micro-step of optimizer step `step`; returns the gradient norm."""
        self.set_scalars(step)
        self.optimize()
        return self.grad_norm()

    def set_scalars(self, step: int) -> None:
        """This step's learning rate and bias corrections (llmz.optim.AdamW.scalars) to the device."""
        self.dev.copy_from_host(self.scalars, np.array(self.opt.scalars(step), dtype=np.float64))

    def grad_norm(self) -> float:
        return float(np.sqrt(self.dev.to_host(self.norm_sq)[0]))

    def backward_done(self) -> None:
        """After each micro-step's backward: nothing is in flight, so nothing to wait for."""

    def set_micro_step(self, i: int) -> None:
        """Before micro-step i: only bf16's stochastic rounding draws from it."""

    def comm_waits_for_compute(self) -> None:
        self.dev.synchronize()

    def compute_waits_for_comm(self) -> None:
        self.dev.synchronize()

    def state_bytes(self) -> dict[str, int]:
        return dict(self.allocated)

    def state_arrays(self) -> list:
        """This rank's training state on the device, which llmz.run.guards checks is finite before a save: the
        parameters it keeps (every one, or stage 3's shard), m and v."""
        kept = (getattr(self, "params", None), getattr(self, "param_shard", None), self.m, self.v)
        return [a for a in kept if a is not None]

    def full_parameters(self):
        """Every parameter on the host (stage 3 gathers them)."""
        return self.dev.to_host(self.params)
