"""python -m llmz.bench --layer NAME: one layer's teaching and fast versions side by side (llm.c's dev/cuda role).

For each version, on the same random inputs at the model's sizes: the layer's forward and backward calls (the
calls llmz.model makes), checked against the float64 NumPy reference of llmz/kernels/<layer>.py, then timed.
One row per version and pass: the kernels that ran, the worst relative error over the pass's outputs
(||got - ref|| / ||ref||), microseconds per call, and GB/s (the arrays the pass touches, each counted once) or
TFLOP/s (matmul, attention). On a GPU the times are CUDA events around `reps` calls queued while the GPU waits
(as `--per-kernel` does), so they are the GPU's, not Python's launch rate. In the simulator the same rows
come out at tiny sizes, a smoke test (its times mean nothing); on cpu only the references run.
"""
from __future__ import annotations

import functools
import time

import numpy as np

from ..kernels import (
    adamw,
    attention,
    classifier,
    encoder,
    flash_attention,
    gelu,
    layernorm,
    matmul,
    residual,
)

LAYERS = ("encoder", "layernorm", "matmul", "attention", "flash", "gelu", "residual", "classifier", "adamw",
          "norm", "accumulate")
HOLD_MS = 200           # the GPU waits this long while the host queues the timed calls
FLOAT64 = ("scalars", "norm_sq", "norm_scratch")       # float64 whatever the precision (AdamW's, the norm's)


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-300))


class Case:
    """A layer's inputs (host, float64), its passes and their float64 references. Each pass is
    (name, call(dev, k, d), outputs, reference(h) -> {output: array}, traffic, flops): d and h map names to
    device and host arrays, k is llmz.kernels or llmz.fast; traffic names an array once for each time the pass
    reads or writes it whole (the bytes of GB/s)."""

    def __init__(self, arrays: dict, ints: dict | None = None, cublas: bool = False):
        self.arrays, self.ints, self.passes = arrays, ints or {}, []
        self.cublas = cublas            # the fast version's products run on cuBLAS (matmul, gemm attention)

    def add(self, name, call, outputs, reference, traffic=(), flops=0):
        self.passes.append((name, call, outputs, reference, traffic, flops))


def encoder_case(cfg, B: int, T: int, rng) -> Case:
    """The encoder layer's inputs and passes."""
    C, V, Vp = cfg.channels, cfg.vocab_size, cfg.padded_vocab_size
    n = rng.normal
    case = Case({"wte": n(size=(Vp, C)) * 0.02, "wpe": n(size=(T, C)) * 0.02, "dout": n(size=(B, T, C)),
                 "out": np.zeros((B, T, C)), "dwte": np.zeros((Vp, C)), "dwpe": np.zeros((T, C))},
                {"inp": rng.integers(0, V, (B, T)).astype(np.int32)})

    def fwd_ref(h):
        out = np.empty((B, T, C))
        encoder.encoder_forward_ref(out, h["inp"], h["wte"], h["wpe"])
        return {"out": out}

    def bwd_ref(h):
        dwte, dwpe = h["dwte"].copy(), h["dwpe"].copy()
        encoder.encoder_backward_ref(dwte, dwpe, h["dout"], h["inp"])
        return {"dwte": dwte, "dwpe": dwpe}
    case.add("forward", lambda dev, k, d: k.encoder_forward(dev, d["out"], d["inp"], d["wte"], d["wpe"]),
             ("out",), fwd_ref, ("inp", "wpe", "out", "out"))         # wte's B*T rows read: out's size
    case.add("backward", lambda dev, k, d: k.encoder_backward(dev, d["dwte"], d["dwpe"], d["dout"], d["inp"],
                                                               d.get("buckets")), ("dwte", "dwpe"), bwd_ref,
             ("dout", "dout", "inp", "dwpe", "dwpe", "out", "out"))   # dwte's B*T rows: out's size
    return case


