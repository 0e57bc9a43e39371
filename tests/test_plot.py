"""python -m llmz.plot: the --log files of several runs become one figure with every run's points, the
records it does not know are skipped, and a missing or corrupt log is one `error:` line and exit 2."""
import json
import subprocess
import sys

import numpy as np
import pytest

from llmz import plot
from mpirun import REPO

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_log(path, rng, steps: int, stage: int, world: int, extra=()):
    """A log as llmz.train writes it (start, val, step, checkpoint and end records) with random values,
    plus `extra` lines; returns {key: [values by step]} of what it wrote."""
    want = {"loss": rng.uniform(1, 6, steps), "lr": rng.uniform(1e-4, 1e-3, steps),
            "grad_norm": rng.uniform(0.1, 5, steps), "tokens_per_s": rng.uniform(1e3, 1e5, steps),
            "val": {0: float(rng.uniform(4, 6)), steps - 1: float(rng.uniform(1, 3))}}
    lines = [{"event": "start", "config": {"num_layers": 2}, "world_size": world,
              "args": {"zero_stage": stage, "precision": "fp32", "batch_size": 4, "seq_len": 8, "grad_accum": 1}}]
    for s in range(steps):
        if s in want["val"]:
            lines.append({"step": s, "val_loss": want["val"][s]})
        lines.append({"step": s, **{k: float(want[k][s]) for k in ("loss", "lr", "grad_norm", "tokens_per_s")},
                      "ms": 1.0, "elapsed_s": s * 0.1})         # a field this reader does not know
    lines.append({"event": "checkpoint", "step": steps, "path": "ck/step_000010"})
    lines.append({"event": "end", "final_loss": float(want["loss"][-1]), "tokens_per_s": 5e4})
    path.write_text("".join(json.dumps(r) + "\n" for r in lines) + "".join(extra))
    return want


