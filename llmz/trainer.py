"""The training run, as a library: a TrainConfig in, a trained model (and its log, checkpoints, samples) out.

    cfg = TrainConfig(model="small", steps=100).for_device("cpu")
    train(cfg, "cpu", init_ranks())             # what `python -m llmz.train` runs, on every rank
    run = Trainer(cfg, "cpu", init_ranks())     # or step by step, as the lessons and llmz.bench do
    run.step(0)["loss"]

A Trainer holds everything one rank needs: device, communicator, data, model, its ZeRO stage (llmz.zero),
AdamW (llmz.optim); its step is K micro-steps of forward and backward, then the stage's update. train() is
the loop around it, nanoGPT's: validate, sample, step, check, log, checkpoint. The rest has a module of its
own in llmz/run/, the run's housekeeping: where the run starts and what it writes (llmz.run.checkpoints), what
stops it (llmz.run.guards), what it says (llmz.run.log); its samples are the Sampler below.

Importing this module imports numba (the kernels, through llmz.zero): resolve the device first
(llmz.device.resolve), as the simulator needs.
"""
from __future__ import annotations

import contextlib
import math
import time

import numpy as np

from . import memory
from .bf16 import bf16_to_f32
from .comm import make_communicator
from .config import GPT2Config, TrainConfig
from .data import DataLoader, check_same_data
from .device import Device
from .errors import AgreedError, LlmzError, before_any_work
from .graph import Graphs
from .model import GPT2, generate
from .optim import AdamW
from .precision import PRECISIONS
from .run import checkpoints
from .run.checkpoints import Checkpoints
from .run.guards import Guards, check_fits
from .run import folder as run_folder
from .run.launch import agree, allgather, interrupted
from .run.lock import take_locks
from .run.log import RunLog
from .run.state import check_run_identity, run_identity
from .tokenizer import load_tokenizer, start_id
from .trace import Tracer
from .zero import make_stage


class Trainer:
    """One rank's run, built from `cfg` (TrainConfig.for_device filled in) on a resolved device `kind`.
    make_stage builds its ZeRO stage: llmz.zero's, or in the lessons their plain twin's (llmz.plain)."""

    def __init__(self, cfg: TrainConfig, kind: str, ranks, make_stage=make_stage):
        self.cfg, self.ranks = cfg, ranks
        self.rank, self.world_size = ranks.rank, ranks.world_size
        self.notes: list[str] = []                  # lines for rank 0 to print (resume decisions)
        self.precision = PRECISIONS[cfg.precision]
        self.dev = Device(kind, self.precision, gpu_index=ranks.local_rank, matmul=cfg.matmul,
                          attention=cfg.attention, tf32=not cfg.no_tf32, kernel_set=cfg.kernels)
        self.comm = make_communicator(cfg.comm, ranks, self.dev)
        self.tok = load_tokenizer(cfg.tokenizer)
        self.resumed = checkpoints.find(cfg, ranks, self.notes)
        self.run_id = run_identity(self.resumed, ranks)             # kept across resumes (a collective)
        config, self.layout, params = checkpoints.start(cfg, kind, self.tok, self.world_size, self.resumed)
        self.sampler = Sampler(cfg, self.tok, config, self.dev, self.notes)
        B, T, V = cfg.batch_size, cfg.seq_len, config.vocab_size
        self.train_loader = DataLoader(cfg.train_data, B, T, self.rank, self.world_size, shuffle=cfg.shuffle,
                                       seed=cfg.seed, vocab_size=V)
        self.val_loader = (DataLoader(cfg.val_data, B, T, self.rank, self.world_size, vocab_size=V)
                           if cfg.val_data else None)
        # every file's name, size and SHA-256, the same on every rank (a collective), and the resumed
        # checkpoint's where it names the same file
        self.data = check_same_data(ranks, {"--train-data": self.train_loader, "--val-data": self.val_loader})
        self.notes += checkpoints.check_data(cfg, self.resumed, self.data)
        self.opt = AdamW(lr=cfg.lr, beta1=cfg.beta1, beta2=cfg.beta2, eps=cfg.eps,
                         weight_decay=cfg.weight_decay, grad_clip=cfg.grad_clip,
                         warmup_steps=cfg.warmup_steps, schedule=cfg.lr_schedule,
                         final_lr_frac=cfg.final_lr_frac, total_steps=cfg.steps)
        flash, value_bytes = self.dev.attention == "flash", self.precision.value_bytes
        if kind == "gpu":                           # refuse before the big allocations, not halfway
            free, total = self.dev.xp.cuda.runtime.memGetInfo()
            predicted = memory.predicted(self.layout, cfg.zero_stage, B, T, value_bytes, flash=flash,
                                         recompute=cfg.recompute)
            check_fits(predicted, free, total, self.dev.gpu_index)
        self.model = GPT2(config, self.dev, B, T, recompute=cfg.recompute)    # its shape: self.model.config
        self.tracer = Tracer(self.dev, self.rank) if cfg.trace else None
        self.zero = make_stage(cfg.zero_stage, self.layout, self.dev, self.comm, self.opt, params,
                               overlap=not cfg.no_overlap, tracer=self.tracer, seed=cfg.seed,
                               start_step=self.resumed.step if self.resumed else 0)
        self.memory = memory.report(self.layout, cfg.zero_stage, B, T, value_bytes, self.zero, self.model,
                                    self.dev, flash=flash, recompute=cfg.recompute)
        self.tokens_per_step = B * T * cfg.grad_accum * self.world_size
        self.x, self.y = self.dev.zeros((B, T), np.int32), self.dev.zeros((B, T), np.int32)
        self.loss_sum = self.dev.zeros(1, np.float64)    # the step's summed per-position losses, on device
        self.prepared = None                             # the next batch's host side (prepare_batch)
        self.mean_buf = self.dev.zeros(1, np.float64)    # mean_over_ranks' all-reduce (no allocation a step)
        self.guards = Guards(cfg, self.dev, self.comm, self.zero, V)
        # the micro-step and the update replay as CUDA graphs where every call in them can be captured:
        # not with MPI's host-staged collectives, not while tracing (host timestamps). bf16 as well: AdamW's
        # and ZeRO-2's stochastic rounding read their step from device memory (zero.set_scalars,
        # zero.set_micro_step)
        self.graphs = Graphs(self.dev, enabled=not (cfg.no_cuda_graph or cfg.trace)
                             and self.comm.name in ("local", "nccl"), after_launch=self.comm.after_graph)
        self.checkpoints = Checkpoints(self, self.resumed)
        self.start_step = self.checkpoints.restore() if self.resumed else 0

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


