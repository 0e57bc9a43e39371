"""CUDA graphs (llmz.graph) at ZeRO stage 2: the captured micro-step, replayed, leaves exactly the gradient shard
the eager micro-step leaves (ZeRO-2's graphed step once hung: llmz/graph.py says why). GPU only: cpu and
the simulator have no graphs (Graphs runs fn()
eagerly there, which the last test checks)."""
import os

import numpy as np
import pytest


def stage2_run(tmp_path, device: str, precision: str, comm: str = "auto", stage: int = 2):
    from llmz.data import write_tokens
    from llmz.run.launch import init_ranks
    from llmz.train import parse_args
    from llmz.trainer import Trainer
    path = os.path.join(tmp_path, "tokens.bin")
    write_tokens(path, np.random.default_rng(1).integers(0, 256, 50_000, dtype=np.int64))
    model, B, T = ("d2", 4, 64) if device == "gpu" else ("tiny", 2, 8)
    args, kind = parse_args(["--device", device, "--model", model, "-b", str(B), "-t", str(T),
                             "--zero-stage", str(stage), "--precision", precision, "--comm", comm, "--grad-accum", "2",
                             "--train-data", path, "--val-data", "", "--steps", "2", "--quiet"])
    run = Trainer(args, kind, init_ranks())
    run.next_batch(run.train_loader, backward=True)
    return run


def accumulated_shard(run, micros: list[int], graphed: bool) -> np.ndarray:
    """The gradient shard after the micro-steps numbered `micros` (bf16: their rounding draws) on the same batch,
    from the same random shard (random, so that bf16 sums are not exact: from zero, the same gradient added
    twice is exactly doubled and no draw would show); each micro-step through run.graphs (graphed) or called
    directly (eager)."""
    z = run.zero
    shard = z.grad_store.grad_shard
    start = np.random.default_rng(7).normal(0, 1e-3, shard.size)
    if shard.dtype == np.uint16:
        from llmz.bf16 import f32_to_bf16
        start = f32_to_bf16(start.astype(np.float32))
    run.dev.copy_from_host(shard, start.astype(shard.dtype))
    for micro in micros:
        z.set_micro_step(micro)
        if graphed:
            run.graphs.run("micro_step", run.micro_step)
        else:
            run.micro_step()
    return run.dev.to_host(shard).copy()


@pytest.mark.gpu
@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_stage2_micro_step_replayed_twice_gives_the_eager_gradient_shard_bit_for_bit(tmp_path, precision, stage):
    """Stage 3 too: its micro-step is stage 2's plus every block's parameters gathered twice."""
    run = stage2_run(tmp_path, "gpu", precision, stage=stage)
    assert run.graphs.enabled
    eager = accumulated_shard(run, [5, 6], graphed=False)
    first = accumulated_shard(run, [5, 6], graphed=True)      # graphs.run: eager, then captured and replayed
    second = accumulated_shard(run, [5, 6], graphed=True)     # replayed twice
    assert run.graphs.graphs.get("micro_step") is not None
    assert np.any(eager != accumulated_shard(run, [], graphed=False))      # the micro-steps added something
    assert np.array_equal(first, eager) and np.array_equal(second, eager), \
        f"{np.sum(first != eager)} and {np.sum(second != eager)} of {eager.size} shard values differ"
    if precision == "bf16":
        # the replay reads the micro-step number from the device: the accumulations (shard + slot, not exact
        # in bf16) round with other words at other micro-steps
        other = accumulated_shard(run, [8, 9], graphed=True)
        assert np.sum(other != eager) > eager.size // 100, f"{np.sum(other != eager)} of {eager.size} differ"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_graphs_run_eagerly_off_the_gpu(tmp_path, precision):
    """Off the GPU Graphs only calls fn(): the same shard every call, and no graph is kept."""
    run = stage2_run(tmp_path, "cpu", precision)
    assert not run.graphs.enabled
    a = accumulated_shard(run, [0, 1], graphed=True)
    b = accumulated_shard(run, [0, 1], graphed=False)
    assert np.any(a != accumulated_shard(run, [], graphed=False)) and np.array_equal(a, b)
    assert run.graphs.graphs == {}
