"""Is the step slower? The same llmz.train run from two source trees, alternately, in one invocation.

    python tools/ab_step_time.py BEFORE_TREE AFTER_TREE [--rounds 3] [--launch "mpiexec -n 2"] -- TRAIN FLAGS

BEFORE_TREE and AFTER_TREE are folders holding an llmz checkout (`git archive <commit> | tar -x -C DIR` makes
one of any commit); each run starts inside its tree (relative paths in TRAIN FLAGS are read there). Each round runs the train command once from each tree (PYTHONPATH pointing at it), in
alternation so that both see the same machine; the per-step times come from the run's --log (the first step,
which compiles, left out). Prints, per run, the min, 10th percentile and median ms/step, and at the end the
median over rounds of each tree's median and their ratio (after / before).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile

import numpy as np


def step_ms(tree: str, launch: list[str], flags: list[str], log: str) -> np.ndarray:
    # the tree first, then whatever PYTHONPATH held (the GPU machine's carried wheels: numpy < 2.5, which
    # numba-cuda needs; without them the older tree met NumPy 2.5 and failed on np.row_stack)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (os.path.abspath(tree),
                                                                    os.environ.get("PYTHONPATH"))))}
    cmd = [*launch, sys.executable, "-m", "llmz.train", *flags, "--log", os.path.abspath(log)]
    # run inside the tree: `python -m` puts the working directory first on sys.path, ahead of PYTHONPATH, so
    # started from a checkout both runs would import that checkout's llmz
    p = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, check=False)
    if p.returncode != 0:
        sys.exit(f"{shlex.join(cmd)} (PYTHONPATH={tree}) exited {p.returncode}:\n{p.stderr[-2000:]}")
    with open(log) as f:
        return np.array([r["ms"] for r in map(json.loads, f) if "ms" in r][1:])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--launch", default="", help='a launcher before python, e.g. "mpiexec -n 2"')
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)           # after --: llmz.train's flags
    args, flags = p.parse_args(argv[:cut]), argv[cut + 1:]
    medians: dict[str, list[float]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for which in ("before", "after"):
                ms = step_ms(getattr(args, which), shlex.split(args.launch), flags, os.path.join(tmp, f"{which}.jsonl"))
                medians[which].append(float(np.median(ms)))
                print(f"round {r + 1} {which:6s}: min {ms.min():.3f}  p10 {np.percentile(ms, 10):.3f}  median "
                      f"{np.median(ms):.3f} ms/step ({ms.size} steps)", flush=True)
    b, a = statistics.median(medians["before"]), statistics.median(medians["after"])
    print(f"median of medians: before {b:.3f} ms, after {a:.3f} ms: after/before = {a / b:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
