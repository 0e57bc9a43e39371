"""Training state: what the ranks need, beyond the model file, to continue training exactly (resume),
on the same number of ranks or another, at the same ZeRO stage or another.

A checkpoint is a folder, written at a step boundary (llmz.train):

    DIR/step_000010/model.bin          rank 0: the llm.c model file (fp32), for llmz.sample and llm.c
    DIR/step_000010/state_rank0.bin    every rank: its training-state file (below)
    DIR/step_000010/DONE               rank 0, last, after a barrier: the checkpoint is complete

Training-state file (little-endian):

    header  256 uint32: [0]=20261203 magic, [1]=1 version, [2]=JSON length n, [3]=CRC-32 of the JSON; rest 0
    JSON    n bytes of UTF-8: step (optimizer steps done), world size, rank, ZeRO stage, precision, the model
            config, the flags that shape training, the data loader state, the RNG state (numpy's bit
            generator), this rank's slice of every bucket ([name, size, start, end]), the arrays that
            follow ({name, dtype, count, crc32}), the run id (below), and the data the run read,
            data_files: {"--train-data": [[name, bytes, SHA-256 hex], ...], "--val-data": [...]}
    zeros   up to a multiple of 8 bytes
    arrays  params, m, v back to back: each is slice r of every bucket (llmz.layout), bucket by bucket,
            in the precision training ran in (so a float64 run resumes bit-exactly; model.bin is fp32)

Every rank saves slice r of every bucket whatever its stage (stage 0 keeps everything, but the N slices of
the N ranks already make the whole). Because slices are per bucket, a run with another world size, whose
buckets are padded differently, rebuilds its own shard from all the files (`Checkpoint.assemble`).
Every reader check ends in a one-line LlmzError that names the file.

A run has an identity, a random run id drawn at its first start and kept by every resume, written into each
state file, DONE and the log's start records. A checkpoint of another run (copied into the folder, or a
log of another run) is named as such at resume and refused unless --resume-other-run says to take it
(`check_run_identity`); state files of two runs in one folder are refused by `load_checkpoint`. Files
written before run ids existed have none, and are not compared.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import uuid
import zlib
from dataclasses import dataclass, fields

import numpy as np

from ..config import ZERO_STAGES, GPT2Config
from ..errors import LlmzError, UsageError, before_any_work
from ..files import (
    HEADER_BYTES,
    HEADER_INTS,
    TMP_SUFFIX,
    atomic_write,
    check_header,
    check_size,
    loads_json,
    read_array,
    read_bytes,
    read_header,
)
from ..layout import Layout
from .launch import agree
from .model_file import load_model

STATE_MAGIC = 20261203
STATE_VERSION = 1
ARRAYS = ("params", "m", "v")
DTYPES = {"fp32": "<f4", "fp64": "<f8", "bf16": "<f4"}     # bf16 runs save their fp32 master, m and v
MODEL_FILE, DONE_FILE = "model.bin", "DONE"
STEP_DIR = re.compile(r"step_(\d+)$")
STATE_FILE = re.compile(r"state_rank(\d+)\.bin$")


# ---- one training-state file -------------------------------------------------------------------------------
def shard_table(layout: Layout, rank: int) -> list[list]:
    """[name, size, start, end] per bucket: rank's slice of it (inside the padded bucket)."""
    return [[b.name, b.size, *layout.shard_range(b, rank)] for b in layout.buckets]


def _align8(n: int) -> int:
    return (n + 7) // 8 * 8


def write_state(path: str, meta: dict, arrays: dict[str, np.ndarray]) -> None:
    """Write one rank's training state atomically. meta: the JSON fields (without "arrays");
    arrays: params, m, v, each this rank's slice of every bucket (1-D, float32 or float64)."""
    body, table = [], []
    for name in ARRAYS:
        a = np.ascontiguousarray(arrays[name]).ravel()
        a = a.astype(a.dtype.newbyteorder("<"), copy=False)
        table.append({"name": name, "dtype": a.dtype.str, "count": int(a.size),
                      "crc32": zlib.crc32(a.view(np.uint8))})
        body.append(a)
    text = json.dumps({**meta, "arrays": table}).encode()
    header = np.zeros(HEADER_INTS, dtype="<u4")
    header[:4] = STATE_MAGIC, STATE_VERSION, len(text), zlib.crc32(text)
    pad = bytes(_align8(HEADER_BYTES + len(text)) - HEADER_BYTES - len(text))
    atomic_write(path, [header, text, pad, *body])