def layernorm_case(cfg, B: int, T: int, rng) -> Case:
    """The layernorm layer's inputs and passes."""
    C = cfg.channels
    n = rng.normal
    x = n(size=(B, T, C)) * rng.uniform(0.5, 3, (B, T, 1)) + n(size=(B, T, 1))
    case = Case({"inp": x, "weight": 1 + 0.3 * n(size=C), "bias": 0.3 * n(size=C), "dout": n(size=(B, T, C)),
                 "out": np.zeros((B, T, C)), "dinp": np.zeros((B, T, C)), "dweight": np.zeros(C),
                 "dbias": np.zeros(C), "mean": np.zeros((B, T)), "rstd": np.zeros((B, T))})

    def fwd_ref(h):
        out, mean, rstd = np.empty((B, T, C)), np.empty((B, T)), np.empty((B, T))
        layernorm.layernorm_forward_ref(out, mean, rstd, h["inp"], h["weight"], h["bias"])
        return {"out": out, "mean": mean, "rstd": rstd}

    def bwd_ref(h):
        _, mean, rstd = fwd_ref(h).values()
        g = [np.zeros((B, T, C)), np.zeros(C), np.zeros(C)]
        layernorm.layernorm_backward_ref(*g, h["dout"], h["inp"], h["weight"], mean, rstd)
        return dict(zip(("dinp", "dweight", "dbias"), g))
    case.add("forward", lambda dev, k, d: k.layernorm_forward(dev, d["out"], d["mean"], d["rstd"], d["inp"],
                                                               d["weight"], d["bias"]), ("out", "mean", "rstd"),
             fwd_ref, ("inp", "out", "mean", "rstd"))
    case.add("backward", lambda dev, k, d: k.layernorm_backward(dev, d["dinp"], d["dweight"], d["dbias"],
                                                                 d["dout"], d["inp"], d["weight"], d["mean"],
                                                                 d["rstd"]), ("dinp", "dweight", "dbias"),
             bwd_ref, ("dout", "inp", "dinp", "dinp", "mean", "rstd"))       # dweight, dbias: small
    return case


def matmul_case(cfg, B: int, T: int, rng) -> Case:
    """The matmul layer's inputs and passes."""
    # the MLP's first product: C -> 4C
    C = cfg.channels
    n = rng.normal
    OC = 4 * C
    case = Case({"inp": n(size=(B, T, C)), "weight": n(size=(OC, C)) * 0.02, "bias": n(size=OC) * 0.02,
                 "dout": n(size=(B, T, OC)), "out": np.zeros((B, T, OC)), "dinp": np.zeros((B, T, C)),
                 "dweight": np.zeros((OC, C)), "dbias": np.zeros(OC)}, cublas=True)

    def fwd_ref(h):
        out = np.empty((B, T, OC))
        matmul.matmul_forward_ref(out, h["inp"], h["weight"], h["bias"])
        return {"out": out}

    def bwd_ref(h):
        g = [np.zeros((B, T, C)), np.zeros((OC, C)), np.zeros(OC)]
        matmul.matmul_backward_ref(*g, h["dout"], h["inp"], h["weight"])
        return dict(zip(("dinp", "dweight", "dbias"), g))
    case.add("forward", lambda dev, k, d: k.matmul_forward(dev, d["out"], d["inp"], d["weight"], d["bias"]),
             ("out",), fwd_ref, flops=2 * B * T * C * OC)
    case.add("backward", lambda dev, k, d: k.matmul_backward(dev, d["dinp"], d["dweight"], d["dbias"], d["dout"],
                                                              d["inp"], d["weight"], dinp_accumulate=False),
             ("dinp", "dweight", "dbias"), bwd_ref, flops=4 * B * T * C * OC)
    return case


