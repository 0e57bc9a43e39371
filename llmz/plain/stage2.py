"""ZeRO stage 2, plain: gradient sharding. As stage 1, but the full gradient is never kept: backward writes
block l's gradients into slot l % 2 of two slots (the embeddings' and the final layernorm's into buffers of
their own), and the moment a bucket is complete, done(b) reduce-scatters it and adds my slice into my gradient
shard, every micro-step. (Each reduce-scatter ends before done(b) returns, so one slot would do here.)"""
from __future__ import annotations

from llmz.model import FullParams
from llmz.plain.base import PlainStage


class Stage2(PlainStage):
    stage = 2

    def __init__(self, layout, dev, comm, opt, params_host):
        super().__init__(layout, dev, comm, opt)
        L = layout
        self.params = self.alloc("parameters", L.total, params_host)   # bucket by bucket (llmz.layout)
        self.param_store = FullParams(L, self.params)           # what the model reads: .bucket(b)
        slot = max(b.padded_size for b in L.buckets[1:-1])      # the largest block
        self.grad_shard = self.alloc("gradients", L.shard_total)       # my slice of every bucket
        self.slots = [self.alloc("gradients", slot), self.alloc("gradients", slot)]
        self.ends = {b.index: self.alloc("gradients", b.padded_size) for b in (L.embeddings, L.lnf)}
        self.m = self.alloc("optimizer_state", L.shard_total)   # AdamW's moments, my slice of every bucket
        self.v = self.alloc("optimizer_state", L.shard_total)

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
    def optimize(self) -> None:
        L, r = self.layout, self.rank
        self.norm_squared([self.grad_shard])                    # my slices, averaged over the ranks and K
        self.comm.all_reduce(self.norm_sq, op="sum")            # each rank summed the squares of its slices
        self.clip()                                             # longer than grad_clip: scaled down to it
        for b in L.buckets:                                     # AdamW on my slice of every bucket
            s, e, at = *L.shard_range(b, r), L.shard_offset(b)  # [s, e) of bucket b, at `at` in m and v
            self.adamw(b, s, e, L.bucket_buffer(self.params, b)[s:e], self.grad_shard[at:at + e - s],
                       self.m[at:at + e - s], self.v[at:at + e - s])
        for b in L.buckets:                                     # every rank's slices to every rank
            self.comm.all_gather(L.bucket_buffer(self.params, b))
        self.k.zero(self.dev, self.grad_shard)                  # done(b) accumulates: start from zero
