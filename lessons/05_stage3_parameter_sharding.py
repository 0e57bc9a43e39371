"""Lesson 05 - ZeRO stage 3, parameter sharding: gather each block's parameters just before it runs.

What changes from lesson 03: stage 2 still keeps every parameter (bΨ) on every rank, although each rank
updates only its slice. Stage 3 keeps only that slice (llmz.zero.params.GatheredParameters) and fetches a block's full
parameters from the other ranks the moment the model asks for them (`p.bucket(b)` in llmz/model.py, the
twin of the gradient store's `grads.bucket(b)`):
  * two parameter slots: before block l's forward its parameters are all-gathered into slot l % 2 (every
    rank contributes its slice; comm.all_gather(slot, src=my slice)). Backward needs them again, so it
    gathers them again, in reverse order: 2L block all-gathers a micro-step.
  * prefetch, ordered by events: while block l computes, block l+1's all-gather (in backward: l-1's) already
    runs on the comm stream, into the other slot, once an event recorded on the compute stream says the
    block that used that slot before is done. The compute stream waits on the gather's event before block
    l+1's first kernel. The host never waits. Backward's first block (L-1) is gathered under the
    classifier's backward; a forward's block 0 has nothing before it to hide under.
  * the embeddings and the final layernorm: wte is used first (encoder) and last (classifier) in forward and
    first again in backward, back to back, and it is the biggest bucket; in a buffer of its own it costs the
    same memory gathered once as twice. So both are all-gathered once a step, right after AdamW, and kept.
  * gradients: exactly as in lesson 03 (two gradient slots, reduce-scatter + accumulate during backward).
    AdamW updates my slice of the parameters; there is no all-gather of everything after the step.

Memory per rank, Ψ parameters, b bytes per value, N ranks (slot = the largest block):
    parameters bΨ/N + two slots + embeddings + lnf      gradients: the same      m and v 2bΨ/N
In bf16 with an fp32 master: (2Ψ + 2Ψ + 12Ψ)/N + the slots and embeddings (the ZeRO paper's P_os+g+p).
Communication per micro-step: two all-gathers of the blocks and one reduce-scatter of everything, about
3(N-1)/N * bΨ (stage 2: 2), the price of dividing the parameters by N.

Checkpoints: (1) the losses equal stage 2's (both run here, with --grad-accum K), (2) every rank gathers the
same parameters, bit for bit, (3) parameter bytes per rank = shard + two slots + embeddings + lnf, exactly,
(4) all-gathers per step: K times (blocks 0..L-1, then L-1..0), then the embeddings and lnf, in that order,
(5) bytes sent per rank per step as the count of (4) and K reduce-scatters predicts, (6) --no-overlap (no
prefetch) gives the same bits, (7) the timeline PNG: every block's gather but a forward's block 0 began
before the block ahead of it finished computing.
Figures in --out: stage3_timeline.png (rank 0's step) and memory_per_rank_stages0-3.png.
"""
import os
import sys

from lessons import common


