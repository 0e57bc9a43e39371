"""python -m llmz.bench: time llmz's training step, kernel by kernel, and beside PyTorch.

Trains `--model` on random tokens through llmz.trainer.Trainer (the same step that `python -m llmz.train`
runs: CUDA graphs, ZeRO stage, everything) for a few warm-up and then timed steps, and prints ms per step,
tokens/s, MFU and the GPU memory held. With no flags: on a GPU, GPT-2 124M (d12) at B=16, T=1024, as llm.c
benchmarks it; on a CPU, the model of llmz.train's default run (small) at its B=16, T=64, about 10 s on 2
cores. `--per-kernel` adds a table of every kernel's time, `--vs-torch` the same step in PyTorch, `--layer`
times one layer instead of the step (`--help` says each).

The package: this file is the command and the step's timing; layers.py times one layer's teaching and fast
versions (--layer), torch_ref.py the same step in PyTorch (--vs-torch).
"""
from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time

import numpy as np

from ..args import Parser, check_bench, check_kernels, check_train
from ..config import RECOMPUTE, ZERO_STAGES, TrainConfig, describe_presets, preset
from ..data import write_tokens
from ..device import ATTENTIONS, KERNEL_SETS, KINDS, MATMULS, resolve
from ..precision import PRECISIONS
from ..run.launch import abort_on_error, init_ranks
from ..run.log import mfu
from . import torch_ref

# the card's ceilings for the per-kernel table: HBM bandwidth, dense tensor-core throughput
CEILINGS = {"H200": {"GB/s": 4800.0, "fp32": 494.7, "bf16": 989.4},
            "H100": {"GB/s": 3350.0, "fp32": 494.7, "bf16": 989.4}}


# What runs when a flag is not given, by device: (model, B, T, warm-up steps, timed steps). On a GPU GPT-2 124M
# as llm.c benchmarks it; on a CPU the model of llmz.train's default run at its B and T; in the simulator,
# which runs every CUDA thread as a Python thread (seconds a step even for tiny), tiny on a few positions.
DEFAULTS = {"gpu": ("d12", 16, 1024, 3, 10), "cpu": ("small", 16, 64, 3, 10), "sim": ("tiny", 1, 4, 1, 2)}
LAYER_B = 4             # --layer: B at most 4 (d48's layers fit one GPU)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m llmz.bench", description=__doc__.split("\n\n")[1].replace("\n", " "))
    a = p.add_argument
    a("--device", choices=KINDS, default="auto", help="gpu (CuPy and the Numba kernels), cpu (the NumPy "
      "references), sim (the kernels in Numba's CUDA simulator: slow) or auto: gpu where CuPy sees one, else cpu")
    a("--model", default=None, help=f"a preset, the same model as in llmz.train (parameters at maxT 1024): "
      f"{describe_presets()} (default: d12 on gpu, GPT-2 124M; small on cpu, the default training run's; tiny "
      "on sim)")
    a("--vocab-size", type=int, default=None, help="V, the range of the random tokens (default: the preset's, "
      "256 or GPT-2's 50257 as --model says)")
    a("-b", "--batch-size", type=int, default=None, help=f"B (default: 16 on gpu and cpu, 1 on sim; at most "
      f"{LAYER_B} with --layer)")
    a("-t", "--seq-len", type=int, default=None, help="T (default: 1024 on gpu, 64 on cpu, 4 on sim)")
    a("--precision", choices=tuple(PRECISIONS), default="fp32", help="as in llmz.train: fp32, bf16 (bf16 "
      "values, fp32 master weights and optimizer state) or fp64 (cpu and sim only)")
    a("--kernels", choices=KERNEL_SETS, default="auto", help="as in llmz.train: fast (GPU default) or teaching")
    a("--matmul", choices=MATMULS, default="auto", help="as in llmz.train: cublas or numba (the tiled kernel)")
    a("--attention", choices=ATTENTIONS, default="auto", help="as in llmz.train: flash, gemm or direct "
      "(default auto: on a GPU flash in bf16, gemm in fp32)")
    a("--no-tf32", action="store_true", help="as in llmz.train: cuBLAS fp32 products in full fp32, not TF32")
    a("--no-cuda-graph", action="store_true", help="as in llmz.train: launch every kernel from Python each step "
      "instead of replaying the step as a CUDA graph")
    a("--recompute", "-r", type=int, choices=RECOMPUTE, default=0, help="as in llmz.train: 1 recomputes GELU "
      "in backward, 2 also the layernorms, 3 also attention's softmax (less activation memory, the same numbers)")
    a("--zero-stage", type=int, choices=ZERO_STAGES, nargs="+", default=[0], metavar="STAGE",
      help="ZeRO stage(s); several (e.g. 0 1 2 3) are timed one after another in this process, one row each")
    a("--warmup", type=int, default=None, help="untimed steps first: compilation, CUDA graph capture, caches "
      "(default: 3; 1 on sim)")
    a("--steps", type=int, default=None, help="timed steps; the median is printed (default: 10; 2 on sim)")
    a("--per-kernel", action="store_true", help="one more step, eager, with CUDA events around every kernel and "
      "cuBLAS call: each kernel's time per step, its share, and the TFLOP/s or GB/s it reached against the "
      "card's ceilings (GPU only)")
    a("--vs-torch", nargs="?", const="eager", default=None, choices=("eager", "compile", "both"),
      help="after llmz, a nanoGPT-style PyTorch GPT-2 of the same shapes, precision and optimizer "
      "(llmz.bench.torch_ref: SDPA, fused AdamW, autocast bf16), eager (the default), torch.compile'd, or both: its "
      "ms, tokens/s, peak memory and the ratio (default: not run)")
    a("--torch-attention", choices=("sdpa", "manual"), default="sdpa",
      help="PyTorch's attention: scaled_dot_product_attention (nanoGPT) or the explicit softmax")
    a("--layer", default=None, metavar="NAME", help="instead of the step, one layer's teaching and fast "
      "versions side by side at the model's sizes (llm.c's dev/cuda role: llmz.bench.layers): error against "
      "the NumPy reference, us per call, GB/s or TFLOP/s. NAME: encoder, layernorm, matmul, attention, flash, "
      "gelu, residual, classifier, adamw, norm, accumulate, a comma-separated list, or all (default: the step)")
    a("--reps", type=int, default=20, help="--layer: timed calls per version and pass")
    return p


