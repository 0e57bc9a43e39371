"""One ZeRO stage put together from its three parts (the table in llmz/zero/__init__.py), and the training step
they make. What llmz.trainer, the lessons and the tests call, with z = make_stage(...):

    each micro-step  model.forward(z.param_store, x); model.backward(z.param_store, z, x, y, dloss);
                     z.backward_done()
    after the last   z.update(step)  =  z.set_scalars(step); z.optimize(); z.grad_norm()

optimize() runs on the device only, with no host synchronisation and no allocation (a CUDA graph captures it,
llmz/graph.py, as it captures a micro-step):
    1. reduce_gradients    the gradients this rank owns become the average over ranks (the gradient store)
    2. norm and clip       their global norm, all-reduced where the ranks own different parts; the clip factor
    3. AdamW               on what this rank owns (the sharded optimizer), written where the parameter store says
    4. gather_parameters   the parameters whole again where the model reads them (the parameter store)
    5. zero                the gradients, for the next step
"""
from __future__ import annotations

import numpy as np

from ..layout import Layout
from ..optim import AdamW
from . import slices
from .context import Context
from .sharded_adamw import ShardedAdamW, start_values


class ZeroStage:
    def __init__(self, stage: int, parts: tuple, layout: Layout, dev, comm, opt: AdamW, params_host: np.ndarray,
                 overlap: bool = True, tracer=None, seed: int = 0, start_step: int = 0):
        """parts: (gradient store class, parameter store class, optimizer sharded?), a row of the table.
        params_host: the full host parameters at full precision (a resume: those saved after `start_step`
        updates); every rank passes the same."""
        grad_store, param_store, sharded = parts
        self.stage, self.layout, self.dev, self.comm, self.opt = stage, layout, dev, comm, opt
        # bf16 (parameters, gradients and activations as uint16 bit patterns), decided once, from the device
        bf16 = dev.precision.bf16
        self.ctx = Context(layout, dev, comm, bf16, seed, overlap, tracer)
        self.allocated = self.ctx.allocated             # category -> bytes allocated (the memory report)
        self.param_store = param_store(self.ctx, sharded, start_values(params_host, bf16, seed, start_step))
        self.optimizer = ShardedAdamW(self.ctx, opt, sharded, params_host)
        self.grad_store = grad_store(self.ctx, sharded)

    # ---- the gradient store backward writes into (llmz.model) ----------------------------------------------
    def bucket(self, b: int) -> dict:
        """Where backward accumulates bucket b's gradients. The parameter store hears of it first: at stage 3
        backward's first call tells it that blocks now come in reverse order."""
        self.param_store.grads_asked(b)
        return self.grad_store.bucket(b)

    def done(self, b: int) -> None:
        """Bucket b's gradients are complete (stages 2, 3: reduce-scatter it now)."""
        self.grad_store.done(b)
        self.param_store.grads_done(b)

    def backward_done(self) -> None:
        """After each micro-step's backward (stages 2, 3: the compute stream waits for the comm stream)."""
        self.grad_store.backward_done()

    def set_micro_step(self, i: int) -> None:
        """Before micro-step i (counted over the run: step * K + micro), outside any captured graph: its number
        to the device, where bf16 stages 2 and 3 draw their rounding words from it."""
        self.grad_store.set_micro_step(i)

    # ---- the update -----------------------------------------------------------------------------------------
    def update(self, step: int) -> float:
        """The optimizer step after the last micro-step; returns the global gradient norm (reading it is the one
        host synchronisation)."""
        self.set_scalars(step)
        self.optimize()
        return self.grad_norm()

    def set_scalars(self, step: int) -> None:
        """This step's learning rate and bias corrections to the device (outside any captured graph)."""
        self.optimizer.set_scalars(step)

    def optimize(self) -> None:
        """Everything of the update that runs on the device (the module docstring's steps 1-5)."""
        self.reduce_gradients()
        self.optimizer.clip(self.grad_store.owned())
        self.optimizer.update(self.param_store.slice, self.grad_store.slice)
        self.gather_parameters()
        self.grad_store.zero()

    def reduce_gradients(self) -> None:
        self.grad_store.reduce()

    def gather_parameters(self) -> None:
        self.param_store.gather_after_update()

    def grad_norm(self) -> float:
        """The global gradient norm of the last optimize() (a host read: synchronises the compute stream)."""
        return self.optimizer.grad_norm()

    # ---- ordering of the two streams, for the caller's own collectives (llmz.train) ---------------------------
    def comm_waits_for_compute(self) -> None:
        self.ctx.comm_waits_for_compute()

    def compute_waits_for_comm(self) -> None:
        self.ctx.compute_waits_for_comm()

    # ---- what the lessons and tests count -----------------------------------------------------------------------
    @property
    def reduce_scatters_in_backward(self) -> int:
        return self.grad_store.reduce_scatters_in_backward

    @property
    def all_gathers(self) -> list[str]:
        """Stage 3: the buckets gathered so far, in order (clear() it to count afresh)."""
        return self.param_store.all_gathers

    def state_arrays(self) -> list:
        """The device arrays of this rank's training state: the parameters it keeps (all of them, or at stage 3
        its slice), then the optimizer's fp32 master copy (bf16 only), m and v (llmz.run.guards checks they are
        all finite before anything is saved)."""
        kept = [*self.param_store.buffers().values(), *self.optimizer.buffers().values()]
        return [a for a in kept if a is not None]

    # ---- the host side: checkpoints (llmz.run.state), the memory report (llmz.memory) -----------------------------
    def full_parameters(self) -> np.ndarray:
        """Every parameter on the host, in the run's dtype (bf16: the uint16 bits). Stage 3 gathers them: call
        it on every rank."""
        return self.param_store.full_parameters()

    def owned_ranges(self) -> list[tuple]:
        """(bucket, start, end) of what m and v hold, in their order: every bucket whole at stage 0, my slice of
        every bucket at stages 1-3."""
        return self.optimizer.owned_ranges()

    def state_slices(self, params_host: np.ndarray) -> dict[str, np.ndarray]:
        return slices.state_slices(self.optimizer, params_host)

    def load_optimizer_state(self, m_owned: np.ndarray, v_owned: np.ndarray) -> None:
        slices.load_optimizer_state(self.optimizer, m_owned, v_owned)

    def state_bytes(self) -> dict[str, int]:
        return dict(self.allocated)
