# Exercise for lesson 02: llmz/plain/stage1.py with its key lines removed. Fill in each gap (a raise
# NotImplementedError that says what belongs there), then grade your file with the lesson's checkpoints:
#     mpiexec -n 2 python -m lessons.02_stage1_optimizer_sharding --mine lessons/exercises/02_stage1.py
# It stops at the first gap it reaches; once none is left, each checkpoint that fails names what is wrong.
#
# ZeRO stage 1, plain: optimizer-state sharding. As stage 0, but m and v are kept only for my slice of every
# bucket (my shard, llmz.layout). After backward each bucket's gradients are reduce-scattered (rank r receives
# the average of slice r only), the norm is summed over the ranks' slices, AdamW moves my slice of the
# parameters, and each bucket's parameters are all-gathered: every rank's slice to every rank.
from __future__ import annotations

from llmz.plain.stage0 import Stage0


class Stage1(Stage0):
    stage = 1

    def hold_optimizer_state(self) -> None:
        raise NotImplementedError("gap 1 of 5: AdamW's m and v (self.alloc('optimizer_state', n)) for my slice "
                                  "of every bucket only: how many values is that? (llmz.layout.Layout)")

    def reduce_gradients(self) -> None:
        L = self.layout
        raise NotImplementedError("gap 2 of 5: reduce-scatter each bucket's gradients "
                                  "(self.comm.reduce_scatter, op=...): rank r then holds the average of slice r"
                                  " of the bucket, at its place in the bucket")

    def gradient_norm(self) -> None:
        raise NotImplementedError("gap 3 of 5: the global gradient norm: self.norm_squared(pieces) over my "
                                  "slice of every bucket (L.shard_range(b, r)), then the ranks' parts combined "
                                  "(self.comm.all_reduce of self.norm_sq, op=...)")

    def my_part(self, b) -> tuple:
        L = self.layout
        raise NotImplementedError("gap 4 of 5: s, e, at: my slice [s, e) of bucket b, and where it starts in m "
                                  "and v (L.shard_range, L.shard_offset)")
        return (s, e, L.bucket_buffer(self.params, b)[s:e], L.bucket_buffer(self.grads, b)[s:e],
                self.m[at:at + e - s], self.v[at:at + e - s])

    def share_parameters(self) -> None:
        L = self.layout
        raise NotImplementedError("gap 5 of 5: every rank's updated slices to every rank: all-gather each "
                                  "bucket's parameters (self.comm.all_gather, in place)")