def fill_defaults(args, kind: str) -> None:
    """The flags not given, filled in for the device (DEFAULTS)."""
    model, B, T, warmup, steps = DEFAULTS[kind]
    args.model = args.model or model
    args.batch_size = args.batch_size or (min(B, LAYER_B) if args.layer else B)
    args.seq_len = args.seq_len or T
    args.warmup = warmup if args.warmup is None else args.warmup
    args.steps = args.steps or steps


def make_run(args, kind: str, data_path: str, stage: int):
    """An llmz.trainer.Trainer of `args` at ZeRO `stage`, training on the token file at data_path."""
    from ..trainer import Trainer  # numba loads here, after the device is resolved (the simulator)
    cfg = TrainConfig(device=kind, precision=args.precision, kernels=args.kernels, matmul=args.matmul,
                      attention=args.attention, no_tf32=args.no_tf32, no_cuda_graph=args.no_cuda_graph,
                      zero_stage=stage, model=args.model, vocab_size=args.vocab_size, train_data=data_path,
                      recompute=args.recompute, val_data="", batch_size=args.batch_size, seq_len=args.seq_len,
                      steps=args.warmup + args.steps + 1, lr=3e-4, warmup_steps=0, quiet=True)
    cfg = cfg.for_device(kind)
    check_train(cfg, kind)
    return Trainer(cfg, kind, init_ranks())


def gpu_name(dev) -> str:
    return dev.xp.cuda.runtime.getDeviceProperties(dev.gpu_index)["name"].decode() if dev.kind == "gpu" else ""


PACE_EVERY = 48        # --per-kernel: a hold kernel before every 48th timed region ...
PACE_MS = 40           # ... sleeping longer than the host takes to queue them (~5 ms) and their events


class Pacer:
    """Keeps the GPU behind the host while every kernel is timed between two events: before every PACE_EVERY-th
    timed region, an untimed kernel that sleeps PACE_MS while the host queues the next regions. A pair of events
    around a kernel the GPU reaches before the host has launched it counts the launch (30-600 us), not the
    kernel; one hold before a whole micro-step is not enough at d48 (~1,700 kernels and twice as many events
    fill CUDA's launch queue, the host then waits for the GPU and falls behind: that table summed to 285 ms
    against a 215 ms graphed step). `late`: the holds after which the host took longer than PACE_MS to queue
    the next regions (the GPU may then have waited for it): 0, or the table is not the GPU's alone."""

    def __init__(self, dev):
        self.dev, self.n, self.holds, self.late, self.t = dev, 0, 0, 0, None

    def __call__(self):
        if self.n % PACE_EVERY == 0:
            now = time.perf_counter()
            if self.t is not None and (now - self.t) * 1e3 > 0.9 * PACE_MS:
                self.late += 1
            dev = self.dev
            profile, dev.profile = dev.profile, None
            from .layers import hold_kernel  # numba: the device is resolved by now
            dev.launch(hold_kernel(), 1, 1, PACE_MS)
            dev.profile = profile
            self.holds += 1
            self.t = time.perf_counter()
        self.n += 1