def attention_case(cfg, B: int, T: int, rng) -> Case:
    """The attention layer's inputs and passes."""
    C, NH = cfg.channels, cfg.num_heads
    n = rng.normal
    sq = (B, NH, T, T)
    case = Case({"inp": n(size=(B, T, 3 * C)), "dout": n(size=(B, T, C)), "out": np.zeros((B, T, C)),
                 "preatt": np.zeros(sq), "att": np.zeros(sq), "dinp": np.zeros((B, T, 3 * C)),
                 "dpreatt": np.zeros(sq), "datt": np.zeros(sq)}, cublas=True)

    def fwd_ref(h):
        out, pre, att = np.empty((B, T, C)), np.empty(sq), np.empty(sq)
        attention.attention_forward_ref(out, pre, att, h["inp"], NH)
        return {"out": out, "att": att}

    def bwd_ref(h):
        dinp = np.zeros((B, T, 3 * C))
        attention.attention_backward_ref(dinp, np.empty(sq), np.empty(sq), h["dout"], h["inp"],
                                         fwd_ref(h)["att"], NH)
        return {"dinp": dinp}
    # the model's calls: att and dpreatt zero above the diagonal from the start (upper_is_zero)
    case.add("forward", lambda dev, k, d: k.attention_forward(dev, d["out"], d["preatt"], d["att"], d["inp"], NH,
                                                               upper_is_zero=True), ("out", "att"), fwd_ref,
             flops=4 * B * T * T * C)
    case.add("backward", lambda dev, k, d: k.attention_backward(dev, d["dinp"], d["dpreatt"], d["datt"],
                                                                 d["dout"], d["inp"], d["att"], NH,
                                                                 accumulate=False, upper_is_zero=True),
             ("dinp",), bwd_ref, flops=8 * B * T * T * C)
    return case


def flash_case(cfg, B: int, T: int, rng) -> Case:
    """The flash layer's inputs and passes."""
    C, NH = cfg.channels, cfg.num_heads
    n = rng.normal
    # --attention flash: the same math as "attention" without the (B,NH,T,T) buffers; its flop count is
    # the attention rows' (the whole T x T products), so the two layers' rows compare by time
    case = Case({"inp": n(size=(B, T, 3 * C)), "dout": n(size=(B, T, C)), "out": np.zeros((B, T, C)),
                 "lse": np.zeros((B, NH, T)), "dinp": np.zeros((B, T, 3 * C))})

    def fwd_ref(h):
        out, lse = np.empty((B, T, C)), np.empty((B, NH, T))
        flash_attention.flash_attention_forward_ref(out, lse, h["inp"], NH)
        return {"out": out, "lse": lse}

    def bwd_ref(h):
        f = fwd_ref(h)
        dinp = np.zeros((B, T, 3 * C))
        flash_attention.flash_attention_backward_ref(dinp, h["dout"], h["inp"], f["out"], f["lse"], NH,
                                                     accumulate=False)
        return {"dinp": dinp}
    case.add("forward", lambda dev, k, d: k.flash_attention_forward(dev, d["out"], d["lse"], d["inp"], NH),
             ("out", "lse"), fwd_ref, flops=4 * B * T * T * C)
    case.add("backward", lambda dev, k, d: k.flash_attention_backward(dev, d["dinp"], d["dout"], d["inp"],
                                                                       d["out"], d["lse"], NH,
                                                                       accumulate=False),
             ("dinp",), bwd_ref, flops=8 * B * T * T * C)
    return case


def gelu_case(cfg, B: int, T: int, rng) -> Case:
    """The gelu layer's inputs and passes."""
    C = cfg.channels
    n = rng.normal
    shape = (B, T, 4 * C)
    case = Case({"inp": n(size=shape) * 2, "dout": n(size=shape), "out": np.zeros(shape),
                 "dinp": np.zeros(shape)})

    def fwd_ref(h):
        out = np.empty(shape)
        gelu.gelu_forward_ref(out, h["inp"])
        return {"out": out}

    def bwd_ref(h):
        dinp = np.empty(shape)
        gelu.gelu_backward_ref(dinp, h["inp"], h["dout"], accumulate=False)
        return {"dinp": dinp}
    case.add("forward", lambda dev, k, d: k.gelu_forward(dev, d["out"], d["inp"]), ("out",), fwd_ref,
             ("inp", "out"))
    case.add("backward", lambda dev, k, d: k.gelu_backward(dev, d["dinp"], d["inp"], d["dout"],
                                                            accumulate=False), ("dinp",), bwd_ref,
             ("inp", "dout", "dinp"))
    return case


