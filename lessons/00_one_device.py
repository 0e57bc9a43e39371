"""Lesson 00 - one device: GPT-2 as a list of kernels, and one training step.

GPT-2 is a straight list of layers: the encoder (token + position embedding); L blocks of layernorm, qkv
matmul, attention, projection, residual add, layernorm, fc matmul, GELU, projection, residual add; the
final layernorm; the classifier (logits = x @ wte.T, softmax, cross-entropy). Each layer is a pair of
functions, forward and backward, and each pair exists twice in the teaching set (llmz/kernels/*.py): a Numba
CUDA kernel, run on the GPU, or on a laptop in Numba's CUDA simulator (--device sim), and a NumPy reference of
the same math (--device cpu). llmz/fast/ holds the faster kernels the GPU runs by default, each tested against
its teaching twin; --kernels teaching|fast picks the set. The three are op sets with the same names and
arguments (llmz.reference, llmz.kernels, llmz.fast): a Device picks one, `dev.ops`, and llmz.model.GPT2
calls its layers in order.

One training step:
    forward    the activations, and the loss: the mean cross-entropy over the B*T positions
    backward   d(loss)/d(every parameter), accumulated (+=) into the gradient buffer, bucket by bucket
    update     the gradient norm, clipping, then AdamW: p -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * p);
               then the gradients are zeroed for the next step
The update is llmz/plain/step.py: read it first (one screen). It is what this lesson trains with; llmz.zero's
stage 0, the production code, trains beside it and must end with the same bits. It writes the step as parts
(what a rank holds, where backward puts a bucket's gradients, the update's collectives and the part of each
bucket a rank updates); each later lesson's ZeRO stage is the one before with some of those parts replaced
(llmz/plain/stage0.py ... stage3.py, each a subclass; `--diff` shows the parts a lesson replaced).

Memory on one device, with Ψ parameters and b bytes per value (b = 4 in fp32; this lesson runs the CPU in
fp64, b = 8, so that later lessons can compare ranks to the last bit):
    parameters b*Ψ + gradients b*Ψ + AdamW's m and v 2b*Ψ    (fp32: 4Ψ + 4Ψ + 8Ψ bytes)
Each later lesson divides one more of these terms by the number of ranks N. The words the lessons use (rank,
Ψ, bucket, shard, micro-step, the collectives, slot, streams and events) are defined in lessons/README.md,
before lesson 01.

Checkpoints: (1) the kernels' loss equals the float64 reference's, (2) so does every gradient tensor,
(3) repeated steps on one batch drive its loss down, (4) the bytes held are b*Ψ + b*Ψ + 2b*Ψ, (5) the plain
step's parameters equal llmz.zero's stage 0's after those steps, bit for bit.

There is nothing to communicate yet (so no --comm): under mpiexec every rank runs this same lesson on its
own device and rank 0 prints.
"""
import sys

import numpy as np

from lessons import common
from llmz.config import GPT2Config, fmt_bytes, preset
from llmz.device import Device, gpu_available, resolve
from llmz.layout import Layout, init_parameters
from llmz.model import GPT2, FullGrads, FullParams

# the kernels run in float32 against a float64 reference: rounding of sums of up to a few hundred terms
LOSS_TOL, GRAD_TOL = 1e-5, 1e-4


def forward_backward(dev, config, params_host, x, y):
    """One forward and backward on `dev` (its op set: kernels or NumPy references): the loss and the flat
    gradient."""
    B, T = x.shape
    layout = Layout(config, 1)
    params = dev.asarray(params_host, dev.dtype)
    grads = dev.zeros(layout.total)
    model = GPT2(config, dev, B, T)
    xd, yd = dev.asarray(x, np.int32), dev.asarray(y, np.int32)
    model.forward(FullParams(layout, params), xd, yd)
    loss = model.mean_loss()
    model.backward(FullParams(layout, params), FullGrads(layout, grads), xd, yd, 1.0 / (B * T))
    return loss, dev.to_host(grads)


def one_step(run, step: int) -> tuple[float, float]:
    """Forward, backward and the update on the batch in run.x, run.y; the loss (before the update) and the
    gradient norm. run.zero: the plain step, or llmz.zero's stage 0."""
    model, z = run.model, run.zero
    model.forward(z.param_store, run.x, run.y)                 # activations and per-position losses
    loss = model.mean_loss()
    model.backward(z.param_store, z, run.x, run.y, 1.0 / run.x.size)   # accumulates (+=) into z's gradients
    return loss, z.update(step)                # norm, clip, AdamW; zero the gradients


