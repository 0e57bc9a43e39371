"""The exercises (lessons/exercises/): each is its lesson's plain version (llmz/plain/) with only its key lines
removed, every gap a `raise NotImplementedError` saying what belongs there, numbered in the order a run reaches
them. `--mine FILE` trains the lesson with the learner's file and grades it with the lesson's checkpoints: the
solution passes every one; an untouched exercise stops at its first gap with one line naming it; each plausible
wrong version fails exactly the checkpoints its mistake predicts, and no other; the learner's file is never
written to, nor anything beside it. Lessons under `mpiexec -n 2` on cpu, as tests/test_lessons.py runs them."""
import difflib
import re
import subprocess
import sys

import pytest

from mpirun import REPO, run_mpi

pytestmark = pytest.mark.mpi
EXERCISES = {"01_stage0_data_parallel": "stage0", "02_stage1_optimizer_sharding": "stage1",
             "03_stage2_gradient_sharding": "stage2", "04_stochastic_rounding": "rounding",
             "05_stage3_parameter_sharding": "stage3"}
GAP = re.compile(r'raise NotImplementedError\("gap (\d+) of (\d+): ')


def exercise(lesson: str) -> str:
    return f"lessons/exercises/{lesson[:2]}_{EXERCISES[lesson]}.py"


def solution(lesson: str) -> str:
    return f"llmz/plain/{EXERCISES[lesson]}.py"


def grade(lesson: str, mine, tmp_path):
    """The lesson at 2 ranks on cpu with --mine mine: (the finished process, {checkpoint: verdict})."""
    figures = ["--out", str(tmp_path / "out")] if lesson[:2] in ("03", "05") else []
    p = run_mpi(2, ["-m", f"lessons.{lesson}", "--device", "cpu", "--mine", str(mine), *figures], timeout=300)
    verdicts = {int(i): v for i, v in re.findall(r"^CHECKPOINT (\d+)/\d+: .* \.\.\. (PASS|FAIL)$", p.stdout,
                                                 re.MULTILINE)}
    return p, verdicts


def docstring_and_code(path) -> tuple[str, list[str]]:
    """A plain version's module docstring (its text) and the lines after it."""
    lines = (REPO / path).read_text().splitlines(keepends=True)
    end = next(i for i, line in enumerate(lines) if line.rstrip().endswith('"""') and (i or line.count('"""') == 2))
    return "".join(lines[:end + 1]).strip().strip('"'), lines[end + 1:]


@pytest.mark.parametrize("lesson", EXERCISES)
def test_an_exercise_is_its_plain_version_with_only_its_gaps_removed(lesson):
    """The exercise opens with a comment: how to run it, then the plain version's docstring (what to write).
    After it, the exercise is the solution line for line, but for its gaps: each replaces a run of the
    solution's lines by one raise statement at their indentation, and the gaps are numbered 1 .. M in file
    order."""
    doc, ours = docstring_and_code(solution(lesson))
    theirs = (REPO / exercise(lesson)).read_text().splitlines(keepends=True)
    head = next(i for i, line in enumerate(theirs) if not line.startswith("#"))
    assert f"--mine {exercise(lesson)}" in "".join(theirs[:head])
    said = " ".join(line.lstrip("#").strip() for line in theirs[:head])
    assert " ".join(doc.split()) in said, said
    theirs = theirs[head:]
    numbers = []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=ours, b=theirs, autojunk=False).get_opcodes():
        if op == "equal":
            continue
        assert op == "replace", (op, ours[i1:i2], theirs[j1:j2])
        indent = " " * (len(ours[i1]) - len(ours[i1].lstrip()))
        starts = [j for j in range(j1, j2) if theirs[j].lstrip().startswith("raise ")]
        assert starts and theirs[j1].startswith(indent + "raise "), (ours[i1:i2], theirs[j1:j2])
        for a, b in zip(starts, starts[1:] + [j2]):
            gap = "".join(theirs[a:b]).strip()
            found = GAP.match(gap)
            assert found and gap.endswith('")') and gap.count("raise") == 1, gap
            numbers.append((int(found.group(1)), int(found.group(2))))
    assert numbers and numbers == [(k, len(numbers)) for k in range(1, len(numbers) + 1)], numbers


