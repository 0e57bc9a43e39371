# Exercise for lesson 03: llmz/plain/stage2.py with its key lines removed. Fill in each gap (a raise
# NotImplementedError that says what belongs there), then grade your file with the lesson's checkpoints:
#     mpiexec -n 2 python -m lessons.03_stage2_gradient_sharding --mine lessons/exercises/03_stage2.py
# It stops at the first gap it reaches; once none is left, each checkpoint that fails names what is wrong.
#
# ZeRO stage 2, plain: gradient sharding. As stage 1, but the full gradient is never kept: backward writes
# block l's gradients into slot l % 2 of two slots (the embeddings' and the final layernorm's into buffers of
# their own), and the moment a bucket is complete, done(b) reduce-scatters it and adds my slice into my gradient
# shard, every micro-step; the update has nothing left to reduce. (Each reduce-scatter ends before done(b)
# returns, so one slot would do here; llmz.zero's does not wait.)
from __future__ import annotations

from llmz.plain.stage1 import Stage1


class Stage2(Stage1):
    stage = 2

    def hold_gradients(self) -> None:
        L = self.layout
        raise NotImplementedError("gap 1 of 6: the gradients: self.grad_shard, my slice of every bucket; "
                                  "self.slots, two slots, each the size of the largest block; self.ends, a "
                                  "buffer each for the embeddings and lnf ({bucket index: buffer}) "
                                  "(self.alloc('gradients', n))")

    # ---- backward (llmz.model): where bucket b's gradients accumulate, and the moment they are complete ----
    def buffer(self, b: int):
        """Where bucket b's gradients go: block l's into slot l % 2, the embeddings' and lnf's their own."""
        raise NotImplementedError("gap 2 of 6: bucket b's gradient buffer, cut to the bucket's padded size: "
                                  "block l (bucket l + 1) in slot l % 2, the embeddings and lnf in their own")

    def bucket(self, b: int) -> dict:
        return self.layout.buckets[b].views(self.buffer(b))

    def done(self, b: int) -> None:
        bucket, buf = self.layout.buckets[b], self.buffer(b)
        raise NotImplementedError("gap 3 of 6: bucket b is complete: reduce-scatter its buffer (op=...)")
        raise NotImplementedError("gap 4 of 6: add my slice of the buffer into my shard, at the bucket's place "
                                  "in it, and zero the buffer: one op, self.k.accumulate_shard(self.dev, "
                                  "shard_part, buf, rank)")

    # ---- the update, after the last micro-step ------------------------------------------------------------
    def reduce_gradients(self) -> None:
        raise NotImplementedError("gap 5 of 6: what is left for the update to reduce, now that done(b) "
                                  "reduce-scattered every bucket during backward?")

    def my_part(self, b) -> tuple:
        L = self.layout
        s, e, at = *L.shard_range(b, self.rank), L.shard_offset(b)     # my slice, at `at` in m and v
        raise NotImplementedError("gap 6 of 6: what AdamW updates of bucket b (as Stage1.my_part returns it): "
                                  "my slice [s, e), its parameters, gradients, m and v, the gradients now from "
                                  "my shard")

    def gradient_norm(self) -> None:
        self.norm_squared([self.grad_shard])                    # my slices, averaged over the ranks and K
        self.comm.all_reduce(self.norm_sq, op="sum")            # each rank summed the squares of its slices

    def zero_gradients(self) -> None:
        self.k.zero(self.dev, self.grad_shard)                  # done(b) accumulates
