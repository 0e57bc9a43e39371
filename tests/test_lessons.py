"""Every lesson under `mpiexec -n 2` on cpu exits 0 with every checkpoint PASS, its plain stage (llmz/plain/)
equal to llmz.zero's bit for bit, and that checkpoint holds at 1, 3 and 4 ranks too; with a collective removed
on purpose (LLMZ_LESSON_BREAK, honoured by lessons.common.apply_break) the checkpoints that measure it FAIL,
every rank still finishes, and the lesson exits non-zero. Run alone, a lesson about ranks says so; a bad flag
is one line; --diff prints what a lesson changed from the lesson it builds on, the mechanism first, in at most
80 lines; the figures are readable and named by their settings; lessons/README.md covers every lesson.
(The exercises and --mine: tests/test_exercises.py.)"""
import difflib
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from mpirun import REPO, run_mpi

pytestmark = pytest.mark.mpi
LESSONS = {"00_one_device": 5, "01_stage0_data_parallel": 5, "02_stage1_optimizer_sharding": 5,
           "03_stage2_gradient_sharding": 8, "04_stochastic_rounding": 6,
           "05_stage3_parameter_sharding": 8}
# the checkpoint that holds each lesson's plain stage to llmz.zero's, bit for bit
SAME_AS_PRODUCTION = {"00_one_device": 5, "01_stage0_data_parallel": 5, "02_stage1_optimizer_sharding": 5,
                      "03_stage2_gradient_sharding": 6, "04_stochastic_rounding": 6,
                      "05_stage3_parameter_sharding": 6}


DRAWS = ("03_stage2_gradient_sharding", "05_stage3_parameter_sharding")      # the lessons that take --out


def run_lesson(name: str, out, env: dict | None = None, ranks: int = 2, args: tuple = ()):
    figures = ["--out", str(out)] if name in DRAWS else []
    return run_mpi(ranks, ["-m", f"lessons.{name}", "--device", "cpu", *figures, *args], timeout=300, env=env)


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
    bits = cps[SAME_AS_PRODUCTION[name] - 1][2]
    assert bits.startswith("the plain ") and "bit for bit" in bits, bits
    if name.startswith("03"):
        for png in ("stage2_timeline_thin_2ranks_k2.png", "memory_per_rank_thin_2ranks.png"):
            assert (tmp_path / png).stat().st_size > 10_000, png
    if name.startswith("05"):
        for png in ("stage3_timeline_thin_2ranks_k2.png", "memory_per_rank_stages0-3_thin_2ranks.png"):
            assert (tmp_path / png).stat().st_size > 10_000, png


@pytest.mark.parametrize("ranks, name", [(n, name) for n in (1, 3, 4) for name in
                                         ("01_stage0_data_parallel", "02_stage1_optimizer_sharding",
                                          "03_stage2_gradient_sharding", "05_stage3_parameter_sharding")])
def test_the_plain_stage_is_llmz_zeros_bit_for_bit_on_1_3_and_4_ranks(ranks, name, tmp_path):
    """The plain stage and llmz.zero's reduce through the same Communicator (a blocking collective there is the
    non-blocking one waited for), so their MPI sums run in the same order at any N: the same bits."""
    p = run_lesson(name, tmp_path, ranks=ranks, args=("--steps", "3"))
    assert p.returncode == 0, p.stdout + p.stderr
    _, _, text, verdict = checkpoints(p.stdout)[SAME_AS_PRODUCTION[name] - 1]
    assert verdict == "PASS" and f"equal on {ranks} of {ranks} rank" in text, text


