"""bf16 training through llmz.trainer.Trainer on the CPU references (bf16 values as uint16 bit patterns,
computed in float32, fp32 master weights): the loss follows fp32's, ZeRO stages agree, the memory report matches the
2Ψ + 2Ψ + 12Ψ/N formula, and a resumed run repeats the straight one bit for bit."""
import json
import subprocess
import sys

import numpy as np
import pytest

from mpirun import REPO, run_mpi

B, T, STEPS = 4, 16, 30
FLAGS = ["--device", "cpu", "--model", "tiny", "-t", str(T), "--steps", str(STEPS), "--lr", "3e-3",
         "--warmup-steps", "5", "--weight-decay", "0.1", "--grad-clip", "1.0", "--seed", "7"]


def worker(out, *flags, world=1, timeout=300):
    args = ["tests/train_worker.py", str(out), *FLAGS, *map(str, flags)]
    p = run_mpi(world, args, timeout=timeout) if world > 1 else subprocess.run(
        [sys.executable, *args], cwd=REPO, capture_output=True, text=True, check=False, timeout=timeout)
    assert p.returncode == 0, p.stdout + p.stderr
    return [json.loads((out / f"result_rank{r}.json").read_text()) for r in range(world)], \
        [np.load(out / f"params_rank{r}.npy") for r in range(world)]


def test_bf16_loss_follows_fp32_within_a_few_percent_and_memory_matches_the_formula(tmp_path):
    (f32,), _ = worker(tmp_path / "fp32", "-b", B, "--precision", "fp32")
    (b16,), (p16,) = worker(tmp_path / "bf16", "-b", B, "--precision", "bf16")
    l32, l16 = np.array(f32["losses"]), np.array(b16["losses"])
    rel = np.abs(l16 - l32) / l32
    print(f"bf16 vs fp32 over {STEPS} steps: loss {l32[0]:.4f} -> {l32[-1]:.4f} (fp32), {l16[-1]:.4f} (bf16); "
          f"worst relative difference {rel.max():.2e}")
    assert l16[-1] < 0.85 * l16[0]                   # it trains (fp32: 5.53 -> 4.50)
    assert rel.max() < 0.03                          # tiny model, 30 steps: bf16 rounding moves it ~1%
    # every parameter is a bf16 value (widened for the host): the low 16 bits of its float32 are zero
    assert not np.any(p16.astype(np.float32).view(np.uint32) & 0xFFFF)
    mem = b16["memory"]
    psi = mem["predicted"]["parameters"] // 2
    assert mem["predicted"] == mem["measured"], mem
    assert mem["predicted"]["optimizer_state"] == 12 * psi and mem["predicted"]["gradients"] == 2 * psi


@pytest.mark.mpi
def test_bf16_stages_0_1_2_agree_within_bf16_tolerance(tmp_path):
    (r0, _), (p0, _) = worker(tmp_path / "s0", "-b", B // 2, "--precision", "bf16", "--zero-stage", 0, world=2)
    (r1, _), (p1, _) = worker(tmp_path / "s1", "-b", B // 2, "--precision", "bf16", "--zero-stage", 1, world=2)
    (r2, _), _ = worker(tmp_path / "s2", "-b", B // 2, "--precision", "bf16", "--zero-stage", 2, world=2)
    # stages 0 and 1 reduce the same bf16 gradients (summed in fp32, rounded once) and update the same fp32
    # master with the same rounding draws; only the gradient norm is summed in another order (float64), so the
    # clip factor, and through it a rare master bit, can differ
    rel01 = np.abs(np.array(r1["losses"]) - r0["losses"]) / np.array(r0["losses"])
    print(f"bf16 stage 1 vs stage 0: worst relative loss difference {rel01.max():.2e}, parameters "
          f"{np.count_nonzero(p0 != p1)} of {p0.size} differ")
    assert rel01.max() < 1e-3
    # stage 2 reduces every micro-step and adds into its shard with stochastic rounding: a few bf16 steps
    rel = np.abs(np.array(r2["losses"]) - r0["losses"]) / np.array(r0["losses"])
    print(f"bf16 stage 2 vs stage 0: worst relative loss difference {rel.max():.2e}")
    assert rel.max() < 0.03


def test_bf16_resume_repeats_the_straight_run_bit_for_bit(tmp_path):
    ck = tmp_path / "ck"
    straight = subprocess.run([sys.executable, "-m", "llmz.train", *FLAGS, "-b", str(B), "--precision", "bf16",
                               "--val-every", "0", "--val-data", "", "--sample-tokens", "0",
                               "--checkpoint-dir", str(ck), "--checkpoint-every", "10",
                               "--log", str(tmp_path / "straight.jsonl")], cwd=REPO, capture_output=True, text=True,
                              check=False, timeout=300)
    assert straight.returncode == 0, straight.stderr
    resumed = subprocess.run([sys.executable, "-m", "llmz.train", *FLAGS, "-b", str(B), "--precision", "bf16",
                              "--val-every", "0", "--val-data", "", "--sample-tokens", "0",
                              "--resume", str(ck / "step_000010"), "--log", str(tmp_path / "resumed.jsonl")], cwd=REPO,
                             capture_output=True, text=True, check=False, timeout=300)
    assert resumed.returncode == 0, resumed.stderr

    def losses(p):
        return {r["step"]: (r["loss"], r["grad_norm"]) for r in map(json.loads, p.read_text().splitlines())
                if "loss" in r}
    a, b = losses(tmp_path / "straight.jsonl"), losses(tmp_path / "resumed.jsonl")
    assert set(b) == set(range(10, STEPS)) and all(a[s] == b[s] for s in b)
