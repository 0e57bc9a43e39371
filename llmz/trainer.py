"""One rank's training, as a library: a TrainConfig in, a model that steps.

    run = Trainer(cfg, "cpu", init_ranks())     # device, communicator, data, model, ZeRO stage, AdamW
    run.step(0)["loss"]                         # K micro-steps of forward and backward, then the update

A Trainer holds everything one rank needs to train: device, communicator, data, model, its ZeRO stage
(llmz.zero), AdamW (llmz.optim); its step is K micro-steps of forward and backward, then the stage's update.
It starts from `start` (a Start: the model's config, layout, parameters and step), by default a fresh model
of cfg's preset. What a training run keeps around it (where it starts: --resume, --init-from; validation,
samples, checkpoints, the log, what stops it: nanoGPT's loop) is the run's housekeeping, llmz/run/:
llmz.run.loop's Run is a Trainer with all of that, and its train() is what `python -m llmz.train` runs.

Importing this module imports numba (the kernels, through llmz.zero): resolve the device first
(llmz.device.resolve), as the simulator needs.
"""
from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np

from . import memory
from .bf16 import bf16_to_f32
from .comm import make_communicator
from .config import GPT2Config, TrainConfig, default_model, preset
from .data import DataLoader, check_same_data
from .device import Device
from .graph import Graphs
from .layout import Layout, init_parameters
from .model import GPT2
from .optim import AdamW
from .precision import PRECISIONS
from .tokenizer import load_tokenizer
from .trace import Tracer
from .zero import make_stage


class Start(NamedTuple):
    """What a run starts from: the model's shape, its layout over the ranks, the full parameters (float64,
    or a file's values) and the step it continues at."""
    config: GPT2Config
    layout: Layout
    params: np.ndarray
    step: int = 0


def fresh_start(cfg: TrainConfig, kind: str, tok, world_size: int) -> Start:
    """A freshly initialised model of cfg's preset (llmz.layout.init_parameters, seeded by --seed)."""
    config = preset(cfg.model or default_model(kind), vocab_size=cfg.vocab_size, tokens=tok.vocab_size,
                    max_seq_len=cfg.max_seq_len or 1024)
    layout = Layout(config, world_size)
    return Start(config, layout, init_parameters(layout, cfg.seed))