@dataclass
class TrainingState:
    path: str
    meta: dict                        # the JSON section
    layout: Layout                    # the saved run's layout (its world size pads the buckets)
    arrays: dict[str, np.ndarray]     # params, m, v: this rank's slice of every bucket, bucket by bucket

    @property
    def rank(self) -> int:
        return self.meta["rank"]

    @property
    def step(self) -> int:
        return self.meta["step"]


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_meta(path: str, meta) -> tuple[GPT2Config, Layout]:
    """The JSON section's fields, their types and their agreement with each other; returns the saved
    model config and layout."""
    def bad(what: str):
        raise LlmzError(f"{path}: bad training state: {what}")

    if not isinstance(meta, dict):
        bad("the JSON section is not an object")
    for key in ("step", "world_size", "rank", "zero_stage"):
        if not _is_int(meta.get(key)) or meta[key] < 0:
            bad(f"{key} is {meta.get(key)!r}, not an integer >= 0")
    if meta["world_size"] < 1 or meta["rank"] >= meta["world_size"]:
        bad(f"rank {meta['rank']} of world size {meta['world_size']}")
    if meta["zero_stage"] not in ZERO_STAGES:
        bad(f"ZeRO stage {meta['zero_stage']}")
    if meta.get("precision") not in DTYPES:
        bad(f"precision {meta.get('precision')!r} (expected one of {', '.join(DTYPES)})")
    for key in ("flags", "data", "rng"):
        if not isinstance(meta.get(key), dict):
            bad(f"{key} is missing or not an object")
    if not isinstance(meta.get("run_id", ""), str):
        bad(f"run id {meta['run_id']!r} is not a string")
    files = meta.get("data_files", {})
    if not isinstance(files, dict) or not all(isinstance(v, list) for v in files.values()):
        bad(f"data_files {files!r} is not an object of lists")
    # the model config
    cfg = meta.get("config")
    names = [f.name for f in fields(GPT2Config)]
    if not isinstance(cfg, dict) or sorted(cfg) != sorted(names) or not all(_is_int(cfg[k]) for k in names):
        bad(f"config {cfg!r} is not a model config ({', '.join(names)})")
    try:
        config = GPT2Config(**cfg)
    except (ValueError, ZeroDivisionError) as e:
        bad(f"config: {e}")
    # the data loader position
    data = meta["data"]
    for key in ("position", "num_tokens", "B", "T", "world_size", "seed"):
        if not _is_int(data.get(key)) or data[key] < 0:
            bad(f"data loader {key} is {data.get(key)!r}")
    if not isinstance(data.get("shuffle"), bool):
        bad(f"data loader shuffle is {data.get('shuffle')!r}")
    if data["world_size"] != meta["world_size"]:
        bad(f"data loader world size {data['world_size']} != world size {meta['world_size']}")
    # the RNG: numpy's PCG64 must accept it
    try:
        np.random.PCG64().state = meta["rng"]
    except Exception as e:  # noqa: BLE001  (numpy raises ValueError, TypeError or KeyError here)
        bad(f"RNG state not accepted by numpy's PCG64 ({type(e).__name__}: {e})")
    # this rank's slice of every bucket: exactly what the layout of this config and world size says
    table = meta.get("buckets")
    if not isinstance(table, list) or len(table) != config.num_layers + 2:
        bad(f"bucket table has {len(table) if isinstance(table, list) else table!r} entries, "
            f"the model has {config.num_layers + 2} buckets")
    layout = Layout(config, meta["world_size"])
    expect = shard_table(layout, meta["rank"])
    for got, want in zip(table, expect):
        if got != want:
            bad(f"bucket {want[0]}: the file says {got!r}, config and rank give {want}")
    # the arrays that follow
    arrays = meta.get("arrays")
    count = layout.shard_total
    if not isinstance(arrays, list) or not all(isinstance(a, dict) for a in arrays) \
            or [a.get("name") for a in arrays] != list(ARRAYS):
        bad(f"the array table must list {', '.join(ARRAYS)}")
    for a in arrays:
        if a.get("dtype") != DTYPES[meta["precision"]]:
            bad(f"array {a['name']} has dtype {a.get('dtype')!r}, precision {meta['precision']} needs "
                f"{DTYPES[meta['precision']]}")
        if a.get("count") != count:
            bad(f"array {a['name']} holds {a.get('count')!r} values, the rank's slices hold {count}")
        if not _is_int(a.get("crc32")):
            bad(f"array {a['name']} has no CRC-32")
    return config, layout