def test_two_logs_become_one_png_with_both_runs_points(tmp_path, rng, capsys):
    a = write_log(tmp_path / "stage0.jsonl", rng, 40, stage=0, world=2)
    b = write_log(tmp_path / "stage2.jsonl", rng, 25, stage=2, world=2,
                  extra=['{"event": "resume", "step": 12}\n', '{"step": 3, "note": "unknown"}\n', '{"step": 24, "lo'])
    out = tmp_path / "figs" / "curves.png"                  # its folder does not exist yet
    assert plot.main([str(tmp_path / "stage0.jsonl"), str(tmp_path / "stage2.jsonl"), "-o", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 20_000
    assert "wrote" in capsys.readouterr().out

    # what the figure holds: each run's raw points in every panel, under its label
    runs = [plot.read_log(str(tmp_path / f)) for f in ("stage0.jsonl", "stage2.jsonl")]
    plot.label_runs(runs)
    assert [r.label for r in runs] == ["stage0 (ZeRO 0, 2 ranks, fp32)", "stage2 (ZeRO 2, 2 ranks, fp32)"]
    fig = plot.figure(runs, smooth=1)
    ax_loss, ax_norm, ax_lr, ax_tps = fig.axes
    for run, want in zip(runs, (a, b)):
        steps = len(want["loss"])
        for ax, key in ((ax_loss, "loss"), (ax_norm, "grad_norm"), (ax_lr, "lr"), (ax_tps, "tokens_per_s")):
            [line] = [ln for ln in ax.get_lines() if ln.get_label() == run.label]
            np.testing.assert_array_equal(line.get_xdata(), np.arange(steps))
            np.testing.assert_array_equal(line.get_ydata(), want[key])
        [val] = [ln for ln in ax_loss.get_lines() if ln.get_label() == f"{run.label} (val)"]
        assert list(val.get_xdata()) == sorted(want["val"])
        assert list(val.get_ydata()) == [want["val"][s] for s in sorted(want["val"])]
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == [r.label for r in runs]
    # x = tokens: step * B*T*K*ranks = step * 64
    fig = plot.figure(runs, x="tokens", smooth=1)
    [line] = [ln for ln in fig.axes[0].get_lines() if ln.get_label() == runs[1].label]
    np.testing.assert_array_equal(line.get_xdata(), np.arange(25) * 64)


def test_smoothing_is_a_centred_mean_with_no_lag(rng):
    v = [0.0] * 10 + [10.0] * 10
    m = plot.moving_average(v, 5)
    assert m[:8] == [0.0] * 8 and m[12:] == [10.0] * 8      # flat parts stay where they are
    assert m[9] == pytest.approx(4.0) and m[10] == pytest.approx(6.0)     # the step stays at 9.5
    assert plot.moving_average(v, 1) == v
    x = rng.normal(size=50)
    m = plot.moving_average(list(x), 7)
    assert m[0] == pytest.approx(x[0]) and m[-1] == pytest.approx(x[-1])      # the ends are their own
    assert m[1] == pytest.approx(x[:3].mean()) and m[20] == pytest.approx(x[17:24].mean())


def test_a_real_training_log_plots(tmp_path):
    log = tmp_path / "run.jsonl"
    p = subprocess.run([sys.executable, "-m", "llmz.train", "--device", "cpu", "--model", "tiny", "-b", "2", "-t",
                        "8", "--steps", "3", "--val-every", "2", "--val-batches", "1", "--quiet", "--log", str(log)],
                       cwd=REPO, capture_output=True, text=True, check=False, timeout=300)
    assert p.returncode == 0, p.stderr
    run = plot.read_log(str(log))
    assert sorted(run.train) == [0, 1, 2] and sorted(run.val) == [0, 2] and run.end
    assert run.tokens_per_step == 16
    p = subprocess.run([sys.executable, "-m", "llmz.plot", str(log), str(log), "--label", "a", "--label", "b",
                        "-o", str(tmp_path / "c.png")], cwd=REPO, capture_output=True, text=True, check=False,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "c.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("case, message", [
    ("missing", "no such file"),
    ("corrupt", "line 3 is not JSON"),
    ("not a log", "no step records"),
    ("a list", "line 1 is not a JSON object"),
    ("folder", "not a regular file"),
    ("binary", "cannot read as a text log"),
    ("bad -o", "name a .png, .svg or .pdf"),
    ("labels", "1 --label for 2 logs"),
])
def test_a_bad_log_or_flag_is_one_error_line_and_exit_2(tmp_path, rng, capsys, case, message):
    good = tmp_path / "good.jsonl"
    write_log(good, rng, 5, stage=1, world=1)
    bad = tmp_path / "bad.jsonl"
    out = tmp_path / "c.png"
    args = [str(good), str(bad)]
    if case == "corrupt":
        lines = good.read_text().splitlines(keepends=True)
        bad.write_text("".join(lines[:2]) + "{not json\n" + "".join(lines[3:]))
    elif case == "not a log":
        bad.write_text('{"a": 1}\n{"event": "start"}\n')
    elif case == "a list":
        bad.write_text("[1, 2]\n")
    elif case == "folder":
        bad.mkdir()
    elif case == "binary":                                  # e.g. the model file passed by mistake
        bad.write_bytes(b"\xff" + bytes(rng.integers(0, 256, 4096, dtype=np.uint8)))      # 0xff: never UTF-8
    elif case == "bad -o":
        args, out = [str(good)], tmp_path / "c.jpg"
    elif case == "labels":
        bad.write_text(good.read_text())
        args += ["--label", "only one"]
    assert plot.main([*args, "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert not out.exists()


def test_a_run_folders_log_is_named_by_its_folder(tmp_path, rng):
    """runs/001/log.jsonl (llmz.run.folder) is '001' in the legend; two folders of one name, their paths."""
    for folder in ("runs/001", "runs/002", "other/001"):
        (tmp_path / folder).mkdir(parents=True)
        write_log(tmp_path / folder / "log.jsonl", rng, 5, stage=0, world=1)
    runs = [plot.read_log(str(tmp_path / f / "log.jsonl")) for f in ("runs/001", "runs/002")]
    plot.label_runs(runs)
    assert [r.label.split(" (")[0] for r in runs] == ["001", "002"]
    runs = [plot.read_log(str(tmp_path / f / "log.jsonl")) for f in ("runs/001", "other/001")]
    plot.label_runs(runs)
    assert [r.label.split(" (")[0] for r in runs] == [str(tmp_path / "runs/001"), str(tmp_path / "other/001")]
