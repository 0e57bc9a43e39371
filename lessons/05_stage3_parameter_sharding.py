"""Lesson 05 - ZeRO stage 3, parameter sharding: gather each block's parameters just before it runs.

What changes from lesson 03: stage 2 still keeps every parameter (bΨ) on every rank, although each rank
updates only its shard. Stage 3 keeps only that shard and fetches a block's full parameters from the other
ranks the moment the model asks for them (`p.bucket(b)` in llmz/model.py, the twin of the gradient store's
`grads.bucket(b)`). In llmz/plain/stage3.py (`--diff` shows the change from stage 2):
  * the parameters become my shard (what AdamW moves) and two slots: when the model asks for block l, its
    parameters are all-gathered into slot l % 2, every rank contributing its slice from its shard
    (comm.all_gather(slot, src=my slice)). Backward needs them again, so asks again, in reverse order: 2L
    block all-gathers a micro-step.
  * the embeddings and the final layernorm: wte is used first (encoder) and last (classifier) in forward and
    first again in backward, back to back, and it is the biggest bucket; in a buffer of its own it costs the
    same memory gathered once as twice. So both are all-gathered once a step, right after AdamW, and kept.
  * gradients: exactly as in lesson 03 (two gradient slots, reduce-scatter + accumulate at done(b)). There is
    no all-gather of everything after the step.
The plain stage gathers a block when it is asked for and waits, so one slot would do. llmz.zero's stage 3
(llmz.zero.params.GatheredParameters, trained here beside it) prefetches: while block l computes, block l+1's
all-gather (in backward: l-1's) already runs on the comm stream, into the other slot, once an event says the
block that used that slot before is done; the compute stream waits on the gather's event before block l+1's
first kernel, the host never waits. Backward's first block (L-1) is gathered under the classifier's
backward; a forward's block 0 has nothing before it to hide under. On CPU ranks the gather is MPI's
non-blocking all-gather, started before block l computes and waited for when block l+1 is asked for.

Memory per rank, Ψ parameters, b bytes per value, N ranks (slot = the largest block):
    parameters bΨ/N + two slots + embeddings + lnf      gradients: the same      m and v 2bΨ/N
In bf16 with an fp32 master: (2Ψ + 2Ψ + 12Ψ)/N + the slots and embeddings (the ZeRO paper's P_os+g+p).
Communication per micro-step: two all-gathers of the blocks and one reduce-scatter of everything, about
3(N-1)/N * bΨ (stage 2: 2), the price of dividing the parameters by N.

Checkpoints: (1) the losses and gradient norms equal stage 2's (both run here, with --grad-accum K), (2) every
rank gathers the same parameters, bit for bit, (3) parameter bytes per rank = shard + two slots + embeddings +
lnf, exactly, (4) all-gathers per step: K times 2L blocks, then the embeddings and lnf, (5) bytes sent per
rank per step as the count of (4) and K reduce-scatters predicts, (6) the plain stage 3's parameters equal
llmz.zero's prefetching stage 3's, bit for bit, (7) the timeline PNG of llmz.zero's step: every block's gather
but a forward's block 0 began before the block ahead of it finished computing, (8) the overlap it shows: part
of the time the gathers and reduce-scatters were in flight, a layer computed.
Figures in --out, named by model, ranks N and K: stage3_timeline_thin_2ranks_k2.png (rank 0's step; the .json
beside it opens in ui.perfetto.dev) and memory_per_rank_stages0-3_thin_2ranks.png (stages 0 to 3 by category).

Write it yourself: lessons/exercises/05_stage3.py is llmz/plain/stage3.py with its key lines removed:
    mpiexec -n 2 python -m lessons.05_stage3_parameter_sharding --mine lessons/exercises/05_stage3.py
"""
import os
import sys

from lessons import common
from llmz.args import LESSON_FLAGS
from llmz.plain.stage0 import Stage0
from llmz.plain.stage1 import Stage1
from llmz.plain.stage2 import Stage2
from llmz.trace import gathers_ahead


def gathered(run):
    """Record what run's all-gathers fill, in order: each named by its buffer's size (every block's is a
    block's, the embeddings' and lnf's their own). Returns the list so far as a function of the run
    (side_by_side's `measure`)."""
    names = {b.padded_size: b.name for b in (run.layout.embeddings, run.layout.lnf)}
    seen, start = [], run.comm.start_all_gather

    def recording(buf, src=None):
        seen.append(names.get(buf.size, "block"))
        return start(buf, src)
    run.comm.start_all_gather = recording
    return lambda r: list(seen)


