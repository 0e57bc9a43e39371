"""Lesson 03 - ZeRO stage 2, gradient sharding: reduce-scatter each block during backward.

What changes from lesson 02: stage 1 still keeps the full gradient (bΨ) on every rank until the end of
backward, although after the reduce-scatter each rank needs only its slice. Stage 2 never keeps it. Backward
finishes the buckets one at a time (the final layernorm, block L-1, ..., block 0, the embeddings last: wte is
tied to the classifier, llmz.model), and the moment a bucket is complete, done(b), it is reduce-scattered and
my averaged slice is added (+=) into my gradient shard. In llmz/plain/stage2.py (`--diff` shows the change
from stage 1: the reduce-scatter moves from the update into done(b), the full gradient buffer becomes a shard
and two slots):
  * two slots: block l writes its gradients into slot l % 2; the embedding and final-layernorm gradients keep
    buffers of their own (wte's gradient grows from the first op of backward to the last).
  * done(b): reduce-scatter the bucket's buffer, then one op adds my part into my shard AND zeroes the buffer
    for the next block that uses it (llmz.kernels.accumulate: no separate memset).
  * accumulation across K micro-steps: every micro-step reduce-scatters every bucket into the shard (K
    reduce-scatters per step instead of stage 1's one), so communication grows to (K+1)(N-1)/N * bΨ.
The plain stage waits for each reduce-scatter before backward goes on, so one slot would do. llmz.zero's stage 2
(llmz.zero.grads.ShardedGradients, trained here beside it) does not wait: on a GPU, at done(b) an event makes
the comm stream wait for the block's last kernel and the comm stream reduce-scatters block l's slot while the
compute stream runs block l-1's backward into the other; the compute stream waits on the slot's event only
before block l-2 writes into it again. On CPU ranks (no streams) MPI's non-blocking reduce-scatter is started
at done(b) and moved on inside the MPI calls backward makes between layers; the host waits for it when block
l-2 needs the slot. Overlap changes when things run, never the numbers: checkpoint 6 holds the plain stage and
llmz.zero's to the same bits.

Memory per rank, Ψ parameters, b bytes per value, N ranks:
    parameters bΨ + gradients bΨ/N + two block slots + embedding and lnf gradients + m and v 2bΨ/N
It pays when the model has many blocks: with L blocks of P parameters the gradients shrink from L*P to about
L*P/N + 2P (this lesson's `thin` model: 8 blocks).

Checkpoints: (1) the losses and gradient norms equal stage 1's (both run here, with --grad-accum K),
(2) parameters bit-identical on every rank, (3) gradient bytes per rank = shard + two slots + embedding + lnf
gradients, (4) K*(L+2) reduce-scatters during the micro-steps of a step, (5) bytes sent per step
(K+1)(N-1)/N * bΨ, (6) the plain stage 2's parameters equal llmz.zero's overlapping stage 2's, bit for bit,
(7) the timeline PNG of one step of llmz.zero's, with one compute and one comm span per bucket per micro-step,
(8) the overlap it shows: part of the time the reduce-scatters were in flight, a layer computed.
Figures in --out, named by model, ranks N and K: stage2_timeline_thin_2ranks_k2.png (rank 0's step; the .json
beside it opens in ui.perfetto.dev) and memory_per_rank_thin_2ranks.png (stages 0, 1, 2 by category).

Write it yourself: lessons/exercises/03_stage2.py is llmz/plain/stage2.py with its key lines removed:
    mpiexec -n 2 python -m lessons.03_stage2_gradient_sharding --mine lessons/exercises/03_stage2.py
"""
import os
import sys

from lessons import common
from llmz.args import LESSON_FLAGS
from llmz.plain.stage0 import Stage0
from llmz.plain.stage1 import Stage1


def lesson(a, ranks) -> int:
    N, K = ranks.world_size, a.grad_accum
    ck = common.Checks(ranks, 8)
    # lesson 02's plain stage 1 (the reference), this lesson's plain stage 2, llmz.zero's (overlapping; traced)
    trace, ref, run, prod = common.three_runs(a, ranks, 2, Stage1, "stage2_timeline")
    psi, b, L = run.layout.num_parameters, run.dev.dtype.itemsize, run.model.config.num_layers
    reduce_scatters = ("reduce-scatters in backward", common.count_in_micro_steps(run, "reduce_scatter"))
    t = common.side_by_side(a, ranks, run, ref, ("stage 2", "stage 1"), prod=prod, trace=trace,
                            measure=reduce_scatters)

    # ---- checkpoints --------------------------------------------------------------------------------------
    common.check_same_losses(ck, a, t, f"losses and gradient norms of stage 2 = stage 1's over {a.steps} "
                             f"steps of K={K}")
    common.check_params_identical(ck, ranks, run)
    common.check_sharded(ck, run, ref, "gradients", "stage 1")     # shard + two slots + embeddings + lnf
    ck.check(t.measured == [K * (L + 2)] * a.steps,
             f"reduce-scatters during the micro-steps (forward and backward) per step {t.measured} = K*(L+2) = "
             f"{K}*({L}+2) = {K * (L + 2)} (every bucket, every micro-step, as backward finishes it)")
    expect = (K + 1) * (N - 1) * b * psi // N
    worst, ok = common.sent_as_predicted(ranks, t.sent, expect)
    ck.check(ok, f"bytes sent per rank per step {worst:,} B = (K+1)(N-1)/N * {b}Ψ = {expect:,} B ({K} reduce-scatters "
             f"+ 1 all-gather; stage 1 sends 2(N-1)/N * {b}Ψ; expected within 0.5%: padding and two scalars)",
             across_ranks=True)
    common.check_same_as_production(ck, a, ranks, run, prod, "stage 2 (overlapping: it changes the timing, "
                                    "never the numbers)")
    ok, text = True, ""
    if ranks.rank == 0:
        png = os.path.splitext(trace)[0] + ".png"
        spans = {s: sum(e["tid"] == s for e in t.events) for s in ("compute", "comm")}
        ok = os.path.getsize(png) > 0 and spans["compute"] == spans["comm"] == K * (L + 2)
        text = (f"timeline {png} written: {spans['compute']} compute + {spans['comm']} comm spans in step "
                f"{min(1, a.steps - 1)}, expected K*(L+2) = {K * (L + 2)} each")
    ck.check(ok, text)
    common.check_overlap(ck, ranks, prod, t.events, "3/4", "a reduce-scatter starts as its block's backward ends",
                         gpu="block l's reduce-scatter beside block l-1's backward",
                         exposed="the embeddings' reduce-scatter, the last, with no layer after it")
    common.stages_memory_chart(a, ranks, {"stage 1": ref, "stage 2": run}, {"stage 0": (0, Stage0)},
                               "memory_per_rank")
    return ck.exit_code()


if __name__ == "__main__":
    sys.exit(common.main(lesson, __doc__, steps=5, sim_steps=2, about_ranks=True,
                         builds_on="02_stage1_optimizer_sharding", uses=LESSON_FLAGS))