def read_state(path: str) -> TrainingState:
    """Read and check one training-state file: header, JSON, the sizes against the config and world size,
    the exact file length, and the CRC-32 of the JSON and of every array."""
    f, raw, size = read_header(path, "training-state file")
    with f:
        header = check_header(path, raw, STATE_MAGIC, "an llmz training-state file", dtype="<u4")
        version, n, crc = (int(x) for x in header[1:4])
        if version != STATE_VERSION:
            raise LlmzError(f"{path}: unsupported version {version} (expected {STATE_VERSION})")
        if header[4:].any():
            raise LlmzError(f"{path}: header entries 4..255 must be zero (a newer llmz wrote it?)")
        if HEADER_BYTES + n > size:
            raise LlmzError(f"{path}: truncated: {size} bytes end inside the {n}-byte JSON section")
        text = read_bytes(f, n, path, "training-state file")
        if zlib.crc32(text) != crc:
            raise LlmzError(f"{path}: the JSON section is corrupt (CRC-32 mismatch)")
        try:
            meta = json.loads(text.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise LlmzError(f"{path}: the JSON section does not parse ({e})") from None
        config, layout = _check_meta(path, meta)
        # the exact length from the JSON and fstat, before reading the arrays; then each with its checksum
        at = _align8(HEADER_BYTES + n)
        itemsize = np.dtype(DTYPES[meta["precision"]]).itemsize
        check_size(path, size, at + len(ARRAYS) * layout.shard_total * itemsize,
                   f"a {meta['precision']} state for rank {meta['rank']} of {meta['world_size']} "
                   f"(L={config.num_layers} C={config.channels})")
        if any(read_bytes(f, at - HEADER_BYTES - n, path, "training-state file")):
            raise LlmzError(f"{path}: the padding after the JSON section is not zero")
        arrays = {}
        for a in meta["arrays"]:
            arrays[a["name"]] = read_array(f, a["dtype"], a["count"], path, "training-state file")
            if zlib.crc32(arrays[a["name"]].view(np.uint8)) != a["crc32"]:
                raise LlmzError(f"{path}: array {a['name']} is corrupt (CRC-32 mismatch)")
    return TrainingState(path, meta, layout, arrays)


# ---- a checkpoint folder: model.bin, one state file per rank, DONE -----------------------------------------
def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:06d}")


def state_path(folder: str, rank: int) -> str:
    return os.path.join(folder, f"state_rank{rank}.bin")


