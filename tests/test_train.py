"""python -m llmz.train end to end on cpu: gradient accumulation equals a bigger batch, a tiny model overfits
one batch, the files it writes load back, and every bad input is one line and a non-zero exit."""
import json
import re
import subprocess
import sys

import numpy as np
import pytest

from llmz.data import write_tokens
from mpirun import REPO

TINY = ["--device", "cpu", "--model", "tiny", "--val-every", "0", "--sample-tokens", "8", "--quiet"]


def train(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "llmz.train", *TINY, *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, check=False, timeout=timeout)


def worker(out, *args):
    p = subprocess.run([sys.executable, "tests/train_worker.py", str(out), *TINY, *map(str, args)], cwd=REPO,
                       capture_output=True, text=True, check=False, timeout=300)
    assert p.returncode == 0, p.stderr
    return json.loads((out / "result_rank0.json").read_text()), np.load(out / "params_rank0.npy")


def test_grad_accum_2_equals_one_batch_of_twice_the_size(tmp_path):
    common = ["--precision", "fp64", "-t", "8", "--steps", "5", "--lr", "1e-2", "--warmup-steps", "0"]
    r2, p2 = worker(tmp_path / "k2", *common, "-b", "2", "--grad-accum", "2")
    r1, p1 = worker(tmp_path / "k1", *common, "-b", "4", "--grad-accum", "1")
    # the same tokens in the same order: equal up to the order of float64 additions
    np.testing.assert_allclose(r2["losses"], r1["losses"], rtol=1e-12)
    assert np.linalg.norm(p2 - p1) / np.linalg.norm(p1) < 1e-12
    assert r2["losses"][-1] < r2["losses"][0]


def test_tiny_model_overfits_one_batch(tmp_path):
    B, T = 2, 16
    rng = np.random.default_rng(0)
    data = tmp_path / "one_batch.bin"
    write_tokens(str(data), rng.integers(0, 256, B * T + 1))       # exactly one batch: repeated every step
    p = train("--train-data", data, "--val-data", data, "-b", B, "-t", T, "--steps", 150, "--lr", "1e-2",
              "--warmup-steps", "5", "--lr-schedule", "constant", "--log", tmp_path / "log.jsonl")
    assert p.returncode == 0, p.stderr
    steps = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    losses = [s["loss"] for s in steps if "loss" in s]
    assert losses[-1] < losses[0] / 10, (losses[0], losses[-1])


def test_log_and_model_file_round_trip_through_sample(tmp_path):
    log, model = tmp_path / "run.jsonl", tmp_path / "model.bin"
    p = train("-b", 2, "-t", 16, "--steps", 3, "--log", log, "--save", model)
    assert p.returncode == 0, p.stderr
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [r for r in recs if "loss" in r]
    assert [r["step"] for r in steps] == [0, 1, 2]
    for r in steps:
        assert {"step", "loss", "lr", "grad_norm", "ms", "tokens_per_s"} <= set(r)
    assert recs[0]["event"] == "start" and "memory" in recs[0]
    s = subprocess.run([sys.executable, "-m", "llmz.sample", "--init-from", str(model), "--prompt", "ROMEO:",
                        "--tokens", "5", "--device", "cpu"], cwd=REPO, capture_output=True, text=True, check=False,
                       timeout=120)
    assert s.returncode == 0, s.stderr
    assert s.stdout.startswith("ROMEO:")


def test_print_every_shows_every_nth_step_the_first_the_last_and_each_validated_one_and_logs_them_all(tmp_path):
    log = tmp_path / "run.jsonl"
    base = ["-b", 2, "-t", 8, "--steps", 12, "--val-every", 7, "--val-batches", 1, "--log", log]
    p = subprocess.run([sys.executable, "-m", "llmz.train", *[x for x in TINY if x != "--quiet"],
                        *map(str, base), "--print-every", "5"], cwd=REPO, capture_output=True, text=True,
                       check=False, timeout=300)
    assert p.returncode == 0, p.stderr
    shown = [int(m) for m in re.findall(r"^step +(\d+)/12 \|", p.stdout, re.MULTILINE)]
    assert shown == [0, 5, 7, 10, 11], p.stdout          # every 5th, the first, the last, and step 7's validation
    logged = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [r for r in logged if "loss" in r]
    assert [r["step"] for r in steps] == list(range(12))   # the log keeps one record per step, all its fields
    assert all({"step", "loss", "lr", "grad_norm", "ms", "tokens_per_s", "elapsed_s", "eta_s"} <= set(r)
               for r in steps)
    assert logged[0]["args"]["print_every"] == 5
    q = train(*base[:-2], "--print-every", 5)              # --quiet (in TINY) still prints no step line
    assert q.returncode == 0 and not re.search(r"^step +\d+/", q.stdout, re.MULTILINE), q.stdout


