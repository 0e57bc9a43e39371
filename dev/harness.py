"""What every dev/<layer>.py shares (llm.c's dev/cuda common.h): the sizes, random bf16 inputs made on the
GPU, float64 references computed there, timing as the GPU runs the kernels, the copy ceiling, and the table
printed last.

    python dev/<layer>.py [--model d12|d24|d36|d48|d12,d48|all] [-b B] [--reps N] [--timing graph] [VERSION ...]
    python dev/harness.py --check-timing     # the timing methods on known cases (a copy kernel), first

Each script lists its versions (v1 the teaching kernel, v2 what llmz/fast/ runs today, then the candidates in
the order they were written, "not yet run on a GPU" until tools/kern_gpu.sh has measured them) and its cases
(the layer's calls at one model size); for every size, case and version: the outputs poisoned (NaN), the
version run on fresh random inputs and checked against the float64 reference (norm-wise relative error under
the case's bf16 tolerance, nothing left NaN), then timed (K calls replayed from a CUDA graph, rotating over
copies of the arrays that together pass twice the L2 cache; see time_us), its bytes (each array the call must read or write, once) over the time, and that rate as a share of the copy
ceiling measured first (a 2 GiB device-to-device copy, bytes read + written). A short table last; the whole
table as JSON under $OUT (when set). Exit status 1 if any check failed.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
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
    p.add_argument("--reps", type=int, default=20, help="timed replays (graph) or rounds (hold) per version")
    p.add_argument("--timing", choices=tuple(METHODS), default="graph", help="graph (default: K calls captured "
                   "and replayed; the hold where a call cannot be captured), hold (K calls queued behind a kernel "
                   "that holds the GPU) or launch (one call between two events: Python's launch, for comparison)")
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


# ---- timing: as the GPU sees it ------------------------------------------------------------------------
# One call between two CUDA events times Python's launch (30-600 us), not a 10 us kernel: the first event is
# passed while the host is still launching. So a version is timed as K calls in a row that the GPU runs back
# to back: captured once into a CUDA graph and replayed (the replay launches each node in ~1 us), or, where a
# call cannot be captured (a library that synchronises or allocates), queued behind a kernel that holds the
# GPU while the host launches them. K is chosen so that the K calls last >= TARGET_US. The calls rotate over
# several copies of the case's arrays, together > 2x the L2 cache, so that each call reads its inputs from
# memory, as the step does, and not from the cache the previous call left warm. `check_timing()` tries the
# methods on known cases first (python dev/harness.py --check-timing).
TARGET_US = 2000.0          # the timed calls of one replay last at least this long
MAX_CALLS = 1000            # ... and are at most this many
MAX_SETS = 16               # copies of the arrays rotated through
HOLD_MS = 300               # the hold kernel's sleep: longer than the host takes to queue the calls


def l2_bytes(dev) -> int:
    if dev.kind != "gpu":
        return 1 << 20
    return int(dev.xp.cuda.runtime.getDeviceProperties(dev.gpu_index)["l2CacheSize"])


def array_bytes(arrays: dict) -> int:
    return sum(a.nbytes for a in arrays.values() if hasattr(a, "nbytes") and hasattr(a, "shape"))


def copies_for(dev, arrays: dict) -> int:
    """How many copies of a case's arrays to rotate through: together more than twice the L2 cache (one in the
    simulator, where nothing is timed)."""
    if dev.kind != "gpu":
        return 1
    footprint = max(array_bytes(arrays), 1)
    return max(1, min(MAX_SETS, -(-2 * l2_bytes(dev) // footprint) + 1))


def clone(arrays: dict) -> dict:
    return {k: (a.copy() if hasattr(a, "copy") and hasattr(a, "shape") else a) for k, a in arrays.items()}


@functools.cache
def hold_kernel():
    """One thread that sleeps ~ms milliseconds (nanosleep sleeps at most ~1 ms a call)."""
    from numba import cuda

    @cuda.jit
    def hold(ms):
        for _ in range(ms):
            cuda.nanosleep(1000000)
    return hold


def _median_us(times) -> float:
    return float(np.median(times))


def graph_us(dev, calls, reps: int) -> float:
    """Microseconds a call: `calls` (rotated) captured K times into one CUDA graph on the compute stream, the
    graph replayed `reps` times behind one untimed replay (so the GPU never waits for the host between the two
    events), the median replay over K. Raises if a call cannot be captured."""
    import cupy as cp
    stream = dev.compute_stream.cupy
    mode = getattr(cp.cuda.runtime, "streamCaptureModeRelaxed", 2)

    def capture(k):
        stream.begin_capture(mode)
        try:
            for i in range(k):
                calls[i % len(calls)]()
        finally:
            graph = stream.end_capture()
        return graph

    def replay(graph, k, n):
        times = []
        for _ in range(n):
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            graph.launch(stream)            # untimed: the GPU is busy while the host records and launches
            e0.record(stream)
            graph.launch(stream)
            e1.record(stream)
            e1.synchronize()
            times.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3 / k)
        return _median_us(times)

    n = len(calls)
    k = n * max(1, -(-20 // n))
    per = replay(capture(k), k, 3)                  # a first estimate from >= 20 calls
    want = min(MAX_CALLS, max(k, int(TARGET_US / max(per, 1e-3))))
    k2 = n * max(1, -(-want // n))
    if k2 > k:
        return replay(capture(k2), k2, reps)
    return replay(capture(k), k, reps)


def held_us(dev, calls, reps: int) -> float:
    """Microseconds a call: K calls (rotated) queued behind a kernel that holds the GPU for HOLD_MS, timed
    between an event after the hold and one after the last call; the median of `reps` rounds. Raises if the
    host took longer to queue them than the hold lasted (then the GPU waited for the host: not its time)."""
    import cupy as cp
    stream = dev.compute_stream.cupy
    n = len(calls)
    for c in calls:
        c()
    dev.synchronize()
    t0 = time.perf_counter()
    for c in calls:
        c()
    dev.synchronize()
    host_us = (time.perf_counter() - t0) * 1e6 / n       # what one call costs the host (an upper bound)
    k = n * max(1, min(MAX_CALLS, int(0.5 * HOLD_MS * 1e3 / max(host_us, 1.0))) // n)
    times = []
    for _ in range(max(3, reps // 3)):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        dev.launch(hold_kernel(), 1, 1, HOLD_MS)
        e0.record(stream)
        t0 = time.perf_counter()
        for i in range(k):
            calls[i % n]()
        e1.record(stream)
        queued_ms = (time.perf_counter() - t0) * 1e3
        e1.synchronize()
        if queued_ms > 0.9 * HOLD_MS:
            raise RuntimeError(f"the host took {queued_ms:.0f} ms to queue {k} calls, longer than the hold")
        times.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3 / k)
    return _median_us(times)


def launch_us(dev, calls, reps: int) -> float:
    """The old way, kept to show what it measured: one call between two CUDA events, the median of reps."""
    import cupy as cp
    stream = dev.compute_stream.cupy
    calls[0]()
    times = []
    for i in range(reps):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(stream)
        calls[i % len(calls)]()
        e1.record(stream)
        e1.synchronize()
        times.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3)
    return _median_us(times)


METHODS = {"graph": graph_us, "hold": held_us, "launch": launch_us}


def time_us(dev, calls, reps: int, method: str = "graph") -> tuple[float, str]:
    """(microseconds a call, the method that timed it): `method` (graph, hold or launch), a graph falling back to
    the hold where the calls cannot be captured. `calls`: one function of no arguments, or a list to rotate."""
    calls = calls if isinstance(calls, (list, tuple)) else [calls]
    if dev.kind != "gpu":                       # the simulator: the wall time of one call (meaningless)
        t0 = time.perf_counter()
        calls[0]()
        return (time.perf_counter() - t0) * 1e6, "wall"
    if method == "graph":
        try:
            return graph_us(dev, calls, reps), "graph"
        except Exception:  # noqa: BLE001 (not capturable: a library call that syncs or allocates)
            dev.synchronize()
            method = "hold"
    return METHODS[method](dev, calls, reps), method


def copy_ceiling(dev) -> float:
    """GB/s of a 2 GiB device-to-device copy (bytes read + written), the median of 10 (one copy lasts ~1 ms:
    a single launch between events is accurate at this size)."""
    import cupy as cp
    n = (1 << 30) if dev.kind == "gpu" else 1024
    with dev.compute_stream.cupy if dev.kind == "gpu" else contextlib.nullcontext():
        a = cp.ones(n, cp.uint16)
        b = cp.empty_like(a)
    us, _ = time_us(dev, lambda: cp.copyto(b, a), 10, "launch")
    return 2 * a.nbytes / us / 1e3


def check_timing(reps: int = 10) -> int:
    """The timing methods on known cases: a 16-byte-unit copy kernel (dev/vectors.py) of 2 GiB (every method
    should give the copy ceiling) and of d12's layernorm size (12.6 MB in, 12.6 MB out: near the ceiling by
    graph and hold, far under it by one launch between events), and the fast set's layernorm forward at d12
    (B=8). Prints a table; exit status 1 if graph and hold disagree by more than 10% on a copy or the large
    copy misses 80% of the ceiling."""
    import cupy as cp
    from numba import cuda

    from dev.vectors import load8, store8
    from llmz.fast import layernorm as fast

    @cuda.jit
    def copy_units_kernel(dst, src, units):
        u = cuda.grid(1)
        if u < units:
            a0, a1, a2, a3, a4, a5, a6, a7 = load8(src, 8 * u)
            store8(dst, 8 * u, a0, a1, a2, a3, a4, a5, a6, a7)
    dev = device()
    ceiling = copy_ceiling(dev)
    print(f"copy ceiling (CuPy copy of 2 GiB, bf16 bits): {ceiling:.0f} GB/s; L2 {l2_bytes(dev) / 2**20:.0f} MiB")
    ok, rows = True, []
    for label, n in (("unit copy 2 GiB", 1 << 30), ("unit copy d12 (8*1024*768)", 8 * 1024 * 768)):
        sets = [{"src": rand(n), "dst": cp.empty(n, cp.uint16)}]
        sets += [clone(sets[0]) for _ in range(copies_for(dev, sets[0]) - 1)]
        calls = [(lambda d=d, n=n: dev.launch(copy_units_kernel, -(-n // 8 // 256), 256, d["dst"], d["src"],
                                              n // 8)) for d in sets]
        got = {}
        for m in METHODS:
            us, _ = time_us(dev, calls, reps, m)
            got[m] = us
            rows.append((label, m, len(sets), us, 4 * n / us / 1e3))
        ok &= abs(got["graph"] / got["hold"] - 1) < 0.1
        if n == 1 << 30:
            ok &= 4 * n / got["graph"] / 1e3 > 0.8 * ceiling
    N, C = 8 * 1024, 768
    base = {"inp": rand((N, C)), "weight": rand(C, 0.5), "bias": rand(C, 0.5), "out": cp.empty((N, C), cp.uint16),
            "mean": cp.empty(N, cp.float32), "rstd": cp.empty(N, cp.float32)}
    sets = [base] + [clone(base) for _ in range(copies_for(dev, base) - 1)]
    calls = [(lambda d=d: fast.layernorm_forward(dev, d["out"], d["mean"], d["rstd"], d["inp"], d["weight"],
                                                 d["bias"])) for d in sets]
    for m in METHODS:
        us, _ = time_us(dev, calls, reps, m)
        rows.append(("fast layernorm forward d12 B=8", m, len(sets), us, (4 * N * C + 8 * N) / us / 1e3))
    print(f"{'case':<34}{'method':<8}{'sets':>5}{'us':>10}{'GB/s':>8}{'%':>7}")
    for label, m, nsets, us, gbs in rows:
        print(f"{label:<34}{m:<8}{nsets:>5}{us:10.2f}{gbs:8.0f}{100 * gbs / ceiling:6.1f}%")
    print(f"timing check: {'PASS' if ok else 'FAIL'} (graph and hold agree within 10% on the copies; the 2 GiB "
          f"copy at >= 80% of the ceiling)")
    return 0 if ok else 1


# ---- the run ------------------------------------------------------------------------------------------
class Table:
    """Rows (model, case, version, name, us, bytes, error, ok) and the table of them."""

    def __init__(self, layer: str, ceiling: float):
        self.layer, self.ceiling, self.rows = layer, ceiling, []

    def add(self, model, case, version, name, us, nbytes, err, ok, note="", method="", sets=1):
        gbs = nbytes / us / 1e3 if us else 0.0
        self.rows.append({"model": model, "case": case, "version": version, "name": name, "us": us,
                          "bytes": nbytes, "GB/s": gbs, "ceiling %": 100 * gbs / self.ceiling, "error": err,
                          "ok": ok, "note": note, "timing": method, "sets": sets})
        print(f"  {model:<4} {case:<26} v{version} {name:<34} {us:10.1f} us {gbs:8.0f} GB/s "
              f"{100 * gbs / self.ceiling:5.1f}%  err {err:.1e} {'PASS' if ok else 'FAIL'} ({method}, {sets} "
              f"set{'s' if sets > 1 else ''}) {note}", flush=True)

    def print(self) -> int:
        print(f"\n{self.layer}: bf16, % of the copy ceiling {self.ceiling:.0f} GB/s (read + write)")
        print(f"{'model':<6}{'case':<28}{'ver':<5}{'us':>10}{'GB/s':>8}{'%':>7}{'error':>9}  result  timing")
        for r in self.rows:
            print(f"{r['model']:<6}{r['case']:<28}{'v' + str(r['version']):<5}{r['us']:10.1f}{r['GB/s']:8.0f}"
                  f"{r['ceiling %']:6.1f}%{r['error']:9.1e}  {'PASS' if r['ok'] else 'FAIL'}    {r['timing']}")
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
    """Phase 1: every (model, case, version) checked on fresh inputs. Returns (row fields, what to time) for
    each: what to time is None (the check failed) or (call, arrays, case, timed), the arrays kept alive for the
    timing (timed: what the call handed back to time, or None: the call itself)."""
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
                    checked.append(((model, case, v, name, nbytes, err, err < tol, ""),
                                    (call, arrays, case, timed if callable(timed) else None)))
                except Exception as e:  # noqa: BLE001 (one line a failed version; the next one runs)
                    note = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
                    checked.append(((model, case, v, name, nbytes, float("nan"), False, note), None))
                print(f"  checked {model} {case} v{v}: {checked[-1][0][5]:.1e} {checked[-1][0][7]}", flush=True)
            del want, pristine
    return checked


def timed_calls(dev, call, arrays, case, timed) -> list:
    """The calls to rotate through: the checked arrays and enough copies of them to pass twice the L2 cache
    (copies_for), each call on its own set (a version that hands back what to time, hands it back per set)."""
    calls = [timed or (lambda: call(dev, arrays, case))]
    for _ in range(copies_for(dev, arrays) - 1):
        d = clone(arrays)
        t = call(dev, d, case)
        calls.append(t if callable(t) else (lambda d=d: call(dev, d, case)))
    return calls


def run(layer: str, doc: str, versions: dict, cases, argv) -> int:
    """The script's main. cases(cfg, B) yields (case name, make() -> {name: CuPy array}, outputs (the names a
    call only writes), reference(arrays) -> {name: float64 array}, bytes, tolerance, applies(version) ->
    bool); versions: {number: (name, call(dev, arrays, case name))}; a call may return a function of no
    arguments, which is then what is timed (e.g. a library call without the copy of its result into the
    checked array). Checks everything first, then times everything (see gpu_lock), each version as the GPU
    runs it (time_us)."""
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
        for (model, case, v, name, nbytes, err, ok, note), what in checked:
            us, method, sets, calls = 0.0, "", 0, None
            if what is not None:
                try:
                    calls = timed_calls(dev, *what)
                    sets = len(calls)
                    us, method = time_us(dev, calls, args.reps, args.timing)
                except Exception as e:  # noqa: BLE001
                    note = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
                    dev.synchronize()
                del calls
            table.add(model, case, v, name, us, nbytes, err, ok, note, method, sets)
        print(f"({time.time() - t1:.0f} s timing)")
    return table.print()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="the timing methods checked on known cases (check_timing)")
    p.add_argument("--check-timing", action="store_true", required=True)
    p.add_argument("--reps", type=int, default=10)
    sys.exit(check_timing(p.parse_args().reps))
