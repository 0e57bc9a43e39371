"""ZeRO stage 3, plain: parameter sharding. As stage 2, but the full parameters are never kept either: my
parameter shard is what AdamW moves, and when the model asks for a block (param_store.bucket(b), in forward
and again in backward) its parameters are all-gathered from every rank's slice into slot l % 2 of two slots.
The embeddings and the final layernorm, used at both ends, are gathered once a step, after the update, and
kept."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from llmz.plain.stage2 import Stage2


class Stage3(Stage2):
    stage = 3

    def hold_parameters(self, params_host) -> None:
        L = self.layout
        mine = [L.bucket_buffer(params_host, b)[slice(*L.shard_range(b, self.rank))] for b in L.buckets]
        self.param_shard = self.alloc("parameters", L.shard_total, np.concatenate(mine))   # my slices
        slot = max(b.padded_size for b in L.buckets[1:-1])      # the largest block
        self.param_slots = [self.alloc("parameters", slot), self.alloc("parameters", slot)]
        self.param_ends = {b.index: self.alloc("parameters", b.padded_size, L.bucket_buffer(params_host, b))
                           for b in (L.embeddings, L.lnf)}
        self.param_store = SimpleNamespace(bucket=lambda b: L.buckets[b].views(self.gather(b)))  # the model's

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

    # ---- the update, after the last micro-step ------------------------------------------------------------
    def my_part(self, b) -> tuple:
        s, e, at = *self.layout.shard_range(b, self.rank), self.layout.shard_offset(b)
        n = e - s                                               # my slice: all four in my shards, at `at`
        return s, e, self.param_shard[at:at + n], self.grad_shard[at:at + n], self.m[at:at + n], self.v[at:at + n]

    def share_parameters(self) -> None:
        L = self.layout
        for b in (L.embeddings, L.lnf):                         # gathered once a step and kept
            at = L.shard_offset(b)
            self.comm.all_gather(self.param_ends[b.index], src=self.param_shard[at:at + b.shard_size])
