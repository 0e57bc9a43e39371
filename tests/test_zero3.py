"""ZeRO stage 3 (llmz.zero.params.GatheredParameters): on N ranks against one process with the union batch and
against stage 2 bit for bit (cpu, float64 and bf16, under mpiexec); its memory report against the formula; the
all-gathers it runs, their order and bytes; the prefetch seen in its timeline; the parameter store the model
asks."""
import json
import subprocess
import sys

import numpy as np
import pytest
from test_zero import FLAGS, STEPS, B, load, ranks, single

from mpirun import REPO, run_mpi

K = 2                                   # micro-steps: every micro-step gathers and reduce-scatters again
L = 2                                   # tiny: 2 blocks


# ---- N ranks under mpiexec (cpu, float64) ------------------------------------------------------------------
@pytest.mark.mpi
@pytest.mark.parametrize("N", [2, 4])
def test_stage3_matches_single_process_with_union_batch_over_5_steps(tmp_path_factory, N):
    (ref,), (ref_params,) = single(tmp_path_factory, N * B, K)
    results, params = ranks(tmp_path_factory, N, 3, K)
    # float64 throughout: the only differences are the order of additions (1e-16 each), well under 1e-10
    losses = np.array(results[0]["losses"])
    np.testing.assert_allclose(losses, ref["losses"], rtol=1e-10)
    np.testing.assert_allclose(results[0]["grad_norms"], ref["grad_norms"], rtol=1e-10)
    assert max(ref["grad_norms"]) > 1.0                     # clipping (--grad-clip 1) was in play
    rel = np.linalg.norm(params[0] - ref_params) / np.linalg.norm(ref_params)
    assert rel < 1e-10, rel
    # every rank gathers bit-identical full parameters from the N shards
    for p in params[1:]:
        assert np.array_equal(p, params[0])
    assert losses[-1] < losses[0]


@pytest.mark.mpi
def test_stage3_is_stage2_bit_for_bit(tmp_path_factory):
    """Stage 3 computes with exactly the bits stage 2 holds whole: the same losses, norms and parameters."""
    r2, p2 = ranks(tmp_path_factory, 2, 2, K)
    r3, p3 = ranks(tmp_path_factory, 2, 3, K)
    assert r3[0]["losses"] == r2[0]["losses"] and r3[0]["grad_norms"] == r2[0]["grad_norms"]
    assert all(np.array_equal(a, b) for a, b in zip(p3, p2))


@pytest.mark.mpi
@pytest.mark.parametrize("N", [2, 4])
def test_stage3_memory_report_follows_the_formula(tmp_path_factory, N):
    (res, *_), _ = ranks(tmp_path_factory, N, 3, K)
    pred, meas = res["memory"]["predicted"], res["memory"]["measured"]
    from llmz.config import preset
    from llmz.layout import Layout
    lay = Layout(preset("tiny", vocab_size=256), N)
    # predicted with the real Ψ/N, allocated with buckets padded to multiples of N: at most N-1 a bucket
    pad = 8 * len(lay.buckets)
    for k in pred:
        assert 0 <= meas[k] - pred[k] <= 3 * pad, (k, pred[k], meas[k])
    # allocated, exactly: my slice of every bucket + two block slots + embeddings + lnf, for the parameters
    # and (as at stage 2) for the gradients; m and v of my slice
    slot = max(b.padded_size for b in lay.buckets[1:-1])
    sharded = 8 * (lay.shard_total + 2 * slot + lay.embeddings.padded_size + lay.lnf.padded_size)
    assert meas["parameters"] == meas["gradients"] == sharded
    assert meas["optimizer_state"] == 2 * 8 * lay.shard_total


