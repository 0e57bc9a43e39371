"""Flash attention on tensor cores, version by version (llm.c's dev/cuda role): every version's forward and
backward checked against a float64 reference on fresh random inputs, run twice for the same bits, timed at
GPT-2 small's shape (B=16, T=1024, NH=12, hs=64, bf16), and a table printed last.

    timeout 150 python dev/flash_attention.py          # every version (GPU; ~60-90 s with compilation)
    python dev/flash_attention.py 1 3                  # some versions

version 1: the first tensor-core version (was llmz.fast until the promotion; dev/flash_attention_v1.py):
           64-row blocks of 4 warps (16 rows a warp); each K/V tile loaded global -> registers -> shared a
           word at a time (V transposed on the way) behind the branch of the row check, so the loads of a tile go out one after another (the SASS shows LDG, STS, BRA per row:
           ~20 L2 round trips a tile, nothing to overlap them); fragments read one word a lane (LDS.32).
version 2: the tiles by cp.async (16-byte global -> shared copies that skip the registers and do not make the
           thread wait; a row past T is zero-filled, no branch) into two shared buffers: tile k+1's copies fly
           while tile k's mmas run, one syncthreads a tile. Fragments by ldmatrix .x4 (four 8x8 matrices an
           instruction: a quarter of the shared loads) out of row-major tiles, .trans for the operands read
           down the key axis (V in O += P V; K, Q, dO in dq, dk, dv): no transposed staging, half the shared
           tiles in the backward. D = rowsum(dO * O) with 16-byte loads, 8 lanes a row.
version 3: version 2 with 128-row blocks of 8 warps: each K/V (Q/dO) tile is copied once for twice the rows
           (half the copies and syncthreads per mma); a warp skips the tiles above the diagonal for its 16
           rows, so the bigger diagonal block costs no extra mma.
version 4: version 3's backward with 64-row dk/dv blocks (version 2's, 2 blocks an SM at ~230 registers) and
           128-row dq blocks; the forward of version 3.
version 5: the forward with 32 rows a warp (128-row blocks of 4 warps, FlashAttention-2's shape for hs=64):
           each K/V fragment read from shared memory feeds two mmas (half the ldmatrix per mma), two
           independent mma chains a warp; ~2x the registers (2 blocks an SM). Backward: version 4's.
version 6: version 2 with its 64-row dq kernel bounded to 2 blocks an SM instead of 3 (no spills).
The forward and the backward of a version are independent: the best of each column can be combined.

Each version runs in its own try/except (a compile or launch error is one line and the next version runs);
the device is synchronised after every launch group, so an error is charged to the version that made it.
Checks: out and dinp poisoned (NaN) before each run; bf16 tolerances as tools/flash_check.py (norm-wise
relative error out < 1e-2, dq/dk/dv < 2e-2, lse within 1e-2); shapes B=2 T=1024 NH=12, and NH=3 at T=1030,
65 (partial last tiles), 17 (accumulating onto a random dinp), 1; two runs of the first shape must give
the same bits (no atomics anywhere).
Promotion (done): llmz.fast.flash_attention runs version 5's forward and version 4's backward (the best of
each column on an H200): flash_forward_mma_kernel is version 5's forward, flash_dq_mma_kernel the 128-row,
8-warp dq, flash_dkv_mma_kernel the 64-row, 4-warp dk/dv, flash_rowsum_kernel the 16-byte-load rowsum, as
module-level kernels with their block shapes as module constants, each composed from llmz.fast's device
functions (FlashAttention-2's steps). This file imports them and builds the earlier versions' block shapes
from the same bodies (reshaped below: the 16-rows-a-warp forward is FWD_TILES = 1), and version 1
(dev/flash_attention_v1.py) composes the same device functions around its own staging, so no kernel's
source is here twice.
Kernel sizes: python tools/flash_ptx.py --dev (ptxas registers, spills, shared memory; no GPU needed).
"""
import math
import os
import sys
import time
import traceback
import types

import numpy as np
from numba import cuda

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dev import flash_attention_v1 as v1
from llmz.device import ceil_div
from llmz.fast import flash_attention as fa
from llmz.fast.device_helpers import pair_view
from llmz.fast.flash_attention import (
    HS,
    LOG2E,
    SCALE,
    causal_flops,
    launch_bounds,
)
from tools.flash_check import TOL, errors, rel, time_ms, time_sdpa


