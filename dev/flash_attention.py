"""Flash attention on tensor cores, version by version (llm.c's dev/cuda role): every version's forward and
backward checked against a float64 reference on fresh random inputs, run twice for the same bits, timed at a
GPT-2 size's attention shape (bf16), and a table printed last.

    timeout 290 python dev/flash_attention.py --model d12 d48      # every version, timed at d12 and d48 (GPU)
    python dev/flash_attention.py 5 7 --model d48                  # some versions (default --model d12)

--model NAME ...: timed at each model's attention (llmz.config presets: C channels, L layers; -b B, default
16, 8 for d36 and d48; -t T, default 1024; the heads NH = C / hs for the version's head size hs).

version 1: the first tensor-core version (was llmz.fast until the promotion; dev/flash_attention_v1.py):
           64-row blocks of 4 warps (16 rows a warp); each K/V tile loaded global -> registers -> shared a
           word at a time (V transposed on the way) behind the branch of the row check, so the loads of a
           tile go out one after another (the SASS shows LDG, STS, BRA per row: ~20 L2 round trips a tile,
           nothing to overlap them); fragments read one word a lane (LDS.32).
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
           (llmz.fast.flash_attention today.)
version 6: version 2 with its 64-row dq kernel bounded to 2 blocks an SM instead of 3 (no spills).
version 7: version 5 without the row-sum pass: the dq kernel runs first and computes D = rowsum(dO o O) of
           its own rows (dO's fragments are in its registers already; the same words of O, then the row's 4
           lanes), uses it and stores it for the dk/dv kernel that runs after it. One launch and one read of
           dO and O fewer (flash_rowsum_kernel: 6.1 ms a d48 step at 9% of the bandwidth).
version 8: version 5 compiled for head size 32 (--model small's): the same source, HS = 32.
version 9: version 5 compiled for head size 128: HS = 128 with streamed tiles of BC = 32 rows and one row
           tile a warp in the forward (at 64 and two, registers and the 48 KiB of static shared memory run out).
version 10: version 5 with streamed tiles of BC = 32 rows (S, P, dP, dS: half the registers) and 3 blocks an SM
           (12 warps where 5 has 8; dq in blocks of 4 warps): more warps to hide the ldmatrix and exp
           latencies, against twice the syncthreads and cp.async groups per key. ptxas: forward 168 registers
           (72 B spilled), dk/dv 168 (16 B), dq 162 (none).
version 11: versions 10 and 7 together.
version 12: the forward on Hopper's wgmma (dev/flash_attention_wgmma.py: warpgroup products from registers and
           128-byte-swizzled shared tiles, 8 instructions a 64-key tile for 64 rows where version 5 issues 256
           mma.sync); the backward of version 5. Not yet run on a GPU: its probe (the instruction, the
           descriptors, the layouts) runs first, in a process of its own.
The forward and the backward of a version are independent: the best of each column can be combined.

Each version runs in its own try/except (a compile or launch error is one line and the next version runs);
the device is synchronised after every launch group, so an error is charged to the version that made it.
Checks: out and dinp poisoned (NaN) before each run; bf16 tolerances as tools/flash_check.py (norm-wise
relative error out < 1e-2, dq/dk/dv < 2e-2, lse within 1e-2); shapes B=2 T=1024 NH=12, and NH=3 at T=1030,
65 (partial last tiles), 17 (accumulating onto a random dinp), 1, at the version's head size; two runs of the
first shape must give the same bits (no atomics anywhere).
Promotion (done): llmz.fast.flash_attention runs version 5's forward and version 4's backward (the best of
each column on an H200), each kernel composed from llmz.fast's device functions (FlashAttention-2's steps).
Versions 2-11 are that source compiled with other module constants (llmz.fast.flash_attention.compiled_with:
block shapes, head size), version 7 with one device function swapped; version 1 (dev/flash_attention_v1.py)
composes the same device functions around its own staging: no kernel's source is here twice.
Kernel sizes: python tools/flash_ptx.py --dev (ptxas registers, spills, shared memory; no GPU needed).
"""
import argparse
import json
import math
import os
import subprocess
import sys
import time
import traceback

