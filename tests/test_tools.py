"""The small tools around training: CUDA graphs off the GPU, the loss-curve comparison, the bad-input and fault
re-measure."""
import json
import os
import re
import subprocess
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_graphs_run_the_function_every_time_where_there_is_nothing_to_capture():
    from llmz.device import Device
    from llmz.graph import Graphs
    calls = []
    g = Graphs(Device("cpu", np.float64), enabled=True)
    assert not g.enabled                       # only a GPU captures
    for _ in range(3):
        g.run("step", lambda: calls.append(1))
    assert len(calls) == 3 and g.calls == {"step": 3} and not g.graphs


def _log(path, losses):
    with open(path, "w") as f:
        f.write(json.dumps({"event": "start"}) + "\n")
        f.writelines(json.dumps({"step": step, "loss": loss, "lr": 1e-3}) + "\n" for step, loss in enumerate(losses))
        f.write(json.dumps({"step": len(losses) - 1, "val_loss": 9.0}) + "\n")


def test_compare_logs_passes_within_tolerance_and_fails_outside(tmp_path):
    ref, near, far = tmp_path / "ref.jsonl", tmp_path / "near.jsonl", tmp_path / "far.jsonl"
    _log(ref, [5.0, 4.0, 3.0])
    _log(near, [5.0, 4.0 * (1 + 1e-7), 3.0])
    _log(far, [5.0, 4.0, 3.3])

    def compare(*paths, tol):
        return subprocess.run([sys.executable, "tools/compare_logs.py", *map(str, paths), "--tol", str(tol)],
                              cwd=REPO, capture_output=True, text=True, check=False, timeout=60)
    ok = compare(ref, near, tol=1e-6)
    assert ok.returncode == 0 and ok.stdout.startswith("PASS") and "at step 1" in ok.stdout, ok.stdout
    bad = compare(ref, near, far, tol=1e-6)
    assert bad.returncode == 1 and "FAIL" in bad.stdout and "at step 2" in bad.stdout, bad.stdout


def hostile(k: str, timeout: float) -> tuple[int, int]:
    """tools/hostile_check.py -k k: (cases, cases OK), its tally line asserted clean."""
    p = subprocess.run([sys.executable, os.path.join(REPO, "tools", "hostile_check.py"), "-k", k], cwd=REPO,
                       capture_output=True, text=True, timeout=timeout, check=False)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    tally = p.stdout.strip().splitlines()[-1]
    m = re.match(r"(\d+) cases: (\d+) one-line as promised", tally)
    assert m and "0 TRACEBACK, 0 HANG" in tally, tally
    return int(m[1]), int(m[2])


def test_hostile_check_runs_its_cases_and_counts_them():
    # the re-measure of bad inputs (tools/hostile_check.py); the whole set takes minutes, here the non-finite
    # models and flags (8 cases today): every one must end in one line as promised, and the tally must say so
    n, ok = hostile("NaN", timeout=300)
    assert n == ok >= 5

def test_hostile_check_a_stopped_rank_and_a_live_log_under_another_name():
    # the collective watchdog (--collective-timeout 5: a stopped rank named within 15 s, the last checkpoint
    # intact) and the lock on the log file itself (a symlink or hard link of a live run's log is refused)
    for k, at_least in (("watchdog: 2 ranks, stage 2, one rank", 1), ("log a hard link of a log", 1),
                        ("alias.jsonl", 1)):
        n, ok = hostile(k, timeout=600)
        assert n == ok >= at_least, k