def residual_case(cfg, B: int, T: int, rng) -> Case:
    """The residual layer's inputs and passes."""
    C = cfg.channels
    n = rng.normal
    shape = (B, T, C)
    case = Case({"inp1": n(size=shape), "inp2": n(size=shape), "dout": n(size=shape), "out": np.zeros(shape),
                 "dinp1": n(size=shape), "dinp2": n(size=shape)})

    def fwd_ref(h):
        out = np.empty(shape)
        residual.residual_forward_ref(out, h["inp1"], h["inp2"])
        return {"out": out}

    def bwd_ref(h):
        d1, d2 = h["dinp1"].copy(), h["dinp2"].copy()
        residual.residual_backward_ref(d1, d2, h["dout"])
        return {"dinp1": d1, "dinp2": d2}
    case.add("forward", lambda dev, k, d: k.residual_forward(dev, d["out"], d["inp1"], d["inp2"]), ("out",),
             fwd_ref, ("inp1", "inp2", "out"))
    case.add("backward", lambda dev, k, d: k.residual_backward(dev, d["dinp1"], d["dinp2"], d["dout"]),
             ("dinp1", "dinp2"), bwd_ref, ("dout", "dinp1", "dinp1", "dinp2", "dinp2"))
    return case


def classifier_case(cfg, B: int, T: int, rng) -> Case:
    """The classifier layer's inputs and passes."""
    V, Vp = cfg.vocab_size, cfg.padded_vocab_size
    n = rng.normal
    case = Case({"logits": n(size=(B, T, Vp)) * 3, "losses": np.zeros((B, T))},
                {"targets": rng.integers(0, V, (B, T)).astype(np.int32)})
    dloss = 1.0 / (B * T)

    def fwd_ref(h):
        losses = np.empty((B, T))
        classifier.classifier_forward_ref(losses, np.empty((B, T, Vp)), h["logits"], h["targets"], V)
        return {"losses": losses}

    def bwd_ref(h):
        losses, x = np.empty((B, T)), h["logits"].copy()
        classifier.classifier_fused_ref(losses, x, h["targets"], dloss, V)
        return {"losses": losses, "logits": x}
    # forward: the losses (llmz.model's forward); backward: losses and dlogits over the logits in place
    case.add("forward", lambda dev, k, d: k.classifier_loss(dev, d["losses"], d["logits"], d["targets"], V),
             ("losses",), fwd_ref, ("logits",))
    case.add("backward", lambda dev, k, d: k.classifier_fused(dev, d["losses"], d["logits"], d["targets"],
                                                               dloss, V), ("losses", "logits"), bwd_ref,
             ("logits", "logits", "logits"))           # read twice (the fast kernel), written once
    return case


def adamw_case(cfg, B: int, T: int, rng) -> Case:
    """The adamw layer's inputs and passes."""
    n = rng.normal
    N = cfg.num_parameters()
    beta1, beta2, eps, wd, decay = 0.9, 0.95, 1e-8, 0.1, N // 2
    scalars = np.array([3e-4, 0.7, 1 - beta1 ** 5, 1 - beta2 ** 5, 5])
    case = Case({"params": n(size=N) * 0.02, "grads": n(size=N) * 1e-2, "m": n(size=N) * 1e-3,
                 "v": rng.random(N) * 1e-5 + 1e-7, "scalars": scalars})

    def update_ref(h):
        p, m, v = h["params"].copy(), h["m"].copy(), h["v"].copy()
        adamw.adamw_update_ref(p, h["grads"], m, v, decay, scalars, beta1, beta2, eps, wd)
        return {"params": p, "m": m, "v": v}

    def update(dev, k, d):
        if d["params"].dtype == np.uint16:      # bf16: the master copy moves, the bf16 params are rounded
            return k.adamw_update_bf16(dev, d["params"], d["master"], d["grads"], d["m"], d["v"], decay,
                                       d["scalars"], beta1, beta2, eps, wd, 1234)
        k.adamw_update(dev, d["params"], d["grads"], d["m"], d["v"], decay, d["scalars"], beta1, beta2, eps, wd)
    case.add("update", update, ("params", "m", "v"), update_ref,
             ("grads", "params", "params", "m", "m", "v", "v"))
    return case


def norm_case(cfg, B: int, T: int, rng) -> Case:
    """The norm layer's inputs and passes."""
    n = rng.normal
    N = cfg.num_parameters()
    case = Case({"x": n(size=N) * 1e-2, "norm_sq": np.zeros(1), "norm_scratch": np.zeros(256)})
    case.add("norm^2", lambda dev, k, d: k.norm_squared(dev, d["norm_sq"], d["x"], d["norm_scratch"]),
             ("norm_sq",), lambda h: {"norm_sq": np.array([np.sum(h["x"] ** 2)])}, ("x",))
    return case