@pytest.mark.mpi
@pytest.mark.parametrize("N", [2, 4])
def test_stage3_all_gathers_and_bytes_per_step(tmp_path_factory, N):
    (res, *_), _ = ranks(tmp_path_factory, N, 3, K)
    from llmz.config import preset
    from llmz.layout import Layout
    lay = Layout(preset("tiny", vocab_size=256), N)
    blocks, ends = lay.buckets[1:-1], (lay.embeddings, lay.lnf)
    # per step: every block twice per micro-step, the embeddings and lnf once; then train_worker's final
    # host_params gathers every block once more (the two ends are already whole)
    calls = res["comm_calls"]
    assert calls["all_gather"] == STEPS * (2 * K * L + 2) + L
    assert calls["reduce_scatter"] == STEPS * K * (L + 2)
    assert res["reduce_scatters_in_backward"] == [K * (L + 2)] * STEPS

    def ring(nbytes, rounds=1):
        return rounds * (N - 1) * nbytes // N
    per_step = (sum(ring(8 * b.padded_size) for b in blocks) * 2 * K + sum(ring(8 * b.padded_size) for b in ends)
                + sum(ring(8 * b.padded_size) for b in lay.buckets) * K
                + ring(8, 2) * 2)                    # the gradient norm's and the loss's all-reduce
    assert res["comm_bytes"] == STEPS * per_step + sum(ring(8 * b.padded_size) for b in blocks)


@pytest.mark.mpi
def test_bf16_stage3_is_stage2_bit_for_bit(tmp_path):
    """bf16 (cpu references on uint16 bits, fp32 master, stochastic rounding): the same draws, the same bits."""
    out = {}
    for stage in (2, 3):
        d = tmp_path / f"s{stage}"
        p = run_mpi(2, ["tests/train_worker.py", str(d), *FLAGS, "-b", str(B), "--grad-accum", str(K),
                        "--precision", "bf16", "--zero-stage", str(stage)], timeout=300)
        assert p.returncode == 0, p.stdout + p.stderr
        out[stage] = load(d, 2)
    (r2, p2), (r3, p3) = out[2], out[3]
    assert r3[0]["losses"] == r2[0]["losses"] and r3[0]["grad_norms"] == r2[0]["grad_norms"]
    assert all(np.array_equal(a, b) for a, b in zip(p3, p2))
    # (2Ψ + 2Ψ + 12Ψ)/N + slots and ends: bf16 parameters and gradients, the fp32 master, m and v of my slice
    from llmz.config import preset
    from llmz.layout import Layout
    lay = Layout(preset("tiny", vocab_size=256), 2)
    slot = max(b.padded_size for b in lay.buckets[1:-1])
    meas = r3[0]["memory"]["measured"]
    assert meas["parameters"] == meas["gradients"] == 2 * (lay.shard_total + 2 * slot + lay.embeddings.padded_size
                                                          + lay.lnf.padded_size)
    assert meas["optimizer_state"] == 12 * lay.shard_total


# ---- one rank, in this process -----------------------------------------------------------------------------
def make_run(stage: int, *extra: str, precision: str = "fp64"):
    from llmz.run.launch import RankInfo
    from llmz.train import parse_args
    from llmz.trainer import Trainer
    args, kind = parse_args(["--device", "cpu", "--precision", precision, "--model", "tiny", "-b", "2", "-t", "8",
                             "--steps", "3", "--lr", "1e-2", "--warmup-steps", "1", "--weight-decay", "0.1",
                             "--grad-clip", "1.0", "--zero-stage", str(stage), "--grad-accum", str(K),
                             "--val-data", "", "--quiet", *extra], kind="cpu")
    return Trainer(args, kind, RankInfo(0, 1, 0, 1, "here"))


@pytest.mark.parametrize("precision", ["fp64", "bf16"])
def test_one_rank_stage3_equals_stage2_bit_for_bit(precision):
    runs = [make_run(s, precision=precision) for s in (2, 3)]
    losses = [[r.step(s)["loss"] for s in range(3)] for r in runs]
    assert losses[0] == losses[1]
    assert np.array_equal(runs[0].host_params(), runs[1].host_params())
    assert not hasattr(runs[1].zero.param_store, "params")     # no full parameter buffer at stage 3