import numba
import numpy as np
from numba import cuda

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dev import flash_attention_v1 as v1
from dev import flash_attention_wgmma as wg
from llmz.config import preset
from llmz.fast import flash_attention as fa
from llmz.fast.device_helpers import pair_view
from llmz.kernels.grid import ceil_div
from tools.flash_check import TOL, errors, rel, time_ms, time_sdpa

PEAK_TFLOPS = 989.0         # the H200's dense bf16 tensor-core peak (llmz's MFU uses the same)
A_HS = fa.A_HS              # a lane's words of a row tile's A fragments over the head (a kernel's array size)


# ---- version 7: D = rowsum(dO o O) in the dq kernel --------------------------------------------------------
@cuda.jit(device=True, inline=True)
def bf16_dot(x, y):
    # the two bf16 products of words x and y, summed (float32)
    return fa.bf16_lo(x) * fa.bf16_lo(y) + fa.bf16_hi(x) * fa.bf16_hi(y)


@cuda.jit(device=True, inline=True)
def load_query_rows_with_d(qf, dof, inp, dout, lse, d_out, b, h, r0, lane):
    # version 7's load_query_rows: Q_i, dO_i, L_i as llmz.fast's, and D_i = rowsum(dO_i o O_i) computed here
    # (dO's A fragments times the same words of O: even words are row g's, odd row g+8's; then the row's 4
    # lanes) and stored to dsum for the dk/dv kernel that runs next. d_out = (dsum, out).
    dsum, out = d_out
    T = lse.shape[2]
    of = cuda.local.array(A_HS, numba.uint32)
    fa.load_fragments(qf, 0, inp, b, r0, h * fa.WORDS, lane)
    fa.load_fragments(dof, 0, dout, b, r0, h * fa.WORDS, lane)
    fa.load_fragments(of, 0, out, b, r0, h * fa.WORDS, lane)
    da, db = numba.float32(0.0), numba.float32(0.0)
    for y in range(0, A_HS, 2):
        da += bf16_dot(dof[y], of[y])
        db += bf16_dot(dof[y + 1], of[y + 1])
    da, db = fa.row_sum(da), fa.row_sum(db)
    ra, rb = r0 + lane // 4, r0 + lane // 4 + 8
    if lane % 4 == 0 and ra < T:
        dsum[b, h, ra] = da
    if lane % 4 == 0 and rb < T:
        dsum[b, h, rb] = db
    la = lse[b, h, ra] * fa.LOG2E if ra < T else numba.float32(0.0)
    lb = lse[b, h, rb] * fa.LOG2E if rb < T else numba.float32(0.0)
    return la, lb, da, db


def backward_d_in_dq(mod):
    """The backward of version 7 for module `mod` (its dq kernel taking (dsum, out) for dsum): dq (and D)
    first, then dk/dv reading D; no row-sum kernel."""
    def backward(dev, dinp, dout, inp, out, lse, dsum, NH, accumulate):
        B, T, _ = inp.shape
        dout2, inp2, dinp2 = pair_view(dout), pair_view(inp), pair_view(dinp)
        d_out = (cuda.as_cuda_array(dsum), cuda.as_cuda_array(pair_view(out)))
        dev.launch(mod.flash_dq_mma_kernel, (ceil_div(T, mod.DQ_ROWS), NH, B), mod.DQ_THREADS, dinp2, dout2,
                   inp2, lse, d_out, mod.SCALE * mod.LOG2E, mod.SCALE, accumulate,
                   flops=mod.causal_flops(B, NH, T, 3))
        dev.launch(mod.flash_dkv_mma_kernel, (ceil_div(T, mod.DKV_ROWS), NH, B), mod.DKV_THREADS, dinp2, dout2,
                   inp2, lse, dsum, mod.SCALE * mod.LOG2E, mod.SCALE, accumulate,
                   flops=mod.causal_flops(B, NH, T, 4))
    return backward


def with_d_in_dq(**constants):
    """llmz.fast's source compiled with `constants` (at head size 64), its dq kernel computing D (version 7)."""
    mod = fa.compiled_with(**constants)
    mod.load_query_rows = load_query_rows_with_d
    return mod