def accumulate_case(cfg, B: int, T: int, rng) -> Case:
    """The accumulate layer's inputs and passes."""
    # one block's bucket, rank 1 of 2 ranks
    C = cfg.channels
    n = rng.normal
    nb = 12 * C * C + 13 * C
    case = Case({"shard": n(size=nb) * 1e-2, "slot": n(size=2 * nb) * 1e-3})

    def accumulate(dev, k, d):
        if d["shard"].dtype == np.uint16:
            return k.accumulate_shard_bf16(dev, d["shard"], d["slot"], 1, 1234, 0)
        k.accumulate_shard(dev, d["shard"], d["slot"], 1)
    case.add("accumulate", accumulate, ("shard", "slot"),
             lambda h: {"shard": h["shard"] + h["slot"][nb:], "slot": np.zeros(2 * nb)},
             ("shard", "shard", "slot", "slot"))
    return case


CASES = {"encoder": encoder_case, "layernorm": layernorm_case, "matmul": matmul_case, "attention": attention_case,
         "flash": flash_case, "gelu": gelu_case, "residual": residual_case, "classifier": classifier_case,
         "adamw": adamw_case, "norm": norm_case, "accumulate": accumulate_case}


def make_case(layer: str, cfg, B: int, T: int, rng) -> Case:
    """The inputs and passes of one layer at these sizes (C, NH, V, Vp from cfg)."""
    if layer not in CASES:
        raise ValueError(f"unknown layer {layer!r}; choose from {', '.join(LAYERS)}")
    return CASES[layer](cfg, B, T, rng)


def to_device(dev, case: Case, dtype):
    """The case's arrays on dev: values in dtype (bf16: uint16 bits), statistics and losses float32 beside bf16
    (as llmz.model keeps them), AdamW's master, m, v float32, the norm's and scalars float64; ints as int32."""
    from ..bf16 import f32_to_bf16
    bf16 = np.dtype(dtype) == np.uint16
    d = {}
    for name, a in case.arrays.items():
        if name in FLOAT64:
            d[name] = dev.asarray(a, np.float64)
        elif bf16 and name in ("mean", "rstd", "losses", "m", "v", "lse"):
            d[name] = dev.asarray(a, np.float32)
        elif bf16:
            d[name] = dev.asarray(f32_to_bf16(a.astype(np.float32)))
        else:
            d[name] = dev.asarray(a, dtype)
    if bf16 and "params" in d:
        d["master"] = dev.asarray(case.arrays["params"], np.float32)
    for name, a in case.ints.items():
        d[name] = dev.asarray(a, np.int32)
    return d


def to_host64(dev, a) -> np.ndarray:
    from ..bf16 import bf16_to_f32
    a = dev.to_host(a)
    return (bf16_to_f32(a) if a.dtype == np.uint16 else a).astype(np.float64)


@functools.cache
def hold_kernel():
    """A kernel for one thread that sleeps ~ms milliseconds (nanosleep takes at most ~1 ms a call); built on
    first use, as numba may only be imported once the device kind is settled (llmz.device)."""
    from numba import cuda

    @cuda.jit
    def hold(ms):
        for _ in range(ms):
            cuda.nanosleep(1000000)
    return hold


def time_ms(dev, call, reps: int) -> float:
    """Milliseconds per call: on the GPU CUDA events around `reps` calls queued while the GPU waits; elsewhere
    the wall time of one call."""
    dev.synchronize()
    if dev.kind != "gpu":
        t0 = time.perf_counter()
        call()
        dev.synchronize()
        return (time.perf_counter() - t0) * 1e3
    import cupy

    e0, e1 = dev.event(timing=True), dev.event(timing=True)
    dev.launch(hold_kernel(), 1, 1, HOLD_MS)
    e0.record(dev.compute_stream)
    for _ in range(reps):
        call()
    e1.record(dev.compute_stream)
    e1.synchronize()
    return cupy.cuda.get_elapsed_time(e0.cupy, e1.cupy) / reps