@pytest.mark.parametrize("name, broken, failing", [
    ("01_stage0_data_parallel", "skip_all_reduce", (1, 2, 4, 5)),     # losses, identical params, bytes, bits
    ("02_stage1_optimizer_sharding", "skip_all_gather", (1, 2, 4, 5)),  # losses, identical params, bytes, bits
    ("03_stage2_gradient_sharding", "skip_all_gather", (1, 2, 5, 6)),   # losses, identical params, bytes, bits
    ("05_stage3_parameter_sharding", "skip_all_gather", (1, 2, 4, 5, 6)),   # and the all-gathers' count
])
def test_removing_a_collective_fails_the_checkpoints_that_measure_it(name, broken, failing, tmp_path):
    p = run_lesson(name, tmp_path, env={"LLMZ_LESSON_BREAK": broken})
    assert p.returncode != 0, p.stdout
    assert "MPI_Abort" not in p.stdout + p.stderr        # a verdict, not a crash: every rank reached the end
    cps = checkpoints(p.stdout)
    assert len(cps) == LESSONS[name], p.stdout
    assert tuple(i for i, _, _, v in cps if v == "FAIL") == failing, p.stdout
    assert any("bit-identical" in text and v == "FAIL" for _, _, text, v in cps)


def lesson_files() -> list[str]:
    return sorted(p.stem for p in (REPO / "lessons").glob("[0-9][0-9]_*.py"))


def test_lessons_readme_covers_every_lesson():
    """Each lesson file has a row in lessons/README.md's table, a checkpoint section and a command to run it."""
    text = (REPO / "lessons" / "README.md").read_text()
    for name in lesson_files():
        assert f"| `{name}` |" in text, f"{name}: no row in the table of lessons/README.md"
        assert re.search(rf"^\*\*{name[:2]} ", text, re.MULTILINE), f"{name}: no checkpoint section"
        assert f"python -m lessons.{name}" in text, f"{name}: no command to run it"


@pytest.mark.parametrize("name", lesson_files())
def test_a_lesson_on_a_missing_gpu_is_one_error_line_and_exit_2(name):
    from llmz.device import gpu_available
    if gpu_available():
        pytest.skip("this machine has a GPU")
    p = subprocess.run([sys.executable, "-m", f"lessons.{name}", "--device", "gpu"], cwd=REPO, capture_output=True,
                       text=True, check=False, timeout=120)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --device gpu"), p.stderr


def file_diff(old: str, new: str) -> str:
    before, after = ((REPO / f).read_text().splitlines(keepends=True) for f in (old, new))
    return "".join(difflib.unified_diff(before, after, old, new))


# What each lesson's --diff must show arriving (+) and leaving (-): its collective, where the lesson says
MOVES = {"01": (["self.comm.all_reduce(L.bucket_buffer(self.grads, b)"], []),
         "02": (["self.comm.reduce_scatter(L.bucket_buffer(self.grads, b)", "self.comm.all_gather(",
                 'self.alloc("optimizer_state", self.layout.shard_total)'],
                ["self.comm.all_reduce(L.bucket_buffer(self.grads, b)"]),
         "03": (['self.comm.reduce_scatter(buf, op="avg")', "self.slots = ", "self.grad_shard = "],
                ["self.comm.reduce_scatter(L.bucket_buffer(self.grads, b)", "self.grads = "]),
         "05": (["self.comm.all_gather(slot, src=self.param_shard", "self.param_shard = "], ["self.params = "])}


