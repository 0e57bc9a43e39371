"""--recompute (llm.c's -r): GELU (1) and the layernorms too (2) computed again in backward instead of kept per
layer. The same kernel on the same inputs, so every number is the same bit for bit as keeping them: the model's
loss and gradients in each op set and precision, a training run's losses and parameters at ZeRO stages 0 and
2 with K=2; and the activations shrink by exactly the buffers no longer kept, as llmz.memory predicts."""
import numpy as np
import pytest

from helpers import bits
from llmz.config import preset
from llmz.device import Device
from llmz.layout import Layout, init_parameters
from llmz.memory import activation_elements, predicted
from llmz.model import GPT2, Activations, FullGrads, FullParams

TINY = preset("tiny", vocab_size=50, max_seq_len=8)


def step_bits(dev, recompute: int, flat, x, y):
    """Forward and backward once at `recompute`: (losses, logits, gradients) as stored bits. Between forward
    and backward the shared buffer is poisoned with NaN: a value backward read without recomputing it would
    show."""
    B, T = x.shape
    layout = Layout(TINY, 1)
    model = GPT2(TINY, dev, B, T, recompute=recompute)
    params, grads = dev.asarray(flat), dev.zeros(layout.total)
    pv = FullParams(layout, params)
    xd, yd = dev.asarray(x, np.int32), dev.asarray(y, np.int32)
    model.forward(pv, xd)
    logits = dev.to_host(model.acts.logits).copy()
    if recompute:
        dev.ops.fill(dev, model.acts.recomputed, np.nan)
    model.backward(pv, FullGrads(layout, grads), xd, yd, 1.0 / (B * T))
    return [bits(dev.to_host(a)) for a in (model.acts.losses, logits, grads)]


def perturbed_parameters(layout, dev, rng):
    """Initial parameters plus noise (biases and layernorms too: no gradient trivially zero), stored as dev's."""
    flat = init_parameters(layout, seed=int(rng.integers(1 << 30)))
    flat += rng.normal(0, 0.1, flat.shape)
    layout.views(flat)[0]["wte"][TINY.vocab_size:] = 0
    if dev.precision.name == "bf16":
        from llmz.bf16 import f32_to_bf16
        return f32_to_bf16(flat.astype(np.float32))
    return flat.astype(dev.dtype)


@pytest.mark.parametrize("kind, precision, kernels, attention", [
    ("cpu", "fp32", "auto", "direct"), ("cpu", "fp64", "auto", "flash"), ("cpu", "bf16", "auto", "direct"),
    ("sim", "fp32", "teaching", "direct"), ("sim", "fp32", "fast", "direct"),
])
def test_recompute_gives_the_same_losses_and_gradients_bit_for_bit(rng, kind, precision, kernels, attention):
    from conftest import HAVE_GPU
    if kind == "sim" and HAVE_GPU:
        pytest.skip("the simulator runs where there is no GPU (here the kernels' tests run on the GPU)")
    dev = Device(kind, precision, kernel_set=kernels, attention=attention)
    flat = perturbed_parameters(Layout(TINY, 1), dev, rng)
    # the simulator runs every thread in Python: a smaller batch, and level 3 only (it recomputes every kernel)
    shape, levels = ((2, 8), (1, 2, 3)) if kind == "cpu" else ((1, 4), (3,))
    x, y = rng.integers(0, TINY.vocab_size, shape), rng.integers(0, TINY.vocab_size, shape)
    kept = step_bits(dev, 0, flat, x, y)
    assert np.any(kept[2] != 0)                     # the gradients are not trivially zero
    for recompute in levels:
        again = step_bits(dev, recompute, flat, x, y)
        for name, a, b in zip(("losses", "logits", "gradients"), kept, again):
            assert np.array_equal(a, b), f"recompute {recompute}: {name} differ in {np.sum(a != b)} places"


@pytest.mark.parametrize("flash", [False, True])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_recompute_allocates_what_the_formula_predicts_and_saves_exactly_the_buffers_not_kept(precision, flash):
    cfg, Bb, Tt = preset("d2", vocab_size=300), 2, 64
    dev = Device("cpu", precision, attention="flash" if flash else "direct")
    b = dev.precision.value_bytes
    layout = Layout(cfg, 1)
    allocated, formula = {}, {}
    for r in (0, 1, 2, 3):
        acts = Activations(cfg, dev, Bb, Tt, recompute=r)
        values, stats = activation_elements(cfg, Bb, Tt, flash, r)
        allocated[r] = acts.nbytes()
        formula[r] = predicted(layout, 0, Bb, Tt, b, flash, r)["activations"]
        assert allocated[r] == formula[r] == b * values + 4 * stats, r       # to the byte
        assert hasattr(acts, "fch_gelu") == (r < 1) and hasattr(acts, "ln1") == hasattr(acts, "ln2") == (r < 2)
    L, C, BT = cfg.num_layers, cfg.channels, Bb * Tt
    # 1: fch_gelu (L, B, T, 4C) becomes one (B, T, 4C); 2: ln1 and ln2 (L, B, T, C) go into that same buffer
    assert formula[0] - formula[1] == b * (L - 1) * BT * 4 * C
    assert formula[1] - formula[2] == b * 2 * L * BT * C
    # 3: att (L, B, NH, T, T) becomes one (B, NH, T, T); flash keeps none, so there 3 is 2
    NH = cfg.num_heads
    assert formula[2] - formula[3] == (0 if flash else b * (L - 1) * Bb * NH * Tt * Tt)
    # the other categories do not move
    others = [{k: v for k, v in predicted(layout, 2, Bb, Tt, b, flash, r).items() if k != "activations"}
              for r in (0, 1, 2, 3)]
    assert others[0] == others[1] == others[2] == others[3]


