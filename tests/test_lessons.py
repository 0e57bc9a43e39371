"""Every lesson under `mpiexec -n 2` on cpu exits 0 with every checkpoint PASS; with a collective removed on
purpose (LLMZ_LESSON_BREAK, honoured by lessons.common.apply_break) the checkpoints that measure it FAIL,
every rank still finishes, and the lesson exits non-zero."""
import re

import pytest

from mpirun import run_mpi

pytestmark = pytest.mark.mpi
LESSONS = {"00_one_device": 4, "01_stage0_data_parallel": 4, "02_stage1_optimizer_sharding": 4,
           "03_stage2_gradient_sharding": 7, "05_stage3_parameter_sharding": 7}


def run_lesson(name: str, out, env: dict | None = None):
    return run_mpi(2, ["-m", f"lessons.{name}", "--device", "cpu", "--out", str(out)], timeout=120, env=env)


def checkpoints(stdout: str) -> list[tuple[int, int, str, str]]:
    """(number, total, text, verdict) of every CHECKPOINT line."""
    return [(int(i), int(n), text, v)
            for i, n, text, v in re.findall(r"^CHECKPOINT (\d+)/(\d+): (.*) \.\.\. (PASS|FAIL)$", stdout, re.MULTILINE)]


@pytest.mark.parametrize("name", LESSONS)
def test_lesson_on_two_ranks_passes_every_checkpoint(name, tmp_path):
    p = run_lesson(name, tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    cps = checkpoints(p.stdout)
    n = LESSONS[name]
    # each checkpoint printed exactly once (rank 0 only), in order, and all of them passed
    assert [(i, total) for i, total, _, _ in cps] == [(i, n) for i in range(1, n + 1)], p.stdout
    assert all(v == "PASS" for *_, v in cps), p.stdout
    assert f"{n} of {n} checkpoints passed" in p.stdout
    if name.startswith("03"):
        for png in ("stage2_timeline.png", "memory_per_rank.png"):
            assert (tmp_path / png).stat().st_size > 10_000, png
    if name.startswith("05"):
        for png in ("stage3_timeline.png", "memory_per_rank_stages0-3.png"):
            assert (tmp_path / png).stat().st_size > 10_000, png


@pytest.mark.parametrize("name, broken, failing", [
    ("01_stage0_data_parallel", "skip_all_reduce", (1, 2, 4)),        # losses, identical params, bytes
    ("02_stage1_optimizer_sharding", "skip_all_gather", (1, 2, 4)),   # losses, identical params, bytes
    ("03_stage2_gradient_sharding", "skip_all_gather", (1, 2, 5)),    # losses, identical params, bytes
    ("05_stage3_parameter_sharding", "skip_all_gather", (1, 2, 4, 5)),  # losses, identical params, count, bytes
])
def test_removing_a_collective_fails_the_checkpoints_that_measure_it(name, broken, failing, tmp_path):
    p = run_lesson(name, tmp_path, env={"LLMZ_LESSON_BREAK": broken})
    assert p.returncode != 0, p.stdout
    assert "MPI_Abort" not in p.stdout + p.stderr        # a verdict, not a crash: every rank reached the end
    cps = checkpoints(p.stdout)
    assert len(cps) == LESSONS[name], p.stdout
    assert tuple(i for i, _, _, v in cps if v == "FAIL") == failing, p.stdout
    assert any("bit-identical" in text and v == "FAIL" for _, _, text, v in cps)