def checkpoints(root: str) -> list[tuple[int, str, bool]]:
    """(step, folder, complete) of every step_N folder under root, by step."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    except OSError as e:
        raise LlmzError(f"{root}: cannot list checkpoints ({e.strerror or e})") from None
    out = []
    for name in names:
        m = STEP_DIR.match(name)
        path = os.path.join(root, name)
        if m and os.path.isdir(path):
            out.append((int(m.group(1)), path, os.path.isfile(os.path.join(path, DONE_FILE))))
    return sorted(out)


def latest_checkpoint(root: str) -> str | None:
    """The complete checkpoint (one with DONE) of the highest step under root, or None."""
    done = [path for _, path, complete in checkpoints(root) if complete]
    return done[-1] if done else None


def prepare_step_dir(folder: str, world_size: int) -> None:
    """Rank 0, before anyone writes: make the folder; drop a DONE and state files of ranks >= world_size
    left by an earlier run, so the folder is never complete with a mix of two runs' files, and the temporary
    files of an earlier attempt whose writer was killed (no rank of this run writes here yet)."""
    try:
        os.makedirs(folder, exist_ok=True)
        for name in os.listdir(folder):
            m = STATE_FILE.match(name)
            if name == DONE_FILE or (m and int(m.group(1)) >= world_size) or name.endswith(TMP_SUFFIX):
                os.unlink(os.path.join(folder, name))
    except OSError as e:
        raise LlmzError(f"{folder}: cannot prepare the checkpoint folder ({e.strerror or e})") from None


def write_done(folder: str, info: dict) -> None:
    atomic_write(os.path.join(folder, DONE_FILE), [(json.dumps(info) + "\n").encode()])


def prune(root: str, keep: int, newest: int) -> list[str]:
    """After writing the checkpoint of step `newest`: delete the complete checkpoints older than the newest
    `keep` of those up to `newest`, and incomplete ones older than `newest` (left by a crash). Checkpoints
    after `newest` are never touched (they are not this run's). DONE goes first, so a half-deleted folder
    is never taken as complete."""
    found = [(s, p, c) for s, p, c in checkpoints(root) if s <= newest]
    complete = [(s, p) for s, p, c in found if c]
    doomed = [p for s, p in complete[:-keep]] if keep > 0 else []
    doomed += [p for s, p, c in found if not c and s < newest]
    for p in doomed:
        try:
            if os.path.exists(os.path.join(p, DONE_FILE)):
                os.unlink(os.path.join(p, DONE_FILE))
            shutil.rmtree(p)
        except OSError as e:
            raise LlmzError(f"{p}: cannot delete old checkpoint ({e.strerror or e})") from None
    return doomed


@dataclass
class Checkpoint:
    """A complete checkpoint folder, read and checked: its model config, step and every rank's state."""
    path: str
    config: GPT2Config
    states: list[TrainingState]       # by saved rank

    @property
    def step(self) -> int:
        return self.states[0].step

    @property
    def meta(self) -> dict:
        return self.states[0].meta

    @property
    def world_size(self) -> int:
        return len(self.states)

    def assemble(self, name: str, ranges) -> np.ndarray:
        """Array `name` (params, m or v) over `ranges`, a list of (bucket, start, end) of ANY layout of the
        same model, concatenated: each range is copied from the saved slices that overlap it, and padding
        (elements at or past the bucket's size) is zero. This is re-sharding."""
        saved = self.states[0].layout.buckets
        dtype = self.states[0].arrays[name].dtype
        out = np.zeros(sum(e - s for _, s, e in ranges), dtype=dtype)
        at = 0
        for b, s, e in ranges:
            k = b.index
            for st in self.states:
                src = st.arrays[name]
                src_at = st.layout.shard_offset(saved[k])               # where bucket k's slice starts
                ss, se = st.layout.shard_range(saved[k], st.rank)
                lo, hi = max(s, ss), min(e, se, b.size)
                if lo < hi:
                    out[at + lo - s:at + hi - s] = src[src_at + lo - ss:src_at + hi - ss]
            at += e - s
        return out


def full_ranges(layout: Layout) -> list:
    """Every bucket whole: assembling over these gives a full flat buffer of `layout`."""
    return [(b, 0, b.padded_size) for b in layout.buckets]


def load_checkpoint(path: str) -> Checkpoint:
    """Read a complete checkpoint folder: DONE present, model.bin valid, state files for ranks
    0..N-1 exactly, agreeing with each other and with the model file (config and fp32 parameters)."""
    if not os.path.isdir(path):
        raise LlmzError(f"{path}: no such checkpoint folder")
    if not os.path.isfile(os.path.join(path, DONE_FILE)):
        raise LlmzError(f"{path}: incomplete checkpoint (no {DONE_FILE} marker; a crash while writing?)")
    config, llmc = load_model(os.path.join(path, MODEL_FILE))
    ranks = sorted(int(m.group(1)) for m in map(STATE_FILE.match, os.listdir(path)) if m)
    if not ranks or ranks[0] != 0:
        raise LlmzError(f"{path}: no {state_path('', 0)} training-state file")
    first = read_state(state_path(path, 0))
    n = first.meta["world_size"]
    if ranks != list(range(n)):
        raise LlmzError(f"{path}: state files for ranks {ranks}, but {first.path} says {n} ranks")
    states = [first] + [read_state(state_path(path, r)) for r in range(1, n)]
    same = ("step", "world_size", "zero_stage", "precision", "config", "flags", "data")
    for r, st in enumerate(states):
        if st.rank != r:
            raise LlmzError(f"{st.path}: says rank {st.rank}")
        if st.meta.get("run_id") != first.meta.get("run_id"):
            raise LlmzError(f"{st.path}: of another run (run id {st.meta.get('run_id')}) than {first.path} "
                            f"(run id {first.meta.get('run_id')})")
        diff = [k for k in same if st.meta[k] != first.meta[k]]
        if diff:
            raise LlmzError(f"{st.path}: {', '.join(diff)} differ from {first.path} (files of two runs?)")
    if first.layout.config != config:
        raise LlmzError(f"{first.path}: config {first.layout.config} differs from {MODEL_FILE}'s {config}")
    m = STEP_DIR.match(os.path.basename(os.path.normpath(path)))
    if m and int(m.group(1)) != first.step:
        raise LlmzError(f"{first.path}: step {first.step} in a folder named for step {int(m.group(1))}")
    ckpt = Checkpoint(path, config, states)
    # the model file holds the same parameters, rounded to fp32 (a mixed-up folder fails here); a bf16 run's
    # model file holds the bf16 parameters, each a stochastic rounding of its fp32 master: within one bf16
    # step (2^-7 relative) of it
    one = Layout(config, 1)
    params = one.to_llmc(ckpt.assemble("params", full_ranges(one))).astype(np.float32)
    if first.meta["precision"] == "bf16":
        same = np.all(np.abs(params - llmc) <= 2.0**-7 * np.abs(params) + 1e-30) or np.array_equal(
            params, llmc, equal_nan=True)
    else:
        same = np.array_equal(params, llmc, equal_nan=True)
    if not same:
        raise LlmzError(f"{os.path.join(path, MODEL_FILE)}: parameters differ from the state files' "
                        f"({'within one bf16 step' if first.meta['precision'] == 'bf16' else 'fp32-rounded'}): "
                        f"files of two runs?")
    return ckpt


def load_checkpoint_agreed(path: str, ranks) -> Checkpoint:
    """load_checkpoint on every rank (each reads every file), the outcome agreed (llmz.run.launch.agree): a
    checkpoint found wrong alike on every rank is one line from rank 0, not one per rank; a refusal at
    start, exit status 2."""
    def load():
        with before_any_work():
            return load_checkpoint(path)
    return agree(ranks, load)


# ---- the run's identity -----------------------------------------------------------------------------------
def run_identity(resumed: Checkpoint | None, ranks) -> str:
    """This run's id: the resumed checkpoint's, else a new random one, rank 0's on every rank."""
    if resumed is not None and resumed.meta.get("run_id"):
        return resumed.meta["run_id"]
    return ranks.allgather(uuid.uuid4().hex[:16])[0]


def done_run_id(folder: str) -> str | None:
    """The run id a checkpoint's DONE names (None: none, or no readable DONE)."""
    try:
        with open(os.path.join(folder, DONE_FILE)) as f:
            rid = loads_json(f.read(4096)).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return rid if isinstance(rid, str) else None


def log_run_id(path: str) -> str | None:
    """The run id of the last start record of a --log (None: no log, or none there)."""
    rid = None
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith('{"event": "start"'):
                    try:
                        rid = loads_json(line).get("run_id")
                    except ValueError:
                        pass
    except OSError:
        return None
    return rid if isinstance(rid, str) else None


def check_run_identity(args) -> list[str]:
    """Rank 0 of llmz.train, at start: the checkpoint --resume takes must be of the run that the other
    complete checkpoints of --checkpoint-dir belong to; else refused (status 2) naming both runs, unless
    --resume-other-run. The --log must be this run's too, or new: a resume trims its log back to the step it
    resumes from, which only the run that wrote the log may do, so another run's log is refused whatever the
    flags (it stays whole; name a new --log). Returns the notes to print."""
    resume = args.resume
    if resume == "latest":
        resume = latest_checkpoint(args.checkpoint_dir) if args.checkpoint_dir else None
    mine = done_run_id(resume) if resume else None
    if mine is None:
        return []
    others = [(p, done_run_id(p)) for _, p, done in checkpoints(args.checkpoint_dir) if done] \
        if args.checkpoint_dir else []
    others = [(f"checkpoint {p}", rid) for p, rid in others if rid and rid != mine]
    log_run = log_run_id(args.log) if args.log and os.path.isfile(args.log) else None
    if not others and log_run not in (None, mine):
        raise UsageError(f"--log {args.log} is the log of run {log_run}, and --resume {resume} continues run {mine}: "
                         f"a resume trims its log back to the step it resumes from, which only the run that wrote "
                         f"the log may do; name a new --log for run {mine}")
    if not others:
        return []
    where, theirs = others[0]
    line = (f"--resume {resume} is a checkpoint of run {mine}, but {where} belongs to run {theirs} (a checkpoint "
            f"copied from another run?)")
    if not args.resume_other_run:
        raise UsageError(f"{line}; to continue run {mine} there anyway, add --resume-other-run")
    if log_run not in (None, mine):
        raise UsageError(f"{line}; --resume-other-run takes it, but --log {args.log} is the log of run {log_run}, "
                         f"which only that run may trim: name a new --log for run {mine}")
    return [f"note: {line}; continuing it, as --resume-other-run says"]
