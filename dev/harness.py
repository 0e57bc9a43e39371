"""What every dev/<layer>.py shares (llm.c's dev/cuda common.h): the sizes, random bf16 inputs made on the
GPU, float64 references computed there, timing with CUDA events, the copy ceiling, and the table printed last.

    python dev/<layer>.py [--model d12|d24|d36|d48|d12,d48|all] [-b B] [--reps N] [VERSION ...]

Each script lists its versions (v1 the teaching kernel, v2 what llmz/fast/ runs today, then the candidates in
the order they were written, "not yet run on a GPU" until tools/kern_gpu.sh has measured them) and its cases
(the layer's calls at one model size); for every size, case and version: the outputs poisoned (NaN), the
version run on fresh random inputs and checked against the float64 reference (norm-wise relative error under
the case's bf16 tolerance, nothing left NaN), then timed (median of `reps` calls after one, CUDA events), its
bytes (each array the call must read or write, once) over the time, and that rate as a share of the copy
ceiling measured first (a 2 GiB device-to-device copy, bytes read + written). A short table last; the whole
table as JSON under $OUT (when set). Exit status 1 if any check failed.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llmz.config import preset

MODELS = ("d12", "d24", "d36", "d48")
T = 1024                    # the sequence length of every case (rows = B * T)
# a failed check: worse than this norm-wise relative error (bf16 outputs: a few roundings of 2^-9)
BF16_TOL = 1e-2


def parse(argv, doc: str, versions: dict):
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--model", default="all", help="d12, d24, d36, d48, a comma list of them, or all (default)")
    p.add_argument("-b", "--batch-size", type=int, default=8, help="B (default 8, T = 1024)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("versions", nargs="*", type=int, help=f"versions to run (default all: {sorted(versions)})")
    args = p.parse_args(argv)
    args.models = MODELS if args.model == "all" else tuple(args.model.split(","))
    if not set(args.models) <= set(MODELS):
        p.error(f"--model {args.model}: choose from {', '.join(MODELS)}, a comma list of them, or all")
    args.versions = args.versions or sorted(versions)
    return args


def device():
    """The GPU as an llmz Device in bf16 with the fast kernels (cuBLAS products); the simulator when
    NUMBA_ENABLE_CUDASIM is set (a smoke test of the scripts with a NumPy stand-in for CuPy)."""
    from llmz.device import Device
    return Device("sim" if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" else "gpu", np.uint16, kernel_set="fast")


# ---- inputs and references on the GPU ------------------------------------------------------------------
def rand(shape, scale=1.0, dtype="bf16"):
    """Random normal values on the GPU: bf16 bits (uint16, rounded to nearest) or float32."""
    import cupy as cp
    x = (cp.random.standard_normal(shape, dtype=cp.float32) * np.float32(scale))
    return to_bf16(x) if dtype == "bf16" else x


def to_bf16(x):
    """float32 CuPy array -> bf16 bits, round to nearest even."""
    import cupy as cp
    bits = x.view(cp.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(cp.uint16)


def f64(a):
    """A CuPy array of bf16 bits or floats -> float64."""
    import cupy as cp
    if a.dtype == cp.uint16:
        return (a.astype(cp.uint32) << 16).view(cp.float32).astype(cp.float64)
    return a.astype(cp.float64)


def host(a) -> np.ndarray:
    """A CuPy array's values on the host."""
    return a.get() if hasattr(a, "get") else np.asarray(a)


def rel(got, want) -> float:
    """||got - want|| / ||want|| in float64 (NaN anywhere gives NaN, which fails every check)."""
    import cupy as cp
    g, w = f64(got), f64(want)
    return float(cp.linalg.norm(g - w) / max(float(cp.linalg.norm(w)), 1e-300))


def poison(a):
    """Fill an output with NaN (bf16: 0x7FC0), so an element left unwritten fails the check."""
    a.fill(0x7FC0 if a.dtype == np.uint16 else np.nan)
    return a


# ---- timing -----------------------------------------------------------------------------------------
def time_us(dev, call, reps: int) -> float:
    """Median microseconds of `call` over reps calls, each between two CUDA events, after one untimed call."""
    import cupy as cp
    call()
    times = []
    stream = getattr(dev.compute_stream, "cupy", None)
    for _ in range(reps):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(stream)
        call()
        e1.record(stream)
        e1.synchronize()
        times.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3)
    return float(np.median(times))


def copy_ceiling(dev) -> float:
    """GB/s of a 2 GiB device-to-device copy (bytes read + written), the median of 10."""
    import cupy as cp
    n = (1 << 30) if dev.kind == "gpu" else 1024
    with dev.compute_stream.cupy if dev.kind == "gpu" else contextlib.nullcontext():
        a = cp.ones(n, cp.uint16)
        b = cp.empty_like(a)
    us = time_us(dev, lambda: cp.copyto(b, a), 10)
    return 2 * a.nbytes / us / 1e3