def trainer(kind: str, precision: str, stage: int, recompute: int, steps: int = 2):
    """A one-rank run of the tiny model (d2 at T=64 on a GPU, whose flash kernels need head size 64), K=2. (The
    simulator's share is the model test above: a training step there takes minutes, mostly the tiled products
    over the 256-token vocabulary.)"""
    from llmz.run.launch import RankInfo
    from llmz.train import parse_args
    from llmz.trainer import Trainer
    model, Bt, Tt = ("d2", "4", "64") if kind == "gpu" else ("tiny", "2", "8")
    args, kind = parse_args(["--device", kind, "--precision", precision, "--model", model, "-b", Bt, "-t", Tt,
                             "--steps", str(steps), "--lr", "1e-2", "--warmup-steps", "1", "--grad-clip", "1.0",
                             "--zero-stage", str(stage), "--grad-accum", "2", "--val-data", "", "--quiet",
                             "--recompute", str(recompute)], kind=kind)
    return Trainer(args, kind, RankInfo(0, 1, 0, 1, "here"))


def train_bits(kind: str, precision: str, stage: int, recompute: int, steps: int = 2):
    run = trainer(kind, precision, stage, recompute, steps)
    out = [run.step(s) for s in range(steps)]
    assert run.memory["predicted"] == run.memory["measured"] and run.memory["recompute"] == recompute
    return [(o["loss"], o["grad_norm"]) for o in out], bits(run.host_params()), run.memory


@pytest.mark.parametrize("precision", ["fp32", "fp64", "bf16"])
@pytest.mark.parametrize("stage", [0, 2])
def test_training_with_recompute_repeats_the_run_without_it_bit_for_bit(precision, stage):
    losses0, params0, mem0 = train_bits("cpu", precision, stage, 0)
    for r in (1, 2, 3):
        losses, params, mem = train_bits("cpu", precision, stage, r)
        assert losses == losses0 and np.array_equal(params, params0), f"recompute {r}"
        assert mem["predicted"]["activations"] < mem0["predicted"]["activations"]


def test_a_micro_step_with_recompute_allocates_nothing(monkeypatch):
    """What a captured CUDA graph needs (llmz.graph): after the first step, the recomputing micro-step makes no
    buffer (the shared one is made with the activations)."""
    run = trainer("cpu", "fp32", 2, 3)
    run.step(0)
    made = []
    for name in ("zeros", "empty", "full", "asarray"):
        real = getattr(run.dev, name)
        monkeypatch.setattr(run.dev, name, lambda *a, _real=real, **k: made.append(a) or _real(*a, **k))
    run.next_batch(run.train_loader, backward=True)
    made.clear()
    run.micro_step()
    assert made == []


def test_recompute_flag_outside_0_to_3_is_refused_in_one_line():
    from llmz.args import check_train_numbers
    from llmz.config import TrainConfig
    from llmz.errors import UsageError
    from llmz.train import parse_args
    with pytest.raises(UsageError, match="--recompute"):
        parse_args(["--device", "cpu", "--recompute", "4"], kind="cpu")
    with pytest.raises(UsageError, match="--recompute 4: must be 0, 1, 2 or 3"):
        check_train_numbers(TrainConfig(recompute=4).for_device("cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("precision, recompute", [("bf16", 1), ("bf16", 2), ("fp32", 3)])
def test_graphed_steps_with_recompute_repeat_recompute_0_bit_for_bit_on_the_gpu(precision, recompute):
    """The fast set on the GPU, replayed as CUDA graphs (bf16 with flash attention; fp32 with the gemm path,
    whose att level 3 recomputes): the same losses, norms and parameters."""
    want = train_bits("gpu", precision, 2, 0, steps=3)
    got = train_bits("gpu", precision, 2, recompute, steps=3)
    assert got[0] == want[0] and np.array_equal(got[1], want[1])