@pytest.mark.parametrize("lesson", EXERCISES)
def test_the_solution_passes_every_checkpoint_through_mine(lesson, tmp_path):
    p, verdicts = grade(lesson, REPO / solution(lesson), tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert verdicts and set(verdicts.values()) == {"PASS"}, p.stdout
    assert f"your {'stochastic rounding' if lesson[:2] == '04' else 'stage'}" in p.stdout


@pytest.mark.parametrize("lesson", EXERCISES)
def test_an_untouched_exercise_stops_at_once_with_one_line_naming_its_first_gap(lesson, tmp_path):
    mine = tmp_path / "mine" / "exercise.py"
    mine.parent.mkdir()
    text = (REPO / exercise(lesson)).read_text()
    mine.write_text(text)
    p, verdicts = grade(lesson, mine, tmp_path)
    assert p.returncode == 1 and not verdicts, p.stdout + p.stderr
    line = next(i for i, s in enumerate(text.splitlines(), 1) if 'raise NotImplementedError("gap 1 of' in s)
    last = p.stdout.strip().splitlines()[-1]
    assert re.fullmatch(rf"{re.escape(str(mine))}:{line}: gap 1 of \d+: .* \(fill it in, then run the lesson "
                        r"again\)", last), last
    assert "Traceback" not in p.stdout + p.stderr and "MPI_Abort" not in p.stdout + p.stderr
    assert mine.read_text() == text and sorted(f.name for f in mine.parent.iterdir()) == ["exercise.py"]


# A mistake a learner could make, as a change to the solution (old -> new, each `old` found exactly once), and
# the checkpoints it fails: exactly those. At 2 ranks with clipping on (these lessons' gradient norms are all
# above grad_clip), an average's factor of 2 is divided out exactly by the clip, so a sum where the mean belongs
# shows in the gradient norm (checkpoint 1) and not in the parameters.
WRONG = [
    ("01_stage0_data_parallel", "a sum where the mean belongs",
     'op="avg")     # gradients', 'op="sum")     # gradients', {1}),
    ("01_stage0_data_parallel", "no all-reduce: every rank steps on its own gradients",
     'self.comm.all_reduce(L.bucket_buffer(self.grads, b), op="avg")', "pass", {1, 2, 4, 5}),
    ("01_stage0_data_parallel", "the parameters all-reduced instead of the gradients",
     "self.comm.all_reduce(L.bucket_buffer(self.grads, b)", "self.comm.all_reduce(L.bucket_buffer(self.params, b)",
     {1, 2, 5}),
    ("01_stage0_data_parallel", "the blocks' buckets only: the embeddings and lnf left out",
     "for b in L.buckets:                                     # on every rank",
     "for b in L.buckets[1:-1]:                               # on every rank", {1, 2, 4, 5}),
    ("02_stage1_optimizer_sharding", "a missing all-gather",
     "self.comm.all_gather(L.bucket_buffer(self.params, b))", "pass", {1, 2, 4, 5}),
    ("02_stage1_optimizer_sharding", "the norm of my slices only: each rank clips by its own",
     'self.comm.all_reduce(self.norm_sq, op="sum")', "pass", {1, 5}),
    ("02_stage1_optimizer_sharding", "AdamW on rank 0's slice on every rank",
     "*L.shard_range(b, self.rank), L.shard_offset(b)", "*L.shard_range(b, 0), L.shard_offset(b)", {1, 5}),
    ("02_stage1_optimizer_sharding", "m and v kept whole: the right numbers, no memory saved",
     'self.m = self.alloc("optimizer_state", self.layout.shard_total)',
     'self.m = self.alloc("optimizer_state", self.layout.total)', {3}),
    ("02_stage1_optimizer_sharding", "a sum where the mean belongs",
     'self.comm.reduce_scatter(L.bucket_buffer(self.grads, b), op="avg")',
     'self.comm.reduce_scatter(L.bucket_buffer(self.grads, b), op="sum")', {1}),
    ("03_stage2_gradient_sharding", "a slice added at the wrong rank's offset (rank 0's, undefined elsewhere)",
     "buf, self.rank)", "buf, 0)", {1, 6}),
    ("03_stage2_gradient_sharding", "my slice added at the start of my shard, whatever the bucket",
     "self.k.accumulate_shard(self.dev, self.grad_shard[at:at + bucket.shard_size]",
     "self.k.accumulate_shard(self.dev, self.grad_shard[:bucket.shard_size]", {1, 6}),
    ("03_stage2_gradient_sharding", "a slot reused before it was emptied (added, never zeroed)",
     "self.k.accumulate_shard(self.dev, self.grad_shard[at:at + bucket.shard_size], buf, self.rank)",
     ("self.grad_shard[at:at + bucket.shard_size] += "
      "buf[self.rank * bucket.shard_size:(self.rank + 1) * bucket.shard_size]"), {1, 6}),
    ("03_stage2_gradient_sharding", "the embeddings and lnf never reduce-scattered",
     "        bucket, buf = self.layout.buckets[b], self.buffer(b)\n",
     "        bucket, buf = self.layout.buckets[b], self.buffer(b)\n        if b in self.ends:\n            return\n",
     {1, 4, 5, 6}),
    ("03_stage2_gradient_sharding", "the shard not zeroed after the update: steps add up",
     "self.k.zero(self.dev, self.grad_shard)", "pass", {1, 6}),
    ("04_stochastic_rounding", "truncation: the dropped bits dropped",
     "return ((bits + r) >> 16)", "return (bits >> 16)", {2, 3, 6}),
    ("04_stochastic_rounding", "round to nearest",
     "return ((bits + r) >> 16)", "return ((bits + 0x8000) >> 16)", {2, 3, 6}),
    ("04_stochastic_rounding", "a generator with state: right on average, not the same bits twice",
     "    r = random_u32(seed, offset + np.arange(bits.size), step) & 0xFFFF",
     "    r = RNG.integers(0, 1 << 16, bits.size).astype(np.uint64)", {5, 6}),
    ("05_stage3_parameter_sharding", "the embeddings and lnf not gathered after the update",
     "            self.comm.all_gather(self.param_ends[b.index], src=self.param_shard[at:at + b.shard_size])",
     "            pass", {1, 4, 5, 6}),
    ("05_stage3_parameter_sharding", "the embeddings and lnf gathered every time they are asked for",
     "            return self.param_ends[b]\n",
     ("            at = self.layout.shard_offset(self.layout.buckets[b])\n"
      "            self.comm.all_gather(self.param_ends[b], src=self.param_shard[at:at + "
      "self.layout.buckets[b].shard_size])\n            return self.param_ends[b]\n"), {4, 5}),
    ("05_stage3_parameter_sharding", "a block gathered without my slice (the slot's stale one sent)",
     "self.comm.all_gather(slot, src=self.param_shard[at:at + bucket.shard_size])", "self.comm.all_gather(slot)",
     {1, 6}),
    ("05_stage3_parameter_sharding", "a block gathered from my gradient shard",
     "self.comm.all_gather(slot, src=self.param_shard[at:at + bucket.shard_size])",
     "self.comm.all_gather(slot, src=self.grad_shard[at:at + bucket.shard_size])", {1, 6}),
]


@pytest.mark.parametrize("lesson, mistake, old, new, failing", WRONG, ids=[f"{w[0][:2]}-{w[1]}" for w in WRONG])
def test_a_wrong_version_fails_exactly_the_checkpoints_its_mistake_predicts(lesson, mistake, old, new, failing,
                                                                          tmp_path):
    text = (REPO / solution(lesson)).read_text()
    assert text.count(old) == 1, old
    text = text.replace(old, new)
    if "RNG." in new:                   # a module-level generator, seeded: the same draws on every rank
        text = text.replace("\n\n\ndef ", "\n\nRNG = np.random.default_rng(1234)\n\n\ndef ", 1)
    mine = tmp_path / "mine.py"
    mine.write_text(text)
    p, verdicts = grade(lesson, mine, tmp_path)
    assert p.returncode == 1 and "MPI_Abort" not in p.stdout + p.stderr, p.stdout + p.stderr
    assert {i for i, v in verdicts.items() if v == "FAIL"} == failing, p.stdout
    assert mine.read_text() == text


def test_mine_names_a_file_that_is_not_there_or_lacks_the_stage_in_one_line(tmp_path):
    (tmp_path / "empty.py").write_text("x = 1\n")
    for name, said in (("nothing.py", "No such file"),
                       ("empty.py", "defines no Stage1: start from lessons/exercises/02_stage1.py")):
        path = tmp_path / name
        p = subprocess.run([sys.executable, "-m", "lessons.02_stage1_optimizer_sharding", "--device", "cpu",
                            "--mine", str(path)], cwd=REPO, capture_output=True, text=True, check=False, timeout=120)
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: --mine {path}"), p.stderr
        assert said in lines[0], lines[0]