# ---- the kernels at other block shapes: llmz.fast's bodies, recompiled -----------------------------------
def reshaped(kernel, threads, blocks, **constants):
    """`kernel`, a llmz.fast.flash_attention kernel, compiled again with other values of its module's
    constants (Numba reads a kernel's globals when it compiles it, from the function's __globals__): the
    promoted body at an earlier version's block shape, with no second copy of its source."""
    f = kernel.py_func
    body = types.FunctionType(f.__code__, {**f.__globals__, **constants}, f.__name__, f.__defaults__,
                              f.__closure__)
    return cuda.jit(fastmath=True, **launch_bounds(threads, blocks))(body)


def forward_kernel(warps, blocks):
    """llmz.fast's forward kernel for blocks of 16*warps query rows, one row tile of 16 a warp (versions 2-4
    and 6; llmz.fast's, version 5's, has two), bounded for `blocks` blocks an SM."""
    return reshaped(fa.flash_forward_mma_kernel, 32 * warps, blocks, FWD_TILES=1, FWD_ROWS=16 * warps,
                    FWD_THREADS=32 * warps)


def dq_kernel(warps, blocks):
    """llmz.fast's dq kernel for blocks of 16*warps query rows, bounded for `blocks` blocks an SM."""
    return reshaped(fa.flash_dq_mma_kernel, 32 * warps, blocks, DQ_ROWS=16 * warps, DQ_THREADS=32 * warps)


def dkv_kernel(warps, blocks):
    """llmz.fast's dk/dv kernel for blocks of 16*warps keys, bounded for `blocks` blocks an SM."""
    return reshaped(fa.flash_dkv_mma_kernel, 32 * warps, blocks, DKV_ROWS=16 * warps, DKV_THREADS=32 * warps)


FWD64 = forward_kernel(4, blocks=4)                 # versions 2 and 6
FWD128 = forward_kernel(8, blocks=2)                # versions 3 and 4
DQ64 = dq_kernel(4, blocks=3)                       # version 2
DQ64B2 = dq_kernel(4, blocks=2)                     # version 6 (no spills)
DKV128 = dkv_kernel(8, blocks=1)                    # version 3
# llmz.fast's: fa.flash_forward_mma_kernel (version 5), fa.flash_dq_mma_kernel (8 warps, 1 block: versions
# 3, 4, 5), fa.flash_dkv_mma_kernel (4 warps, 2 blocks: versions 2, 4, 5, 6), fa.flash_rowsum_kernel (2-6)


# ---- launches: (dev, arrays) as llmz.fast.flash_attention's -------------------------------------------
def forward_with(kernel, rows, threads):
    """The forward launch of `kernel`, blocks of `rows` query rows and `threads` threads."""
    def forward(dev, out, lse, inp, NH):
        B, T, _ = inp.shape
        dev.launch(kernel, (ceil_div(T, rows), NH, B), threads, pair_view(out), lse, pair_view(inp),
                   SCALE * LOG2E, flops=causal_flops(B, NH, T, 2))
    return forward


def backward_with(dq, dq_warps, dkv, dkv_warps):
    """The backward launches: llmz.fast's rowsum, then `dkv` and `dq` (16 rows a warp)."""
    def backward(dev, dinp, dout, inp, out, lse, dsum, NH, accumulate):
        B, T, _ = inp.shape
        dout2, inp2, dinp2 = pair_view(dout), pair_view(inp), pair_view(dinp)
        dev.launch(fa.flash_rowsum_kernel, ceil_div(B * T * NH * fa.CHUNKS, fa.ROWSUM_THREADS), fa.ROWSUM_THREADS,
                   dsum, dout2, pair_view(out))
        dev.launch(dkv, (ceil_div(T, 16 * dkv_warps), NH, B), 32 * dkv_warps, dinp2, dout2, inp2, lse,
                   dsum, SCALE * LOG2E, SCALE, accumulate, flops=causal_flops(B, NH, T, 4))
        dev.launch(dq, (ceil_div(T, 16 * dq_warps), NH, B), 32 * dq_warps, dinp2, dout2, inp2, lse,
                   dsum, SCALE * LOG2E, SCALE, accumulate, flops=causal_flops(B, NH, T, 3))
    return backward


