"""Lesson 00's training step, plain: one device holds every parameter, every gradient and AdamW's m and v.
Backward accumulates (+=) each bucket's gradients; the update then takes their norm, the clip factor, AdamW on
every bucket, and zeroes the gradients for the next step.

Each ZeRO stage after it is this step with some of its parts replaced (a subclass each, lesson after lesson:
Stage0(OneDevice), Stage1(Stage0), Stage2(Stage1), Stage3(Stage2)); `--diff` shows the parts a lesson replaces.
The parts are what ZeRO changes: what a rank holds (the ZeRO paper's three: hold_parameters, hold_gradients,
hold_optimizer_state), where backward puts a bucket's gradients and what happens once they are complete
(bucket, done), and in the update the collectives (reduce_gradients, share_parameters), the gradient whose norm
is taken (gradient_norm) and the part of each bucket this rank updates (my_part)."""
from __future__ import annotations

from llmz.model import FullParams
from llmz.plain.base import PlainStage


class OneDevice(PlainStage):
    stage = 0

    def __init__(self, layout, dev, comm, opt, params_host):
        super().__init__(layout, dev, comm, opt)
        self.hold_parameters(params_host)                       # what this rank keeps from step to step
        self.hold_gradients()
        self.hold_optimizer_state()

    # ---- what this rank holds: every value, laid out bucket by bucket (llmz.layout) ---------------------------
    def hold_parameters(self, params_host) -> None:
        self.params = self.alloc("parameters", self.layout.total, params_host)
        self.param_store = FullParams(self.layout, self.params)        # what the model reads: .bucket(b)

    def hold_gradients(self) -> None:
        self.grads = self.alloc("gradients", self.layout.total)        # laid out as the parameters
        self.grad_views = self.layout.views(self.grads)

    def hold_optimizer_state(self) -> None:
        self.m = self.alloc("optimizer_state", self.layout.total)      # AdamW's moments, laid out as the
        self.v = self.alloc("optimizer_state", self.layout.total)      # parameters

    # ---- backward (llmz.model): where bucket b's gradients accumulate, and the moment they are complete ----
    def bucket(self, b: int) -> dict:
        return self.grad_views[b]

    def done(self, b: int) -> None:
        """Nothing to do until the update."""

    # ---- the update, after the last micro-step ------------------------------------------------------------
    def optimize(self) -> None:
        self.reduce_gradients()                                 # the gradient every rank steps with
        self.gradient_norm()                                    # self.norm_sq: its norm, squared
        self.clip()                                             # longer than grad_clip: scaled down to it
        for b in self.layout.buckets:                           # AdamW on what this rank updates
            self.adamw(b, *self.my_part(b))
        self.share_parameters()                                 # the updated values to every rank
        self.zero_gradients()                                   # backward accumulates: start from zero

    def reduce_gradients(self) -> None:
        """Nothing: one device's gradients are the gradient."""

    def gradient_norm(self) -> None:
        self.norm_squared([self.grads])

    def my_part(self, b) -> tuple:
        """What this rank updates of bucket b: its stretch [s, e), and there its parameters, gradients, m, v."""
        L, s, e, at = self.layout, 0, b.padded_size, b.offset   # the whole bucket, at `at` in m and v
        return (s, e, L.bucket_buffer(self.params, b)[s:e], L.bucket_buffer(self.grads, b)[s:e],
                self.m[at:at + e - s], self.v[at:at + e - s])

    def share_parameters(self) -> None:
        """Nothing: every rank updated every parameter."""

    def zero_gradients(self) -> None:
        self.k.zero(self.dev, self.grads)
