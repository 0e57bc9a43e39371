"""python -m llmz.bench: time GPT-2's forward+backward and the whole training step on one device.

Prints ms per forward+backward and per optimizer step, tokens/s and (on a known GPU) MFU, and the peak
memory. The teaching kernels are what runs today; faster paths are measured against these numbers.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from .device import KINDS, resolve


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m llmz.bench", description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=KINDS, default="auto")
    p.add_argument("--model", default="d12")
    p.add_argument("--vocab-size", type=int, default=50257)
    p.add_argument("-b", "--batch-size", type=int, default=4)
    p.add_argument("-t", "--seq-len", type=int, default=1024)
    p.add_argument("--precision", choices=("fp32", "fp64"), default="fp32")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args(argv)
    kind = resolve(args.device)
    from .comm import make_communicator
    from .config import preset
    from .device import Device
    from .launch import init_ranks
    from .layout import Layout, init_parameters
    from .model import GPT2
    from .optim import AdamW
    from .train import mfu
    from .zero import make_stage
    dtype = np.float64 if args.precision == "fp64" else np.float32
    cfg = preset(args.model, vocab_size=args.vocab_size)
    B, T = args.batch_size, args.seq_len
    dev = Device(kind, dtype)
    layout = Layout(cfg, 1)
    ranks = init_ranks()
    comm = make_communicator("auto", ranks, dev)
    stage = make_stage(0, layout, dev, comm, AdamW(), init_parameters(layout, 0))
    model = GPT2(cfg, dev, B, T)
    rng = np.random.default_rng(0)
    x = dev.asarray(rng.integers(0, cfg.vocab_size, (B, T)), np.int32)
    y = dev.asarray(rng.integers(0, cfg.vocab_size, (B, T)), np.int32)
    print(f"bench: {dev.kind} {args.precision}, model {args.model} ({cfg.num_parameters():,} parameters), "
          f"B={B} T={T}")

    def fwd_bwd():
        model.forward(stage.pviews, x, y)
        model.backward(stage.pviews, stage, x, y, 1.0 / (B * T))

    def step(i):
        fwd_bwd()
        stage.reduce_gradients()
        stage.update(i)

    for name, fn in (("forward+backward", lambda i: fwd_bwd()), ("training step", step)):
        for i in range(args.warmup):
            fn(i)
        dev.synchronize()
        times = []
        for i in range(args.steps):
            t0 = time.perf_counter()
            fn(i)
            dev.synchronize()
            times.append(time.perf_counter() - t0)
        ms = float(np.median(times)) * 1e3
        tps = B * T / (ms / 1e3)
        util = mfu(tps, cfg, T, dev, args.precision)
        print(f"  {name:<17} {ms:10.1f} ms (median of {args.steps}) {tps:12.0f} tokens/s"
              + (f"   MFU {util * 100:.2f}%" if util is not None else ""))
    if dev.kind == "gpu":
        pool = dev.xp.get_default_memory_pool()
        print(f"  GPU memory held by CuPy's pool: {pool.total_bytes() / 2**30:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