# version: (what it is, forward, backward)
VERSIONS = {
    1: ("first tensor-core (dev/..._v1.py)", v1.flash_attention_forward_v1, v1.flash_attention_backward_v1),
    2: ("cp.async x2 + ldmatrix, 64-row", forward_with(FWD64, 64, 128),
        backward_with(DQ64, 4, fa.flash_dkv_mma_kernel, 4)),
    3: ("as 2, 128-row blocks", forward_with(FWD128, 128, 256),
        backward_with(fa.flash_dq_mma_kernel, 8, DKV128, 8)),
    4: ("as 3, dk/dv 64-row", forward_with(FWD128, 128, 256), fa.flash_attention_backward_fast),
    5: ("fwd 32 rows a warp; bwd as 4 (llmz.fast)", fa.flash_attention_forward_fast,
        fa.flash_attention_backward_fast),
    6: ("as 2, dq 2 blocks an SM", forward_with(FWD64, 64, 128),
        backward_with(DQ64B2, 4, fa.flash_dkv_mma_kernel, 4)),
}


# ---- the float64 reference (dense: the whole causal T x T, float64) ---------------------------------------
def reference(x, dy, NH, dinp0=None, xp=np):
    """x (B,T,3C), dy (B,T,C) float64 -> out (B,T,C), lse (B,NH,T), dinp (B,T,3C) (+ dinp0 when given). The
    plain softmax attention and its gradient, checked against llmz's flash reference in main(); xp: numpy,
    or cupy (float64 on the GPU: seconds instead of a minute at B=2 T=1024 NH=12)."""
    B, T, C3 = x.shape
    C = C3 // 3
    hs = C // NH
    q, k, v = (x[..., i * C:(i + 1) * C].reshape(B, T, NH, hs).transpose(0, 2, 1, 3) for i in range(3))
    g = dy.reshape(B, T, NH, hs).transpose(0, 2, 1, 3)
    s = q @ k.swapaxes(-1, -2) / math.sqrt(hs)
    s[..., xp.triu(xp.ones((T, T), dtype=bool), 1)] = -np.inf
    m = s.max(-1, keepdims=True)
    p = xp.exp(s - m)
    lsum = p.sum(-1, keepdims=True)
    p /= lsum
    o = p @ v
    dv = p.swapaxes(-1, -2) @ g
    ds = p * (g @ v.swapaxes(-1, -2) - xp.sum(g * o, -1, keepdims=True))
    dq = ds @ k / math.sqrt(hs)
    dk = ds.swapaxes(-1, -2) @ q / math.sqrt(hs)

    def merge(a):
        return a.transpose(0, 2, 1, 3).reshape(B, T, -1)
    dinp = xp.concatenate([merge(dq), merge(dk), merge(dv)], -1)
    if dinp0 is not None:
        dinp = dinp + dinp0
    return merge(o), (m + xp.log(lsum))[..., 0], dinp