class Sampler:
    """The samples a training run prints (--sample-every, and one at the end): llmz.model.generate, from the
    parameters the run trains, on a second GPT2 of batch 1 (cheap activations), with seeds drawn from the
    run's own RNG, whose state every checkpoint keeps, so a resumed run prints the samples the uninterrupted
    one would."""

    def __init__(self, cfg: TrainConfig, tok, config: GPT2Config, dev, notes: list[str]):
        self.tok, self.config, self.dev = tok, config, dev
        self.n_tokens, self.T = cfg.sample_tokens, cfg.seq_len
        self.rng = np.random.default_rng(cfg.seed)          # draws the seeds of the samples
        self.model = None                                    # the B=1 model, built for the first sample
        # among the tokens the tokenizer can decode (a model wider than its tokenizer, e.g. --vocab-size 50257
        # on byte data, would otherwise sample ids it cannot print)
        self.vocab = min(config.vocab_size, tok.vocab_size)
        if self.vocab < config.vocab_size and cfg.sample_tokens:
            notes.append(f"note: the model has {config.vocab_size} tokens, the tokenizer {tok.vocab_size}: "
                         f"samples are drawn among the tokenizer's {tok.vocab_size} only")

    def next_seed(self) -> int:
        """The seed of the next printed sample, from the run's RNG (saved in checkpoints)."""
        return int(self.rng.integers(2**31))

    def sample(self, params, prompt_ids, n_tokens: int, seed: int) -> list[int]:
        """The prompt and n_tokens ids after it (no prompt: those alone, after a start token), from the
        parameter store `params` (llmz.model): at ZeRO stage 3 it gathers the parameters, so every rank calls
        it."""
        if self.model is None:
            self.model = GPT2(self.config, self.dev, 1, self.T)
        ids = generate(self.model, params, list(prompt_ids) or [start_id(self.tok)], n_tokens, seed,
                       vocab=self.vocab)
        return list(prompt_ids) + ids

    def text(self, params) -> str:
        """A sample of --sample-tokens tokens from an empty prompt, decoded, with the run's next seed."""
        return self.tok.decode(self.sample(params, [], self.n_tokens, self.next_seed()))


