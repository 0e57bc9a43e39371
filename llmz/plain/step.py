"""Lesson 00's training step, plain: one device holds every parameter, every gradient and AdamW's m and v.
Backward accumulates (+=) each bucket's gradients; then their norm, the clip factor, AdamW on every bucket,
and the gradients zeroed for the next step."""
from __future__ import annotations

from llmz.model import FullParams
from llmz.plain.base import PlainStage


class OneDevice(PlainStage):
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
        self.norm_squared([self.grads])                         # the gradient's norm, squared
        self.clip()                                             # longer than grad_clip: scaled down to it
        for b in L.buckets:                                     # AdamW on every bucket, whole
            s, e, at = 0, b.padded_size, b.offset               # [s, e) of bucket b, at `at` in m and v
            self.adamw(b, s, e, L.bucket_buffer(self.params, b)[s:e], L.bucket_buffer(self.grads, b)[s:e],
                       self.m[at:at + e - s], self.v[at:at + e - s])
        self.k.zero(self.dev, self.grads)                       # backward accumulates: start from zero
