"""Lesson 03 - ZeRO stage 2, gradient sharding: reduce-scatter each block during backward.

What changes from lesson 02: stage 1 still keeps the full gradient (bΨ) on every rank until the end of
backward, although after the reduce-scatter each rank needs only its slice. Stage 2 never keeps it
(llmz.zero.grads.ShardedGradients). Backward finishes the buckets one at a time (the final layernorm, block
L-1, ..., block 0, the embeddings last: wte is tied to the classifier, llmz.model), and the moment a bucket
is complete (`done(b)`) it is reduce-scattered and my averaged slice is added (+=) into my gradient shard. So:
  * two slots: block l writes its gradients into slot l % 2. While block l-1's backward fills the other
    slot, block l's slot is being reduce-scattered; block l-2 reuses it once that is done. The embedding
    and final-layernorm gradients keep buffers of their own (wte's gradient grows from the first op of
    backward to the last).
  * the comm stream and its events (on a GPU): at done(b) an event recorded on the compute stream makes the
    comm stream wait for the block's last kernel; the comm stream runs the reduce-scatter and one kernel
    that adds my part into the shard AND zeroes the slot (no separate memset), then records an event; the
    compute stream waits on that event only before it writes into the same slot again (block l-2). No host
    synchronisation anywhere in backward: compute and communication overlap.
  * on CPU ranks (no streams) the same shape with MPI's non-blocking collectives: done(b) starts the
    reduce-scatter and backward goes on; MPICH moves it on inside the MPI calls backward makes between layers
    (llmz.comm's progress()), and the host waits for it, and adds my part, only when block l-2 needs the slot.
  * --no-overlap: the compute stream (on CPU ranks: the host) waits for each reduce-scatter right away,
    serialising them. Same numbers, bit for bit (only the timing changes).
  * accumulation across K micro-steps: every micro-step reduce-scatters every bucket into the shard
    (K reduce-scatters per step instead of stage 1's one), so communication grows to (K+1)(N-1)/N * bΨ.

Memory per rank, Ψ parameters, b bytes per value, N ranks:
    parameters bΨ + gradients bΨ/N + two block slots + embedding and lnf gradients + m and v 2bΨ/N
It pays when the model has many blocks: with L blocks of P parameters the gradients shrink from L*P to about
L*P/N + 2P (this lesson's `thin` model: 8 blocks).

Checkpoints: (1) the losses equal stage 1's (both run here, with --grad-accum K), (2) parameters bit-identical
on every rank, (3) gradient bytes per rank = shard + two slots + embedding + lnf gradients, (4) K*(L+2)
reduce-scatters during backward per step, (5) bytes sent per step (K+1)(N-1)/N * bΨ, (6) --no-overlap gives
the same bits, (7) the timeline PNG of one step, with one compute and one comm span per bucket per micro-step,
(8) the overlap it shows: part of the time the reduce-scatters were in flight, a layer computed.
Figures in --out, named by model, ranks N and K: stage2_timeline_thin_2ranks_k2.png (rank 0's step; the .json
beside it opens in ui.perfetto.dev) and memory_per_rank_thin_2ranks.png (stages 0, 1, 2 by category).
"""
import os
import sys

from lessons import common
from llmz.args import LESSON_FLAGS


def lesson(a, ranks) -> int:
    N, K = ranks.world_size, a.grad_accum
    ck = common.Checkpoints(ranks, 8)
    trace = common.figure_name(a, ranks, "stage2_timeline", ext="json", with_k=True)
    ref = common.make_run(a, ranks, stage=1)                           # lesson 02: the reference
    run = common.make_run(a, ranks, stage=2, trace=trace)              # this lesson
    serial = common.make_run(a, ranks, stage=2, overlap=False)         # the same, serialised
    for r in (run, serial):
        common.apply_break(r.zero)
    psi, b, L = run.layout.num_parameters, run.dev.dtype.itemsize, run.model.config.num_layers
    common.say_setup(a, ranks, run)
    reduce_scatters = ("reduce-scatters in backward", lambda r: r.zero.reduce_scatters_in_backward)
    t = common.side_by_side(a, ranks, run, ref, ("stage 2", "stage 1"), serial=serial, trace=trace,
                            measure=reduce_scatters)

    # ---- checkpoints --------------------------------------------------------------------------------------
    common.check_same_losses(ck, a, t, f"losses of stage 2 = stage 1's over {a.steps} steps of K={K}")
    common.check_params_identical(ck, ranks, run)
    common.check_sharded(ck, run, ref, "gradients", "stage 1")     # shard + two slots + embeddings + lnf
    ck.check(t.measured == [K * (L + 2)] * a.steps,
             f"reduce-scatters during backward per step {t.measured} = K*(L+2) = {K}*({L}+2) = {K * (L + 2)} "
             f"(every bucket, every micro-step)")
    expect = (K + 1) * (N - 1) * b * psi // N
    worst, ok = common.sent_as_predicted(ranks, t.sent, expect)
    ck.check(ok, f"bytes sent per rank per step {worst:,} B = (K+1)(N-1)/N * {b}Ψ = {expect:,} B ({K} reduce-scatters "
             f"+ 1 all-gather; stage 1 sends 2(N-1)/N * {b}Ψ; expected within 0.5%: padding and two scalars)",
             across_ranks=True)
    same = common.same_bits(ranks, serial, run)
    ck.check(all(same), f"--no-overlap: parameters bit-identical to the overlapped run's on {sum(same)} of "
             f"{common.n_ranks(N)}, expected all (overlap changes the timing, never the numbers)")
    ok, text = True, ""
    if ranks.rank == 0:
        png = os.path.splitext(trace)[0] + ".png"
        spans = {s: sum(e["tid"] == s for e in t.events) for s in ("compute", "comm")}
        ok = os.path.getsize(png) > 0 and spans["compute"] == spans["comm"] == K * (L + 2)
        text = (f"timeline {png} written: {spans['compute']} compute + {spans['comm']} comm spans in step "
                f"{min(1, a.steps - 1)}, expected K*(L+2) = {K * (L + 2)} each")
    ck.check(ok, text)
    common.check_overlap(ck, ranks, run, t.events, "3/4", "a reduce-scatter starts as its block's backward ends",
                         gpu="block l's reduce-scatter beside block l-1's backward",
                         exposed="the embeddings' reduce-scatter, the last, with no layer after it")
    run0 = common.make_run(a, ranks, stage=0)              # built for its memory report only
    common.memory_chart(a, ranks, {"stage 0": run0, "stage 1": ref, "stage 2": run},
                        common.figure_name(a, ranks, "memory_per_rank"),
                        f"memory per rank: {a.model}, {common.n_ranks(N)}, {psi:,} parameters ({a.precision})")
    return ck.exit_code()


if __name__ == "__main__":
    sys.exit(common.main(lesson, __doc__, steps=5, sim_steps=2, about_ranks=True,
                         builds_on="02_stage1_optimizer_sharding", uses=LESSON_FLAGS))
