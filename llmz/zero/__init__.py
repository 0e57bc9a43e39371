"""ZeRO stages 0, 1, 2, 3 as parts (Rajbhandari et al. 2019; llm.c's zero.cuh and PR #593).

A stage is three parts, and the table below says which:
  grads.py          the gradient store backward writes into: full (stages 0, 1), or sharded, with two block
                    slots reduce-scattered during backward (stages 2, 3)
  params.py         the parameter store the model reads: full (stages 0-2), or gathered block by block into
                    two slots just before each block runs (stage 3)
  sharded_adamw.py  AdamW on what this rank owns (master, m, v): everything (stage 0) or its slice of every
                    bucket (stages 1-3); the gradient norm and clipping
and, apart from the math: stage.py puts them together (ZeroStage: the micro-step's hooks, the update);
context.py holds what they share (device, communicator, the two events that order the compute and the comm
stream, the bytes allocated, the trace spans); slices.py is the host side of checkpoints.

With Ψ parameters, N ranks and b bytes per value (fp32: b = 4, no master copy), each rank keeps:

  stage 0  gradients bΨ,  m and v 2bΨ     all-reduce every bucket after backward; every rank runs AdamW on all
  stage 1  gradients bΨ,  m and v 2bΨ/N   reduce-scatter every bucket at the last micro-step; AdamW on my
                                          slice; all-gather every bucket's parameters
  stage 2  gradients bΨ/N + two block slots + embedding and lnf gradients, m and v 2bΨ/N
                                          block l's gradients go into slot l % 2; when the block is done the
                                          comm stream reduce-scatters the slot and one kernel adds my part
                                          into my gradient shard and zeroes the slot
  stage 3  parameters bΨ/N + two block slots + embeddings + lnf, gradients as stage 2, m and v 2bΨ/N
                                          before block l runs (forward, then again in backward) its
                                          parameters are all-gathered into slot l % 2, block l+1's (l-1's in
                                          backward) while block l computes; the embeddings and the final
                                          layernorm are gathered once a step, after AdamW, and kept

Rank r owns slice r of every bucket (llmz.layout). All communication goes through llmz.comm; ordering
between the compute stream and the comm stream is by events only (record on one, wait on the other), never a
host synchronisation inside a step. bf16 (values kept as uint16 bits) adds an fp32 master copy to the
optimizer state and rounds stochastically where a sum goes back to bf16: AdamW's parameter, stage 2's shard.
"""
from __future__ import annotations

import numpy as np

from ..layout import Layout
from ..optim import AdamW
from .grads import FullGradients, ShardedGradients
from .params import FullParameters, GatheredParameters
from .stage import ZeroStage

# stage: (gradient store, parameter store, optimizer state sharded), as the ZeRO paper's figure 1 reads
STAGES = {
    0: (FullGradients, FullParameters, False),          # plain data parallelism
    1: (FullGradients, FullParameters, True),           # P_os:     optimizer state partitioned
    2: (ShardedGradients, FullParameters, True),        # P_os+g:   and the gradients
    3: (ShardedGradients, GatheredParameters, True),    # P_os+g+p: and the parameters
}


def make_stage(stage: int, layout: Layout, dev, comm, opt: AdamW, params_host: np.ndarray, overlap: bool = True,
               tracer=None, seed: int = 0, start_step: int = 0) -> ZeroStage:
    """ZeRO stage `stage` on this rank. params_host: the full host parameters at full precision, the same on
    every rank. overlap=False (--no-overlap): the compute stream waits for every collective at once.
    seed: bf16's stochastic rounding; start_step: the updates already done (a resume)."""
    return ZeroStage(stage, STAGES[stage], layout, dev, comm, opt, params_host, overlap=overlap, tracer=tracer,
                     seed=seed, start_step=start_step)

