"""A training run's checkpoints (--checkpoint-dir, --resume, --save): where the run starts, what it writes.

    find         the checkpoint --resume names, read and checked on every rank, or None (start afresh)
    start        the model and its parameters: from that checkpoint, an llm.c file (--init-from) or a preset
    restore      continue from the checkpoint: m and v re-sharded for this run, the step, the data, the RNG
    save         DIR/step_NNNNNN/{model.bin, state_rank<r>.bin, DONE}, from finite values only
    forget       a checkpoint of parameters a later check found bad loses its DONE (--resume skips it)
    save_model   --save: the llm.c model file

The files are llmz.run.state's (training state) and llmz.run.model_file's (llm.c model files).
"""
from __future__ import annotations

import os

import numpy as np

from ..config import TrainConfig
from ..data import DIGEST, SHOWN
from ..errors import AgreedError, LlmzError
from ..layout import Layout
from ..trainer import Start, fresh_start
from . import model_file, state

# the settings that shape the training trajectory: saved in every checkpoint, compared on resume
RESUME_FLAGS = ("precision", "zero_stage", "batch_size", "seq_len", "grad_accum", "steps", "lr",
                "warmup_steps", "lr_schedule", "final_lr_frac", "weight_decay", "beta1", "beta2", "eps",
                "grad_clip", "seed", "shuffle", "train_data")


def resume_flags(cfg: TrainConfig) -> dict:
    return {k: getattr(cfg, k) for k in RESUME_FLAGS}


def find(cfg: TrainConfig, ranks, notes: list[str]):
    """The checkpoint --resume names (a llmz.run.state.Checkpoint: every rank reads every state file, and the
    ranks agree on the outcome), or None."""
    if not cfg.resume:
        return None
    path = cfg.resume
    if path == "latest":
        path = state.latest_checkpoint(cfg.checkpoint_dir)
        if path is None:
            notes.append(f"resume: no complete checkpoint in {cfg.checkpoint_dir}; starting afresh")
            return None
    if cfg.init_from:     # `--init-from F --resume --checkpoint-dir D`: one command for launch and relaunch
        notes.append(f"resume: {path} found, so --init-from {cfg.init_from} is not used")
    return state.load_checkpoint_agreed(path, ranks)


def start(cfg: TrainConfig, kind: str, tok, world_size: int, resumed) -> Start:
    """The run's start (llmz.trainer.Start: model config, layout, full parameters in float64 or the file's
    values, step): the checkpoint it resumes, an llm.c file, or a freshly initialised preset
    (llmz.trainer.fresh_start; llmz.args.check_train has checked that the flags describe it, that the
    tokenizer fits it and that T fits its maxT)."""
    if resumed:
        layout = Layout(resumed.config, world_size)
        begin = Start(resumed.config, layout, resumed.assemble("params", state.full_ranges(layout)), resumed.step)
    elif cfg.init_from:
        config, llmc = model_file.load_model(cfg.init_from)
        layout = Layout(config, world_size)
        begin = Start(config, layout, layout.from_llmc(llmc, np.float64))
    else:
        begin = fresh_start(cfg, kind, tok, world_size)
    config = begin.config
    if config.vocab_size < tok.vocab_size or cfg.seq_len > config.max_seq_len:
        raise LlmzError(f"the model (V={config.vocab_size}, maxT={config.max_seq_len}) does not fit the "
                        f"tokenizer ({tok.vocab_size} tokens) or -t {cfg.seq_len}")
    return begin


def check_data(cfg: TrainConfig, resumed, data: dict) -> list[str]:
    """The data of a resumed run against its checkpoint's (data: llmz.data.check_same_data's {flag: [[name,
    size, SHA-256], ...]}): a file under a name the checkpoint's data had, with other bytes, is refused in one
    line naming both digests (the run would go on at its position in other text), unless --resume-other-data,
    which turns it into a note (printed, and in the log's start record). Files under other names are
    --train-data's "changed:" note (restore). Checkpoints from before digests are not compared."""
    saved = resumed.meta.get("data_files") if resumed is not None else None
    if not isinstance(saved, dict):
        return []
    notes = []
    for flag, files in data.items():
        before = {f[0]: f for f in saved.get(flag, []) if isinstance(f, list) and len(f) == 3}
        for name, size, digest in files:
            if name not in before or before[name][2] == digest:
                continue
            line = (f"{flag} {name} is not the file checkpoint {resumed.path} was trained on: {DIGEST} "
                    f"{digest[:SHOWN]} now ({size:,} bytes), {str(before[name][2])[:SHOWN]} then "
                    f"({before[name][1]:,} bytes)")
            if not cfg.resume_other_data:
                raise AgreedError(f"{line}; the run would go on at its position in other data: restore the file, "
                                  f"or add --resume-other-data to go on anyway", 2)
            notes.append(f"note: {line}; going on, as --resume-other-data says")
    return notes


def restore_loader(loader, saved: dict, path: str) -> list[str]:
    """Put `loader` where the saved one stopped. With the same tokens per micro-step over all ranks
    (world size x B x T; B may change with the world size) the token stream continues exactly; with
    another global batch it continues at the same token count, rounded down. Returns notes to print."""
    mine = loader.state()
    keys = ("num_tokens", "T", "shuffle") + (("seed",) if loader.shuffle else ())
    diff = [f"{k} {saved[k]} (here {mine[k]})" for k in keys if saved[k] != mine[k]]
    if diff:
        raise LlmzError(f"{path}: the training data or batch differ from the checkpoint's: {', '.join(diff)}")
    old_stride = saved["world_size"] * saved["B"] * saved["T"]
    if old_stride == loader.stride:
        loader.position = saved["position"]
        return []
    loader.position = saved["position"] * old_stride // loader.stride
    return [(f"resume: {loader.stride} tokens per micro-step over all ranks (was {old_stride}): the data "
             f"continues at token {saved['position'] * old_stride:,}, not bit for bit")]


