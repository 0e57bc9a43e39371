"""Compare the per-step losses of two or more `python -m llmz.train --log` files against the first.

    python tools/compare_logs.py REFERENCE.jsonl OTHER.jsonl [...] [--tol 0.01]

Prints, for each other file, the worst relative loss difference over the steps both have, the step where
it happens, and PASS/FAIL against --tol; exits 1 if any FAIL."""
import argparse
import json
import sys


def losses(path: str) -> dict[int, float]:
    with open(path) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r and "step" in r}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("reference")
    p.add_argument("others", nargs="+")
    p.add_argument("--tol", type=float, default=1e-5, help="worst relative difference allowed per step")
    a = p.parse_args(argv)
    ref = losses(a.reference)
    ok = True
    for path in a.others:
        other = losses(path)
        steps = sorted(set(ref) & set(other))
        if not steps:
            print(f"FAIL {path}: no step in common with {a.reference}")
            ok = False
            continue
        rel = {s: abs(other[s] - ref[s]) / abs(ref[s]) for s in steps}
        worst = max(rel, key=rel.get)
        good = rel[worst] <= a.tol
        ok &= good
        print(f"{'PASS' if good else 'FAIL'} {path} vs {a.reference}: {len(steps)} steps, loss {ref[steps[0]]:.4f} -> "
              f"{ref[steps[-1]]:.4f} (reference) / {other[steps[-1]]:.4f}; worst relative difference "
              f"{rel[worst]:.2e} at step {worst} (tolerance {a.tol:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