@pytest.mark.parametrize("name", lesson_files())
def test_diff_shows_the_parts_a_lesson_replaced_then_its_file(name):
    """--diff: each plain stage is the earlier lesson's with some parts replaced (a subclass, llmz/plain/), so
    the mechanism's diff is those parts as the earlier stage has them beside the new ones: within 80 lines,
    with the lesson's collective arriving where the lesson says (MOVES). Then the two lesson files' diff."""
    from lessons.common import plain_file
    text = (REPO / "lessons" / f"{name}.py").read_text()
    said = re.search(r"What changes from lesson (\d\d)", text)
    p = subprocess.run([sys.executable, "-m", f"lessons.{name}", "--diff"], cwd=REPO, capture_output=True,
                       text=True, check=False, timeout=120)
    assert p.returncode == 0, p.stderr
    if said is None:                                    # the first lesson, or an experiment of its own
        assert p.stdout.startswith(f"{name} builds on no earlier lesson") and p.stdout.count("\n") == 1
        assert plain_file(name) in p.stdout
        return
    before = next(n for n in lesson_files() if n.startswith(said.group(1)))
    files = file_diff(f"lessons/{before}.py", f"lessons/{name}.py")
    assert p.stdout.endswith(files)
    mechanism = p.stdout[:len(p.stdout) - len(files)]
    assert mechanism.startswith(f"--- {plain_file(before)}: ") and f"+++ {plain_file(name)}: " in mechanism
    assert 0 < mechanism.count("\n") <= 80, mechanism
    lines = mechanism.splitlines()[2:]
    arrive, leave = MOVES[name[:2]]
    for what, sign in [(w, "+") for w in arrive] + [(w, "-") for w in leave]:
        assert any(line.startswith(sign) and what in line for line in lines), (sign, what, mechanism)