def per_kernel(run, step: int, precision: str, graphed_ms: float | None = None) -> str:
    """One eager step with a CUDA event pair around every kernel and cuBLAS call: the table as text. (Events
    cannot be timed inside a replayed graph: CUDA refuses it, measured on the H200.) The Pacer keeps the GPU
    behind the host, so the pairs time the GPU's work alone; the table's sum is then compared with the graphed
    step (graphed_ms): within a few percent when the method holds (the graph adds ~1 us a launch between
    kernels and nothing else)."""
    import cupy
    dev = run.dev
    dev.synchronize()
    enabled, run.graphs.enabled = run.graphs.enabled, False
    pacer = Pacer(dev)
    dev.profile, dev.profile_pace = [], pacer
    try:
        run.step(step)
        dev.synchronize()
        records = [(r, cupy.cuda.get_elapsed_time(r[1].cupy, r[2].cupy)) for r in dev.profile]
    finally:
        dev.profile, dev.profile_pace, run.graphs.enabled = None, None, enabled
    rows: dict[str, list] = {}
    for (name, _, _, flops, nbytes), ms in records:
        r = rows.setdefault(name, [0, 0.0, 0, 0])
        r[0] += 1
        r[1] += ms
        r[2] += flops
        r[3] += nbytes
    total = sum(r[1] for r in rows.values())
    ceil = next((v for k, v in CEILINGS.items() if k in gpu_name(dev)), None)
    against = (f"; {100 * total / graphed_ms:.1f}% of the graphed step's {graphed_ms:.2f} ms" if graphed_ms else "")
    lines = [f"per kernel, one eager step ({len(records)} launches behind {pacer.holds} holds, {pacer.late} "
             f"late; sum {total:.2f} ms{against}):",
             f"  {'kernel':<36}{'calls':>6}{'ms/step':>10}{'share':>8}{'achieved':>14}{'of ceiling':>12}"]
    for name, (calls, ms, flops, nbytes) in sorted(rows.items(), key=lambda kv: -kv[1][1]):
        if flops:
            rate, unit = flops / (ms * 1e-3) / 1e12, "TFLOP/s"
            peak = ceil and ceil["bf16" if precision == "bf16" else "fp32"]
        else:
            rate, unit = nbytes / (ms * 1e-3) / 1e9, "GB/s"
            peak = ceil and ceil["GB/s"]
        frac = f"{rate / peak * 100:9.1f}%" if peak else ""
        lines.append(f"  {name:<36}{calls:>6}{ms:>10.2f}{ms / total * 100:>7.1f}%{rate:>8.1f} {unit:<7}{frac:>10}")
    return "\n".join(lines)