def test_the_model_asks_for_each_block_just_in_time_and_stage3_gathers_in_that_order():
    run = make_run(3)
    z = run.zero
    store = z.param_store                               # the parameter store: what the model's p.bucket(b) asks
    asked = []
    real = store.bucket

    def spy(b):
        asked.append(b)
        return real(b)
    store.bucket = spy
    # a forward-only pass (validation, sampling): every block once, in order, the next one gathered ahead
    run.next_batch(run.train_loader)
    z.all_gathers.clear()
    run.model.forward(z.param_store, run.x, run.y)
    assert asked == [0, 1, 2, 3]
    assert z.all_gathers == ["block0", "block1"] and store.prefetched is None
    # a training micro-step: forward, then backward from block L-1 down, each block gathered again
    asked.clear()
    z.all_gathers.clear()
    run.micro_step()
    assert asked == [0, 1, 2, 3] + [0, 3, 2, 1]
    assert z.all_gathers == ["block0", "block1", "block1", "block0"] and not store.in_backward


def test_stage3_parameter_path_makes_no_event_and_allocates_nothing_after_start_up(monkeypatch):
    """What a captured CUDA graph needs from stage 3's own part (the gathers: forward, and the embeddings' and
    lnf's after AdamW): the events it records and waits on were made once, no buffer is allocated."""
    run = make_run(3)
    run.step(0)
    made = []
    real = run.dev.event
    monkeypatch.setattr(run.dev, "event", lambda *a, **k: made.append(1) or real(*a, **k))
    before = dict(run.zero.allocated)
    run.model.forward(run.zero.param_store, run.x, run.y)
    run.zero.gather_parameters()
    assert made == [] and run.zero.allocated == before


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_each_stage_keeps_the_buffers_its_row_of_the_table_names(stage):
    """The ZeRO paper's rows on 2 ranks (rank 1, built here: nothing is sent): what each rank keeps whole (Ψ
    values) and what only as its slice of every bucket (Ψ/N)."""
    from llmz.comm import Communicator
    from llmz.config import preset
    from llmz.device import Device
    from llmz.layout import Layout, init_parameters
    from llmz.optim import AdamW
    from llmz.run.launch import RankInfo
    from llmz.zero import make_stage
    lay = Layout(preset("tiny", vocab_size=256), 2)
    start = init_parameters(lay, 0)
    z = make_stage(stage, lay, Device("cpu", np.float64), Communicator(RankInfo(1, 2, 1, 2, "here")), AdamW(), start)
    whole, mine = lay.total, lay.shard_total
    kept = {name: a.size for part in (z.param_store, z.grad_store, z.optimizer)
            for name, a in part.buffers().items() if name != "master"}
    params = {"params": whole} if stage < 3 else {"param_shard": mine}
    grads = {"grads": whole} if stage < 2 else {"grad_shard": mine}
    assert kept == {**params, **grads, "m": whole if stage == 0 else mine, "v": whole if stage == 0 else mine}
    assert z.optimizer.master is None                   # fp64: no master copy
    # the parameters start as the host's: all of them, or my slice of every bucket
    if stage < 3:
        assert np.array_equal(z.param_store.params, start)
    else:
        assert np.array_equal(z.param_store.param_shard,
                              np.concatenate([start[b.offset + b.shard_size:b.offset + b.padded_size]
                                              for b in lay.buckets]))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("overlap", [True, False])