# ---- the versions: (what it is, module or None, forward, backward, head size) ---------------------------------
def version(name, mod, backward=None):
    return name, mod, mod.flash_attention_forward_fast, backward or mod.flash_attention_backward_fast, mod.HS


V7 = with_d_in_dq()                                 # at llmz.fast's block shapes
SMALL_TILES = {"BC": 32, "FWD_BLOCKS_PER_SM": 3, "DKV_BLOCKS_PER_SM": 3, "DQ_WARPS": 4, "DQ_BLOCKS_PER_SM": 3}
V11 = with_d_in_dq(**SMALL_TILES)
VERSIONS = {
    1: ("first tensor-core (dev/..._v1.py)", None, v1.flash_attention_forward_v1, v1.flash_attention_backward_v1,
        64),
    2: version("cp.async x2 + ldmatrix, 64-row", fa.compiled_with(
        FWD_TILES=1, FWD_WARPS=4, FWD_BLOCKS_PER_SM=4, DQ_WARPS=4, DQ_BLOCKS_PER_SM=3)),
    3: version("as 2, 128-row blocks", fa.compiled_with(
        FWD_TILES=1, FWD_WARPS=8, FWD_BLOCKS_PER_SM=2, DKV_WARPS=8, DKV_BLOCKS_PER_SM=1)),
    4: version("as 3, dk/dv 64-row", fa.compiled_with(FWD_TILES=1, FWD_WARPS=8, FWD_BLOCKS_PER_SM=2)),
    5: version("llmz.fast: fwd 32 rows/warp, bwd 4's", fa),
    6: version("as 2, dq 2 blocks an SM", fa.compiled_with(
        FWD_TILES=1, FWD_WARPS=4, FWD_BLOCKS_PER_SM=4, DQ_WARPS=4, DQ_BLOCKS_PER_SM=2)),
    7: version("5, D = rowsum(dO o O) in dq", V7, backward_d_in_dq(V7)),
    8: version("5 at head size 32", fa.compiled_with(HS=32)),
    9: version("5 at head size 128 (BC 32, 1 tile)", fa.compiled_with(HS=128, BC=32, FWD_TILES=1)),
    10: version("5, BC 32, 3 blocks an SM", fa.compiled_with(**SMALL_TILES)),
    11: version("10 and 7", V11, backward_d_in_dq(V11)),
    12: ("wgmma forward (dev/..._wgmma.py); bwd 5's", None, wg.flash_attention_forward_wgmma,
         fa.flash_attention_backward_fast, 64),
}


