"""Flash attention on a GPU, in one run: correctness of the tensor-core kernels, then their speed.

    timeout 500 python tools/flash_check.py

  (a) the mma intrinsic: one 16x16 @ 16x8 bf16 tile against float64, and the bf16 pack against llmz.bf16
  (b) the fast flash forward + backward (bf16, B=4, T=1024, NH=12, hs=64) against the float64 flash
      reference (which tests/test_flash_attention.py checks against the plain attention reference) and
      against the teaching flash kernels on the same GPU; twice, for the same bits; then T = 1, 17, 1000, 1030
      (B=2, NH=3) for the causal mask at tile edges and partial tiles, and the accumulate flag
  (c) fast flash fwd+bwd at B=16, T=1024, NH=12, hs=64 against today's gemm path (cuBLAS products + softmax
      kernels) and PyTorch's SDPA when torch imports: ms and TFLOP/s (causal flops: forward 2 products,
      backward 5, each B*NH*hs*T*(T+1))
  (d) a summary table, last.
Every section runs in its own try/except (a CUDA error is reported with the kernel's name); the exit code
is 1 when any check failed.
Tolerances (bf16): inputs are bf16, products accumulate in fp32, P and dS are rounded to bf16 for the
products (as FlashAttention-2 does), outputs rounded once: relative error (norm-wise) of out < 1e-2, of dq, dk,
dv < 2e-2; lse (fp32) within 1e-2 absolute.
"""
import os
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RESULTS = []                # (section, name, ok, detail)
TOL = {"out": 1e-2, "lse": 1e-2, "dq": 2e-2, "dk": 2e-2, "dv": 2e-2}


def record(section, name, ok, detail=""):
    RESULTS.append((section, name, ok, detail))
    print(f"[{'PASS' if ok else 'FAIL'}] {section}: {name} {detail}", flush=True)


def guarded(section):
    """Run fn; an exception becomes a FAIL line naming the section (and the kernel, if the caller set it)."""
    def wrap(fn):
        def run(*args, **kw):
            try:
                return fn(*args, **kw)
            except Exception as e:
                record(section, f"raised {type(e).__name__}", False, str(e).splitlines()[0][:300] if str(e) else "")
                traceback.print_exc()
                return None
        return run
    return wrap


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


# ---- (a) the intrinsic ------------------------------------------------------------------------------
@guarded("a mma tile")
def check_mma():
    from numba import cuda

    from llmz.bf16 import bf16_to_f32, f32_to_bf16
    from llmz.fast.mma import mma_tile_kernel
    rng = np.random.default_rng(1)
    A = bf16_to_f32(f32_to_bf16(rng.normal(size=(16, 16)))).astype(np.float64)
    B = bf16_to_f32(f32_to_bf16(rng.normal(size=(16, 8)))).astype(np.float64)
    C = rng.normal(size=(16, 8)).astype(np.float32)
    a = f32_to_bf16(A).view(np.uint32)                      # (16, 8) words: A's rows as pairs
    bt = f32_to_bf16(np.ascontiguousarray(B.T)).view(np.uint32)       # (8, 8): B's columns as pairs
    d, packed = cuda.device_array((16, 8), np.float32), cuda.device_array((16, 4), np.uint32)
    mma_tile_kernel[1, 32](d, packed, cuda.to_device(a), cuda.to_device(bt), cuda.to_device(C))
    cuda.synchronize()
    got, want = d.copy_to_host(), A @ B + C
    err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    # 16 exact bf16 products summed in fp32: a few fp32 ulps
    record("a mma tile", "m16n8k16 bf16 vs float64", err < 1e-5, f"max error / max |D| = {err:.2e} (bound 1e-5)")
    same = np.array_equal(packed.copy_to_host(), f32_to_bf16(got).view(np.uint32))
    record("a mma tile", "pack_bf16x2 = llmz.bf16 round to nearest", same)


# ---- (b) correctness of the fast kernels ---------------------------------------------------------------
def devices():
    from llmz.device import Device
    fast = Device("gpu", np.uint16, kernel_set="fast", attention="flash")
    teach = Device("gpu", np.uint16, kernel_set="teaching", attention="flash")
    return fast, teach