# ---- checks and timings ------------------------------------------------------------------------------------
def run(dev, version, inp, dout, NH, dinp0=None):
    """One forward + backward of `version` on poisoned outputs: (out bits, lse, dinp bits) on the host."""
    _, forward, backward = VERSIONS[version]
    B, T, C3 = inp.shape
    out = dev.full((B, T, C3 // 3), 0x7FC0, np.uint16)
    lse = dev.full((B, NH, T), np.nan, np.float32)
    dsum = dev.full((B, NH, T), np.nan, np.float32)
    x = dev.asarray(inp)
    forward(dev, out, lse, x, NH)
    dev.synchronize()
    dinp = dev.asarray(dinp0) if dinp0 is not None else dev.full(inp.shape, 0x7FC0, np.uint16)
    backward(dev, dinp, dev.asarray(dout), x, out, lse, dsum, NH, dinp0 is not None)
    dev.synchronize()
    return dev.to_host(out), dev.to_host(lse), dev.to_host(dinp)


def setup(rng):
    """The checked cases (label, inp, dout, NH, dinp0, want) with fresh random bf16 inputs and their float64
    references (on the GPU), after checking the dense reference against llmz's flash reference."""
    import cupy

    from llmz.bf16 import bf16_to_f32, f32_to_bf16
    from llmz.kernels.flash_attention import flash_attention_backward_ref, flash_attention_forward_ref
    x, dy = rng.normal(size=(1, 130, 3 * 2 * HS)), rng.normal(size=(1, 130, 2 * HS))
    o, lse = np.empty((1, 130, 2 * HS)), np.empty((1, 2, 130))
    flash_attention_forward_ref(o, lse, x, 2)
    d = np.zeros(x.shape)
    flash_attention_backward_ref(d, dy, x, o, lse, 2)
    err = max(rel(a, b) for a, b in zip(reference(x, dy, 2), (o, lse, d)))
    print(f"dense float64 reference vs llmz flash reference (B=1 T=130 NH=2): {err:.1e} "
          f"({'PASS' if err < 1e-12 else 'FAIL'})")

    def f64(a):
        return None if a is None else cupy.asarray(bf16_to_f32(a).astype(np.float64))
    cases = []
    for B, T, NH, acc in ((2, 1024, 12, False), (2, 1030, 3, False), (2, 65, 3, False), (2, 17, 3, True),
                          (1, 1, 3, False)):
        C = NH * HS
        inp, dout = f32_to_bf16(rng.normal(size=(B, T, 3 * C))), f32_to_bf16(rng.normal(size=(B, T, C)))
        # accumulating: onto a dinp0 ~10x smaller than 1, so that rounding the sum to bf16 (what the check
        # subtracts dinp0 from) stays well inside the tolerance (onto N(0,1) at T=1030 it alone is 1.6e-2)
        dinp0 = f32_to_bf16(0.1 * rng.normal(size=(B, T, 3 * C))) if acc else None
        want = tuple(cupy.asnumpy(a) for a in reference(f64(inp), f64(dout), NH, f64(dinp0), xp=cupy))
        cases.append((f"B={B} T={T} NH={NH}" + (" +=" if acc else ""), inp, dout, NH, dinp0, want))
    return cases


TIMED = (16, 1024, 12)                          # B, T, NH: GPT-2 small's attention, one layer


def check_and_time(dev, ver, cases, timed):
    """One row of the table: (version, name, fwd ms, bwd ms, worst errors, ok, note)."""
    name, forward, backward = VERSIONS[ver]
    worst, ok, note = {}, True, ""
    for label, inp, dout, NH, dinp0, want in cases:
        got = run(dev, ver, inp, dout, NH, dinp0)
        errs, finite = errors(got, want, NH * HS, dinp0)
        good = finite and all(errs[k] < TOL[k] for k in errs)
        ok &= good
        for k, v in errs.items():
            worst[k] = max(worst.get(k, 0.0), v)
        print(f"  v{ver} {label}: " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items())
              + ("" if finite else " NON-FINITE") + f" {'PASS' if good else 'FAIL'}", flush=True)
        if label == cases[0][0]:
            same = all(np.array_equal(a, b) for a, b in zip(got, run(dev, ver, inp, dout, NH, dinp0)))
            ok &= same
            note += "" if same else "nondeterministic "
            print(f"  v{ver} {label}: second run {'gives the same bits' if same else 'gives DIFFERENT BITS'}")
    tin, tdout, tout, tlse, tdinp, tdsum = timed
    NH = TIMED[2]
    fwd = time_ms(dev, lambda: forward(dev, tout, tlse, tin, NH))
    bwd = time_ms(dev, lambda: backward(dev, tdinp, tdout, tin, tout, tlse, tdsum, NH, False))
    return ver, name, fwd, bwd, worst, ok, note


def context_alive(dev):
    """False after a sticky CUDA error (an illegal address poisons the whole context)."""
    try:
        dev.synchronize()
        dev.to_host(dev.full((4,), 1.0, np.float32))
        return True
    except Exception:  # noqa: BLE001 (any failure here means the context is gone)
        return False


def run_versions(versions):
    """Check and time `versions` in this process; after a sticky CUDA error, the rest in a fresh process.
    Returns the table's rows."""
    import json
    import subprocess

    from llmz.bf16 import f32_to_bf16
    from llmz.device import Device
    dev = Device("gpu", np.uint16, matmul="cublas", attention="flash")
    rng = np.random.default_rng()
    cases = setup(rng)
    B, T, NH = TIMED
    C = NH * HS
    timed = (dev.asarray(f32_to_bf16(rng.normal(size=(B, T, 3 * C)))),
             dev.asarray(f32_to_bf16(rng.normal(size=(B, T, C)))),
             dev.zeros((B, T, C)), dev.zeros((B, NH, T), np.float32), dev.zeros((B, T, 3 * C)),
             dev.zeros((B, NH, T), np.float32))
    rows = []
    for i, ver in enumerate(versions):
        t0 = time.time()
        try:
            row = check_and_time(dev, ver, cases, timed)
        except Exception as e:  # noqa: BLE001 (one line, then the next version)
            msg = str(e).splitlines()[0][:200] if str(e) else ""
            row = (ver, VERSIONS[ver][0], float("nan"), float("nan"), {}, False, f"{type(e).__name__}: {msg}")
            print(f"v{ver} FAILED: {row[6]}", flush=True)
            traceback.print_exc(limit=2)
            if not context_alive(dev) and versions[i + 1:]:
                print(f"(the CUDA context is gone: versions {versions[i + 1:]} in a fresh process)", flush=True)
                rows.append(row)
                r = subprocess.run([sys.executable, __file__, "--child", *map(str, versions[i + 1:])],
                                   capture_output=True, text=True, check=False)
                print(r.stderr[-3000:] if r.returncode else "", end="")
                for line in r.stdout.splitlines():
                    if line.startswith("ROW "):
                        rows.append(tuple(json.loads(line[4:])))
                    else:
                        print(line)
                return rows
        rows.append(row)
        print(f"v{ver} {row[1]}: forward {row[2]:.3f} ms, backward {row[3]:.3f} ms ({time.time() - t0:.1f} s)",
              flush=True)
    return rows


def registers():
    """Registers a thread of each compiled kernel (what the GPU's driver reports)."""
    regs = []
    kernels = [("v1", k) for k in (v1.flash_forward_mma_kernel, v1.flash_dq_mma_kernel, v1.flash_dkv_mma_kernel)]
    kernels += [("v2", FWD64), ("v2", DQ64), ("v3", FWD128), ("v3", DKV128), ("v6", DQ64B2)]
    kernels += [("llmz.fast", k) for k in (fa.flash_forward_mma_kernel, fa.flash_dq_mma_kernel,
                                           fa.flash_dkv_mma_kernel)]
    for ver, k in kernels:
        try:
            n = k.get_regs_per_thread()
            regs.append(f"{ver} {k.py_func.__name__} {max(n.values()) if isinstance(n, dict) else n}")
        except Exception as e:  # noqa: BLE001 (not compiled: the version did not run)
            regs.append(f"{ver} {k.py_func.__name__} ({type(e).__name__})")
    return "registers a thread: " + ", ".join(regs)


def main(argv) -> int:
    import json
    t_start = time.time()
    child = "--child" in argv
    versions = [int(a) for a in argv if a != "--child"] or sorted(VERSIONS)
    sdpa = None if child else time_sdpa(*TIMED, HS)     # first: a version that breaks the context cannot stop it
    rows = run_versions(versions)
    if child:                                   # rows for the parent, one JSON line each
        for row in rows:
            print("ROW " + json.dumps(row))
        return 0
    B, T, NH = TIMED
    unit = B * NH * HS * T * (T + 1)            # one causal product's flops
    print(f"\nflash attention, bf16, B={B} T={T} NH={NH} hs={HS}; TFLOP/s of the causal products (fwd 2, bwd 5); "
          f"errors: worst over the checked shapes ({time.time() - t_start:.0f} s in all)")
    print(f"{'version':<36}{'fwd ms':>8}{'bwd ms':>8}{'fwd TF':>8}{'bwd TF':>8}{'x12 ms':>8}"
          f"{'out':>8}{'dq':>8}{'dk':>8}{'dv':>8}{'lse':>8}   result")
    for ver, name, f, b, w, ok, note in rows:
        errs = "".join(f"{w.get(k, float('nan')):8.1e}" for k in ("out", "dq", "dk", "dv", "lse"))
        print(f"{f'{ver} {name}'[:35]:<36}{f:8.3f}{b:8.3f}{2 * unit / f / 1e9:8.0f}{5 * unit / b / 1e9:8.0f}"
              f"{12 * (f + b):8.2f}{errs}   {'PASS' if ok else 'FAIL'} {note}")
    if sdpa:
        name, f, b = sdpa
        print(f"{name[:35]:<36}{f:8.3f}{b:8.3f}{2 * unit / f / 1e9:8.0f}{5 * unit / b / 1e9:8.0f}{12 * (f + b):8.2f}")
    print(registers())
    return 0 if all(r[5] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