def test_a_zero_stage_on_one_rank_says_in_one_line_what_it_costs_there():
    from llmz.config import fmt_bytes, preset
    from llmz.layout import Layout
    from llmz.memory import predicted
    from llmz.run.log import zero_on_one_rank
    lay = Layout(preset("small"), 1)
    total = {s: sum(predicted(lay, s, 16, 64, 4).values()) for s in range(4)}
    assert zero_on_one_rank(lay, 0, 4) is None and zero_on_one_rank(Layout(preset("small"), 2), 2, 4) is None
    assert "the same memory as stage 0" in zero_on_one_rank(lay, 1, 4) and total[1] == total[0]
    for stage in (2, 3):             # the bytes the line names are those llmz.memory's formula adds to stage 0's
        assert f"{fmt_bytes(total[stage] - total[0])} more than stage 0" in zero_on_one_rank(lay, stage, 4)
    p = train("-b", 2, "-t", 8, "--steps", 1, "--zero-stage", 2)
    assert p.returncode == 0, p.stderr
    notes = [line for line in p.stdout.splitlines() if line.startswith("note: ZeRO stage 2 on one rank")]
    assert len(notes) == 1 and "two block slots" in notes[0], p.stdout


def bad_files(tmp_path):
    good = tmp_path / "good.bin"
    write_tokens(str(good), np.arange(100) % 256)
    raw = good.read_bytes()
    magic = tmp_path / "magic.bin"
    magic.write_bytes(np.int32(1234).tobytes() + raw[4:])
    truncated = tmp_path / "truncated.bin"
    truncated.write_bytes(raw[:-7])
    return good, magic, truncated


@pytest.mark.parametrize("case", ["magic", "truncated", "no_match", "batch_too_big", "seq_len", "flag",
                                  "init_from", "cublas_on_cpu"])
def test_bad_input_is_one_line_error_and_nonzero_exit(tmp_path, case):
    good, magic, truncated = bad_files(tmp_path)
    args = {"magic": ["--train-data", magic],
            "truncated": ["--train-data", truncated],
            "no_match": ["--train-data", tmp_path / "nothing_*.bin"],
            "batch_too_big": ["--train-data", good, "-b", 8, "-t", 64],
            "seq_len": ["--max-seq-len", 32, "-t", 64],
            "flag": ["--steps", -3],
            "init_from": ["--init-from", truncated],
            "cublas_on_cpu": ["--device", "cpu", "--matmul", "cublas"]}[case]
    p = train(*args, "--steps" if case != "flag" else "--lr", 1 if case != "flag" else 1e-3, timeout=120)
    assert p.returncode != 0
    err = p.stderr.strip().splitlines()
    assert len(err) == 1, p.stderr
    assert "error" in err[0] and "Traceback" not in p.stderr
    if case in ("magic", "truncated", "init_from"):
        assert "bin" in err[0]                                    # names the file
    if case == "cublas_on_cpu":
        assert "--matmul cublas" in err[0]


def test_bench_with_no_flags_on_a_cpu_times_the_default_training_runs_model():
    """The defaults that fit a laptop (a GPU's, GPT-2 124M at B=16 T=1024, would need ~28 GiB here); only the step
    counts are cut, to keep the test short."""
    p = subprocess.run([sys.executable, "-m", "llmz.bench", "--device", "cpu", "--steps", "1", "--warmup", "0"],
                       cwd=REPO, capture_output=True, text=True, check=False, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "model small (L=4 C=128 V=256: 957,184 parameters), B=16 T=64" in p.stdout, p.stdout
    assert "training step" in p.stdout


def test_bench_prints_ms_and_tokens_per_second_on_cpu():
    p = subprocess.run([sys.executable, "-m", "llmz.bench", "--device", "cpu", "--model", "tiny", "--vocab-size",
                        "256", "-b", "2", "-t", "16", "--steps", "2", "--warmup", "1"], cwd=REPO,
                       capture_output=True, text=True, check=False, timeout=120)
    assert p.returncode == 0, p.stderr
    lines = [line for line in p.stdout.splitlines() if " ms " in line and "tokens/s" in line]
    assert len(lines) == 1 and "training step" in lines[0], p.stdout
