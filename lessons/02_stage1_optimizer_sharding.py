"""Lesson 02 - ZeRO stage 1, optimizer-state sharding: reduce-scatter, update my shard, all-gather.

What changes from lesson 01: in stage 0 every rank runs the same AdamW on the same numbers, N times over,
and keeps N copies of m and v. Stage 1 splits that work. Each bucket of the flat buffer is padded to a
multiple of N and cut into N slices; rank r owns slice r of every bucket, its shard (llmz.layout), and
keeps m and v for its shard only. The update becomes (llmz/plain/stage1.py replaces four parts of stage 0's; in llmz.zero,
stage 1 of llmz.zero.STAGES: grads.py, sharded_adamw.py, params.py):
    reduce-scatter   each bucket's gradients: rank r receives the average over ranks of ITS slice only
    norm             the squares of my slices, all-reduced: every rank clips by the same global norm
    AdamW            on my slices: the parameters I own move, the others wait for their owners
    all-gather       each bucket's parameters: every rank receives every slice, all ranks equal again
A reduce-scatter followed by an all-gather is exactly the ring all-reduce of lesson 01, split in two with
the update in between: the same bytes, 2(N-1)/N * bΨ per rank per step.

Memory per rank, Ψ parameters, b bytes per value:
    parameters bΨ + gradients bΨ + m and v 2bΨ/N              (fp32: 4Ψ + 4Ψ + 8Ψ/N)
With bf16 parameters and fp32 master weights the sharded part is 12Ψ/N of 16Ψ: that is why stage 1 alone
cuts memory by most of 4x at large N (ZeRO paper, Rajbhandari et al. 2019).

Checkpoints: (1) the losses and gradient norms equal stage 0's (both run here, side by side), (2) the
parameters are bit-identical on every rank (the all-gather did its job), (3) the optimizer state per rank is
1/N of stage 0's, (4) the bytes sent per rank per step are still 2(N-1)/N * bΨ, as in stage 0, (5) the plain
stage 1's parameters equal llmz.zero's, bit for bit.

Write it yourself: lessons/exercises/02_stage1.py is llmz/plain/stage1.py with its key lines removed:
    mpiexec -n 2 python -m lessons.02_stage1_optimizer_sharding --mine lessons/exercises/02_stage1.py
"""
import sys

from lessons import common
from llmz.config import fmt_bytes
from llmz.plain.stage0 import Stage0


def lesson(a, ranks) -> int:
    N = ranks.world_size
    ck = common.Checks(ranks, 5)
    ref = common.make_run(a, ranks, stage=0, plain=Stage0)      # lesson 01: the reference
    run = common.make_run(a, ranks, stage=1, plain=a.plain)     # this lesson
    prod = common.make_run(a, ranks, stage=1)                   # llmz.zero's stage 1, for the same bits
    common.apply_break(run.zero)
    psi, b = run.layout.num_parameters, run.dev.dtype.itemsize
    common.say_setup(a, ranks, run)
    t = common.side_by_side(a, ranks, run, ref, ("stage 1", "stage 0"), prod=prod)

    # ---- checkpoints --------------------------------------------------------------------------------------
    common.check_same_losses(ck, a, t, f"losses and gradient norms of stage 1 = stage 0's over {a.steps} steps")
    common.check_params_identical(ck, ranks, run)
    opt0, opt1 = ref.memory["measured"]["optimizer_state"], run.memory["measured"]["optimizer_state"]
    formula = 2 * b * psi // N
    pad = 2 * b * len(run.layout.buckets)          # m and v: at most one padded value per bucket per rank
    ck.check(opt1 * N == opt0 and 0 <= opt1 - formula <= pad,
             f"optimizer state per rank {fmt_bytes(opt1)} = 1/{N} of stage 0's {fmt_bytes(opt0)} "
             f"(formula 2*{b}Ψ/N = {formula:,} B, measured {opt1:,} B: expected within padding, {pad} B)",
             across_ranks=True)
    expect = 2 * (N - 1) * b * psi // N
    worst, ok = common.sent_as_predicted(ranks, t.sent, expect)
    ck.check(ok, f"bytes sent per rank per step {worst:,} B (stage 0: {max(t.ref_sent):,} B) = 2(N-1)/N * "
             f"{b}Ψ = {expect:,} B (reduce-scatter + all-gather = one all-reduce; expected within 0.5%: padding, "
             f"the loss average and the gradient norm's all-reduce)", across_ranks=True)
    common.check_same_as_production(ck, a, ranks, run, prod, "stage 1")
    return ck.exit_code()


if __name__ == "__main__":
    sys.exit(common.main(lesson, __doc__, steps=5, sim_steps=2, about_ranks=True,
                         builds_on="01_stage0_data_parallel"))
