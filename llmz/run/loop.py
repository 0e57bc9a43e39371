"""The training run around a Trainer (nanoGPT's loop): a TrainConfig in, a trained model, its log, checkpoints
and samples out.

    cfg = TrainConfig(model="small", steps=100).for_device("cpu")
    train(cfg, "cpu", init_ranks())             # what `python -m llmz.train` runs, on every rank

Run is a llmz.trainer.Trainer with the run's housekeeping: where it starts (the checkpoint --resume names, an
llm.c file --init-from names, or a fresh model: llmz.run.checkpoints), the run's identity across resumes
(llmz.run.state), its samples (Sampler), what stops it (llmz.run.guards) and its checkpoints. train() is the
loop: validate, sample, step, check, log, checkpoint; what it says is llmz.run.log's, where it writes its run
folder's (llmz.run.folder).
"""
from __future__ import annotations

import contextlib
import math

import numpy as np

from ..config import GPT2Config, TrainConfig
from ..errors import AgreedError, LlmzError, before_any_work
from ..model import GPT2, generate
from ..tokenizer import load_tokenizer, start_id
from ..trainer import Trainer
from . import checkpoints
from . import folder as run_folder
from .checkpoints import Checkpoints
from .guards import Guards
from .launch import agree, interrupted
from .lock import take_locks
from .log import RunLog
from .state import check_run_identity, run_identity


class Run(Trainer):
    """One rank's training run: a Trainer started where the run starts (a resumed checkpoint, --init-from, or
    afresh), with its identity, samples, guards and checkpoints; `notes`: lines for rank 0 to print (resume
    decisions), `start_step`: the step it continues at."""

    def __init__(self, cfg: TrainConfig, kind: str, ranks):
        notes: list[str] = []
        resumed = checkpoints.find(cfg, ranks, notes)
        run_id = run_identity(resumed, ranks)                       # kept across resumes (a collective)
        tok = load_tokenizer(cfg.tokenizer)
        start = checkpoints.start(cfg, kind, tok, ranks.world_size, resumed)
        super().__init__(cfg, kind, ranks, start, tok=tok)
        self.notes, self.resumed, self.run_id = notes, resumed, run_id
        # the resumed checkpoint's data, where it names the same file
        self.notes += checkpoints.check_data(cfg, resumed, self.data)
        config = self.model.config
        self.sampler = Sampler(cfg, self.tok, config, self.dev, self.notes)
        self.guards = Guards(cfg, self.dev, self.comm, self.zero, config.vocab_size)
        self.checkpoints = Checkpoints(self, resumed)
        self.start_step = self.checkpoints.restore() if resumed else 0


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
            run = Run(cfg, kind, ranks)
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
    cfg = run_folder.with_folder(cfg, ranks.allgather(made)[0])
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