def test_captured_regions_wait_only_on_events_recorded_inside_them_and_end_joined(monkeypatch, stage, overlap):
    """What a CUDA graph capture of the micro-step and of the update needs from the stream order (llmz/graph.py),
    checked on cpu by logging every event record and wait and every collective in program order. The capture
    starts on the compute stream; the comm stream joins it only by waiting on an event recorded in the capture
    (the fork). So: (1) every wait is on an event recorded earlier in the same region, by a stream already in
    the capture (else CUDA refuses it: work outside the capture); (2) every collective runs on a stream in the
    capture; (3) after the comm stream's last collective the compute stream waits on an event recorded on the
    comm stream (the join: a capture must end joined); (4) no event is made and nothing is allocated."""
    from llmz.device import Device
    log = []

    class LoggedEvent:
        def record(self, stream):
            log.append(("record", self, stream.name))

        def wait(self, stream):
            log.append(("wait", self, stream.name))

    made = []
    monkeypatch.setattr(Device, "event", lambda self, timing=False: made.append(1) or LoggedEvent())
    run = make_run(stage, *([] if overlap else ["--no-overlap"]))

    def logged(name, real):
        def collective(*args, **kw):
            log.append(("collective", name, "comm"))
            return real(*args, **kw)
        return collective
    for name in ("all_reduce", "reduce_scatter", "all_gather", "start_reduce_scatter", "start_all_gather"):
        monkeypatch.setattr(run.comm, name, logged(name, getattr(run.comm, name)))
    run.next_batch(run.train_loader, backward=True)
    run.zero.set_scalars(0)                             # outside the captured update, as in llmz.train
    made.clear()
    before = dict(run.zero.allocated)
    for region, fn in (("micro-step", run.micro_step), ("micro-step", run.micro_step), ("update", run.zero.optimize)):
        start = len(log)
        fn()
        ops = log[start:]
        captured, joined, collectives = set(), {"compute"}, []
        for i, (op, x, s) in enumerate(ops):
            if op == "record" and s in joined:
                captured.add(id(x))
            elif op == "wait":
                assert id(x) in captured, f"{region}: the {s} stream waits on an event recorded outside the capture"
                joined.add(s)
            elif op == "collective":
                assert s in joined, f"{region}: {x} on the {s} stream before that stream joined the capture"
                collectives.append(i)
        # stages 0, 1 send nothing during backward; every stage sends in the update
        assert bool(collectives) == (stage >= 2 or region == "update")
        if collectives:
            assert any(op == "record" and s == "comm" and ("wait", x, "compute") in ops[i + 1:]
                       for i, (op, x, s) in enumerate(ops) if i > collectives[-1]), \
                f"{region}: the comm stream is not joined back"
    assert made == [] and run.zero.allocated == before


@pytest.mark.parametrize("overlap", [True, False])
def test_timeline_shows_every_block_gather_but_the_first_issued_ahead(tmp_path, overlap):
    from llmz.trace import gathers_ahead
    run = make_run(3, *([] if overlap else ["--no-overlap"]), "--trace", str(tmp_path / "t.json"))
    run.step(0)
    run.tracer.start()
    run.step(1)
    events = run.tracer.stop(str(tmp_path / "t.json"))["traceEvents"]
    ahead, total = gathers_ahead(events)
    assert total == K * 2 * L
    # prefetching: all but each micro-step's forward block 0; --no-overlap: none (each gathered when asked)
    assert ahead == (K * (2 * L - 1) if overlap else 0)
    assert (tmp_path / "t.png").stat().st_size > 10_000
    names = [e["name"] for e in events if e["tid"] == "comm"]
    assert names.count("all-gather embeddings") == names.count("all-gather lnf") == 1


def test_all_gather_from_a_slice_kept_elsewhere(rng):
    from llmz.comm import Communicator, LocalCommunicator
    from llmz.device import Device
    from llmz.run.launch import RankInfo
    x = rng.standard_normal(6)
    one = LocalCommunicator(RankInfo(0, 1, 0, 1, "here"), Device("cpu", np.float64))
    buf = np.full(6, np.nan)
    one.all_gather(buf, src=x)
    assert np.array_equal(buf, x) and one.calls["all_gather"] == 1 and one.bytes_sent == 0
    four = Communicator(RankInfo(2, 4, 2, 4, "here"))        # accounting only: my slice lands in its place
    buf = np.zeros(8)
    four.all_gather(buf, src=x[:2])
    assert np.array_equal(buf[4:6], x[:2]) and four.bytes_sent == 3 * 64 // 4
    with pytest.raises(ValueError, match="from a slice of 3"):
        four.all_gather(buf, src=x[:3])


def test_train_runs_stage_3_with_its_memory_report_samples_and_checkpoints(tmp_path):
    p = subprocess.run([sys.executable, "-m", "llmz.train", "--device", "cpu", "--precision", "fp64", "--model",
                        "tiny", "-b", "2", "-t", "8", "--steps", "2", "--zero-stage", "3", "--val-batches", "1",
                        "--sample-tokens", "4", "--checkpoint-dir", str(tmp_path / "ck"), "--log",
                        str(tmp_path / "log.jsonl"), "--quiet"], cwd=REPO, capture_output=True, text=True,
                       check=False, timeout=300)
    assert p.returncode == 0, p.stderr
    start = json.loads((tmp_path / "log.jsonl").read_text().splitlines()[0])
    assert start["memory"]["stage"] == 3 and start["memory"]["predicted"] == start["memory"]["measured"]
    from llmz.run.state import load_checkpoint
    assert load_checkpoint(str(tmp_path / "ck" / "step_000002")).meta["zero_stage"] == 3