def bench_stage(args, kind: str, cfg, path: str, stage: int) -> dict:
    """Warm up, then time args.steps steps of `stage`; prints its lines and returns its row."""
    B, T = args.batch_size, args.seq_len
    run = make_run(args, kind, path, stage)
    dev = run.dev
    paths = (f"{dev.kernel_set} kernels, matmul {dev.matmul}"
             f"{' (TF32)' if dev.matmul == 'cublas' and dev.tf32 and args.precision == 'fp32' else ''}, "
             f"attention {dev.attention}" if dev.kind != "cpu" else "the NumPy references")
    print(f"bench: {' '.join(filter(None, (dev.kind, gpu_name(dev), args.precision)))}, {paths}, CUDA graphs "
          f"{'on' if run.graphs.enabled else 'off'}, ZeRO stage {stage}; model {args.model} "
          f"(L={cfg.num_layers} C={cfg.channels} V={cfg.vocab_size}: {cfg.num_parameters():,} parameters), "
          f"B={B} T={T}")
    for i in range(args.warmup):
        run.step(i)
    dev.synchronize()
    times = []
    for i in range(args.warmup, args.warmup + args.steps):
        t0 = time.perf_counter()
        out = run.step(i)          # ends with the host reading the loss and the norm: a full sync
        times.append(time.perf_counter() - t0)
    ms = float(np.median(times)) * 1e3
    tps = B * T / (ms / 1e3)
    util = mfu(tps, cfg, T, dev, args.precision)
    row = {"stage": stage, "ms": ms, "tokens_per_s": tps, "mfu": util, "loss": out["loss"],
           "graphs": run.graphs.enabled, "gib": None}
    print(f"  training step {ms:9.2f} ms (median of {args.steps}) {tps:12,.0f} tokens/s"
          + (f"   MFU {util * 100:.1f}%" if util is not None else "") + f"   loss {out['loss']:.4f}")
    held = ""
    if dev.kind == "gpu":
        pool = dev.xp.get_default_memory_pool()
        free, total = dev.xp.cuda.runtime.memGetInfo()
        row["gib"] = pool.total_bytes() / 2**30
        held = f"; CuPy pool {row['gib']:.2f} GiB; in use on the card {(total - free) / 2**30:.2f} GiB"
    print(f"  memory, --recompute {args.recompute}: predicted {run.memory['predicted_total'] / 2**30:.2f} GiB "
          f"(llmz.memory){held}")
    if args.per_kernel:
        print(per_kernel(run, args.warmup + args.steps, args.precision, ms if run.graphs.enabled else None)
              if dev.kind == "gpu"
              else "per kernel: needs a GPU (CUDA events)")
    run.comm.close()
    del run
    if kind == "gpu":                  # the next stage starts from an empty pool, as a fresh process would
        import cupy
        gc.collect()
        cupy.get_default_memory_pool().free_all_blocks()
    return row


def main(argv=None) -> int:
    with abort_on_error():               # a bad flag or file: one line; Ctrl-C: one line
        args = build_parser().parse_args(argv)
        check_bench(args)
        return bench(args)


def bench(args) -> int:
    kind = resolve(args.device)
    check_kernels(args, kind)
    fill_defaults(args, kind)
    if args.layer:
        from . import layers  # it imports the kernels, so numba: after the device is resolved
        return layers.main(args, kind)
    cfg = preset(args.model, vocab_size=args.vocab_size)
    B, T = args.batch_size, args.seq_len
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        # random tokens, enough for every step to read a fresh batch
        path = os.path.join(tmp, "bench_tokens.bin")
        n = B * T * (args.warmup + args.steps + 3) + 1
        write_tokens(path, np.random.default_rng(0).integers(0, cfg.vocab_size, n, dtype=np.int64))
        for stage in args.zero_stage:
            rows.append(bench_stage(args, kind, cfg, path, stage))
    if len(rows) > 1:
        print(f"stages side by side ({args.precision}, B={B} T={T}, one rank):")
        print(f"  {'stage':>5} {'graphs':>6} {'ms/step':>9} {'tokens/s':>11} {'MFU':>6} {'vs first':>9} {'GiB':>6}"
              f" {'loss':>8}")
        for r in rows:
            util = f"{r['mfu'] * 100:5.1f}%" if r["mfu"] is not None else "     -"
            gib = f"{r['gib']:6.2f}" if r["gib"] is not None else "     -"
            print(f"  {r['stage']:>5} {'on' if r['graphs'] else 'off':>6} {r['ms']:9.2f} {r['tokens_per_s']:11,.0f}"
                  f" {util} {r['ms'] / rows[0]['ms'] - 1:+8.1%} {gib} {r['loss']:8.4f}")
    tps = rows[-1]["tokens_per_s"]
    if args.vs_torch:
        for mode in ("eager", "compile") if args.vs_torch == "both" else (args.vs_torch,):
            r = torch_ref.torch_bench(cfg, B, T, args.precision, args.steps, args.warmup,
                                      attention=args.torch_attention, compile=mode == "compile")
            print(f"  PyTorch {r['torch_version']} {'torch.compile' if mode == 'compile' else 'eager'} "
                  f"({r['attention']}, {args.precision}"
                  f"{', TF32' if args.precision == 'fp32' else ', autocast' if args.precision == 'bf16' else ''}): "
                  f"{r['ms']:9.2f} ms {r['tokens_per_s']:12,.0f} tokens/s, peak {r['peak_bytes'] / 2**30:.2f} GiB "
                  f"allocated, {r['reserved_bytes'] / 2**30:.2f} GiB reserved")
            print(f"  llmz / PyTorch {mode} = {tps / r['tokens_per_s']:.3f}")
    return 0