def lesson(a, ranks) -> int:
    ck = common.Checks(ranks, 5)
    # ---- 1. the layers as kernels, against their NumPy references -----------------------------------------
    # The kernels run on the GPU where there is one, else in the simulator (every CUDA thread a Python
    # thread: slow, so there the model is one block of 8 channels on 4 tokens); --kernels picks the set.
    kernel_kind = resolve("gpu" if a.kind != "sim" and gpu_available() else "sim")    # before numba loads
    if kernel_kind == "gpu":
        config, B, T = preset(a.model, vocab_size=256, max_seq_len=a.seq_len), a.batch_size, a.seq_len
    else:
        config, B, T = GPT2Config(max_seq_len=4, vocab_size=32, padded_vocab_size=32, num_layers=1,
                                  num_heads=2, channels=8), 1, 4
    layout = Layout(config, 1)
    rng = np.random.default_rng(0)
    params = init_parameters(layout, seed=0)
    x, y = rng.integers(0, config.vocab_size, (2, B, T))
    # fp32 throughout: the fast set's cuBLAS products without TF32 (llmz.train's GPU default, TF32 tensor cores,
    # rounds products to 10-bit mantissas: ~1e-3, see BENCHMARKS.md)
    kernels = Device(kernel_kind, np.float32, ranks.local_rank, kernel_set=a.kernels, tf32=False)
    common.say(ranks, f"{kernels.kernel_set} kernels ({kernel_kind}, float32, matmul {kernels.matmul}, attention "
               f"{kernels.attention}) against the NumPy reference (cpu, float64): "
               f"L={config.num_layers} C={config.channels} V={config.vocab_size} B={B} T={T}")
    loss_k, grads_k = forward_backward(kernels, config, params.astype(np.float32), x, y)
    loss_r, grads_r = forward_backward(Device("cpu", np.float64), config, params, x, y)
    rel = abs(loss_k - loss_r) / abs(loss_r)
    ck.check(rel <= LOSS_TOL, f"loss of the kernels {loss_k:.7f} = reference's {loss_r:.7f} "
             f"(relative difference {rel:.1e}, expected <= {LOSS_TOL:.0e})")
    # every tensor of every bucket: ||kernel - reference|| / ||reference||
    errors = {}
    for bucket, gk, gr in zip(layout.buckets, layout.views(grads_k), layout.views(grads_r)):
        for name in gr:
            errors[f"{bucket.name}.{name}"] = float(np.linalg.norm(gk[name] - gr[name]) / np.linalg.norm(gr[name]))
    worst = max(errors, key=errors.get)
    ck.check(max(errors.values()) <= GRAD_TOL, f"all {len(errors)} gradient tensors of the kernels = reference's: "
             f"worst relative error {errors[worst]:.1e} ({worst}), expected <= {GRAD_TOL:.0e}")

    # ---- 2. one training step, repeated on one batch ------------------------------------------------------
    # llmz.trainer.Trainer holds the pieces (device, data, model, AdamW); the step is the plain one
    # (llmz/plain/step.py), and beside it, on the same batch, llmz.zero's stage 0 on a world of one rank
    run = common.make_run(a, common.one_rank(ranks), stage=0, plain=a.plain, comm="auto")
    prod = common.make_run(a, common.one_rank(ranks), stage=0, comm="auto")
    dev, B, T = run.dev, a.batch_size, a.seq_len
    x, y = run.train_loader.next_batch()                 # one batch, kept: its loss must fall
    for r in (run, prod):
        dev.copy_from_host(r.x, x)
        dev.copy_from_host(r.y, y)
    c = run.model.config
    common.say(ranks, f"training on {run.dev.kind} ({a.precision}): L={c.num_layers} C={c.channels} "
               f"V={c.vocab_size} B={B} T={T}, {run.layout.num_parameters:,} parameters, one batch {a.steps} times")
    losses = []
    for step in range(a.steps):
        loss, norm = one_step(run, step)
        one_step(prod, step)
        losses.append(loss)
        if common.shown(a, step):
            common.say(ranks, f"step {step}: loss {losses[-1]:.4f} | grad norm {norm:.3f}")
    ck.check(losses[-1] < losses[0], f"loss on one batch falls over {a.steps} steps: {losses[0]:.4f} -> "
             f"{losses[-1]:.4f} (expected: lower at the end)")

    # ---- 3. what one device holds ---------------------------------------------------------------------------
    m, psi, b = run.memory["measured"], run.layout.num_parameters, dev.dtype.itemsize
    want = {"parameters": b * psi, "gradients": b * psi, "optimizer_state": 2 * b * psi}
    ck.check(all(m[k] == v for k, v in want.items()),
             f"parameters {fmt_bytes(m['parameters'])} + gradients {fmt_bytes(m['gradients'])} + optimizer state "
             f"{fmt_bytes(m['optimizer_state'])} = {b}Ψ + {b}Ψ + {2 * b}Ψ with Ψ = {psi:,} (expected exactly; "
             f"in fp32: 4Ψ + 4Ψ + 8Ψ)")
    common.check_same_as_production(ck, a, ranks, run, prod, "stage 0 on one rank")
    return ck.exit_code()


if __name__ == "__main__":
    sys.exit(common.main(lesson, __doc__, steps=10, sim_steps=3, builds_on=None,
                         uses=("--kernels", "--attention", "--model", "--print-every")))