def test_bf16_stage3_resume_repeats_the_straight_run_bit_for_bit(tmp_path):
    """The bf16 parameters are rebuilt from the saved fp32 master with the rounding draws of the saved step, then
    sharded: a resumed stage-3 run repeats the straight one bit for bit."""
    from llmz.run.launch import RankInfo
    from llmz.run.loop import train
    from llmz.train import parse_args

    def run(name, *extra):
        args, kind = parse_args(["--device", "cpu", "--precision", "bf16", "--model", "tiny", "-b", "2", "-t", "8",
                                 "--steps", "4", "--grad-accum", str(K), "--zero-stage", "3", "--val-data", "",
                                 "--quiet", "--log", str(tmp_path / f"{name}.jsonl"), *extra], kind="cpu")
        train(args, kind, RankInfo(0, 1, 0, 1, "here"))
        return {r["step"]: (r["loss"], r["grad_norm"]) for r in map(json.loads, (tmp_path / f"{name}.jsonl")
                .read_text().splitlines()) if "loss" in r}
    a = run("a", "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "2")
    b = run("b", "--resume", str(tmp_path / "ck" / "step_000002"))
    assert sorted(b) == [2, 3] and all(a[s] == b[s] for s in b) and a[3] != a[2]


# ---- GPU (skipped without one): one rank, local and NCCL -----------------------------------------------------
def gpu_worker(out, stage: int, precision: str, comm: str):
    args = ["tests/train_worker.py", str(out), "--device", "gpu", "--precision", precision, "--model", "d2",
            "--vocab-size", "50257", "-b", "4", "-t", "256", "--steps", "6", "--grad-accum", "2", "--lr", "1e-3",
            "--warmup-steps", "2", "--grad-clip", "1.0", "--zero-stage", str(stage), "--comm", comm,
            "--no-cuda-graph"]
    p = run_mpi(1, args, timeout=600) if comm == "nccl" else subprocess.run(
        [sys.executable, *args], cwd=REPO, capture_output=True, text=True, check=False, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    return load(out, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("comm", ["auto", "nccl"])
def test_gpu_stage3_equals_stage2(tmp_path, precision, comm):
    (r2,), (p2,) = gpu_worker(tmp_path / "s2", 2, precision, comm)
    (r3,), (p3,) = gpu_worker(tmp_path / "s3", 3, precision, comm)
    print(f"{comm} {precision}: stage 2 losses {r2['losses']}, stage 3 {r3['losses']}")
    # the same kernels on the same bits (gathered instead of kept): equal, up to kernels whose order of
    # floating-point additions is not fixed on the GPU (none expected: then the bits are equal too)
    np.testing.assert_allclose(r3["losses"], r2["losses"], rtol=1e-6)
    assert np.linalg.norm(p3 - p2) / np.linalg.norm(p2) < 1e-5
    # one rank: the slice is everything, so stage 3 holds the parameters as stage 2 holds its gradients (the
    # whole buffer + two block slots + the ends), more than stage 2's parameters; what is allocated is that
    m3, m2 = r3["memory"], r2["memory"]
    assert m3["predicted"]["parameters"] == m3["predicted"]["gradients"] == m2["predicted"]["gradients"]
    assert m3["predicted"]["parameters"] > m2["predicted"]["parameters"]
    from llmz.config import preset
    from llmz.layout import Layout
    lay = Layout(preset("d2", vocab_size=50257, max_seq_len=1024), 1)
    slot = max(bk.padded_size for bk in lay.buckets[1:-1])
    b = 2 if precision == "bf16" else 4
    assert m3["measured"]["parameters"] == b * (lay.shard_total + 2 * slot + lay.embeddings.padded_size
                                                + lay.lnf.padded_size)
    assert r3["comm_calls"]["all_gather"] == 6 * (2 * 2 * 2 + 2) + 2