# ---- the float64 reference (dense: the whole causal T x T, float64) ---------------------------------------
def reference(x, dy, NH, dinp0=None, xp=np):
    """x (B,T,3C), dy (B,T,C) float64 -> out (B,T,C), lse (B,NH,T), dinp (B,T,3C) (+ dinp0 when given). The
    plain softmax attention and its gradient, checked against llmz's flash reference in setup(); xp: numpy,
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
def run(dev, ver, inp, dout, NH, dinp0=None):
    """One forward + backward of version `ver` on poisoned outputs: (out bits, lse, dinp bits) on the host."""
    _, _, forward, backward, _ = VERSIONS[ver]
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


def check_reference():
    """The dense float64 reference against llmz's flash reference (B=1 T=130 NH=2): printed, and True if
    they agree to rounding."""
    from llmz.kernels.flash_attention import flash_attention_backward_ref, flash_attention_forward_ref
    rng = np.random.default_rng()
    x, dy = rng.normal(size=(1, 130, 3 * 2 * 64)), rng.normal(size=(1, 130, 2 * 64))
    o, lse = np.empty((1, 130, 2 * 64)), np.empty((1, 2, 130))
    flash_attention_forward_ref(o, lse, x, 2)
    d = np.zeros(x.shape)
    flash_attention_backward_ref(d, dy, x, o, lse, 2)
    err = max(rel(a, b) for a, b in zip(reference(x, dy, 2), (o, lse, d)))
    print(f"dense float64 reference vs llmz flash reference (B=1 T=130 NH=2): {err:.1e} "
          f"({'PASS' if err < 1e-12 else 'FAIL'})")
    return err < 1e-12


def cases_for(hs, rng):
    """The checked cases (label, inp, dout, NH, dinp0, want) at head size hs: fresh random bf16 inputs and
    their float64 references (on the GPU)."""
    import cupy

    from llmz.bf16 import bf16_to_f32, f32_to_bf16

    def f64(a):
        return None if a is None else cupy.asarray(bf16_to_f32(a).astype(np.float64))
    cases = []
    for B, T, NH, acc in ((2, 1024, 12, False), (2, 1030, 3, False), (2, 65, 3, False), (2, 17, 3, True),
                          (1, 1, 3, False)):
        C = NH * hs
        inp, dout = f32_to_bf16(rng.normal(size=(B, T, 3 * C))), f32_to_bf16(rng.normal(size=(B, T, C)))
        # accumulating: onto a dinp0 ~10x smaller than 1, so that rounding the sum to bf16 (what the check
        # subtracts dinp0 from) stays well inside the tolerance (onto N(0,1) at T=1030 it alone is 1.6e-2)
        dinp0 = f32_to_bf16(0.1 * rng.normal(size=(B, T, 3 * C))) if acc else None
        want = tuple(cupy.asnumpy(a) for a in reference(f64(inp), f64(dout), NH, f64(dinp0), xp=cupy))
        cases.append((f"B={B} T={T} NH={NH} hs={hs}" + (" +=" if acc else ""), inp, dout, NH, dinp0, want))
    return cases


def check(dev, ver, cases):
    """Version `ver` on every case: (worst errors, ok, note), a line a case printed."""
    worst, ok, note = {}, True, ""
    for label, inp, dout, NH, dinp0, want in cases:
        got = run(dev, ver, inp, dout, NH, dinp0)
        errs, finite = errors(got, want, inp.shape[2] // 3, dinp0)
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
    return worst, ok, note


def shape(model, B, T):
    """(label, B, T, C, L): the attention shape of a model preset."""
    cfg = preset(model)
    B = B or (8 if model in ("d36", "d48") else 16)
    return f"{model}: B={B} T={T} C={cfg.channels}, {cfg.num_layers} layers", B, T, cfg.channels, cfg.num_layers


def timed_arrays(dev, rng, B, T, C, hs):
    """Random bf16 inputs and outputs for timing at (B, T, C), NH = C // hs heads (NH * hs channels: C unless
    hs does not divide it): (inp, dout, out, lse, dinp, dsum)."""
    from llmz.bf16 import f32_to_bf16
    NH = C // hs
    C = NH * hs
    return (dev.asarray(f32_to_bf16(rng.normal(size=(B, T, 3 * C)))),
            dev.asarray(f32_to_bf16(rng.normal(size=(B, T, C)))),
            dev.zeros((B, T, C)), dev.zeros((B, NH, T), np.float32), dev.zeros((B, T, 3 * C)),
            dev.zeros((B, NH, T), np.float32))


def time_version(dev, ver, arrays):
    """(forward ms, backward ms, per kernel) of version `ver` on the timed arrays; per kernel: the launches of
    one more forward and backward, each between CUDA events, queued while the GPU waits (llmz.bench's
    per-kernel way): "name ms rate" for each, TFLOP/s of the kernel's own products or GB/s."""
    import cupy

    from llmz.bench.layers import hold_kernel
    _, _, forward, backward, hs = VERSIONS[ver]
    inp, dout, out, lse, dinp, dsum = arrays
    NH = inp.shape[2] // 3 // hs
    fwd = time_ms(dev, lambda: forward(dev, out, lse, inp, NH))
    bwd = time_ms(dev, lambda: backward(dev, dinp, dout, inp, out, lse, dsum, NH, False))
    dev.launch(hold_kernel(), 1, 1, 50)
    dev.profile = []
    try:
        forward(dev, out, lse, inp, NH)
        backward(dev, dinp, dout, inp, out, lse, dsum, NH, False)
        dev.synchronize()
        records = [(r, cupy.cuda.get_elapsed_time(r[1].cupy, r[2].cupy)) for r in dev.profile]
    finally:
        dev.profile = None
    kernels = []
    for (name, _, _, flops, nbytes), ms in records:
        rate = f"{flops / ms / 1e9:.0f} TF/s" if flops else f"{nbytes / ms / 1e6:.0f} GB/s"
        kernels.append(f"{name.replace('flash_', '').replace('_mma_kernel', '')} {ms:.3f} {rate}")
    return fwd, bwd, ", ".join(kernels)


