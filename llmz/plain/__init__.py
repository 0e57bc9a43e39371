"""The teaching twin of llmz/zero/: each ZeRO stage written plainly, one screen a stage, the code the lessons
train with (as llmz/kernels/ is the teaching twin of llmz/fast/).

    step.py      lesson 00: one device; after backward, the gradient norm, clipping, AdamW
    stage0.py    lesson 01: and before them, every bucket's gradients all-reduced
    stage1.py    lesson 02: reduce-scatter the gradients, AdamW on my slice, all-gather the parameters
    stage2.py    lesson 03: each bucket reduce-scattered the moment backward finishes it, into my shard
    rounding.py  lesson 04: bf16 accumulation with stochastic rounding
    stage3.py    lesson 05: each block's parameters gathered just before it runs, dropped after

Each is llmz.zero's stage with everything that is about speed taken out: every collective blocks
(base.Blocking: no streams, no events, nothing left in flight), no CUDA graph, no timeline, no bf16. The math
is the op set's (dev.ops: the norm, the clip factor, AdamW, the shard accumulation), called in the order
llmz.zero calls it, so after any number of steps a plain stage holds the same parameters as llmz.zero's, bit
for bit (fp64 on CPU ranks; fp32 without TF32 on a GPU): every lesson checks it.

step.py writes the training step as parts (what a rank holds; where backward puts a bucket's gradients and
what happens once they are complete; the update's collectives, the norm, the part of each bucket this rank
updates), and each stage is the one before with the parts its lesson's idea changes replaced: Stage0(OneDevice),
Stage1(Stage0), Stage2(Stage1), Stage3(Stage2). A stage's file is what its stage changes, and
`python -m lessons.03_stage2_gradient_sharding --diff` sets each replaced part beside the version it replaces.
lessons/exercises/ holds each with its key lines removed, for a learner to write back.

A stage answers what llmz.trainer.Trainer asks of llmz.zero's (base.PlainStage has the plumbing): param_store,
what the model reads (param_store.bucket(b): bucket b's parameters by name); bucket(b) and done(b), where
backward accumulates bucket b's gradients and the moment they are complete; optimize(), the update after the
last micro-step.
"""
