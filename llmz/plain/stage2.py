"""ZeRO stage 2, plain: gradient sharding. As stage 1, but the full gradient is never kept: backward writes
block l's gradients into slot l % 2 of two slots (the embeddings' and the final layernorm's into buffers of
their own), and the moment a bucket is complete, done(b) reduce-scatters it and adds my slice into my gradient
shard, every micro-step; the update has nothing left to reduce. (Each reduce-scatter ends before done(b)
returns, so one slot would do here; llmz.zero's does not wait.)"""
from __future__ import annotations

from llmz.plain.stage1 import Stage1


class Stage2(Stage1):
    stage = 2

    def hold_gradients(self) -> None:
        L = self.layout
        self.grad_shard = self.alloc("gradients", L.shard_total)       # my slice of every bucket
        slot = max(b.padded_size for b in L.buckets[1:-1])      # the largest block
        self.slots = [self.alloc("gradients", slot), self.alloc("gradients", slot)]
        self.ends = {b.index: self.alloc("gradients", b.padded_size) for b in (L.embeddings, L.lnf)}

    # ---- backward (llmz.model): where bucket b's gradients accumulate, and the moment they are complete ----
    def buffer(self, b: int):
        """Where bucket b's gradients go: block l's into slot l % 2, the embeddings' and lnf's their own."""
        buf = self.ends[b] if b in self.ends else self.slots[(b - 1) % 2]
        return buf[:self.layout.buckets[b].padded_size]

    def bucket(self, b: int) -> dict:
        return self.layout.buckets[b].views(self.buffer(b))

    def done(self, b: int) -> None:
        bucket, buf = self.layout.buckets[b], self.buffer(b)
        self.comm.reduce_scatter(buf, op="avg")                 # my slice of the bucket: the ranks' average
        at = self.layout.shard_offset(bucket)                   # my shard += my slice; the buffer = 0
        self.k.accumulate_shard(self.dev, self.grad_shard[at:at + bucket.shard_size], buf, self.rank)

    # ---- the update, after the last micro-step ------------------------------------------------------------
    def reduce_gradients(self) -> None:
        """Nothing: done(b) reduce-scattered every bucket during backward."""

    def my_part(self, b) -> tuple:
        L = self.layout
        s, e, at = *L.shard_range(b, self.rank), L.shard_offset(b)     # my slice, at `at` in m and v
        return (s, e, L.bucket_buffer(self.params, b)[s:e], self.grad_shard[at:at + e - s],
                self.m[at:at + e - s], self.v[at:at + e - s])

    def gradient_norm(self) -> None:
        self.norm_squared([self.grad_shard])                    # my slices, averaged over the ranks and K
        self.comm.all_reduce(self.norm_sq, op="sum")            # each rank summed the squares of its slices

    def zero_gradients(self) -> None:
        self.k.zero(self.dev, self.grad_shard)                  # done(b) accumulates
