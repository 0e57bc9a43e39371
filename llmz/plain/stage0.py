"""ZeRO stage 0, plain: data parallelism. Every rank holds every parameter, every gradient and AdamW's m and
v, and runs backward on its own batch; then, before the update, every bucket's gradients are all-reduced
(averaged over the ranks), so every rank runs the same AdamW on the same numbers and the parameters stay
identical. All the rest is lesson 00's step (llmz/plain/step.py)."""
from __future__ import annotations

from llmz.plain.step import OneDevice


class Stage0(OneDevice):
    def reduce_gradients(self) -> None:
        L = self.layout
        for b in L.buckets:                                     # on every rank the average of every rank's
            self.comm.all_reduce(L.bucket_buffer(self.grads, b), op="avg")     # gradients
