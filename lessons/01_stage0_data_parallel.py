"""Lesson 01 - ZeRO stage 0, data parallelism: N ranks, each its own batch, gradients all-reduced.

What changes from lesson 00: N copies of the same model run at once, one per rank (mpiexec -n N). Rank r
reads its own slice of the data (llm.c's order: micro-batch i of rank r starts at token i*N*B*T + r*B*T),
so a step sees N*B*T tokens. After backward each rank holds the gradient of ITS batch only. One all-reduce
(average) per bucket gives every rank the gradient of the whole N*B batch; every rank then runs the same
AdamW on the same numbers, so the parameters stay identical without ever being sent. The whole change is
two lines: llmz/plain/stage0.py is lesson 00's step with a loop of comm.all_reduce over the buckets (`--diff`
shows them; in llmz.zero it is FullGradients.reduce). The run trains with it beside one process with the union
batch, step by step (lessons.common.side_by_side), and beside llmz.zero's stage 0.

Nothing is divided by N: every rank holds everything.
    parameters bΨ + gradients bΨ + m and v 2bΨ on EVERY rank    (fp32: 4Ψ + 4Ψ + 8Ψ bytes)

What it costs, the ring all-reduce: put the N ranks in a ring and cut a buffer of S bytes into N chunks.
Reduce-scatter: N-1 rounds, in each every rank sends one chunk (S/N) to its neighbour, which adds it to its
own; afterwards each rank holds one chunk summed over all ranks. All-gather: N-1 more rounds pass the summed
chunks on around the ring. Each rank sends 2(N-1)/N * S bytes, so with S = bΨ about 2bΨ per step, almost
independent of N. (llmz.comm.Communicator.bytes_sent counts by this model, whatever the backend really does.)

Checkpoints: (1) the losses and gradient norms equal one process whose batch is the union of the ranks'
batches (rank 0 runs it in-process, on a one-rank communicator), (2) the parameters are bit-identical on every
rank, (3) memory per rank by category is bΨ + bΨ + 2bΨ, (4) bytes sent per rank per step are 2(N-1)/N * bΨ,
(5) the plain stage 0's parameters equal llmz.zero's, bit for bit.

Write it yourself: lessons/exercises/01_stage0.py is llmz/plain/stage0.py with its key line removed; fill it in
and grade it with this lesson's checkpoints:
    mpiexec -n 2 python -m lessons.01_stage0_data_parallel --mine lessons/exercises/01_stage0.py
"""
import sys

from lessons import common
from llmz.config import fmt_bytes
from llmz.memory import table


def lesson(a, ranks) -> int:
    N = ranks.world_size
    ck = common.Checks(ranks, 5)
    # the reference: one process, a world of one, a batch of N*B: exactly the tokens the N ranks read together
    ref = (common.make_run(a, common.one_rank(ranks), stage=0, batch_size=N * a.batch_size, comm="auto")
           if ranks.rank == 0 else None)
    run = common.make_run(a, ranks, stage=0, plain=a.plain)    # this lesson: N ranks, batch B each, all-reduce
    prod = common.make_run(a, ranks, stage=0)                  # llmz.zero's stage 0, for the same bits
    common.apply_break(run.zero)
    psi, b = run.layout.num_parameters, run.dev.dtype.itemsize
    common.say_setup(a, ranks, run)
    t = common.side_by_side(a, ranks, run, ref, (common.n_ranks(N), f"one process, batch {N}x{a.batch_size}"),
                            prod=prod)

    # ---- checkpoints --------------------------------------------------------------------------------------
    common.check_same_losses(ck, a, t, f"losses and gradient norms on {common.n_ranks(N)} = one process with "
                             f"the union batch's over {a.steps} steps", across_ranks=True)   # rank 0's reference
    common.check_params_identical(ck, ranks, run)
    common.say(ranks, table(run.memory))
    m = run.memory["measured"]
    want = {"parameters": b * psi, "gradients": b * psi, "optimizer_state": 2 * b * psi}
    pad = b * (N - 1) * len(run.layout.buckets)      # each bucket is padded by at most N-1 values
    off = {k: m[k] - want[k] for k in want}
    ck.check(all(0 <= off[k] <= (2 if k == "optimizer_state" else 1) * pad for k in want),
             f"memory per rank, the same for any N: parameters {fmt_bytes(m['parameters'])} + gradients "
             f"{fmt_bytes(m['gradients'])} + optimizer state {fmt_bytes(m['optimizer_state'])} = {b}Ψ + {b}Ψ + "
             f"{2 * b}Ψ with Ψ = {psi:,} (padding {max(off.values())} B, expected <= {2 * pad} B)")
    expect = 2 * (N - 1) * b * psi // N
    worst, ok = common.sent_as_predicted(ranks, t.sent, expect)
    ck.check(ok, f"bytes sent per rank per step {worst:,} B = 2(N-1)/N * {b}Ψ = {expect:,} B (ring all-reduce; "
             f"expected within 0.5%: padding and the 8-byte loss average)", across_ranks=True)
    common.check_same_as_production(ck, a, ranks, run, prod, "stage 0")
    return ck.exit_code()


if __name__ == "__main__":
    sys.exit(common.main(lesson, __doc__, steps=5, sim_steps=2, about_ranks=True, builds_on="00_one_device"))