def run_passes(version: str, dev, k, d: dict, case: Case, refs: dict, reps: int) -> list:
    """One version's rows: each pass checked against its reference, then timed."""
    rows = []
    launch = dev.launch
    for name, call, outputs, _, traffic, flops in case.passes:
        ran = []

        def recording(kernel, *args, ran=ran, **kw):
            ran.append(kernel.py_func.__name__)
            launch(kernel, *args, **kw)
        dev.launch = recording
        try:
            call(dev, k, d)                     # the checked call (it compiles, too)
        finally:
            dev.launch = launch
        err = max(rel_err(to_host64(dev, d[o]), refs[name][o]) for o in outputs)
        names = sorted(set(ran), key=ran.index) + (["cuBLAS"] if dev.matmul == "cublas" and case.cublas else [])
        ms = time_ms(dev, lambda call=call: call(dev, k, d), reps)
        nbytes = sum(d[a].nbytes for a in traffic)
        rate = f"{flops / ms / 1e9:7.2f} TFLOP/s" if flops else f"{nbytes / ms / 1e6:7.1f} GB/s"
        rows.append((version, name, ", ".join(names) or "(NumPy reference)", err, ms * 1e3, rate))
    return rows


def run_layer(layer: str, cfg, B: int, T: int, kind: str, dtype, reps: int, tf32: bool, seed: int = 0) -> list:
    """The rows of one layer: (version, pass, kernels, error, us per call, rate text) for teaching and fast."""
    from ..device import Device
    case = make_case(layer, cfg, B, T, np.random.default_rng(seed))
    rows, refs = [], None
    for version in ("teaching", "fast"):
        if version == "fast" and kind == "cpu":
            rows.append((version, "-", "needs --device gpu or sim", None, None, ""))
            continue
        # the attention layer's fast version is the gemm path wherever it runs (flash is the "flash" layer)
        gemm = layer == "attention" and version == "fast" and kind == "gpu"
        dev = Device(kind, dtype, kernel_set=version, tf32=tf32, attention="gemm" if gemm else "auto")
        d = to_device(dev, case, dtype)
        if refs is None:
            # the references on the values the device holds (bf16: the rounded ones; AdamW's master)
            host = {name: to_host64(dev, a) for name, a in d.items()}
            host.update(case.ints)
            if "master" in host:
                host["params"] = host["master"]
            refs = {name: reference(host) for name, _, _, reference, _, _ in case.passes}
        if layer == "encoder" and dev.fast:
            from ..fast.encoder import wte_buckets_upload
            d["buckets"] = wte_buckets_upload(dev, case.ints["inp"])
        rows += run_passes(version, dev, dev.ops, d, case, refs, reps)
    return rows


def main(args, kind: str) -> int:
    """The --layer mode of python -m llmz.bench: print each layer's rows."""
    from ..config import preset
    from ..precision import PRECISIONS
    layers = LAYERS if args.layer == "all" else tuple(args.layer.split(","))
    for layer in layers:
        if layer not in LAYERS:
            raise SystemExit(f"error: unknown --layer {layer!r}; choose from {', '.join(LAYERS)} or all")
    B, T = args.batch_size or 4, args.seq_len
    cfg = preset(args.model, vocab_size=args.vocab_size, max_seq_len=T)
    dtype = PRECISIONS[args.precision].storage
    for layer in layers:
        print(f"layer {layer}: {args.model} (C={cfg.channels}, NH={cfg.num_heads}, Vp={cfg.padded_vocab_size}), "
              f"B={B} T={T}, {args.precision}, device {kind}, {args.reps} timed calls")
        print(f"  {'version':<9}{'pass':<12}{'rel. error':>11}{'us/call':>12}{'rate':>18}   kernels")
        for version, name, names, err, us, rate in run_layer(layer, cfg, B, T, kind, dtype, args.reps,
                                                             not args.no_tf32):
            if err is None:
                print(f"  {version:<9}{name:<12}{'':>11}{'':>12}{'':>18}   {names}")
                continue
            print(f"  {version:<9}{name:<12}{err:>11.2e}{us:>12.1f}{rate:>18}   {names}")
    return 0