class Trainer:
    """One rank's training, built from `cfg` (TrainConfig.for_device filled in) on a resolved device `kind`,
    from `start` (default: fresh_start). make_stage builds its ZeRO stage: llmz.zero's, or in the lessons
    their plain twin's (llmz.plain). tok: cfg's tokenizer where the caller has loaded it already."""

    def __init__(self, cfg: TrainConfig, kind: str, ranks, start: Start | None = None, make_stage=make_stage,
                 tok=None):
        self.cfg, self.ranks = cfg, ranks
        self.rank, self.world_size = ranks.rank, ranks.world_size
        self.precision = PRECISIONS[cfg.precision]
        self.dev = Device(kind, self.precision, gpu_index=ranks.local_rank, matmul=cfg.matmul,
                          attention=cfg.attention, tf32=not cfg.no_tf32, kernel_set=cfg.kernels)
        self.comm = make_communicator(cfg.comm, ranks, self.dev)
        self.tok = tok or load_tokenizer(cfg.tokenizer)
        config, self.layout, params, step = start or fresh_start(cfg, kind, self.tok, self.world_size)
        B, T, V = cfg.batch_size, cfg.seq_len, config.vocab_size
        self.train_loader = DataLoader(cfg.train_data, B, T, self.rank, self.world_size, shuffle=cfg.shuffle,
                                       seed=cfg.seed, vocab_size=V)
        self.val_loader = (DataLoader(cfg.val_data, B, T, self.rank, self.world_size, vocab_size=V)
                           if cfg.val_data else None)
        # every file's name, size and SHA-256, the same on every rank (a collective)
        self.data = check_same_data(ranks, {"--train-data": self.train_loader, "--val-data": self.val_loader})
        self.opt = AdamW(lr=cfg.lr, beta1=cfg.beta1, beta2=cfg.beta2, eps=cfg.eps,
                         weight_decay=cfg.weight_decay, grad_clip=cfg.grad_clip,
                         warmup_steps=cfg.warmup_steps, schedule=cfg.lr_schedule,
                         final_lr_frac=cfg.final_lr_frac, total_steps=cfg.steps)
        flash, value_bytes = self.dev.attention == "flash", self.precision.value_bytes
        if kind == "gpu":                           # refuse before the big allocations, not halfway
            free, total = self.dev.xp.cuda.runtime.memGetInfo()
            predicted = memory.predicted(self.layout, cfg.zero_stage, B, T, value_bytes, flash=flash,
                                         recompute=cfg.recompute)
            memory.check_fits(predicted, free, total, self.dev.gpu_index)
        self.model = GPT2(config, self.dev, B, T, recompute=cfg.recompute)    # its shape: self.model.config
        self.tracer = Tracer(self.dev, self.rank) if cfg.trace else None
        self.zero = make_stage(cfg.zero_stage, self.layout, self.dev, self.comm, self.opt, params,
                               overlap=not cfg.no_overlap, tracer=self.tracer, seed=cfg.seed, start_step=step)
        self.memory = memory.report(self.layout, cfg.zero_stage, B, T, value_bytes, self.zero, self.model,
                                    self.dev, flash=flash, recompute=cfg.recompute)
        self.tokens_per_step = B * T * cfg.grad_accum * self.world_size
        self.x, self.y = self.dev.zeros((B, T), np.int32), self.dev.zeros((B, T), np.int32)
        self.loss_sum = self.dev.zeros(1, np.float64)    # the step's summed per-position losses, on device
        self.prepared = None                             # the next batch's host side (prepare_batch)
        self.mean_buf = self.dev.zeros(1, np.float64)    # mean_over_ranks' all-reduce (no allocation a step)
        # the micro-step and the update replay as CUDA graphs where every call in them can be captured:
        # not with MPI's host-staged collectives, not while tracing (host timestamps). bf16 as well: AdamW's
        # and ZeRO-2's stochastic rounding read their step from device memory (zero.set_scalars,
        # zero.set_micro_step)
        self.graphs = Graphs(self.dev, enabled=not (cfg.no_cuda_graph or cfg.trace)
                             and self.comm.name in ("local", "nccl"), after_launch=self.comm.after_graph)

    # ---- one optimizer step ------------------------------------------------------------------------
    def step(self, step: int) -> dict:
        """K micro-steps of forward+backward, then the ZeRO stage's reduce / update / gather.
        Returns the step's mean loss (over all micro-steps and ranks, before the update) and grad norm.
        On the GPU both parts replay as CUDA graphs (llmz.graph); the loss and the norm are read once, at
        the end."""
        z, K = self.zero, self.cfg.grad_accum
        self.dev.ops.zero(self.dev, self.loss_sum)
        for micro in range(K):
            z.set_micro_step(step * K + micro)        # bf16 stage 2: fresh rounding draws every micro-step
            self.next_batch(self.train_loader, backward=True)
            self.graphs.run("micro_step", self.micro_step)
        z.set_scalars(step)
        self.graphs.run("update", z.optimize)
        self.prepare_batch(self.train_loader)      # host work for the next batch while the GPU runs this step
        loss_sum = float(self.dev.to_host(self.loss_sum)[0])
        grad_norm = z.grad_norm()
        loss = self.mean_over_ranks(loss_sum / (K * self.x.size))
        return {"loss": loss, "grad_norm": grad_norm}

    def micro_step(self) -> None:
        """Forward and backward of the batch in self.x, self.y; its losses summed into self.loss_sum.
        No host synchronisation, no allocation (a CUDA graph captures it)."""
        z, m, cfg = self.zero, self.model, self.cfg
        # forward to the logits; backward's fused classifier computes the losses and dlogits in one pass
        m.forward(z.param_store, self.x)
        m.backward(z.param_store, z, self.x, self.y, 1.0 / (cfg.batch_size * cfg.seq_len * cfg.grad_accum))
        self.dev.ops.sum_into(self.dev, self.loss_sum, m.acts.losses)
        z.backward_done()

    def timed_step(self, step: int, trace: str | None = None) -> tuple[dict, float]:
        """step(step) and the seconds it took on the device; trace: record its timeline there (llmz.trace)."""
        if trace:
            self.tracer.start()
        self.dev.synchronize()
        t0 = time.perf_counter()
        out = self.step(step)
        self.dev.synchronize()
        seconds = time.perf_counter() - t0
        if trace:
            self.tracer.stop(trace)
        return out, seconds

    # ---- batches ---------------------------------------------------------------------------------------
    def next_batch(self, loader, backward: bool = False) -> None:
        """The loader's next (x, y) into the device buffers self.x, self.y (on the compute stream). backward:
        the batch's backward follows, so also what the model's backward needs of it (GPT2.backward_plan; a
        forward-only batch, as in validation, needs none). Uses what prepare_batch made, when it is this
        batch's."""
        prepared = self.prepared
        if prepared is None or prepared[:2] != (loader, loader.position):
            prepared = self.prepare_batch(loader, backward)
        self.prepared = None
        _, _, x, y, plan = prepared
        loader.position += 1
        self.dev.copy_from_host(self.x, x)
        self.dev.copy_from_host(self.y, y)
        if backward:
            self.model.use_backward_plan(x, plan)

    def prepare_batch(self, loader, backward: bool = True) -> tuple:
        """The host side of the loader's next batch: (loader, position, x, y, the model's backward_plan of it
        for a backward, else None), kept for next_batch. Called while the GPU is busy (after the update is
        queued), so the host's part of the next backward costs no GPU time."""
        x, y = loader.peek()
        plan = self.model.backward_plan(x) if backward else None
        self.prepared = (loader, loader.position, x, y, plan)
        return self.prepared

    # ---- across ranks, and on the host -----------------------------------------------------------------
    def mean_over_ranks(self, x: float) -> float:
        buf = self.mean_buf
        self.dev.copy_from_host(buf, np.array([x], dtype=np.float64))
        self.zero.comm_waits_for_compute()
        self.comm.all_reduce(buf, op="avg")
        self.zero.compute_waits_for_comm()
        return float(self.dev.to_host(buf)[0])

    def val_loss(self, batches: int) -> float:
        self.val_loader.reset()
        n = min(batches, self.val_loader.num_batches)
        total = 0.0
        for _ in range(n):
            self.next_batch(self.val_loader)
            self.model.forward(self.zero.param_store, self.x, self.y)
            total += self.model.mean_loss()
        return self.mean_over_ranks(total / n)

    def host_params(self) -> np.ndarray:
        """The full parameters on the host (bf16 runs: the bf16 values, widened to float32)."""
        p = self.zero.full_parameters()             # stage 3 gathers them: every rank calls this
        return bf16_to_f32(p) if p.dtype == np.uint16 else p
