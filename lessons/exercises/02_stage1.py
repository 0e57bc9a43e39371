# Exercise for lesson 02: llmz/plain/stage1.py with its key lines removed. Fill in each gap (a raise
# NotImplementedError that says what belongs there), then grade your file with the lesson's checkpoints:
#     mpiexec -n 2 python -m lessons.02_stage1_optimizer_sharding --mine lessons/exercises/02_stage1.py
# It stops at the first gap it reaches; once none is left, each checkpoint that fails names what is wrong.
"""ZeRO stage 1, plain: optimizer-state sharding. Every rank holds every parameter and every gradient, but m
and v only for its slice of every bucket (its shard, llmz.layout). After backward each bucket's gradients are
reduce-scattered (rank r receives the average of slice r only), AdamW moves my slice of the parameters, and
each bucket's parameters are all-gathered: every rank's slice to every rank."""
from __future__ import annotations

from llmz.model import FullParams
from llmz.plain.base import PlainStage


class Stage1(PlainStage):
    stage = 1

    def __init__(self, layout, dev, comm, opt, params_host):
        super().__init__(layout, dev, comm, opt)
        L = layout
        self.params = self.alloc("parameters", L.total, params_host)   # bucket by bucket (llmz.layout)
        self.param_store = FullParams(L, self.params)           # what the model reads: .bucket(b)
        self.grads = self.alloc("gradients", L.total)           # laid out as the parameters
        self.grad_views = L.views(self.grads)
        raise NotImplementedError("gap 1 of 5: AdamW's m and v (self.alloc('optimizer_state', n)) for my"
                                  " slice of every bucket only: how many values is that?"
                                  " (llmz.layout.Layout)")

    # ---- backward (llmz.model): where bucket b's gradients accumulate, and the moment they are complete ----
    def bucket(self, b: int) -> dict:
        return self.grad_views[b]

    def done(self, b: int) -> None:
        pass

    # ---- the update, after the last micro-step ------------------------------------------------------------
    def optimize(self) -> None:
        L, r = self.layout, self.rank
        raise NotImplementedError("gap 2 of 5: reduce-scatter each bucket's gradients"
                                  " (self.comm.reduce_scatter, op=...): rank r then holds the average of"
                                  " slice r of the bucket, at its place in the bucket")
        raise NotImplementedError("gap 3 of 5: the global gradient norm: self.norm_squared(pieces) over my"
                                  " slice of every bucket (L.shard_range(b, r)), then the ranks' parts"
                                  " combined (self.comm.all_reduce of self.norm_sq, op=...)")
        self.clip()                                             # longer than grad_clip: scaled down to it
        for b in L.buckets:                                     # AdamW on my slice of every bucket
            raise NotImplementedError("gap 4 of 5: s, e, at: my slice [s, e) of bucket b, and where it"
                                      " starts in m and v (L.shard_range, L.shard_offset)")
            self.adamw(b, s, e, L.bucket_buffer(self.params, b)[s:e], L.bucket_buffer(self.grads, b)[s:e],
                       self.m[at:at + e - s], self.v[at:at + e - s])
        raise NotImplementedError("gap 5 of 5: every rank's updated slices to every rank: all-gather each"
                                  " bucket's parameters (self.comm.all_gather, in place)")
        self.k.zero(self.dev, self.grads)                       # backward accumulates: start from zero