class Checkpoints:
    """One rank's side of the run's checkpoints: `run` is its llmz.run.loop.Run, `resumed` the checkpoint
    it started from (find) or None. `last` is the newest good checkpoint, for the lines that name it."""

    def __init__(self, run, resumed):
        self.run, self.resumed = run, resumed
        self.cfg, self.rank, self.world_size = run.cfg, run.rank, run.world_size
        self.last = resumed.path if resumed else None

    def restore(self) -> int:
        """Continue from the resumed checkpoint: this rank's m and v re-sharded for this layout, the data
        position, the RNG (parameters were assembled by start()). Returns the step to continue at."""
        ckpt, run = self.resumed, self.run
        meta = ckpt.meta
        run.zero.load_optimizer_state(ckpt.assemble("m", run.zero.owned_ranges()),
                                      ckpt.assemble("v", run.zero.owned_ranges()))
        run.notes += restore_loader(run.train_loader, meta["data"], ckpt.path)
        # the RNG of this rank's file (a bigger world: of rank r mod the saved world size)
        run.sampler.rng.bit_generator.state = ckpt.states[self.rank % ckpt.world_size].meta["rng"]
        saved, mine = meta["flags"], resume_flags(self.cfg)
        changed = [f"--{k.replace('_', '-')} {mine[k]} (was {saved.get(k)})"
                   for k in mine if saved.get(k) != mine[k]]
        run.notes.append(f"resume: step {ckpt.step} from {ckpt.path} ({ckpt.world_size} rank(s), ZeRO stage "
                         f"{meta['zero_stage']}, {meta['precision']})" + (f"; changed: {', '.join(changed)}"
                                                                         if changed else ""))
        return ckpt.step

    def save(self, root: str, step: int) -> str:
        """Checkpoint after `step` optimizer steps: DIR/step_NNNNNN/{model.bin, state_rank<r>.bin, DONE}.
        Only from finite parameters and optimizer state. Every file is written to a temporary name and
        renamed; DONE comes last, after a barrier, so a folder without it is ignored by --resume. --keep
        then deletes complete checkpoints older than the newest K up to this one (never later ones).
        Returns the folder."""
        run, cfg = self.run, self.cfg
        folder = state.step_dir(root, step)
        run.guards.refuse_non_finite(step, f"checkpoint {folder}", self.last)
        if self.rank == 0:
            state.prepare_step_dir(folder, self.world_size)
        run.comm.barrier()                    # the folder exists and holds no stale DONE
        host = run.host_params()
        if self.rank == 0:
            model_file.save_model(os.path.join(folder, state.MODEL_FILE), run.model.config, host, run.layout,
                                  dtype=run.precision.model_file, seq_len=cfg.seq_len)
        meta = {"step": step, "world_size": self.world_size, "rank": self.rank,
                "zero_stage": cfg.zero_stage, "precision": cfg.precision,
                "config": run.model.config.to_dict(), "flags": resume_flags(cfg),
                "data": run.train_loader.state(), "rng": run.sampler.rng.bit_generator.state,
                "buckets": state.shard_table(run.layout, self.rank), "run_id": run.run_id,
                "data_files": run.data}
        state.write_state(state.state_path(folder, self.rank), meta, run.zero.state_slices(host))
        run.comm.barrier()                    # every rank's file is in place
        if self.rank == 0:
            state.write_done(folder, {"step": step, "world_size": self.world_size,
                                      "zero_stage": cfg.zero_stage, "run_id": run.run_id})
            if cfg.keep:
                state.prune(root, cfg.keep, newest=step)
        self.last = folder
        return folder

    def save_model(self, path: str, step: int) -> None:
        """--save: the model file, from finite parameters only (rank 0 writes it)."""
        run = self.run
        run.guards.refuse_non_finite(step, f"--save {path}", self.last)
        host = run.host_params()
        if self.rank == 0:
            model_file.save_model(path, run.model.config, host, run.layout, dtype=run.precision.model_file,
                                  seq_len=self.cfg.seq_len)

    def forget(self, step: int) -> str:
        """The run stopped at `step` because of what the parameters after `step` updates gave: if this run
        checkpointed those parameters, its DONE goes (the folder stays, for a look; --resume skips it).
        Returns the words for the error line."""
        root = self.cfg.checkpoint_dir
        folder = state.step_dir(root, step) if root else None
        if folder is None or folder != self.last or (self.resumed and self.resumed.path == folder):
            return f"last good checkpoint: {self.last or 'none'}"
        if self.rank == 0:
            done = os.path.join(folder, state.DONE_FILE)
            if os.path.exists(done):
                os.unlink(done)
        self.run.comm.barrier()
        previous = [p for s, p, ok in state.checkpoints(root) if ok and s < step]
        self.last = previous[-1] if previous else (self.resumed.path if self.resumed else None)
        return (f"{folder}, which holds these parameters, is marked incomplete (DONE removed); last good "
                f"checkpoint: {self.last or 'none'}")