# ---- the run ------------------------------------------------------------------------------------------
class Table:
    """Rows (model, case, version, name, us, bytes, error, ok) and the table of them."""

    def __init__(self, layer: str, ceiling: float):
        self.layer, self.ceiling, self.rows = layer, ceiling, []

    def add(self, model, case, version, name, us, nbytes, err, ok, note=""):
        gbs = nbytes / us / 1e3 if us else 0.0
        self.rows.append({"model": model, "case": case, "version": version, "name": name, "us": us,
                          "bytes": nbytes, "GB/s": gbs, "ceiling %": 100 * gbs / self.ceiling, "error": err,
                          "ok": ok, "note": note})
        print(f"  {model:<4} {case:<26} v{version} {name:<34} {us:10.1f} us {gbs:8.0f} GB/s "
              f"{100 * gbs / self.ceiling:5.1f}%  err {err:.1e} {'PASS' if ok else 'FAIL'} {note}", flush=True)

    def print(self) -> int:
        print(f"\n{self.layer}: bf16, % of the copy ceiling {self.ceiling:.0f} GB/s (read + write)")
        print(f"{'model':<6}{'case':<28}{'ver':<5}{'us':>10}{'GB/s':>8}{'%':>7}{'error':>9}  result")
        for r in self.rows:
            print(f"{r['model']:<6}{r['case']:<28}{'v' + str(r['version']):<5}{r['us']:10.1f}{r['GB/s']:8.0f}"
                  f"{r['ceiling %']:6.1f}%{r['error']:9.1e}  {'PASS' if r['ok'] else 'FAIL'}")
        out = os.environ.get("DEV_JSON_DIR") or os.environ.get("OUT")
        if out:
            with open(os.path.join(out, f"dev_{self.layer}.json"), "w") as f:
                json.dump({"ceiling GB/s": self.ceiling, "rows": self.rows}, f, indent=1)
        return 0 if all(r["ok"] for r in self.rows) else 1


def case_versions(names: dict, calls: dict) -> dict:
    """run()'s versions from {case: {version: call(dev, arrays)}}: version v of a case runs calls[case][v]
    (a version missing from a case does not apply to it: the case's applies() says so)."""
    return {v: (names[v], lambda dev, d, case, v=v: calls[case][v](dev, d)) for v in names}


@contextlib.contextmanager
def gpu_lock(exclusive: bool):
    """With KERN_GPU_LOCK set (tools/kern_gpu.sh runs the scripts side by side): a shared flock while a script
    compiles and checks, an exclusive one while it times, so no timing overlaps another process's GPU work."""
    path = os.environ.get("KERN_GPU_LOCK")
    if not path:
        yield
        return
    import fcntl
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def check_all(dev, args, versions, cases) -> list:
    """Phase 1: every (model, case, version) checked on fresh inputs. Returns (row fields, what to time or
    None) for each, the arrays kept alive for the timing."""
    checked = []
    for model in args.models:
        cfg = preset(model)
        for case, make, outputs, reference, nbytes, tol, applies in cases(cfg, args.batch_size):
            arrays = make()
            want = reference(arrays)
            pristine = {k: a.copy() for k, a in arrays.items()}
            for v in args.versions:
                name, call = versions[v]
                if not applies(v):
                    continue
                try:
                    for k, a in pristine.items():       # the inputs again (a version may accumulate into them)
                        arrays[k][...] = a
                    for o in outputs:                   # the outputs it only writes: NaN
                        poison(arrays[o])
                    timed = call(dev, arrays, case)     # a version may hand back what to time (its core alone)
                    dev.synchronize()
                    err = max(rel(arrays[o], want[o]) for o in want)
                    if not callable(timed):
                        timed = (lambda call=call, arrays=arrays, case=case: call(dev, arrays, case))
                    checked.append(((model, case, v, name, nbytes, err, err < tol, ""), timed))
                except Exception as e:  # noqa: BLE001 (one line a failed version; the next one runs)
                    note = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
                    checked.append(((model, case, v, name, nbytes, float("nan"), False, note), None))
                print(f"  checked {model} {case} v{v}: {checked[-1][0][5]:.1e} {checked[-1][0][7]}", flush=True)
            del want
    return checked


def run(layer: str, doc: str, versions: dict, cases, argv) -> int:
    """The script's main. cases(cfg, B) yields (case name, make() -> {name: CuPy array}, outputs (the names a
    call only writes), reference(arrays) -> {name: float64 array}, bytes, tolerance, applies(version) ->
    bool); versions: {number: (name, call(dev, arrays, case name))}; a call may return a function of no
    arguments, which is then what is timed (e.g. a library call without the copy of its result into the
    checked array). Checks everything first, then times everything (see gpu_lock)."""
    args = parse(argv, doc, versions)
    dev = device()
    t0 = time.time()
    with gpu_lock(False):
        checked = check_all(dev, args, versions, cases)
    print(f"{layer}: checked in {time.time() - t0:.0f} s; waiting to time", flush=True)
    with gpu_lock(True):
        t1 = time.time()
        table = Table(layer, copy_ceiling(dev))
        print(f"{layer}: copy ceiling {table.ceiling:.0f} GB/s; versions {args.versions}", flush=True)
        for (model, case, v, name, nbytes, err, ok, note), timed in checked:
            us = 0.0
            if timed is not None:
                try:
                    us = time_us(dev, timed, args.reps)
                except Exception as e:  # noqa: BLE001
                    note = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            table.add(model, case, v, name, us, nbytes, err, ok, note)
        print(f"({time.time() - t1:.0f} s timing)")
    return table.print()
