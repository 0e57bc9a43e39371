# Exercise for lesson 03: llmz/plain/stage2.py with its key lines removed. Fill in each gap (a raise
# NotImplementedError that says what belongs there), then grade your file with the lesson's checkpoints:
#     mpiexec -n 2 python -m lessons.03_stage2_gradient_sharding --mine lessons/exercises/03_stage2.py
# It stops at the first gap it reaches; once none is left, each checkpoint that fails names what is wrong.
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
        raise NotImplementedError("gap 1 of 5: the gradients: self.grad_shard, my slice of every bucket;"
                                  " two slots, each the size of the largest block; self.ends, a buffer each"
                                  " for the embeddings and lnf ({bucket index: buffer})"
                                  " (self.alloc('gradients', n))")
        self.m = self.alloc("optimizer_state", L.shard_total)   # AdamW's moments, my slice of every bucket
        self.v = self.alloc("optimizer_state", L.shard_total)

    # ---- backward (llmz.model): where bucket b's gradients accumulate, and the moment they are complete ----
    def buffer(self, b: int):
        """Where bucket b's gradients go: block l's into slot l % 2, the embeddings' and lnf's their own."""
        raise NotImplementedError("gap 2 of 5: bucket b's gradient buffer, cut to the bucket's padded"
                                  " size: block l (bucket l + 1) in slot l % 2, the embeddings and lnf in"
                                  " their own")

    def bucket(self, b: int) -> dict:
        return self.layout.buckets[b].views(self.buffer(b))

    def done(self, b: int) -> None:
        bucket, buf = self.layout.buckets[b], self.buffer(b)
        raise NotImplementedError("gap 3 of 5: bucket b is complete: reduce-scatter its buffer (op=...)")
        raise NotImplementedError("gap 4 of 5: add my slice of the buffer into my shard, at the bucket's"
                                  " place in it, and zero the buffer: one op,"
                                  " self.k.accumulate_shard(self.dev, shard_part, buf, rank)")

    # ---- the update, after the last micro-step ------------------------------------------------------------
    def optimize(self) -> None:
        L, r = self.layout, self.rank
        self.norm_squared([self.grad_shard])                    # my slices, averaged over the ranks and K
        self.comm.all_reduce(self.norm_sq, op="sum")            # each rank summed the squares of its slices
        self.clip()                                             # longer than grad_clip: scaled down to it
        for b in L.buckets:                                     # AdamW on my slice of every bucket
            s, e, at = *L.shard_range(b, r), L.shard_offset(b)  # [s, e) of bucket b, at `at` in m and v
            raise NotImplementedError("gap 5 of 5: AdamW on my slice [s, e) of bucket b: self.adamw(b, s,"
                                      " e, params, grads, m, v), the gradients now from my shard")
        for b in L.buckets:                                     # every rank's slices to every rank
            self.comm.all_gather(L.bucket_buffer(self.params, b))
        self.k.zero(self.dev, self.grad_shard)                  # done(b) accumulates: start from zero
