"""ZeRO stage 0, plain: data parallelism. Every rank holds every parameter, every gradient and AdamW's m and
v, and runs backward on its own batch; then every bucket's gradients are all-reduced (averaged over the
ranks), so every rank runs the same AdamW on the same numbers and the parameters stay identical."""
from __future__ import annotations

from llmz.model import FullParams
from llmz.plain.base import PlainStage


class Stage0(PlainStage):
    stage = 0

    def __init__(self, layout, dev, comm, opt, params_host):
        super().__init__(layout, dev, comm, opt)
        L = layout
        self.params = self.alloc("parameters", L.total, params_host)   # bucket by bucket (llmz.layout)
        self.param_store = FullParams(L, self.params)           # what the model reads: .bucket(b)
        self.grads = self.alloc("gradients", L.total)           # laid out as the parameters
        self.grad_views = L.views(self.grads)
        self.m = self.alloc("optimizer_state", L.total)         # AdamW's moments, laid out as the parameters
        self.v = self.alloc("optimizer_state", L.total)

    # ---- backward (llmz.model): where bucket b's gradients accumulate, and the moment they are complete ----
    def bucket(self, b: int) -> dict:
        return self.grad_views[b]

    def done(self, b: int) -> None:
        pass

    # ---- the update, after the last micro-step ------------------------------------------------------------
    def optimize(self) -> None:
        L = self.layout
        for b in L.buckets:                                     # on every rank the average of every rank's
            self.comm.all_reduce(L.bucket_buffer(self.grads, b), op="avg")     # gradients
        self.norm_squared([self.grads])                         # the gradient's norm, squared
        self.clip()                                             # longer than grad_clip: scaled down to it
        for b in L.buckets:                                     # AdamW on every bucket, whole
            s, e, at = 0, b.padded_size, b.offset               # [s, e) of bucket b, at `at` in m and v
            self.adamw(b, s, e, L.bucket_buffer(self.params, b)[s:e], L.bucket_buffer(self.grads, b)[s:e],
                       self.m[at:at + e - s], self.v[at:at + e - s])
        self.k.zero(self.dev, self.grads)                       # backward accumulates: start from zero
