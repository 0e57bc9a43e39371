"""Lesson 04 - bf16 and stochastic rounding: why ZeRO-2 accumulates bf16 gradients with random rounding.

bf16 is float32 with the low 16 bits dropped: 8 exponent bits (float32's range) but only 8 significant bits.
Between 1 and 2 its values are 2^-7 apart. Add g = 2^-10 to 1.0 and round to nearest: 1 + 2^-10 lies 1/8 of
a step above 1.0, closer to 1.0 than to 1 + 2^-7, so the sum rounds back to exactly 1.0. Do it 10,000
times and the accumulator still holds 1.0, though the true sum is 10.77: every add was below half a step,
and round-to-nearest dropped each one. That is what happens to a bf16 gradient shard in ZeRO-2 (llm.c PR
#593): micro-step after micro-step a small new gradient is added to a larger accumulated one.

Stochastic rounding rounds up with probability (dropped part) / (step): 1 + 2^-10 becomes 1 + 2^-7 one time
in 8 and 1.0 seven times in 8, so its expected value is 1 + 2^-10 exactly. No add is lost on average; the
price is noise, each add contributing variance p(1-p) step^2 (p = g / step), which this lesson predicts and
measures. In the bits (llm.c's stochastic_rounding): add a random 16-bit integer to the float32 bits and
truncate; a carry out of the dropped 16 bits is the round-up.

The random integer must not come from a generator with state, or a resume (or another rank) would draw
different bits: llmz hashes (seed, element index, step) into it (llmz/bf16.py), so the same inputs give the
same bits on every run and every rank. ZeRO-2's op is accumulate_shard_bf16: add my slice of the slot into
my shard in fp32, round back to bf16, zero the slot. llmz/plain/rounding.py writes it plainly in NumPy (read it:
one screen); llmz/kernels/accumulate.py has the kernel, one launch, and the NumPy reference a cpu Device runs.
The same rounding writes the bf16 parameters after AdamW updates their fp32 master copy (adamw_update_bf16).

The experiment: n accumulators start at 1.0 and receive K adds of g = 2^-10 (--steps K), in three ways:
bf16 round-to-nearest (llmz's op), bf16 stochastic (the plain version, on the host), fp32 (llmz's op); each is
compared with the float64 sum 1 + K g. Then llmz's stochastic op repeats the plain version's adds.

Checkpoints: (1) round-to-nearest loses every add, (2) stochastic rounding is right on average (the mean of
the n accumulators within 4 standard errors of float64), (3) its spread is the predicted one, (4) fp32 loses
nothing here, (5) the same seed gives the same bits: a second run and every rank agree bit for bit, (6) the
plain version's bits equal llmz's accumulate_shard_bf16's (the kernel on a GPU or the simulator).

Under mpiexec every rank runs the same experiment on its own device (nothing is sent but the checkpoints'
hashes, so no --comm) and rank 0 prints. It trains no model: its flags are --device, --steps, --mine and
--diff. Write it yourself: lessons/exercises/04_rounding.py is llmz/plain/rounding.py with its key lines
removed:
    python -m lessons.04_stochastic_rounding --mine lessons/exercises/04_rounding.py
"""
import hashlib
import sys

import numpy as np

from lessons import common
from llmz.bf16 import bf16_to_f32, f32_to_bf16
from llmz.device import Device

G = 2.0**-10                    # the small gradient: 1/8 of bf16's step at 1.0, below the half step
START = 1.0
SEED = 1234
ACCUMULATORS = {"cpu": 1024, "sim": 64, "gpu": 1024}    # the plain version runs on the host: NumPy


def bf16_step(x: np.ndarray) -> np.ndarray:
    """bf16's spacing at x (x > 0 normal): 8 significant bits, so 2^(exponent - 7)."""
    return np.exp2(np.floor(np.log2(x)) - 7)


def predicted_std(K: int) -> float:
    """Spread of one stochastic accumulator after K adds: sum of p(1-p) step^2 along the float64 path."""
    path = START + G * np.arange(K)
    step = bf16_step(path)
    p = G / step
    return float(np.sqrt(np.sum(p * (1 - p) * step**2)))


def accumulate(dev, K: int, n: int, mode: str, plain=None, checkpoints=()):
    """n accumulators at START, K adds of G; mode 'nearest' | 'stochastic' (bf16, llmz's op on dev) | 'fp32'
    (llmz's op on dev) | 'plain' (bf16: plain(shard, slot, rank, seed, step), llmz.plain.rounding's or the
    learner's, on the host). Returns the final values (float64, host), those at the requested steps, and the
    final bits."""
    on = np if mode == "plain" else dev                    # NumPy, or the device's arrays
    if mode == "fp32":
        acc, g = on.asarray(np.full(n, START, np.float32)), on.asarray(np.full(n, G, np.float32))
    else:                                                  # bf16: uint16 bit patterns
        acc, g = on.asarray(f32_to_bf16(np.full(n, START))), on.asarray(f32_to_bf16(np.full(n, G)))

    def value():
        host = np.array(dev.to_host(acc))
        return (host if mode == "fp32" else bf16_to_f32(host)).astype(np.float64)
    slot = on.empty(n, g.dtype)
    seen = {}
    for t in range(K):
        if mode == "plain":
            slot[...] = g                                  # this micro-step's gradient, in the slot
            plain(acc, slot, 0, SEED, t)                   # add in fp32, round back to bf16, zero the slot
        elif mode == "fp32":
            dev.copy(slot, g)
            dev.ops.accumulate_shard(dev, acc, slot, 0)
        else:
            dev.copy(slot, g)
            dev.ops.accumulate_shard_bf16(dev, acc, slot, 0, SEED, t, stochastic=(mode == "stochastic"))
        if t + 1 in checkpoints:
            seen[t + 1] = value()
    return value(), seen, np.array(dev.to_host(acc))


