"""ZeRO stage 1, plain: optimizer-state sharding. As stage 0, but m and v are kept only for my slice of every
bucket (my shard, llmz.layout). After backward each bucket's gradients are reduce-scattered (rank r receives
the average of slice r only), the norm is summed over the ranks' slices, AdamW moves my slice of the
parameters, and each bucket's parameters are all-gathered: every rank's slice to every rank."""
from __future__ import annotations

from llmz.plain.stage0 import Stage0


class Stage1(Stage0):
    stage = 1

    def hold_optimizer_state(self) -> None:
        self.m = self.alloc("optimizer_state", self.layout.shard_total)    # my slice of every bucket
        self.v = self.alloc("optimizer_state", self.layout.shard_total)

    def reduce_gradients(self) -> None:
        L = self.layout
        for b in L.buckets:                                     # my slice of each bucket: the ranks' average
            self.comm.reduce_scatter(L.bucket_buffer(self.grads, b), op="avg")

    def gradient_norm(self) -> None:
        L, r = self.layout, self.rank
        self.norm_squared([L.bucket_buffer(self.grads, b)[slice(*L.shard_range(b, r))] for b in L.buckets])
        self.comm.all_reduce(self.norm_sq, op="sum")            # each rank summed the squares of its slices

    def my_part(self, b) -> tuple:
        L = self.layout
        s, e, at = *L.shard_range(b, self.rank), L.shard_offset(b)     # my slice, at `at` in m and v
        return (s, e, L.bucket_buffer(self.params, b)[s:e], L.bucket_buffer(self.grads, b)[s:e],
                self.m[at:at + e - s], self.v[at:at + e - s])

    def share_parameters(self) -> None:
        L = self.layout
        for b in L.buckets:                                     # every rank's slices to every rank
            self.comm.all_gather(L.bucket_buffer(self.params, b))