def run_flash(dev, inp, dout, NH, dinp0=None, name=""):
    """flash forward + backward on dev (bf16 bits in, host arrays out): out, lse, dinp."""
    from llmz import fast, kernels
    k = fast if dev.fast else kernels            # the layer functions of the device's kernel set
    B, T, C3 = inp.shape
    out = dev.full((B, T, C3 // 3), 0x7FC0, np.uint16)
    lse = dev.full((B, NH, T), np.nan, np.float32)
    x = dev.asarray(inp)
    step = f"{name} forward"
    try:
        k.flash_attention_forward(dev, out, lse, x, NH)
        dev.synchronize()
        step = f"{name} backward"
        dinp = dev.asarray(dinp0) if dinp0 is not None else dev.full(inp.shape, 0x7FC0, np.uint16)
        k.flash_attention_backward(dev, dinp, dev.asarray(dout), x, out, lse, NH, accumulate=dinp0 is not None)
        dev.synchronize()
    except Exception as e:
        raise RuntimeError(f"{step} kernels failed: {e}") from e
    return dev.to_host(out), dev.to_host(lse), dev.to_host(dinp)


def reference(inp, dout, NH, dinp0=None):
    """The float64 flash reference on the bf16 inputs' values: out, lse, dinp (float64)."""
    from llmz.bf16 import bf16_to_f32
    from llmz.kernels.flash_attention import flash_attention_backward_ref, flash_attention_forward_ref
    x, dy = bf16_to_f32(inp).astype(np.float64), bf16_to_f32(dout).astype(np.float64)
    B, T, C3 = x.shape
    out, lse = np.empty((B, T, C3 // 3)), np.empty((B, NH, T))
    flash_attention_forward_ref(out, lse, x, NH)
    dinp = np.zeros(x.shape) if dinp0 is None else bf16_to_f32(dinp0).astype(np.float64)
    flash_attention_backward_ref(dinp, dy, x, out, lse, NH)
    return out, lse, dinp


def errors(got, want, C, dinp0=None):
    """got: (out bits, lse, dinp bits); want: float64 (out, lse, dinp). The norm-wise relative errors of out,
    dq, dk, dv (of what was added, when accumulating onto dinp0), the max |lse error|, and whether every
    value is finite: (errors, finite)."""
    from llmz.bf16 import bf16_to_f32
    out, lse, dinp = got
    errs = {"out": rel(bf16_to_f32(out), want[0]), "lse": float(np.max(np.abs(lse - want[1])))}
    d = bf16_to_f32(dinp).astype(np.float64)
    w = want[2]
    if dinp0 is not None:                       # the gradient itself: what was added
        base = bf16_to_f32(dinp0).astype(np.float64)
        d, w = d - base, w - base
    scale = 1e-3 * np.linalg.norm(w)
    for i, part in enumerate(("dq", "dk", "dv")):
        # relative to the part's norm, or to a thousandth of the whole gradient's where the part is ~0 (T=1:
        # the one softmax weight is 1, so dq = dk = 0 exactly, and bf16 rounding leaves ~1e-7 there)
        x, y = d[..., i * C:(i + 1) * C], w[..., i * C:(i + 1) * C]
        errs[part] = float(np.linalg.norm(x - y) / max(np.linalg.norm(y), scale))
    finite = all(np.all(np.isfinite(bf16_to_f32(x))) for x in (out, dinp)) and bool(np.all(np.isfinite(lse)))
    return errs, finite


def compare(section, what, got, want, C, dinp0=None):
    """got: (out bits, lse, dinp bits); want: float64. Checks each against TOL; returns the errors."""
    errs, finite = errors(got, want, C, dinp0)
    ok = finite and all(errs[k] < TOL[k] for k in errs)
    record(section, what, ok, ", ".join(f"{k} {v:.2e}" for k, v in errs.items()) + ("" if finite else " NON-FINITE"))
    return errs


@guarded("b fast vs float64 (B=4 T=1024 NH=12)")
def check_gpt2_size(fast, teach):
    from llmz.bf16 import f32_to_bf16
    section = "b fast vs float64 (B=4 T=1024 NH=12)"
    rng = np.random.default_rng(2)
    B, T, NH, hs = 4, 1024, 12, 64
    C = NH * hs
    inp, dout = f32_to_bf16(rng.normal(size=(B, T, 3 * C))), f32_to_bf16(rng.normal(size=(B, T, C)))
    want = reference(inp, dout, NH)
    got = run_flash(fast, inp, dout, NH, name="fast")
    compare(section, "fast flash vs float64 reference", got, want, C)
    again = run_flash(fast, inp, dout, NH, name="fast (second run)")
    same = all(np.array_equal(x, y) for x, y in zip(got, again))
    record(section, "two runs give the same bits (out, lse, dinp)", same)
    t0 = time.time()
    tgot = run_flash(teach, inp, dout, NH, name="teaching")
    compare(section, f"teaching flash kernels vs float64 ({time.time() - t0:.1f}s)", tgot, want, C)
    # fast against teaching: both within bf16 rounding of float64, so of each other
    from llmz.bf16 import bf16_to_f32
    errs = {"out": rel(bf16_to_f32(got[0]), bf16_to_f32(tgot[0])), "lse": float(np.max(np.abs(got[1] - tgot[1]))),
            "dinp": rel(bf16_to_f32(got[2]), bf16_to_f32(tgot[2]))}
    ok = errs["out"] < TOL["out"] and errs["lse"] < TOL["lse"] and errs["dinp"] < TOL["dq"]
    record(section, "fast vs teaching flash kernels", ok, ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))
    # a sharper softmax: scores 3x larger
    inp3 = f32_to_bf16(rng.normal(size=(B, T, 3 * C)) * np.sqrt(3))
    compare(section, "fast flash, scores 3x sharper", run_flash(fast, inp3, dout, NH, name="fast"),
            reference(inp3, dout, NH), C)


@guarded("b edges")
def check_edges(fast):
    from llmz.bf16 import f32_to_bf16
    rng = np.random.default_rng(3)
    B, NH, hs = 2, 3, 64
    C = NH * hs
    for T in (1, 17, 64, 65, 1000, 1030):
        inp, dout = f32_to_bf16(rng.normal(size=(B, T, 3 * C))), f32_to_bf16(rng.normal(size=(B, T, C)))
        compare("b edges", f"T={T}", run_flash(fast, inp, dout, NH, name=f"fast T={T}"), reference(inp, dout, NH), C)
    T = 200                                     # backward accumulating onto a non-zero dinp
    inp, dout = f32_to_bf16(rng.normal(size=(B, T, 3 * C))), f32_to_bf16(rng.normal(size=(B, T, C)))
    dinp0 = f32_to_bf16(rng.normal(size=(B, T, 3 * C)))
    compare("b edges", "T=200, accumulate=True", run_flash(fast, inp, dout, NH, dinp0, name="fast accumulate"),
            reference(inp, dout, NH, dinp0), C, dinp0)


# ---- (c) speed ---------------------------------------------------------------------------------------
def time_ms(dev, fn, reps=10):
    """Milliseconds a call (CUDA events around `reps` calls queued while the GPU waits), after one warm-up."""
    from llmz.bench.layers import time_ms as events_ms
    fn()
    return events_ms(dev, fn, reps)


def time_sdpa(B, T, NH, hs):
    """(name, forward ms, backward ms) of PyTorch's causal SDPA on bf16 (B, NH, T, hs) q, k, v, or None
    without torch."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        print("torch not importable: no SDPA timing")
        return None
    q, k, v = (torch.randn(B, NH, T, hs, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(B, NH, T, hs, device="cuda", dtype=torch.bfloat16)

    def tm(fn, reps=10):
        fn()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(reps):
            fn()
        e.record()
        e.synchronize()
        return s.elapsed_time(e) / reps
    fwd = tm(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    both = tm(lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), g))
    return f"torch {torch.__version__} SDPA (bf16)", fwd, both - fwd


TIMES = {}


@guarded("c speed")
def check_speed(fast):
    from llmz.bf16 import f32_to_bf16
    from llmz.device import Device
    from llmz.fast.attention import attention_backward, attention_forward
    from llmz.fast.flash_attention import flash_attention_backward, flash_attention_forward
    B, T, NH, hs = 16, 1024, 12, 64
    C = NH * hs
    unit = B * NH * hs * T * (T + 1)            # one causal product's flops
    rng = np.random.default_rng(4)
    inp, dout = fast.asarray(f32_to_bf16(rng.normal(size=(B, T, 3 * C)))), fast.asarray(f32_to_bf16(rng.normal(size=(B, T, C))))
    out, lse, dinp = fast.zeros((B, T, C)), fast.zeros((B, NH, T), np.float32), fast.zeros((B, T, 3 * C))

    def report(name, fwd, bwd):
        TIMES[name] = (fwd, bwd)
        record("c speed", name, True, f"forward {fwd:.3f} ms ({2 * unit / fwd / 1e9:.0f} TFLOP/s), backward {bwd:.3f} "
               f"ms ({5 * unit / bwd / 1e9:.0f} TFLOP/s), x12 layers {12 * (fwd + bwd):.2f} ms")
    fwd = time_ms(fast, lambda: flash_attention_forward(fast, out, lse, inp, NH))
    bwd = time_ms(fast, lambda: flash_attention_backward(fast, dinp, dout, inp, out, lse, NH, accumulate=False))
    report("fast flash (bf16)", fwd, bwd)
    try:
        gemm = Device("gpu", np.uint16, kernel_set="fast", attention="gemm")
        pre, att = gemm.zeros((B, NH, T, T)), gemm.zeros((B, NH, T, T))
        dpre, datt = gemm.zeros((B, NH, T, T)), gemm.zeros((B, NH, T, T))
        fwd = time_ms(gemm, lambda: attention_forward(gemm, out, pre, att, inp, NH, upper_is_zero=True))
        bwd = time_ms(gemm, lambda: attention_backward(gemm, dinp, dpre, datt, dout, inp, att, NH, accumulate=False,
                                                       upper_is_zero=True))
        report("gemm path (cuBLAS + softmax kernels, bf16)", fwd, bwd)
    except Exception as e:
        record("c speed", "gemm path", False, f"{type(e).__name__}: {e}")
    sdpa = time_sdpa(B, T, NH, hs)
    if sdpa:
        report(*sdpa)


def summary():
    print("\n==== summary ====")
    print(f"{'check':<70}{'result':>8}")
    for section, name, ok, _ in RESULTS:
        print(f"{(section + ': ' + name)[:69]:<70}{'PASS' if ok else 'FAIL':>8}")
    if TIMES:
        print(f"\n{'attention, B=16 T=1024 NH=12 hs=64':<46}{'fwd ms':>9}{'bwd ms':>9}{'x12 ms':>9}")
        for name, (f, b) in TIMES.items():
            print(f"{name[:45]:<46}{f:>9.3f}{b:>9.3f}{12 * (f + b):>9.2f}")
    try:
        from llmz.fast import flash_attention as fa
        regs = {k: getattr(fa, k).get_regs_per_thread() for k in ("flash_forward_mma_kernel", "flash_dkv_mma_kernel",
                                                                  "flash_dq_mma_kernel")}
        print("registers per thread: " + ", ".join(f"{k} {v}" for k, v in regs.items()))
    except Exception as e:
        print(f"(registers per thread not available: {e})")
    failed = [r for r in RESULTS if not r[2]]
    print(f"\n{len(RESULTS) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


def main() -> int:
    t0 = time.time()
    check_mma()
    try:
        fast, teach = devices()
    except Exception as e:
        record("setup", "devices", False, str(e))
        return summary()
    check_gpt2_size(fast, teach)
    check_edges(fast)
    check_speed(fast)
    print(f"(total {time.time() - t0:.0f} s)")
    return summary()


if __name__ == "__main__":
    sys.exit(main())
