"""The run folder (llmz/run/folder.py): `python -m llmz.train` with no output flags writes its model and log into
the next free runs/NNN, names it in its last line and points runs/latest at it, so the next command (sample)
follows as written; a second run takes the next number; a folder holding another run is refused unless
--resume continues it; --no-run-dir writes nothing; two ranks agree on one folder."""
import json
import os
import subprocess
import sys

import pytest

from mpirun import REPO, run_mpi

TINY = ["--device", "cpu", "--model", "tiny", "-b", "2", "-t", "8", "--steps", "2", "--val-every", "0",
        "--sample-tokens", "0", "--quiet"]


def command(module, *args, cwd, runs=None):
    """`python -m module *args` in cwd; runs: LLMZ_RUNS for it (None: unset, runs/ under cwd)."""
    env = {k: v for k, v in os.environ.items() if k != "LLMZ_RUNS"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    if runs is not None:
        env["LLMZ_RUNS"] = str(runs)
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, check=False, timeout=300)


def test_the_default_run_writes_its_folder_and_the_next_command_follows_it(tmp_path):
    first = command("llmz.train", *TINY, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip().splitlines()[-1] == \
        "run folder runs/001: model.bin, log.jsonl (runs/latest points here)"
    recs = [json.loads(line) for line in (tmp_path / "runs/001/log.jsonl").read_text().splitlines()]
    assert recs[0]["event"] == "start" and recs[-1]["event"] == "end"
    assert [r["step"] for r in recs if "loss" in r] == [0, 1]
    second = command("llmz.train", *TINY, cwd=tmp_path)                 # never over the first
    assert second.returncode == 0, second.stderr
    assert second.stdout.strip().splitlines()[-1].startswith("run folder runs/002: model.bin, log.jsonl")
    assert os.readlink(tmp_path / "runs/latest") == "002"
    assert (tmp_path / "runs/001/model.bin").read_bytes() != b"" and sorted(os.listdir(tmp_path / "runs")) == \
        ["001", "002", "latest"]
    sample = command("llmz.sample", "--init-from", "runs/latest/model.bin", "--prompt", "RO", "--tokens", "4",
                     cwd=tmp_path)
    assert sample.returncode == 0, sample.stderr


def test_a_named_folder_holding_a_run_is_refused_unless_resumed(tmp_path):
    folder = tmp_path / "mine"
    p = command("llmz.train", *TINY, "--run-dir", folder, "--checkpoint-every", "1", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert sorted(os.listdir(folder)) == ["checkpoints", "log.jsonl", "model.bin"]
    assert sorted(os.listdir(folder / "checkpoints")) == ["step_000001", "step_000002"]
    assert not (tmp_path / "runs").exists()                               # a folder elsewhere: no runs/latest
    again = command("llmz.train", *TINY, "--run-dir", folder, cwd=tmp_path)
    err = again.stderr.strip().splitlines()
    assert again.returncode == 2 and len(err) == 1 and "holds another run (model.bin, log.jsonl)" in err[0], \
        again.stderr
    at = TINY.index("--steps") + 1
    more = command("llmz.train", *TINY[:at], "4", *TINY[at + 1:], "--run-dir", folder, "--resume", cwd=tmp_path)
    assert more.returncode == 0, more.stderr
    recs = [json.loads(line) for line in (folder / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if "loss" in r] == [0, 1, 2, 3]        # continued from its checkpoint


def test_no_run_dir_writes_nothing(tmp_path):
    p = command("llmz.train", *TINY, "--no-run-dir", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert os.listdir(tmp_path) == [] and "run folder" not in p.stdout
    both = command("llmz.train", *TINY, "--no-run-dir", "--run-dir", "x", cwd=tmp_path)
    assert both.returncode == 2 and "choose one" in both.stderr


@pytest.mark.mpi
def test_two_ranks_write_one_folder(tmp_path):
    p = run_mpi(2, ["-m", "llmz.train", *TINY], env={"LLMZ_RUNS": str(tmp_path)})
    assert p.returncode == 0, p.stderr
    assert sorted(os.listdir(tmp_path)) == ["001", "latest"]
    assert p.stdout.strip().splitlines()[-1] == \
        f"run folder {tmp_path}/001: model.bin, log.jsonl ({tmp_path}/latest points here)"