def lesson(a, ranks) -> int:
    dev = Device(a.kind, np.float32, gpu_index=ranks.local_rank)
    K, n = a.steps, ACCUMULATORS[a.kind]
    ck = common.Checks(ranks, 6)
    exact = START + K * G                                  # float64: exact for these numbers
    common.say(ranks, f"{ranks.world_size} rank(s) on {dev.kind}: {n} accumulators start at {START}, {K} adds "
               f"of g = 2^-10 = {G:.6g} each (bf16's step at 1.0 is 2^-7 = {2**-7:.6g}: g is 1/8 of it)")
    marks = sorted({max(1, K * i // 10) for i in range(1, 11)})
    near, near_at, _ = accumulate(dev, K, n, "nearest", checkpoints=marks)
    sr, sr_at, sr_bits = accumulate(dev, K, n, "plain", a.plain, checkpoints=marks)
    fp32, _, _ = accumulate(dev, K, n, "fp32")
    sr_again, _, sr_bits_again = accumulate(dev, K, n, "plain", a.plain)
    _, _, llmz_bits = accumulate(dev, K, n, "stochastic")

    # ---- the drift of each against float64 ---------------------------------------------------------------
    common.say(ranks, f"{'adds':>7} {'float64':>10} {'bf16 nearest':>13} {'drift':>8} {'bf16 stochastic':>16} "
               f"{'drift':>8} {'rms':>7}")
    for k in marks:
        f64 = START + k * G
        common.say(ranks, f"{k:>7} {f64:>10.5f} {near_at[k][0]:>13.5f} {(near_at[k][0] - f64) / f64:>+8.2%} "
                   f"{sr_at[k].mean():>16.5f} {(sr_at[k].mean() - f64) / f64:>+8.2%} "
                   f"{np.sqrt(np.mean((sr_at[k] - f64) ** 2)) / f64:>7.2%}")

    # ---- checkpoints --------------------------------------------------------------------------------------
    ck.check(np.all(near == START), f"bf16 round-to-nearest loses every add: all {n} accumulators are "
             f"{near.min():g} .. {near.max():g} after {K} adds, float64 says {exact:.6g} (lost "
             f"{(exact - near.mean()) / (exact - START):.0%} of the increment; expected 100%)")
    std = predicted_std(K)
    se = std / np.sqrt(n)
    z = (sr.mean() - exact) / se
    ck.check(abs(z) <= 4, f"{a.plain_name} is right on average: mean of {n} "
             f"accumulators {sr.mean():.6g}"
             f" vs float64 {exact:.6g} ({(sr.mean() - exact) / exact:+.3%}, {z:+.1f} standard errors; "
             f"expected within 4)")
    rms = float(np.sqrt(np.mean((sr - exact) ** 2)))
    ck.check(0.7 <= rms / std <= 1.3, f"its spread is the predicted one: rms error per accumulator {rms:.4g} "
             f"({rms / exact:.2%} of the sum) vs sqrt(sum p(1-p) step^2) = {std:.4g} (ratio {rms / std:.2f}, "
             f"expected 0.7 .. 1.3)")
    ck.check(np.all(fp32 == exact), f"fp32 keeps every add (24 significant bits): {fp32.min():.6g} .. "
             f"{fp32.max():.6g} vs {exact:.6g} (expected equal)")
    digest = hashlib.sha256(np.ascontiguousarray(sr_bits).tobytes()).hexdigest()[:12]
    hashes = common.gather(ranks, digest)
    same = np.array_equal(sr_bits, sr_bits_again) and np.array_equal(sr, sr_again)
    ck.check(same and len(set(hashes)) == 1, f"the same (seed, index, step) give the same bits: a second run "
             f"{'matches' if same else 'DIFFERS'}, {len(set(hashes))} distinct result hash(es) over "
             f"{ranks.world_size} rank(s) ({', '.join(sorted(set(hashes)))}), expected 1")
    same = common.gather(ranks, np.array_equal(sr_bits, llmz_bits))
    ck.check(all(same), f"{a.plain_name} = llmz's accumulate_shard_bf16 ({dev.kind}), bit for bit: the {n} "
             f"accumulators after {K} adds equal on {sum(same)} of {common.n_ranks(ranks.world_size)}, "
             f"expected all")
    return ck.exit_code()


if __name__ == "__main__":
    sys.exit(common.main(lesson, __doc__, steps=10_000, sim_steps=200,
                         steps_help="K: adds of g into each accumulator", builds_on=None, uses=("--mine",)))