def lesson(a, ranks) -> int:
    from llmz.memory import fmt_bytes
    from llmz.trace import gathers_ahead
    N, K = ranks.world_size, a.grad_accum
    ck = common.Checkpoints(ranks, 7)
    trace = os.path.join(a.out, "stage3_timeline.json")
    if ranks.rank == 0:
        os.makedirs(a.out, exist_ok=True)
    run2 = common.make_run(a, ranks, stage=2)                          # lesson 03: the reference
    run3 = common.make_run(a, ranks, stage=3, trace=trace)             # this lesson
    run3s = common.make_run(a, ranks, stage=3, overlap=False)          # the same, no prefetch
    for r in (run3, run3s):
        common.apply_break(r.zero)
    c, psi, b, lay = run3.config, run3.layout.num_parameters, run3.dev.dtype.itemsize, run3.layout
    L = c.num_layers
    common.say(ranks, f"{common.n_ranks(N)} on {run3.dev.kind} ({a.precision}), comm {run3.comm.name}: L={L} "
               f"C={c.channels} B={a.batch_size} T={a.seq_len} K={K}, Ψ = {psi:,} parameters")
    traced = min(1, a.steps - 1)
    losses2, losses3, sent, gathers, counted, events = [], [], [], [], [], []
    for step in range(a.steps):
        losses2.append(run2.step(step)["loss"])
        run3s.step(step)
        if step == traced and ranks.rank == 0:
            run3.tracer.start()                    # rank 0 records this step's timeline
        run3.comm.reset_counters()
        run3.zero.all_gathers.clear()
        losses3.append(run3.step(step)["loss"])
        gathers.append(list(run3.zero.all_gathers))          # the buckets stage 3 gathered, in order
        counted.append(run3.comm.calls["all_gather"])        # the all-gathers the communicator ran
        sent.append(run3.comm.bytes_sent)
        if step == traced and ranks.rank == 0:
            events = run3.tracer.stop(trace)["traceEvents"]
        common.say(ranks, f"step {step}: stage 3 loss {losses3[-1]:.10f} | stage 2 loss {losses2[-1]:.10f} | "
                   f"{counted[-1]} all-gathers | sent {sent[-1]:,} B")

    # ---- checkpoints --------------------------------------------------------------------------------------
    d = common.max_rel_diff(losses3, losses2)
    ck.check(d <= a.rtol, f"losses of stage 3 = stage 2's over {a.steps} steps of K={K}: {losses3[-1]:.10f} vs "
             f"{losses2[-1]:.10f} at the last (worst relative difference {d:.1e}, expected <= {a.rtol:.0e})")
    common.check_params_identical(ck, ranks, run3)           # the parameters each rank gathers from the N shards
    slot = max(bk.padded_size for bk in lay.buckets[1:-1])
    parts = {"shard": lay.shard_total, "two slots": 2 * slot, "embeddings": lay.embeddings.padded_size,
             "lnf": lay.lnf.padded_size}
    p2, p3 = run2.memory["measured"]["parameters"], run3.memory["measured"]["parameters"]
    ck.check(p3 == b * sum(parts.values()),
             f"parameters per rank {fmt_bytes(p3)} = " + " + ".join(f"{k} {fmt_bytes(b * v)}" for k, v in parts.items())
             + f" (expected exactly), vs stage 2's full {fmt_bytes(p2)}: {p3 / p2:.2f}x")
    blocks = [f"block{i}" for i in range(L)]
    expect = K * (blocks + blocks[::-1]) + ["embeddings", "lnf"]
    in_order = all(g == expect for g in gathers)
    ck.check(in_order and counted == [len(expect)] * a.steps,
             f"all-gathers per step run by the communicator {counted} = K*2L + 2 = {K}*2*{L} + 2 = {len(expect)}, "
             f"asked for in the order K x (block0..block{L - 1}, block{L - 1}..block0), embeddings, lnf: "
             f"{'yes' if in_order else 'no, ' + ' '.join(gathers[0])}")
    ends = lay.embeddings.size + lay.lnf.size
    expect_bytes = (N - 1) * b * (K * (2 * (psi - ends) + psi) + ends) // N
    worst = max(common.gather(ranks, max(sent)))
    ok = abs(worst - expect_bytes) <= 0.005 * expect_bytes if N > 1 else worst == 0
    per_micro = expect_bytes / (K * (N - 1) * b * psi / N) if N > 1 else 0.0
    ck.check(ok, f"bytes sent per rank per step {worst:,} B = (N-1)/N * {b} * (K(2Ψ_blocks + Ψ) + Ψ_ends) = "
             f"{expect_bytes:,} B: {per_micro:.2f} x (N-1)/N * {b}Ψ per micro-step (about 3: the blocks gathered "
             f"twice, everything reduce-scattered once, the embeddings and lnf gathered once a step; stage 2: "
             f"(K+1)/K = {(K + 1) / K:.2f}; expected within 0.5%: padding and two scalars)")
    same = common.gather(ranks, common.params_hash(run3s) == common.params_hash(run3))
    ck.check(all(same), f"--no-overlap (every gather waited for at once, none ahead): parameters bit-identical to "
             f"the prefetching run's on {sum(same)} of {common.n_ranks(N)}, expected all")
    if ranks.rank == 0:
        png = os.path.splitext(trace)[0] + ".png"
        ahead, total = gathers_ahead(events)
        ok = os.path.getsize(png) > 0 and (ahead, total) == (K * (2 * L - 1), K * 2 * L)
        text = (f"timeline {png} written: of the {total} block compute spans of step {traced}, {ahead} used an "
                f"all-gather that began before the block ahead of them finished (prefetched), expected "
                f"K*(2L-1) = {K * (2 * L - 1)} of K*2L = {K * 2 * L}: all but each micro-step's forward block 0")
    else:
        ok, text = True, ""
    ck.check(ok, text)
    run0 = common.make_run(a, ranks, stage=0)              # built for their memory reports only
    run1 = common.make_run(a, ranks, stage=1)
    if ranks.rank == 0:
        reports = {f"stage {i}": r.memory for i, r in enumerate((run0, run1, run2, run3))}
        path = os.path.join(a.out, "memory_per_rank_stages0-3.png")
        common.plot_memory(reports, path, f"memory per rank, {N} ranks, {psi:,} parameters ({a.precision})")
        common.say(ranks, f"wrote {path}")
    return ck.exit_code()


if __name__ == "__main__":
    sys.exit(common.main(lesson, __doc__, steps=5, sim_steps=2, grad_accum=2))
