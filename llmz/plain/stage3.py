"""ZeRO stage 3, plain: parameter sharding. As stage 2, but the full parameters are never kept either: my
parameter shard is what AdamW moves, and when the model asks for a block (param_store.bucket(b), in forward
and again in backward) its parameters are all-gathered from every rank's slice into slot l % 2 of two slots.
The embeddings and the final layernorm, used at both ends, are gathered once a step, after the update, and
kept."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from llmz.plain.base import PlainStage


class Stage3(PlainStage):
    stage = 3

    def __init__(self, layout, dev, comm, opt, params_host):
        super().__init__(layout, dev, comm, opt)
        L = layout
        mine = [L.bucket_buffer(params_host, b)[slice(*L.shard_range(b, self.rank))] for b in L.buckets]
        self.param_shard = self.alloc("parameters", L.shard_total, np.concatenate(mine))   # my slices
        slot = max(b.padded_size for b in L.buckets[1:-1])      # the largest block
        self.param_slots = [self.alloc("parameters", slot), self.alloc("parameters", slot)]
        self.param_ends = {b.index: self.alloc("parameters", b.padded_size, L.bucket_buffer(params_host, b))
                           for b in (L.embeddings, L.lnf)}
        self.param_store = SimpleNamespace(bucket=lambda b: L.buckets[b].views(self.gather(b)))  # the model's
        self.grad_shard = self.alloc("gradients", L.shard_total)       # my slice of every bucket
        self.slots = [self.alloc("gradients", slot), self.alloc("gradients", slot)]
        self.ends = {b.index: self.alloc("gradients", b.padded_size) for b in (L.embeddings, L.lnf)}
        self.m = self.alloc("optimizer_state", L.shard_total)   # AdamW's moments, my slice of every bucket
        self.v = self.alloc("optimizer_state", L.shard_total)

    # ---- forward and backward (llmz.model): bucket b's parameters, gathered just before they are used ------
    def gather(self, b: int):
        if b in self.param_ends:                                # gathered after the last update
            return self.param_ends[b]
        bucket = self.layout.buckets[b]
        slot, at = self.param_slots[(b - 1) % 2][:bucket.padded_size], self.layout.shard_offset(bucket)
        self.comm.all_gather(slot, src=self.param_shard[at:at + bucket.shard_size])    # every rank's slice
        return slot

    def full_parameters(self):
        """Every parameter on the host: each bucket gathered once more (every rank calls it)."""
        return np.concatenate([self.dev.to_host(self.gather(b.index)).copy() for b in self.layout.buckets])

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
            self.adamw(b, s, e, self.param_shard[at:at + e - s], self.grad_shard[at:at + e - s],
                       self.m[at:at + e - s], self.v[at:at + e - s])
        for b in (L.embeddings, L.lnf):                         # gathered once a step and kept
            at = L.shard_offset(b)
            self.comm.all_gather(self.param_ends[b.index], src=self.param_shard[at:at + b.shard_size])
        self.k.zero(self.dev, self.grad_shard)                  # done(b) accumulates: start from zero
