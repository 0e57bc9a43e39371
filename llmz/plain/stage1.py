"""ZeRO stage 1, plain: optimizer-state sharding. Every rank holds every parameter and every gradient, but m
and v only for its slice of every bucket (its shard, llmz.layout). After backward each bucket's gradients are
reduce-scattered (rank r receives the average of slice r only), AdamW moves my slice of the parameters, and
each bucket's parameters are all-gathered: every rank's slice to every rank."""
from __future__ import annotations

from llmz.model import FullParams
from llmz.plain.base import PlainStage


class Stage1(PlainStage):
    stage = 1

    def __init__(self, layout, dev, comm, opt, params_host):
        super().__init__(layout, dev, comm, opt)
        L = layout
        self.params = self.alloc("parameters", L.total, params_host)   # bucket by bucket (llmz.layout)
        self.param_store = FullParams(L, self.params)           # what the model reads: .bucket(b)
        self.grads = self.alloc("gradients", L.total)           # laid out as the parameters
        self.grad_views = L.views(self.grads)
        self.m = self.alloc("optimizer_state", L.shard_total)   # AdamW's moments, my slice of every bucket
        self.v = self.alloc("optimizer_state", L.shard_total)

    # ---- backward (llmz.model): where bucket b's gradients accumulate, and the moment they are complete ----
    def bucket(self, b: int) -> dict:
        return self.grad_views[b]

    def done(self, b: int) -> None:
        pass

    # ---- the update, after the last micro-step ------------------------------------------------------------
    def optimize(self) -> None:
        L, r = self.layout, self.rank
        for b in L.buckets:                                     # my slice of each bucket: the ranks' average
            self.comm.reduce_scatter(L.bucket_buffer(self.grads, b), op="avg")
        self.norm_squared([L.bucket_buffer(self.grads, b)[slice(*L.shard_range(b, r))] for b in L.buckets])
        self.comm.all_reduce(self.norm_sq, op="sum")            # each rank summed the squares of its slices
        self.clip()                                             # longer than grad_clip: scaled down to it
        for b in L.buckets:                                     # AdamW on my slice of every bucket
            s, e, at = *L.shard_range(b, r), L.shard_offset(b)  # [s, e) of bucket b, at `at` in m and v
            self.adamw(b, s, e, L.bucket_buffer(self.params, b)[s:e], L.bucket_buffer(self.grads, b)[s:e],
                       self.m[at:at + e - s], self.v[at:at + e - s])
        for b in L.buckets:                                     # every rank's slices to every rank
            self.comm.all_gather(L.bucket_buffer(self.params, b))
        self.k.zero(self.dev, self.grads)                       # backward accumulates: start from zero