def context_alive(dev):
    """False after a sticky CUDA error (an illegal address poisons the whole context)."""
    try:
        dev.synchronize()
        dev.to_host(dev.full((4,), 1.0, np.float32))
        return True
    except Exception:  # noqa: BLE001 (any failure here means the context is gone)
        return False


def run_versions(versions, shapes, shape_args):
    """Check and time `versions` (at every shape) in this process; after a sticky CUDA error, the rest in a
    fresh process (given shape_args, the command line's shape flags). Returns the rows (version, name, hs,
    {shape label: (fwd ms, bwd ms)}, worst, ok, note)."""
    from llmz.device import Device
    dev = Device("gpu", np.uint16, matmul="cublas", attention="flash")
    rng = np.random.default_rng()
    cases, arrays, rows = {}, {}, []
    for i, ver in enumerate(versions):
        name, hs = VERSIONS[ver][0], VERSIONS[ver][4]
        t0 = time.time()
        try:
            if hs not in cases:
                cases[hs] = cases_for(hs, rng)
            worst, ok, note = check(dev, ver, cases[hs])
            times = {}
            for label, B, T, C, _ in shapes:
                if (label, hs) not in arrays:
                    arrays[label, hs] = timed_arrays(dev, rng, B, T, C, hs)
                times[label] = time_version(dev, ver, arrays[label, hs])
            rows.append((ver, name, hs, times, worst, ok, note))
        except Exception as e:  # noqa: BLE001 (one line, then the next version)
            msg = str(e).splitlines()[0][:200] if str(e) else ""
            rows.append((ver, name, hs, {}, {}, False, f"{type(e).__name__}: {msg}"))
            print(f"v{ver} FAILED: {rows[-1][6]}", flush=True)
            traceback.print_exc(limit=2)
            if not context_alive(dev) and versions[i + 1:]:
                print(f"(the CUDA context is gone: versions {versions[i + 1:]} in a fresh process)", flush=True)
                argv = [sys.executable, __file__, "--child", *shape_args, *map(str, versions[i + 1:])]
                r = subprocess.run(argv, capture_output=True, text=True, check=False)
                print(r.stderr[-3000:] if r.returncode else "", end="")
                for line in r.stdout.splitlines():
                    if line.startswith("ROW "):
                        rows.append(tuple(json.loads(line[4:])))
                    else:
                        print(line)
                return rows
            continue
        for label, (f, b, kernels) in times.items():
            print(f"v{ver} {name}, {label.split(':')[0]}: forward {f:.3f} ms, backward {b:.3f} ms; per kernel "
                  f"(ms, rate): {kernels}", flush=True)
        print(f"v{ver}: {time.time() - t0:.1f} s", flush=True)
    return rows


def registers():
    """Registers a thread of each compiled mma kernel of each version (what the GPU's driver reports)."""
    regs = []
    names = ("flash_forward_mma_kernel", "flash_dq_mma_kernel", "flash_dkv_mma_kernel")
    for ver, (_, mod, *_) in VERSIONS.items():
        kernels = [wg.flash_forward_wgmma_kernel] if ver == 12 else [getattr(mod or v1, n) for n in names]
        for k in kernels:
            try:
                n = k.get_regs_per_thread()
                name = k.py_func.__name__.replace("flash_", "").replace("_kernel", "")
                regs.append(f"v{ver} {name} {max(n.values()) if isinstance(n, dict) else n}")
            except Exception:  # noqa: BLE001, S112 (not compiled: the version did not run)
                continue
    return "registers a thread: " + ", ".join(regs)


