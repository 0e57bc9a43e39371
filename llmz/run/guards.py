"""What keeps a run from wasting work or losing it, checked where it can first be known (beside the locks,
the run's identity and the data agreement of llmz.run.lock, llmz.run.state and llmz.data, taken at start, the
collective watchdog of llmz.run.watchdog, and llmz.memory.check_fits, which refuses a configuration the GPU
cannot hold before the Trainer's big allocations):

  divergence   after every step, a non-finite loss or gradient norm, or a loss above --max-loss (default
               3 ln V, three times a uniform guess's), stops the run naming the step, on every rank alike
  non-finite   before anything is written, the parameters and optimizer state must all be finite: nothing
               non-finite is ever saved
"""
from __future__ import annotations

import math

import numpy as np

from ..config import TrainConfig
from ..errors import AgreedError
from ..kernels.norm import NORM_BLOCKS


class Guards:
    """The checks a training run makes after each step and before each write (see the module docstring)."""

    def __init__(self, cfg: TrainConfig, dev, comm, zero, vocab_size: int):
        self.dev, self.comm, self.zero = dev, comm, zero
        # divergence: a loss this far above a uniform guess's (ln V) means the run has left training
        self.max_loss = cfg.max_loss or 3 * math.log(vocab_size)
        self.bound = "--max-loss" if cfg.max_loss else "3 ln V; see --max-loss"
        self.finite_sq = dev.zeros(1, np.float64)      # all_finite's sum of squares, and its scratch
        self.finite_scratch = dev.zeros(NORM_BLOCKS, np.float64)

    def diverged(self, step: int, loss: float, grad_norm: float | None = None) -> str | None:
        """Why the run must stop at `step`, or None: a non-finite loss or gradient norm, or a loss above
        max_loss (--max-loss; default 3 ln V: three times what a uniform guess scores)."""
        if not math.isfinite(loss) or (grad_norm is not None and not math.isfinite(grad_norm)):
            norm = f" or grad norm {grad_norm}" if grad_norm is not None else ""
            return f"step {step}: non-finite loss {loss}{norm}"
        if loss > self.max_loss:
            return (f"step {step}: loss {loss:.6g} is above {self.max_loss:.4g} ({self.bound}): the run "
                    f"diverged")
        return None

    def all_finite(self) -> bool:
        """Are the parameters and the optimizer state (bf16: the fp32 master; m, v) all finite, on every rank?
        One reduction on the device: the sum of their squares, accumulated in float64 (llmz.kernels.norm), is
        finite exactly when every value is (a float32 or bf16 value squares to at most 1.2e77; an fp64 one
        beyond 1e154 counts as non-finite: such a model has diverged anyway), summed over the ranks (m and v
        are sharded), read once."""
        z = self.zero
        for i, x in enumerate(z.state_arrays()):
            self.dev.ops.norm_squared(self.dev, self.finite_sq, x, self.finite_scratch, accumulate=i > 0)
        z.comm_waits_for_compute()
        self.comm.all_reduce(self.finite_sq, op="sum")
        z.compute_waits_for_comm()
        return math.isfinite(float(self.dev.to_host(self.finite_sq)[0]))

    def refuse_non_finite(self, step: int, what: str, last_checkpoint: str | None) -> None:
        """Before writing `what` after `step` optimizer steps: stop, on every rank alike, if anything is
        not finite (nothing non-finite is ever saved)."""
        if not self.all_finite():
            raise AgreedError(f"step {step - 1}: the update left non-finite parameters or optimizer state; "
                              f"{what} not written; last good checkpoint: {last_checkpoint or 'none'}", 1)
