# Exercise for lesson 01: llmz/plain/stage0.py with its key lines removed. Fill in each gap (a raise
# NotImplementedError that says what belongs there), then grade your file with the lesson's checkpoints:
#     mpiexec -n 2 python -m lessons.01_stage0_data_parallel --mine lessons/exercises/01_stage0.py
# It stops at the first gap it reaches; once none is left, each checkpoint that fails names what is wrong.
#
# ZeRO stage 0, plain: data parallelism. Every rank holds every parameter, every gradient and AdamW's m and
# v, and runs backward on its own batch; then, before the update, every bucket's gradients are all-reduced
# (averaged over the ranks), so every rank runs the same AdamW on the same numbers and the parameters stay
# identical. All the rest is lesson 00's step (llmz/plain/step.py).
from __future__ import annotations

from llmz.plain.step import OneDevice


class Stage0(OneDevice):
    def reduce_gradients(self) -> None:
        L = self.layout
        raise NotImplementedError("gap 1 of 1: every rank's gradients, averaged over the ranks, on every rank: "
                                  "for each bucket b of L.buckets, self.comm.all_reduce(buf, op=...) its "
                                  "stretch of self.grads, L.bucket_buffer(self.grads, b)")