def lesson(a, ranks) -> int:
    N, K = ranks.world_size, a.grad_accum
    ck = common.Checks(ranks, 8)
    # lesson 03's plain stage 2 (the reference), this lesson's plain stage 3, llmz.zero's (prefetching; traced)
    trace, ref, run, prod = common.three_runs(a, ranks, 3, Stage2, "stage3_timeline")
    psi, b, lay, L = run.layout.num_parameters, run.dev.dtype.itemsize, run.layout, run.model.config.num_layers
    t = common.side_by_side(a, ranks, run, ref, ("stage 3", "stage 2"), prod=prod, trace=trace,
                            measure=("all-gathers", gathered(run)))

    # ---- checkpoints --------------------------------------------------------------------------------------
    common.check_same_losses(ck, a, t, f"losses and gradient norms of stage 3 = stage 2's over {a.steps} "
                             f"steps of K={K}")
    common.check_params_identical(ck, ranks, run)     # the parameters each rank gathers from the N shards
    common.check_sharded(ck, run, ref, "parameters", "stage 2")    # shard + two slots + embeddings + lnf
    expect = K * 2 * L * ["block"] + ["embeddings", "lnf"]
    counted = [calls["all_gather"] for calls in t.calls]            # the all-gathers the communicator ran
    in_order = all(g == expect for g in t.measured)                 # what they filled, in order
    ck.check(in_order and counted == [len(expect)] * a.steps,
             f"all-gathers per step run by the communicator {counted} = K*2L + 2 = {K}*2*{L} + 2 = {len(expect)}, "
             f"in the order K x 2L blocks (forward, then backward), then the embeddings and lnf: "
             f"{'yes' if in_order else 'no, ' + ' '.join(t.measured[0])}")
    ends = lay.embeddings.size + lay.lnf.size
    expect_bytes = (N - 1) * b * (K * (2 * (psi - ends) + psi) + ends) // N
    worst, ok = common.sent_as_predicted(ranks, t.sent, expect_bytes)
    per_micro = expect_bytes / (K * (N - 1) * b * psi / N) if N > 1 else 0.0
    ck.check(ok, f"bytes sent per rank per step {worst:,} B = (N-1)/N * {b} * (K(2Ψ_blocks + Ψ) + Ψ_ends) = "
             f"{expect_bytes:,} B: {per_micro:.2f} x (N-1)/N * {b}Ψ per micro-step (about 3: the blocks gathered "
             f"twice, everything reduce-scattered once, the embeddings and lnf gathered once a step; stage 2: "
             f"(K+1)/K = {(K + 1) / K:.2f}; expected within 0.5%: padding and two scalars)", across_ranks=True)
    common.check_same_as_production(ck, a, ranks, run, prod, "stage 3 (prefetching: it changes the timing, "
                                    "never the numbers)")
    ok, text = True, ""
    if ranks.rank == 0:
        png = os.path.splitext(trace)[0] + ".png"
        ahead, total = gathers_ahead(t.events)
        ok = os.path.getsize(png) > 0 and (ahead, total) == (K * (2 * L - 1), K * 2 * L)
        text = (f"timeline {png} written: of the {total} block compute spans of step {min(1, a.steps - 1)}, "
                f"{ahead} used an all-gather that began before the block ahead of them finished (prefetched), "
                f"expected K*(2L-1) = {K * (2 * L - 1)} of K*2L = {K * 2 * L}: all but each micro-step's forward block 0")
    ck.check(ok, text)
    common.check_overlap(ck, ranks, prod, t.events, "2/3 (below lesson 03's)",
                         "block l+1's gather (backward: l-1's) starts before block l", gpu="block l+1's gather "
                         "(backward: l-1's) and the reduce-scatters beside block l", exposed="now also each gather's "
                         "end, forward block 0's gather (nothing before it), the embeddings' reduce-scatter")
    common.stages_memory_chart(a, ranks, {"stage 2": ref, "stage 3": run},
                               {"stage 0": (0, Stage0), "stage 1": (1, Stage1)}, "memory_per_rank_stages0-3")
    return ck.exit_code()


if __name__ == "__main__":
    sys.exit(common.main(lesson, __doc__, steps=5, sim_steps=2, about_ranks=True,
                         builds_on="03_stage2_gradient_sharding", uses=LESSON_FLAGS))
