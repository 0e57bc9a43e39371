"""Lesson 02 - ZeRO stage 1, optimizer-state sharding: reduce-scatter, update my shard, all-gather.

What changes from lesson 01: in stage 0 every rank runs the same AdamW on the same numbers, N times over,
and keeps N copies of m and v. Stage 1 splits that work. Each bucket of the flat buffer is padded to a
multiple of N and cut into N slices; rank r owns slice r of every bucket (llmz.layout), and keeps m and v
for its slices only. The step becomes (stage 1 in llmz.zero.STAGES: grads.py, sharded_adamw.py, params.py):
    reduce-scatter   each bucket's gradients: rank r receives the average over ranks of ITS slice only
    AdamW            on my slices: the parameters I own move, the others wait for their owners
    all-gather       each bucket's parameters: every rank receives every slice, all ranks equal again
A reduce-scatter followed by an all-gather is exactly the ring all-reduce of lesson 01, split in two with
the update in between: the same bytes, 2(N-1)/N * bΨ per rank per step.

Memory per rank, Ψ parameters, b bytes per value:
    parameters bΨ + gradients bΨ + m and v 2bΨ/N              (fp32: 4Ψ + 4Ψ + 8Ψ/N)
With bf16 parameters and fp32 master weights the sharded part is 12Ψ/N of 16Ψ: that is why stage 1 alone
cuts memory by most of 4x at large N (ZeRO paper, Rajbhandari et al. 2019).

Checkpoints: (1) the losses equal stage 0's (both run here, side by side), (2) the parameters are
bit-identical on every rank (the all-gather did its job), (3) the optimizer state per rank is 1/N of stage
0's, (4) the bytes sent per rank per step are still 2(N-1)/N * bΨ, as in stage 0.
"""
import sys

from lessons import common


def lesson(a, ranks) -> int:
    from llmz.memory import fmt_bytes
    N = ranks.world_size
    ck = common.Checkpoints(ranks, 4)
    run0 = common.make_run(a, ranks, stage=0)              # lesson 01: the reference
    run1 = common.make_run(a, ranks, stage=1)              # this lesson
    common.apply_break(run1.zero)
    c, psi, b = run1.config, run1.layout.num_parameters, run1.dev.dtype.itemsize
    common.say(ranks, f"{common.n_ranks(N)} on {run1.dev.kind} ({a.precision}), comm {run1.comm.name}: L={c.num_layers} "
               f"C={c.channels} B={a.batch_size} T={a.seq_len}, Ψ = {psi:,} parameters")
    losses0, losses1, sent0, sent1 = [], [], [], []
    for step in range(a.steps):
        run0.comm.reset_counters()
        run1.comm.reset_counters()
        losses0.append(run0.step(step)["loss"])     # all-reduce, AdamW on everything
        losses1.append(run1.step(step)["loss"])     # reduce-scatter, AdamW on my shard, all-gather
        sent0.append(run0.comm.bytes_sent)
        sent1.append(run1.comm.bytes_sent)
        calls = ", ".join(f"{k} x{v}" for k, v in sorted(run1.comm.calls.items()))
        common.say(ranks, f"step {step}: stage 1 loss {losses1[-1]:.10f} | stage 0 loss {losses0[-1]:.10f} | "
                   f"stage 1 sent {sent1[-1]:,} B ({calls})")

    # ---- checkpoints --------------------------------------------------------------------------------------
    d = common.max_rel_diff(losses1, losses0)
    ck.check(d <= a.rtol, f"losses of stage 1 = stage 0's over {a.steps} steps: {losses1[-1]:.10f} vs "
             f"{losses0[-1]:.10f} at the last (worst relative difference {d:.1e}, expected <= {a.rtol:.0e})")
    common.check_params_identical(ck, ranks, run1)
    opt0, opt1 = run0.memory["measured"]["optimizer_state"], run1.memory["measured"]["optimizer_state"]
    formula = 2 * b * psi // N
    pad = 2 * b * len(run1.layout.buckets)          # m and v: at most one padded value per bucket per rank
    ck.check(opt1 * N == opt0 and 0 <= opt1 - formula <= pad,
             f"optimizer state per rank {fmt_bytes(opt1)} = 1/{N} of stage 0's {fmt_bytes(opt0)} "
             f"(formula 2*{b}Ψ/N = {formula:,} B, measured {opt1:,} B: expected within padding, {pad} B)",
             across_ranks=True)
    expect = 2 * (N - 1) * b * psi // N
    worst = max(common.gather(ranks, max(sent1)))
    ok = abs(worst - expect) <= 0.005 * expect if N > 1 else worst == 0
    ck.check(ok, f"bytes sent per rank per step {worst:,} B (stage 0: {max(sent0):,} B) = 2(N-1)/N * {b}Ψ = "
             f"{expect:,} B (reduce-scatter + all-gather = one all-reduce; expected within 0.5%: padding, "
             f"the loss average and the gradient norm's all-reduce)", across_ranks=True)
    return ck.exit_code()


if __name__ == "__main__":
    sys.exit(common.main(lesson, __doc__, steps=5, sim_steps=2, about_ranks=True))
