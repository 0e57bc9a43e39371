"""What a training run says: its lines on rank 0's stdout and, with --log FILE.jsonl, one JSON object a line
(flushed line by line; a new run starts the file, a resumed run continues it, llmz.run.outputs.JsonLog):

    {"event": "start", "run_id", "config", "args", "world_size", "memory", "start_step", "resumed_from",
     "data", "notes"}
    {"step", "val_loss"}                                 every --val-every steps and at the last
    {"step", "loss", "lr", "grad_norm", "ms", "tokens_per_s", "elapsed_s", "eta_s"[, "mfu"]}    every step
                                                         (stdout: a line every --print-every steps)
    {"event": "checkpoint", "step", "path"}
    {"event": "stopped", "step", "reason"}               a non-finite or diverged run, before it ends
    {"event": "end", "first_loss", "final_loss", "val_losses", "mean_ms", "tokens_per_s", "elapsed_s"}

"args" holds every setting (llmz.config.TrainConfig: the flags' names without dashes), "memory" llmz.memory's
report, "data" every token file read, {"--train-data": [[name, bytes, SHA-256 hex], ...], "--val-data": [...]},
"notes" the lines the run began with that say what it decided (a resume, a stale lock taken over, a data file
changed under its name and --resume-other-data). MFU is llm.c's: 6 * parameters + 6 * L * C * T flops per token against the card's dense peak.
"""
from __future__ import annotations

from ..config import fmt_bytes
from ..memory import table
from . import threads
from .outputs import JsonLog
from .progress import Progress, fmt_duration

# MFU denominators (dense, per GPU, TFLOP/s), llm.c's table: fp32 training runs its matmuls in TF32.
PEAK_TFLOPS = {"H100": {"fp32": 494.7, "bf16": 989.4}, "H200": {"fp32": 494.7, "bf16": 989.4},
               "A100": {"fp32": 156.0, "bf16": 312.0}}


def mfu(tokens_per_s: float, config, T: int, dev, precision: str) -> float | None:
    """Model flops utilisation, llm.c's formula: 6 * params + 6 * L * C * T flops per token."""
    if dev.kind != "gpu":
        return None
    name = dev.xp.cuda.runtime.getDeviceProperties(dev.gpu_index)["name"].decode()
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    if peak is None:
        return None
    flops = 6 * config.num_parameters() + 6 * config.num_layers * config.channels * T
    return tokens_per_s * flops / (peak.get(precision, peak["fp32"]) * 1e12)