def print_table(rows, shapes, sdpa):
    """The final table: one block a timed shape; TFLOP/s of the causal products and their % of the peak."""
    for label, B, T, C, L in shapes:
        print(f"\nflash attention, bf16, {label}; TFLOP/s of the causal products (fwd 2, bwd 5), % of "
              f"{PEAK_TFLOPS:.0f}; errors: worst over the checked shapes")
        print(f"{'version':<38}{'hs':>4}{'fwd ms':>8}{'bwd ms':>8}{'fwd TF':>8}{'bwd TF':>8}{'fwd %':>6}{'bwd %':>6}"
              f"{f'x{L} ms':>8}{'out':>8}{'dq':>8}{'dk':>8}{'dv':>8}{'lse':>8}   result")
        for ver, name, hs, times, w, ok, note in rows:
            f, b, _ = times.get(label, (float("nan"), float("nan"), ""))
            unit = B * (C // hs * hs) * T * (T + 1)     # one causal product's flops (NH * hs channels)
            tf, tb = 2 * unit / f / 1e9, 5 * unit / b / 1e9
            errs = "".join(f"{w.get(k, float('nan')):8.1e}" for k in ("out", "dq", "dk", "dv", "lse"))
            print(f"{f'{ver} {name}'[:37]:<38}{hs:>4}{f:8.3f}{b:8.3f}{tf:8.0f}{tb:8.0f}{100 * tf / PEAK_TFLOPS:6.1f}"
                  f"{100 * tb / PEAK_TFLOPS:6.1f}{L * (f + b):8.2f}{errs}   {'PASS' if ok else 'FAIL'} {note}")
        if label in sdpa:
            name, f, b = sdpa[label]
            unit = B * (C // 64 * 64) * T * (T + 1)
            tf, tb = 2 * unit / f / 1e9, 5 * unit / b / 1e9
            print(f"{name[:37]:<38}{64:>4}{f:8.3f}{b:8.3f}{tf:8.0f}{tb:8.0f}{100 * tf / PEAK_TFLOPS:6.1f}"
                  f"{100 * tb / PEAK_TFLOPS:6.1f}{L * (f + b):8.2f}")
        print("per kernel (ms, TFLOP/s of its own products, or GB/s):")
        for ver, _, _, times, *_ in rows:
            if label in times:
                print(f"  v{ver}: {times[label][2]}")


def main(argv) -> int:
    p = argparse.ArgumentParser(prog="python dev/flash_attention.py",
                                description="flash attention's versions, checked against float64 and timed")
    p.add_argument("versions", nargs="*", type=int, help=f"versions to run (default all: {sorted(VERSIONS)})")
    p.add_argument("--model", nargs="+", default=["d12"], help="model presets whose attention is timed")
    p.add_argument("-b", "--batch-size", type=int, default=None, help="B (default 16; 8 for d36 and d48)")
    p.add_argument("-t", "--seq-len", type=int, default=1024)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = [v for v in args.versions if v not in VERSIONS]
    if unknown:
        p.error(f"no version {unknown[0]} (versions: {sorted(VERSIONS)})")
    for m in args.model:
        try:
            preset(m)
        except ValueError as e:
            p.error(str(e))
    t_start = time.time()
    shapes = [shape(m, args.batch_size, args.seq_len) for m in args.model]
    versions = args.versions or sorted(VERSIONS)
    sdpa = {}
    if not args.child:                          # first: a version that breaks the context cannot stop it
        ref_ok = check_reference()
        if 12 in versions:                      # wgmma alone, in a process of its own
            try:
                r = subprocess.run([sys.executable, wg.__file__], capture_output=True, text=True, check=False,
                                   timeout=120)
                print(r.stdout + (f"wgmma probe FAILED (exit {r.returncode}): {r.stderr.strip()[-1500:]}\n"
                                  if r.returncode else ""), end="", flush=True)
            except subprocess.TimeoutExpired:
                print("wgmma probe FAILED: no answer in 120 s", flush=True)
        for label, B, T, C, _ in shapes:
            t = time_sdpa(B, T, C // 64, 64)
            if t:
                sdpa[label] = t
    shape_args = ["--model", *args.model, "-t", str(args.seq_len)]
    shape_args += ["-b", str(args.batch_size)] if args.batch_size else []
    rows = run_versions(versions, shapes, shape_args)
    if args.child:                              # rows for the parent, one JSON line each
        for row in rows:
            print("ROW " + json.dumps(row))
        return 0
    print_table(rows, shapes, sdpa)
    print(registers())
    print(f"({time.time() - t_start:.0f} s in all)")
    return 0 if ref_ok and all(r[5] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