def train(cfg: TrainConfig, kind: str, ranks) -> dict:
    """Train as `cfg` says, on this rank; returns the summary (llmz.run.log). The end of a run goes in the
    order that loses nothing: the last checkpoint, --save, the log's end record and close, and only then the
    sample (its failure can no longer cost anything). A non-finite or diverged step stops the run, naming the
    step, on every rank."""
    locks, run, log, step, latest = [], None, None, None, None
    try:
        cfg = settle_run_dir(cfg, ranks)
        # rank 0 locks the checkpoint folder and the log, and checks they are this run's (the Trainer checks
        # that every rank reads the same data)
        notes = agree(ranks, lambda: take_locks(cfg, locks) + check_run_identity(cfg) if ranks.rank == 0
                      else [])
        with before_any_work():                     # a file found wrong while reading it: status 2
            run = Trainer(cfg, kind, ranks)
        log = RunLog(run, ranks)
        log.begin(notes)

        def stop(why: str):
            """End the run at `step` on every rank alike (the loss is the same on all): one line."""
            where = run.checkpoints.forget(step)
            log.stopped(step, why)
            raise AgreedError(f"{why}; stopped; {where}", 1)

        start = step = run.start_step
        traced = min(start + 1, cfg.steps - 1)        # --trace records the second step (the first compiles)
        for step in range(start, cfg.steps):
            run.comm.watch.step = step                  # for the collective watchdog's lines
            last = step == cfg.steps - 1
            validate = run.val_loader is not None and (last or every(cfg.val_every, step))
            sample = cfg.sample_tokens > 0 and step > 0 and every(cfg.sample_every, step)
            # a checkpoint after this step: every N steps and after the last (only good steps get there)
            checkpoint = bool(cfg.checkpoint_dir) and (last or every(cfg.checkpoint_every, step + 1))
            if validate:
                loss = run.val_loss(cfg.val_batches)
                log.val(step, loss)
                if not math.isfinite(loss):
                    stop(f"step {step}: non-finite validation loss {loss}")
            if sample:
                log.sample(run.sampler.text(run.zero.param_store))
            out, seconds = run.timed_step(step, trace=cfg.trace if step == traced else None)
            if cfg.trace and step == traced:
                log.say(f"timeline {cfg.trace} (and .png), step {step}: {run.tracer.measured}")
            why = run.guards.diverged(step, out["loss"], out["grad_norm"])
            if why:
                stop(why)
            # its line: the first and the last, every --print-every, and beside a validation, sample, checkpoint
            log.step(step, out, seconds, show=step in (start, cfg.steps - 1) or every(cfg.print_every, step)
                     or validate or sample or checkpoint)
            if checkpoint:
                log.checkpoint(step, run.checkpoints.save(cfg.checkpoint_dir, step + 1))
        step = max(cfg.steps, start)
        summary = log.summary()
        if cfg.save:
            run.checkpoints.save_model(cfg.save, step)
            log.say(f"saved {cfg.save}")
            if cfg.run_dir and ranks.rank == 0:
                latest = run_folder.link_latest(cfg.run_dir)
        log.end(summary)
    except KeyboardInterrupt as e:                      # Ctrl-C, SIGTERM, SIGHUP
        raise interrupted(e, where_stopped(cfg, run, log, step)) from None
    finally:
        if log:
            with contextlib.suppress(LlmzError):    # already failing: the first error is the one to report
                log.close()
        for lock in locks:
            lock.release()
    run.comm.barrier()
    # only now, with everything written, the sample. Every rank generates it (the same tokens from the same
    # seed) and rank 0 prints it: at ZeRO stage 3 generating gathers the parameters, a collective, and at the
    # other stages a rank that did not generate would wait as long for rank 0 in its next collective, a wait
    # the collective watchdog's deadline would have to cover
    if cfg.sample_tokens:
        log.say("--- sample ---\n" + run.sampler.text(run.zero.param_store) + "\n--------------")
    if cfg.run_dir:
        log.say(run_folder.last_line(cfg, latest))
    return summary


def settle_run_dir(cfg: TrainConfig, ranks) -> TrainConfig:
    """cfg with its run folder's paths filled in (llmz.run.folder): a folder --run-dir named was filled in with the
    flags; without one (and no --no-run-dir) rank 0 makes the next free runs/NNN and every rank takes its
    name."""
    if cfg.no_run_dir or cfg.run_dir:
        return cfg
    made = agree(ranks, lambda: run_folder.new_folder() if ranks.rank == 0 else None)
    cfg = run_folder.with_folder(cfg, allgather(ranks, made)[0])
    agree(ranks, lambda: run_folder.prepare(cfg))
    return cfg


def every(n: int, step: int) -> bool:
    """Is `step` one of every n-th (n = 0: never)?"""
    return n > 0 and step % n == 0


def where_stopped(cfg: TrainConfig, run, log, step) -> str:
    """The words of a run stopped by Ctrl-C or a signal (llmz.run.launch.interrupted says which): where, the last
    checkpoint, the log."""
    last = (run.checkpoints.last if run else None) or ("none" if cfg.checkpoint_dir else
                                                       "none (no --checkpoint-dir)")
    where = "before training began" if step is None else f"at step {step}"
    return f"{where}; last checkpoint {last}" + (f"; log {cfg.log}" if log and log.file else "")
