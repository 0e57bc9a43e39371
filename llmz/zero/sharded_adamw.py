"""AdamW on what this rank owns: every bucket whole at stage 0, slice r of every bucket at stages 1-3 (the ZeRO
paper's optimizer-state partitioning, P_os). It keeps m and v, and in bf16 the fp32 master copy of the
parameters, for those stretches only, one after another (owned_ranges). After the last micro-step:

  1. the global gradient norm: each rank's sum of squares over the gradient it owns, in float64 on the device,
     all-reduced when the ranks own different parts (stages 1-3);
  2. the clip factor, on the device (scalars[1]: the kernels read it, the host never does);
  3. AdamW on each owned stretch. bf16: the fp32 master moves, and the bf16 parameter is its stochastic
     rounding, element i of the whole buffer drawing at hash index i and the step (the same bits on every
     rank and stage).

Where the stretches of parameters and gradients live is the stores' business (params.py, grads.py): they are
handed in through their slice(b, start, end). The scalars [lr, grad_scale, 1-beta1^t, 1-beta2^t, step] live on
the device, copied in before the update (set_scalars), so a replayed CUDA graph reads the current step's.
"""
from __future__ import annotations

import numpy as np

from ..bf16 import f32_to_bf16, f32_to_bf16_stochastic
from ..kernels.norm import NORM_BLOCKS
from ..optim import AdamW
from .context import Context
from .slices import owned_values, shard_ranges, whole_ranges


def start_values(params_host: np.ndarray, bf16: bool, seed: int, start_step: int) -> np.ndarray:
    """The parameters the model reads at the start, in the run's dtype, from the full-precision host values.
    bf16: their rounding to nearest, and after `start_step` updates (a resume) the stochastic rounding that
    step's AdamW wrote, recomputed from the same (seed, element, step)."""
    if not bf16:
        return params_host
    host32 = params_host.astype(np.float32)
    return f32_to_bf16_stochastic(host32, seed, start_step - 1, 0) if start_step else f32_to_bf16(host32)


class ShardedAdamW:
    def __init__(self, ctx: Context, opt: AdamW, sharded: bool, params_host: np.ndarray):
        """sharded: this rank owns slice r of every bucket (stages 1-3), else everything (stage 0).
        params_host: the full-precision parameters (bf16: the master starts from them)."""
        self.ctx, self.opt, self.sharded = ctx, opt, sharded
        dev, L = ctx.dev, ctx.layout
        n = L.shard_total if sharded else L.total
        state_dtype, self.master = None, None               # m and v in the values' dtype, no master copy
        if ctx.bf16:                                        # bf16 values: an fp32 master, and m and v in fp32
            state_dtype = np.float32
            self.master = ctx.zeros("optimizer_state", n, np.float32)
            dev.copy_from_host(self.master, owned_values(params_host, self.owned_ranges()).astype(np.float32))
        self.m = ctx.zeros("optimizer_state", n, state_dtype)
        self.v = ctx.zeros("optimizer_state", n, state_dtype)
        self.scalars = dev.zeros(5, np.float64)         # [lr, grad_scale, 1-beta1^t, 1-beta2^t, step]
        self.norm_sq = dev.zeros(1, np.float64)         # the global gradient norm, squared
        self.norm_scratch = dev.zeros(NORM_BLOCKS, np.float64)

    def owned_ranges(self) -> list[tuple]:
        """(bucket, start, end) of what master, m and v hold, in their order."""
        L = self.ctx.layout
        return shard_ranges(L, self.ctx.rank) if self.sharded else whole_ranges(L)

    def buffers(self) -> dict:
        return {"master": self.master, "m": self.m, "v": self.v}

    def set_scalars(self, step: int) -> None:
        """This step's [lr, 1, 1-beta1^t, 1-beta2^t, step] to the device (outside any captured graph)."""
        self.ctx.dev.copy_from_host(self.scalars, np.array(self.opt.scalars(step), dtype=np.float64))

    def clip(self, owned_grads: list) -> None:
        """The global norm of the gradients from the pieces this rank owns, and the clip factor from it."""
        ctx, k = self.ctx, self.ctx.kernels
        for i, g in enumerate(owned_grads):
            k.norm_squared(ctx.dev, self.norm_sq, g, self.norm_scratch, accumulate=i > 0)
        if self.sharded:                                # every rank summed the squares of its own part
            ctx.comm_waits_for_compute()
            ctx.comm.all_reduce(self.norm_sq, op="sum")
            ctx.compute_waits_for_comm()
        k.clip_scale(ctx.dev, self.scalars, self.norm_sq, self.opt.grad_clip)

    def update(self, param_slice, grad_slice) -> None:
        """AdamW on every owned stretch [s, e) of bucket b: the parameters param_slice(b, s, e) move, by the
        averaged gradient grad_slice(b, s, e)."""
        ctx, o, k = self.ctx, self.opt, self.ctx.kernels
        at = 0
        for b, s, e in self.owned_ranges():
            n = e - s
            p, g, m, v = param_slice(b, s, e), grad_slice(b, s, e), self.m[at:at + n], self.v[at:at + n]
            decay = ctx.layout.decay_size_in(b, s, e)
            if ctx.bf16:        # the master moves; p is its stochastic rounding, drawn at p's place in the buffer
                k.adamw_update_bf16(ctx.dev, p, self.master[at:at + n], g, m, v, decay, self.scalars, o.beta1,
                                    o.beta2, o.eps, o.weight_decay, ctx.seed, offset=b.offset + s)
            else:
                k.adamw_update(ctx.dev, p, g, m, v, decay, self.scalars, o.beta1, o.beta2, o.eps, o.weight_decay)
            at += n

    def grad_norm(self) -> float:
        """The global gradient norm of the last update (a host read: synchronises the compute stream)."""
        return float(np.sqrt(self.ctx.dev.to_host(self.norm_sq)[0]))
