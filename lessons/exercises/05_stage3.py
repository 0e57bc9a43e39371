# Exercise for lesson 05: llmz/plain/stage3.py with its key lines removed. Fill in each gap (a raise
# NotImplementedError that says what belongs there), then grade your file with the lesson's checkpoints:
#     mpiexec -n 2 python -m lessons.05_stage3_parameter_sharding --mine lessons/exercises/05_stage3.py
# It stops at the first gap it reaches; once none is left, each checkpoint that fails names what is wrong.
#
# ZeRO stage 3, plain: parameter sharding. As stage 2, but the full parameters are never kept either: my
# parameter shard is what AdamW moves, and when the model asks for a block (param_store.bucket(b), in forward
# and again in backward) its parameters are all-gathered from every rank's slice into slot l % 2 of two slots.
# The embeddings and the final layernorm, used at both ends, are gathered once a step, after the update, and
# kept.
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from llmz.plain.stage2 import Stage2


class Stage3(Stage2):
    stage = 3

    def hold_parameters(self, params_host) -> None:
        L = self.layout
        raise NotImplementedError("gap 1 of 5: my parameter shard: self.param_shard, my slice of every bucket "
                                  "of params_host (the full host parameters), one after another "
                                  "(self.alloc('parameters', n, values))")
        slot = max(b.padded_size for b in L.buckets[1:-1])      # the largest block
        self.param_slots = [self.alloc("parameters", slot), self.alloc("parameters", slot)]
        self.param_ends = {b.index: self.alloc("parameters", b.padded_size, L.bucket_buffer(params_host, b))
                           for b in (L.embeddings, L.lnf)}
        raise NotImplementedError("gap 2 of 5: self.param_store, what the model reads: an object whose "
                                  ".bucket(b) returns bucket b's named views (L.buckets[b].views) of its "
                                  "parameters, gathered just then (self.gather(b))")

    # ---- forward and backward (llmz.model): bucket b's parameters, gathered just before they are used ------
    def gather(self, b: int):
        if b in self.param_ends:                                # gathered after the last update
            return self.param_ends[b]
        bucket = self.layout.buckets[b]
        slot, at = self.param_slots[(b - 1) % 2][:bucket.padded_size], self.layout.shard_offset(bucket)
        raise NotImplementedError("gap 3 of 5: block b's full parameters, gathered into `slot`, every rank "
                                  "contributing its slice of the bucket from its shard "
                                  "(self.comm.all_gather(slot, src=...))")
        return slot

    def full_parameters(self):
        """Every parameter on the host: each bucket gathered once more (every rank calls it)."""
        return np.concatenate([self.dev.to_host(self.gather(b.index)).copy() for b in self.layout.buckets])

    # ---- the update, after the last micro-step ------------------------------------------------------------
    def my_part(self, b) -> tuple:
        raise NotImplementedError("gap 4 of 5: what AdamW updates of bucket b (as Stage2.my_part returns it): "
                                  "my slice [s, e), its parameters, gradients, m and v, the parameters now from"
                                  " my shard")

    def share_parameters(self) -> None:
        L = self.layout
        for b in (L.embeddings, L.lnf):                         # gathered once a step and kept
            at = L.shard_offset(b)
            raise NotImplementedError("gap 5 of 5: the embeddings and lnf, gathered whole for the next step "
                                      "into self.param_ends, every rank contributing its slice "
                                      "(self.comm.all_gather(buf, src=...))")
