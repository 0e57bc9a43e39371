"""The run folder: where a training run writes what it trained, unless told otherwise (--no-run-dir).

    runs/001/model.bin        the final model, llm.c's format (what --save FILE.bin writes): llmz.sample, convert
    runs/001/log.jsonl        the --log records: llmz.plot
    runs/001/checkpoints/     with --checkpoint-every N (and no --checkpoint-dir): step_NNNNNN/ folders
    runs/latest -> 001        the last run that finished, so a command can follow the run before it as written

A run given no --run-dir gets the next free number under runs/ (in the current folder; the environment's
LLMZ_RUNS=DIR puts them under DIR), made by rank 0 as the run starts: a second `python -m llmz.train` writes
runs/002 and never over runs/001 (nanoGPT's out/ and llm.c's -o DIR are written over). --run-dir DIR names
the folder; one that already holds a run's model or log is refused, unless --resume continues that run (its
log continued, its checkpoints/ resumed from). --log, --save and --checkpoint-dir still put their files where
they say; the run folder holds the rest, and the run's last line names it.
"""
from __future__ import annotations

import os
from dataclasses import replace

from ..errors import LlmzError, UsageError
from .outputs import prepare_folder, prepare_output

RUNS_ENV = "LLMZ_RUNS"
MODEL, LOG, CHECKPOINTS, LATEST = "model.bin", "log.jsonl", "checkpoints", "latest"


def runs_root() -> str:
    """The folder under which numbered run folders go: $LLMZ_RUNS, else runs/ in the current folder."""
    return os.environ.get(RUNS_ENV) or "runs"


def with_folder(cfg, folder: str):
    """cfg writing into `folder` what no flag sends elsewhere: the log, the model, and the checkpoints where
    there are to be some (--checkpoint-every, --keep or --resume given, no --checkpoint-dir)."""
    wants_checkpoints = cfg.checkpoint_every or cfg.keep or cfg.resume
    return replace(cfg, run_dir=folder, log=cfg.log or os.path.join(folder, LOG),
                   save=cfg.save or os.path.join(folder, MODEL),
                   checkpoint_dir=cfg.checkpoint_dir or (os.path.join(folder, CHECKPOINTS) if wants_checkpoints
                                                         else None))


def check_given(cfg) -> None:
    """--run-dir DIR: not beside --no-run-dir, a folder (or nothing yet), and not holding another run's model
    or log unless --resume continues it. UsageError, one line."""
    if cfg.no_run_dir:
        raise UsageError(f"--run-dir {cfg.run_dir} and --no-run-dir: choose one")
    folder = cfg.run_dir
    if not folder:
        raise UsageError("--run-dir: empty folder name (--no-run-dir for none)")
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise UsageError(f"--run-dir {folder}: exists and is not a folder")
    held = [name for name in (MODEL, LOG) if os.path.exists(os.path.join(folder, name))]
    if held and not cfg.resume:
        raise UsageError(f"--run-dir {folder} holds another run ({', '.join(held)}); name a new folder, leave "
                         f"--run-dir out for the next free one under {runs_root()}/, or --resume to continue it")


def new_folder() -> str:
    """Rank 0: make the next free numbered folder under runs_root() (runs/001, runs/002, ...) and return it.
    Made with mkdir, which fails if another run took the number first: then the next one."""
    root = runs_root()
    try:
        os.makedirs(root, exist_ok=True)
        taken = [int(n) for n in os.listdir(root) if n.isdigit()]
    except OSError as e:
        raise UsageError(f"run folder: cannot make {root}/ ({e.strerror}); --run-dir DIR or --no-run-dir") from None
    n = max(taken, default=0) + 1
    while True:
        folder = os.path.join(root, f"{n:03d}")
        try:
            os.mkdir(folder)
            return folder
        except FileExistsError:
            n += 1
        except OSError as e:
            raise UsageError(f"run folder: cannot make {folder} ({e.strerror}); --run-dir DIR or --no-run-dir") \
                from None


def prepare(cfg) -> None:
    """The outputs with_folder added: their folders made, their names checked (llmz.files)."""
    try:
        for flag, path in (("--save", cfg.save), ("--log", cfg.log)):
            prepare_output(path, flag)
        if cfg.checkpoint_dir:
            prepare_folder(cfg.checkpoint_dir, "--checkpoint-dir")
    except LlmzError as e:
        raise UsageError(f"run folder {cfg.run_dir}: {e}") from None


def link_latest(folder: str) -> str | None:
    """Rank 0, once the model is written: runs/latest -> folder when folder is under runs_root(), replaced in
    one step (a symlink made beside it, renamed over it). Returns the link's path, or None (a folder
    elsewhere; a `latest` that is a real folder, or a filesystem without symlinks: left as it is)."""
    root = os.path.abspath(runs_root())
    if os.path.dirname(os.path.abspath(folder)) != root:
        return None
    link, tmp = os.path.join(runs_root(), LATEST), os.path.join(runs_root(), f".{LATEST}.{os.getpid()}")
    try:
        os.symlink(os.path.basename(os.path.abspath(folder)), tmp)
        os.replace(tmp, link)
        return link
    except OSError:
        if os.path.islink(tmp):
            os.unlink(tmp)
        return None


def last_line(cfg, latest: str | None) -> str:
    """The run's last line: its folder and what it holds, e.g. 'run folder runs/003: model.bin, log.jsonl
    (runs/latest points here)'."""
    folder = cfg.run_dir
    inside = [name + ("/" if name == CHECKPOINTS else "") for name in (MODEL, LOG, CHECKPOINTS)
              if os.path.exists(os.path.join(folder, name))]
    return (f"run folder {folder}: {', '.join(inside) or 'nothing written'}"
            + (f" ({latest} points here)" if latest else ""))