def flash_fallback(dev, config) -> str | None:
    """bf16 flash attention on the fast set at a head size its tensor-core kernels do not cover: one line
    saying the teaching kernels run it (hundreds of times slower) and what is faster; None otherwise."""
    if dev.kernel_set != "fast" or dev.attention != "flash" or dev.precision.name != "bf16":
        return None
    from ..fast.flash_attention import (
        fallback_note,  # numba: only once the device has loaded it (llmz.device)
    )
    return fallback_note(config.channels // config.num_heads)


def zero_on_one_rank(layout, stage: int, value_bytes: int) -> str | None:
    """What ZeRO `stage` (1-3) costs and saves on one rank, in one line; None for stage 0 or several ranks.
    With one rank every shard is the whole buffer, so nothing is divided; stage 2 keeps two block slots and
    the embedding and final-layernorm gradients beside its (whole) gradient shard, stage 3 the same again for
    the parameters (llmz.memory's formula)."""
    if stage == 0 or layout.world_size > 1:
        return None
    b = value_bytes
    slots = 2 * b * max(bk.padded_size for bk in layout.buckets[1:-1])
    ends = b * (layout.embeddings.padded_size + layout.lnf.padded_size)
    if stage == 1:
        return ("note: ZeRO stage 1 on one rank shards nothing (1 rank: the optimizer state's one shard is all "
                "of it): the same memory as stage 0; under mpiexec -n N, m and v divide by N")
    shards, twice, ends_are = (("gradient shard is the whole buffer", "", "gradients") if stage == 2 else
                               ("parameter and gradient shards are the whole buffers",
                                ", for the parameters and again for the gradients,", "buffers"))
    return (f"note: ZeRO stage {stage} on one rank shards nothing (1 rank: the {shards}): it adds{twice} two "
            f"block slots ({fmt_bytes(slots)}) and the embedding and final-layernorm {ends_are} "
            f"({fmt_bytes(ends)}): {fmt_bytes((slots + ends) * (stage - 1))} more than stage 0; under mpiexec -n "
            f"N the shards divide by N and these stay")


class RunLog:
    """The lines and records of one run (llmz.run.loop.train): rank 0 prints and writes, every rank keeps
    the numbers of the summary."""

    def __init__(self, run, ranks):
        self.run, self.cfg, self.ranks = run, run.cfg, ranks
        self.main = ranks.rank == 0
        self.file = None
        self.first_loss = self.last_loss = None
        self.val_losses, self.step_times = [], []
        self.progress = None

    def say(self, *args) -> None:
        if self.main:
            print(*args)

    def write(self, record: dict) -> None:
        if self.file:
            self.file.write(record)

    def begin(self, notes: list[str]) -> None:
        """The run's first lines (device, model, batch, memory, notes) and the log's start record."""
        run, cfg, ranks, c, d = self.run, self.cfg, self.ranks, self.run.model.config, self.run.dev
        self.say(f"llmz: {d.kind} {cfg.precision}, {d.describe()}, {ranks.world_size} rank(s), comm "
                 f"{run.comm.name}, ZeRO stage {cfg.zero_stage}; {threads.note(ranks.local_size)}")
        self.say(f"model: L={c.num_layers} NH={c.num_heads} C={c.channels} V={c.vocab_size} "
                 f"Vp={c.padded_vocab_size} maxT={c.max_seq_len}: {c.num_parameters():,} parameters")
        self.say(f"batch: B={cfg.batch_size} T={cfg.seq_len} K={cfg.grad_accum} x {ranks.world_size} ranks = "
                 f"{run.tokens_per_step:,} tokens/step; {run.train_loader.num_batches} batches per epoch")
        self.say(table(run.memory))
        one_rank = zero_on_one_rank(run.layout, cfg.zero_stage, run.precision.value_bytes)
        extra = [n for n in (one_rank, flash_fallback(d, c)) if n]
        for note in notes + run.notes + extra:
            self.say(note)
        start = run.start_step
        if start >= cfg.steps:
            self.say(f"nothing to train: the checkpoint is at step {start}, --steps is {cfg.steps}")
        if self.main and cfg.log:
            self.file = JsonLog(cfg.log, resume_step=start if run.resumed else None, run_id=run.run_id)
            if self.file.dropped:
                self.say(f"resume: {cfg.log}: dropped {self.file.dropped} record(s) an earlier attempt wrote "
                         f"past step {start}")
            self.write({"event": "start", "run_id": run.run_id, "config": c.to_dict(), "args": cfg.to_dict(),
                        "world_size": ranks.world_size, "memory": run.memory, "start_step": start,
                        "resumed_from": run.resumed.path if run.resumed else None, "data": run.data,
                        "notes": notes + run.notes})
        self.progress = Progress(cfg.steps, start)

    def val(self, step: int, loss: float) -> None:
        self.val_losses.append((step, loss))
        self.say(f"step {step:5d} | val loss {loss:.4f}")
        self.write({"step": step, "val_loss": loss})

    def sample(self, text: str) -> None:
        self.say("---\n" + text + "\n---")

    def step(self, step: int, out: dict, seconds: float, show: bool = True) -> None:
        """A training step's record, and its line where `show` (llmz.run.loop.train: every --print-every steps
        and more) and not --quiet: out is Trainer.step's (loss, grad_norm), seconds its time."""
        run, cfg = self.run, self.cfg
        self.step_times.append(seconds)
        self.progress.tick()
        loss, norm = out["loss"], out["grad_norm"]
        self.first_loss = loss if self.first_loss is None else self.first_loss
        self.last_loss = loss
        tps = run.tokens_per_step / seconds
        util = mfu(tps, run.model.config, cfg.seq_len, run.dev, cfg.precision)
        rec = {"step": step, "loss": loss, "lr": run.opt.lr_at(step), "grad_norm": norm, "ms": seconds * 1e3,
               "tokens_per_s": tps, "elapsed_s": self.progress.elapsed, "eta_s": self.progress.eta}
        if util is not None:
            rec["mfu"] = util
        self.write(rec)
        if show and not cfg.quiet:
            self.say(f"step {step:5d}/{cfg.steps} | loss {loss:.4f} | lr {rec['lr']:.2e} | norm {norm:.3f}"
                     f" | {seconds * 1e3:8.1f} ms | {tps:9.0f} tok/s"
                     + (f" | MFU {util * 100:.1f}%" if util else "") + f" | {self.progress.line()}")

    def checkpoint(self, step: int, folder: str) -> None:
        """The checkpoint written after `step` (it holds step + 1 updates)."""
        self.say(f"step {step:5d} | checkpoint {folder}")
        self.write({"event": "checkpoint", "step": step + 1, "path": folder})

    def stopped(self, step: int, reason: str) -> None:
        self.write({"event": "stopped", "step": step, "reason": reason})

    def summary(self) -> dict:
        # the mean step time leaves out the first step (compiles, warms caches) unless it is the only one
        timed = self.step_times[1:] or self.step_times
        return {"first_loss": self.first_loss, "final_loss": self.last_loss, "val_losses": self.val_losses,
                "mean_ms": sum(timed) * 1e3 / len(timed) if timed else None,
                "tokens_per_s": self.run.tokens_per_step * len(timed) / sum(timed) if timed else None,
                "elapsed_s": self.progress.elapsed}

    def end(self, summary: dict) -> None:
        """The log's end record, the log closed, and the run's last line."""
        self.write({"event": "end", **summary})
        self.close()
        if self.first_loss is not None:
            vals = ", ".join(f"{s}: {v:.4f}" for s, v in self.val_losses)
            one = " (one step, with warm-up)" if len(self.step_times) == 1 else ""
            took = fmt_duration(self.progress.elapsed)
            self.say(f"done: loss {self.first_loss:.4f} -> {self.last_loss:.4f}; val loss by step "
                     f"{{{vals}}}; {summary['mean_ms']:.1f} ms/step{one}; {took} in all")

    def close(self) -> None:
        if self.file:
            self.file.close()