def test_lesson_01_alone_says_it_means_mpiexec_and_marks_its_trivial_checkpoints():
    p = subprocess.run([sys.executable, "-m", "lessons.01_stage0_data_parallel", "--device", "cpu", "--steps", "2"],
                       cwd=REPO, capture_output=True, text=True, check=False, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "mpiexec -n 2 python -m lessons.01_stage0_data_parallel" in p.stdout.split("CHECKPOINT")[0]
    cps = checkpoints(p.stdout)
    trivial = [i for i, _, text, _ in cps if text.endswith("[trivial with 1 rank]")]
    assert trivial == [1, 2, 4], p.stdout            # memory (3) and the bits (5) hold with one rank as well
    assert "5 of 5 checkpoints passed (3 of them trivially" in p.stdout


def test_lesson_05_alone_says_it_means_mpiexec_marks_its_trivial_checkpoints_and_says_why_stages_grow(tmp_path):
    p = subprocess.run([sys.executable, "-m", "lessons.05_stage3_parameter_sharding", "--device", "cpu", "--steps",
                        "2", "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, check=False,
                       timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "mpiexec -n 2 python -m lessons.05_stage3_parameter_sharding" in p.stdout.split("CHECKPOINT")[0]
    cps = checkpoints(p.stdout)
    trivial = [i for i, _, text, _ in cps if text.endswith("[trivial with 1 rank]")]
    assert trivial == [2, 5, 8], p.stdout             # identical parameters across ranks, bytes sent, overlap
    # one rank: the memory chart's stages 2 and 3 stand above stage 0, and a line per stage says why
    for stage in (2, 3):
        assert f"note: ZeRO stage {stage} on one rank shards nothing" in p.stdout, p.stdout
    names = sorted(f.name for f in tmp_path.iterdir())
    assert names == ["memory_per_rank_stages0-3_thin_1ranks.png", "stage3_timeline_thin_1ranks_k2.json",
                     "stage3_timeline_thin_1ranks_k2.png"], names


def test_print_every_keeps_the_first_the_last_and_every_nth_step_line():
    p = subprocess.run([sys.executable, "-m", "lessons.01_stage0_data_parallel", "--device", "cpu", "--steps", "12",
                        "--print-every", "5"], cwd=REPO, capture_output=True, text=True, check=False, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert re.findall(r"^step (\d+):", p.stdout, re.MULTILINE) == ["0", "5", "10", "11"], p.stdout
    assert "over 12 steps" in p.stdout                  # the checkpoints still compare every step


LESSON_HELP = {"00_one_device": ["--device", "--kernels", "--attention", "--steps", "--model", "--batch-size",
                                 "--seq-len", "--print-every", "--diff"],
               "04_stochastic_rounding": ["--device", "--steps", "--mine", "--diff"],
               "05_stage3_parameter_sharding": ["--device", "--comm", "--kernels", "--attention", "--steps",
                                                "--model", "--batch-size", "--seq-len", "--grad-accum",
                                                "--print-every", "--out", "--mine", "--diff"]}


@pytest.mark.parametrize("name", LESSON_HELP)
def test_a_lessons_help_lists_only_the_flags_it_uses(name):
    p = subprocess.run([sys.executable, "-m", f"lessons.{name}", "--help"], cwd=REPO, capture_output=True, text=True,
                       check=True, timeout=60)
    listed = re.findall(r"^  (?:-\w, )?(--[a-z-]+)", p.stdout, re.MULTILINE)
    assert listed == ["--help"] + LESSON_HELP[name], listed
    taken = re.findall(r"\[(--[a-z-]+)", p.stdout.split("\n\n")[0])      # the usage line
    assert taken == LESSON_HELP[name], taken


def test_lessons_readme_defines_its_words_before_lesson_01():
    text = (REPO / "lessons" / "README.md").read_text()
    words = text.index("## Words the lessons use")
    for term in ("**rank**", "**Ψ**", "**bucket**", "**shard**", "**micro-step**", "**all-reduce**",
                 "**reduce-scatter**", "**all-gather**", "**slot**", "**compute stream, comm stream**", "**event**"):
        assert words < text.index(term) < text.index("| `01_stage0_data_parallel` |"), term


def test_figure_names_carry_model_ranks_and_k():
    from lessons import common
    a = SimpleNamespace(out="o", model="thin", grad_accum=3)
    names = {common.figure_name(a, SimpleNamespace(world_size=n), "memory_per_rank") for n in (1, 2, 3)}
    assert names == {str(Path("o") / f"memory_per_rank_thin_{n}ranks.png") for n in (1, 2, 3)}
    assert common.figure_name(a, SimpleNamespace(world_size=3), "stage2_timeline", "json", with_k=True) == \
        str(Path("o") / "stage2_timeline_thin_3ranks_k3.json")


def test_memory_chart_legend_covers_no_bar():
    from lessons import common
    cats = ("parameters", "gradients", "optimizer_state", "activations")
    reports = {f"stage {s}": {"measured": dict(zip(cats, sizes))}
               for s, sizes in enumerate([(9e5, 9e5, 1.8e6, 3e6), (9e5, 9e5, 9e5, 3e6), (9e5, 4e5, 9e5, 3e6)])}
    fig = common.memory_figure(reports, "title")
    fig.tight_layout()
    fig.canvas.draw()
    ax = fig.axes[0]
    legend = ax.get_legend().get_window_extent()
    bars = [p.get_window_extent() for p in ax.patches]
    assert len(bars) == 12 and not any(legend.overlaps(b) for b in bars)
    totals = [t.get_text() for t in ax.texts]
    assert totals == ["6.29 MiB", "5.44 MiB", "4.96 MiB"], totals


def test_a_one_rank_memory_chart_says_under_its_bars_why_stage_2_holds_more():
    from lessons import common
    cats = ("parameters", "gradients", "optimizer_state", "activations")
    reports = {f"stage {s}": {"measured": dict(zip(cats, sizes))}
               for s, sizes in enumerate([(9e5, 9e5, 1.8e6, 3e6), (9e5, 9e5, 1.8e6, 3e6), (9e5, 1.2e6, 1.8e6, 3e6)])}
    fig = common.memory_figure(reports, "title", common.one_rank_note([0, 1, 2]))
    fig.tight_layout()
    fig.canvas.draw()
    ax = fig.axes[0]
    note = ax.xaxis.label
    assert "every shard is the whole buffer" in note.get_text() and "stage 3" not in note.get_text()
    assert "stage 3 the same again" in common.one_rank_note([0, 1, 2, 3])
    inside = fig.bbox
    assert inside.x0 <= note.get_window_extent().x0 and note.get_window_extent().x1 <= inside.x1   # not cut off
    assert not ax.get_legend().get_window_extent().overlaps(note.get_window_extent())
