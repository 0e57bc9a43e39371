"""One check of the command line for every llmz command (train, sample, bench, the lessons): each flag is
finite and in range, the flags agree with each other and with the files they name, outputs can be
written; anything else is refused in one line (`error: ...`, exit status 2) before any work it would waste.

The commands build their parsers with `Parser` (argparse's own errors become that one line too, and every
flag's help ends with its default) and call `check_train` (on the TrainConfig the flags map onto),
`check_sample` or `check_bench`; the lessons' flags are parsed and checked here too (`parse_lesson`).
Under mpiexec every rank checks after the ranks are up (llmz.run.launch.agree), so a bad flag on any rank ends
the whole job at once.

What the checks read: headers only (a model file's config, a token file's count, a checkpoint's DONE),
and the tokenizer. Everything is read through llmz.files: never a FIFO, never more than a header announces.
"""
from __future__ import annotations

import argparse
import math
import os

import numpy as np

from . import files
from .config import PRESETS, RECOMPUTE, TrainConfig, default_model, fmt_bytes, preset
from .data import find_token_files, token_count
from .device import ATTENTIONS, KERNEL_SETS, KINDS, kernel_paths
from .errors import LlmzError, UsageError
from .layout import Layout
from .memory import activation_elements, predicted
from .precision import PRECISIONS
from .run.model_file import model_config, model_header
from .run.outputs import prepare_folder, prepare_output
from .run.state import DONE_FILE, MODEL_FILE, STEP_DIR, checkpoints, latest_checkpoint
from .run.watchdog import MIN_TIMEOUT_S
from .tokenizer import load_tokenizer as load_any_tokenizer
from .tokenizer import start_id

# the ZeRO stages whose step --trace records (llmz.trace: each bucket's reduce-scatter against backward);
# a stage that gets traced joins this tuple
TRACE_STAGES = (2, 3)
SEED_LIMIT = 2**32          # seeds are 32-bit: numpy's generators take any, the bf16 rounding hash uses 32 bits
UNKNOWN_WINDOW_MAX = 256        # the default window of a model file that does not say its trained T
# the most tokens one sample may ask for (--tokens, and llmz.train's --sample-tokens): each is a forward pass
# over the window, ~1 ms for d12 on a GPU, longer on a CPU, so a million is about the longest wait worth asking
MAX_TOKENS = 1_000_000


# ---- parser -------------------------------------------------------------------------------------------------
class HelpFormatter(argparse.HelpFormatter):
    """Every flag's help ends with its default: ' (default: X)' unless the help already has one '(default...)',
    ' (default: off)' for a switch. A flag whose default is None says what it is in its own help."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "(default" in text or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        if action.nargs == 0 and action.const is True:
            return text + " (default: off)"
        return text if action.default is None else text + " (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: a bad flag raises UsageError (exit 2) instead of printing the usage."""

    def __init__(self, **kw):
        super().__init__(formatter_class=HelpFormatter, **kw)

    def error(self, message):
        raise UsageError(f"{message} (see {self.prog} --help)")


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def fail(message: str):
    raise UsageError(message)


# ---- single values --------------------------------------------------------------------------------------------
def need(args, names, ok, what: str) -> None:
    """Refuse the first of `names` (attributes of args; None = not given, skipped) whose value fails ok()."""
    for name in names:
        v = getattr(args, name, None)
        if v is None:
            continue
        if isinstance(v, float) and not math.isfinite(v):
            fail(f"{flag(name)} {v}: must be a finite number")
        if not ok(v):
            fail(f"{flag(name)} {v}: must be {what}")


def positive(args, *names) -> None:
    need(args, names, lambda v: v > 0, "positive")


def non_negative(args, *names) -> None:
    need(args, names, lambda v: v >= 0, ">= 0")


def check_seed(args) -> None:
    need(args, ["seed"], lambda v: 0 <= v < SEED_LIMIT, f"in 0 .. {SEED_LIMIT - 1} (a 32-bit seed)")


def check_preset(args) -> None:
    if args.model is not None and args.model not in PRESETS:
        fail(f"--model {args.model!r}: not a preset; choose one of {', '.join(PRESETS)}")


# ---- files the flags name ------------------------------------------------------------------------------------
def load_tokenizer(name: str):
    try:
        return load_any_tokenizer(name)
    except LlmzError as e:
        fail(f"--tokenizer: {e}")


def checkpoint_step(folder: str) -> tuple[int, str]:
    """(step, model file) of a complete checkpoint folder, from its DONE marker; refuses an incomplete one."""
    if not os.path.isdir(folder):
        fail(f"--resume {folder}: no such checkpoint folder")
    done = os.path.join(folder, DONE_FILE)
    if not os.path.isfile(done):
        fail(f"--resume {folder}: incomplete checkpoint (no {DONE_FILE} marker; a crash while writing?)")
    m = STEP_DIR.match(os.path.basename(os.path.normpath(folder)))
    try:
        with open(done) as f:
            step = files.loads_json(f.read(4096)).get("step")
    except (OSError, ValueError, AttributeError):
        step = None
    if not isinstance(step, int):
        step = int(m.group(1)) if m else None
    if step is None:
        fail(f"--resume {folder}: {DONE_FILE} does not say the step, nor does the folder's name")
    return step, os.path.join(folder, MODEL_FILE)


def check_model_flags(args, cfg, source: str) -> None:
    """--model, --vocab-size, --max-seq-len given together with a model from a file (--init-from, --resume)
    must describe that model; refused when they do not (they would be ignored otherwise)."""
    given = [f"{flag(k)} {getattr(args, k)}" for k in ("model", "vocab_size", "max_seq_len")
             if getattr(args, k) is not None]
    if not given:
        return
    want = cfg
    if args.model is not None:
        want = preset(args.model, vocab_size=args.vocab_size or cfg.vocab_size,
                      max_seq_len=args.max_seq_len or cfg.max_seq_len)
    if (want.num_layers, want.num_heads, want.channels) != (cfg.num_layers, cfg.num_heads, cfg.channels) or \
            (args.vocab_size or cfg.vocab_size) != cfg.vocab_size or \
            (args.max_seq_len or cfg.max_seq_len) != cfg.max_seq_len:
        fail(f"{' '.join(given)} {'does' if len(given) == 1 else 'do'} not describe the model of {source} (L={cfg.num_layers} NH={cfg.num_heads} "
             f"C={cfg.channels} V={cfg.vocab_size} maxT={cfg.max_seq_len}); drop them: the file gives the model")


def batches_in(pattern: str, name: str, B: int, T: int, world_size: int) -> int:
    """Batch positions a --train-data / --val-data glob holds (headers only): at least one, else refused."""
    try:
        files = find_token_files(pattern)
        total = sum(token_count(p) for p in files)
    except LlmzError as e:
        fail(f"{flag(name)}: {e}")
    stride = world_size * B * T
    n = max((total - 1) // stride, 0)
    if n == 0:
        more = "; --val-data '' skips validation" if name == "val_data" else ""
        fail(f"{flag(name)} {pattern}: {total} tokens cannot fill one batch of world size x B x T + 1 = "
             f"{world_size} x {B} x {T} + 1 = {stride + 1} tokens{more}")
    return n


def check_host_memory(layout, stage: int, B: int, T: int, value_bytes: int, recompute: int = 0) -> None:
    """cpu and sim: the bytes a rank will hold (llmz.memory's formula, plus the float64 copy the parameters
    start from and the float32 values of a model file) must fit in the memory available; refused in one line
    otherwise, before allocating."""
    c = layout.config
    fits_in_memory(sum(predicted(layout, stage, B, T, value_bytes, recompute=recompute).values()) + 12 * layout.total,
                   f"this configuration does not fit in memory: L={c.num_layers} C={c.channels} V={c.vocab_size} "
                   f"maxT={c.max_seq_len} at B={B} T={T}", " per rank; lower -b, -t, --max-seq-len or the model")


def fits_in_memory(need_bytes: int, what: str, advice: str = "") -> None:
    free = files.available_memory()
    if free is not None and need_bytes > free:
        fail(f"{what} needs about {fmt_bytes(need_bytes)} of memory, {fmt_bytes(free)} is available{advice}")


def check_outputs(outputs: dict[str, str | None], folders: dict[str, str | None]) -> None:
    """Output files and folders: distinct, creatable (parent folders are made now), not a folder/file
    where the other is needed."""
    named = {f: os.path.abspath(p) for f, p in outputs.items() if p}
    seen: dict[str, str] = {}
    for f, p in named.items():
        if p in seen:
            fail(f"{seen[p]} and {f} name the same file {outputs[f]}")
        seen[p] = f
    for f, p in folders.items():
        if p:
            prepare_folder(p, f)
    for f, p in outputs.items():
        if p:
            prepare_output(p, f)


# ---- python -m llmz.train ------------------------------------------------------------------------------------
def check_train(cfg: TrainConfig, kind: str, world_size: int = 1) -> None:
    """Every setting of a training run (the flags of llmz.train, once TrainConfig.for_device has filled in the
    device's defaults), in the order a user would fix them: numbers, the device, the model, the data, the
    memory, the checkpoint folder, the outputs. world_size: ranks in the job (batches per file are counted for
    it). Any refusal is a UsageError."""
    try:
        check_train_numbers(cfg)
        check_train_device(cfg, kind)
        start, resume, model = check_train_model(cfg, kind)
        check_flash_head_size(cfg, kind, model)
        batches_in(cfg.train_data, "train_data", cfg.batch_size, cfg.seq_len, world_size)
        if cfg.val_data:
            batches_in(cfg.val_data, "val_data", cfg.batch_size, cfg.seq_len, world_size)
        if kind != "gpu":                   # the GPU's: llmz.memory.check_fits, in the Trainer
            check_host_memory(Layout(model, world_size), cfg.zero_stage, cfg.batch_size, cfg.seq_len,
                              PRECISIONS[cfg.precision].value_bytes, cfg.recompute)
        check_checkpoint_dir(cfg, start, resume)
        # outputs last: their folders are created once everything else is known to be good
        check_outputs({"--save": cfg.save, "--log": cfg.log, "--trace": cfg.trace},
                      {"--checkpoint-dir": cfg.checkpoint_dir})
    except UsageError:
        raise
    except LlmzError as e:
        raise UsageError(str(e)) from None


def check_train_numbers(cfg: TrainConfig) -> None:
    """Every number finite and in its range; eps and lr within what the precision can hold."""
    positive(cfg, "batch_size", "seq_len", "grad_accum", "steps", "val_batches", "max_seq_len", "vocab_size",
             "max_loss", "print_every")
    non_negative(cfg, "warmup_steps", "val_every", "sample_every", "sample_tokens", "checkpoint_every",
                 "keep", "lr", "weight_decay", "grad_clip")
    need(cfg, ["sample_tokens"], lambda v: v <= MAX_TOKENS, f"at most {MAX_TOKENS:,}")
    need(cfg, ["collective_timeout"], lambda v: v >= MIN_TIMEOUT_S, f"at least {MIN_TIMEOUT_S:g} s: a shorter "
         f"deadline cannot tell a stopped rank from one the scheduler paused, and would end healthy runs")
    need(cfg, ["beta1", "beta2"], lambda v: 0 <= v < 1, "in [0, 1)")
    need(cfg, ["final_lr_frac"], lambda v: 0 <= v <= 1, "in [0, 1]")
    need(cfg, ["recompute"], lambda v: v in RECOMPUTE, "0, 1, 2 or 3")
    check_seed(cfg)
    check_preset(cfg)
    # the parameters move in the optimizer's dtype (bf16: the fp32 master)
    finfo = np.finfo(PRECISIONS[cfg.precision].optimizer)
    tiny, largest = float(finfo.tiny), float(finfo.max)
    need(cfg, ["eps"], lambda v: v >= tiny, f"at least {tiny:.3g}, the smallest normal {cfg.precision} "
         f"number (AdamW divides by sqrt(v) + eps, and v is 0 where a parameter never had a gradient)")
    if cfg.lr >= largest:
        fail(f"--lr {cfg.lr}: beyond the largest {cfg.precision} value ({largest:.3g}); every update would "
             f"overflow the parameters")


def check_train_device(cfg: TrainConfig, kind: str) -> None:
    """The precision, the kernel set and --trace against the device and the ZeRO stage."""
    if cfg.precision == "fp64" and kind == "gpu":
        fail("--precision fp64 runs on --device cpu or sim only")
    check_kernels(cfg, kind)
    if cfg.trace and cfg.zero_stage not in TRACE_STAGES:
        fail(f"--trace records how ZeRO stages {' and '.join(map(str, TRACE_STAGES))} overlap their collectives "
             f"with compute; at --zero-stage {cfg.zero_stage} there is nothing to trace; use --zero-stage "
             f"{TRACE_STAGES[0]}")
    if (cfg.checkpoint_every or cfg.keep) and not cfg.checkpoint_dir and cfg.no_run_dir:
        fail("--checkpoint-every and --keep need --checkpoint-dir, or a run folder (drop --no-run-dir)")
    if cfg.resume == "latest" and not cfg.checkpoint_dir:
        fail("--resume latest needs --checkpoint-dir or --run-dir DIR (the run folder whose checkpoints/ to "
             "continue), or name a folder: --resume DIR/step_N")


def check_flash_head_size(cfg: TrainConfig, kind: str, model) -> None:
    """--attention flash on a GPU or the simulator: the kernels hold a head of at most HS_MAX channels in
    shared memory (llmz.kernels.flash_attention; the fast set's tensor-core kernels take head size 64 only and
    leave the others to those). A larger head is refused here, not at the first forward."""
    if kind == "cpu" or kernel_paths(kind, cfg.kernels, cfg.matmul, cfg.attention, cfg.precision)[2] != "flash":
        return
    # numba loads here: the device is resolved (llmz.device.resolve)
    from .kernels.flash_attention import HS_MAX
    hs = model.channels // model.num_heads
    if hs > HS_MAX:
        fail(f"--attention flash: head size {hs} (C={model.channels} / NH={model.num_heads}) is beyond the flash "
             f"kernels (at most {HS_MAX}); use --attention " + ("gemm" if kind == "gpu" else "direct"))


def check_train_model(cfg: TrainConfig, kind: str):
    """The model the run starts from (a checkpoint to resume, an llm.c file, or a preset) against the model
    flags, the tokenizer and -t. Returns (the step it starts at, the checkpoint folder or None, the model's
    config)."""
    resume = cfg.resume
    if resume == "latest":
        try:
            resume = latest_checkpoint(cfg.checkpoint_dir)
        except LlmzError as e:
            fail(f"--checkpoint-dir: {e}")
    if resume and cfg.init_from and cfg.resume != "latest":
        fail(f"--init-from {cfg.init_from} and --resume {resume} both give the starting parameters; choose "
             f"one")
    start = 0
    try:
        if resume:
            start, model_file = checkpoint_step(resume)
            model = model_config(model_file)
            check_model_flags(cfg, model, f"checkpoint {resume}")
        elif cfg.init_from:
            model = model_config(cfg.init_from)
            check_model_flags(cfg, model, f"--init-from {cfg.init_from}")
    except UsageError:
        raise
    except LlmzError as e:
        fail(f"{'--resume' if resume else '--init-from'}: {e}")
    tok = load_tokenizer(cfg.tokenizer)
    if not resume and not cfg.init_from:
        if cfg.vocab_size is not None and cfg.vocab_size < tok.vocab_size:
            fail(f"--vocab-size {cfg.vocab_size} is smaller than the tokenizer's {tok.vocab_size} tokens")
        model = preset(cfg.model or default_model(kind), vocab_size=cfg.vocab_size, tokens=tok.vocab_size,
                       max_seq_len=cfg.max_seq_len or 1024)
    if model.vocab_size < tok.vocab_size:
        fail(f"the tokenizer ({cfg.tokenizer}) has {tok.vocab_size} tokens, the model only "
             f"{model.vocab_size}")
    if cfg.seq_len > model.max_seq_len:
        fail(f"--seq-len {cfg.seq_len} > max_seq_len {model.max_seq_len} of the model")
    return start, resume, model


def check_checkpoint_dir(cfg: TrainConfig, start: int, resume: str | None) -> None:
    """A checkpoint folder that already holds later checkpoints of another run is refused."""
    if not cfg.checkpoint_dir:
        return
    try:
        later = [s for s, _, done in checkpoints(cfg.checkpoint_dir) if done and s > start]
    except LlmzError as e:
        fail(f"--checkpoint-dir: {e}")
    if later:
        what = f"resuming from step {start}" if resume else "starting afresh"
        fail(f"--checkpoint-dir {cfg.checkpoint_dir} holds complete checkpoints past step {start} (up to "
             f"step {max(later)}) of another run; {what}, this run's checkpoints would mix with them (and "
             f"--resume latest would pick theirs): choose another --checkpoint-dir, or --resume latest "
             f"to continue that run")


def check_kernels(args, kind: str) -> None:
    """--kernels, --matmul and --attention against each other and the device (llmz.device.kernel_paths)."""
    try:
        kernel_paths(kind, getattr(args, "kernels", "auto"), getattr(args, "matmul", "auto"),
                     getattr(args, "attention", "auto"), getattr(args, "precision", "fp32"))
    except ValueError as e:
        fail(str(e))


# ---- python -m llmz.sample -----------------------------------------------------------------------------------
def window(seq_len: int | None, max_seq_len: int, trained: int) -> tuple[int, str]:
    """The window T a sample runs with, and the words that say why: --seq-len when given, else the T the model
    was trained at (positions past it were never trained: text there is noise), else maxT up to
    UNKNOWN_WINDOW_MAX (each token runs the whole window forward)."""
    if seq_len:
        why = "as --seq-len asks"
        if trained and seq_len > trained:
            why += f"; the model was trained at T={trained}, positions past it were never trained"
        return seq_len, why
    if trained:
        return trained, "the length the model was trained at"
    T = min(max_seq_len, UNKNOWN_WINDOW_MAX)
    return T, ("the model file does not say the length it was trained at: its maxT" +
               (f", at most {UNKNOWN_WINDOW_MAX}" if T < max_seq_len else "") + "; --seq-len to change")


def check_sample(args, kind: str = "cpu"):
    """Every flag of llmz.sample -> (model config, tokenizer, prompt ids) for the run; reads the model's header
    only. Any refusal is a UsageError."""
    try:
        return _check_sample(args, kind)
    except UsageError:
        raise
    except LlmzError as e:
        raise UsageError(str(e)) from None


def _check_sample(args, kind: str):
    positive(args, "seq_len")
    non_negative(args, "tokens", "temperature")
    need(args, ["tokens"], lambda v: v <= MAX_TOKENS, f"at most {MAX_TOKENS:,}")
    check_seed(args)
    check_kernels(args, kind)
    try:
        cfg = model_config(args.init_from)
    except LlmzError as e:
        fail(f"--init-from: {e}")
    if args.seq_len is not None and args.seq_len > cfg.max_seq_len:
        fail(f"--seq-len {args.seq_len} > max_seq_len {cfg.max_seq_len} of the model")
    # memory: the file's values, their copy in llmz's layout, the device's copy (cpu, sim), activations of B=1
    T = window(args.seq_len, cfg.max_seq_len, model_header(args.init_from)[2])[0]
    fits_in_memory((8 if kind == "gpu" else 12) * cfg.num_parameters() + 8 * sum(activation_elements(cfg, 1, T)),
                   f"--init-from {args.init_from}: sampling from this model (L={cfg.num_layers} C={cfg.channels} "
                   f"V={cfg.vocab_size} maxT={cfg.max_seq_len})")
    tok = load_tokenizer(args.tokenizer)
    ids = []
    if args.prompt:
        try:
            ids = tok.encode(args.prompt).tolist()
        except LlmzError as e:
            fail(f"--prompt: {e}")
        if ids and max(ids) >= cfg.vocab_size:
            fail(f"--prompt encodes to token {max(ids)}, beyond the model's vocabulary of {cfg.vocab_size} "
                 f"(another tokenizer than the model's?)")
    else:
        first = start_id(tok)
        if first >= cfg.vocab_size:
            fail(f"--tokenizer {args.tokenizer}: a sample without --prompt starts from its token {first} "
                 f"(end-of-text), beyond the model's vocabulary of {cfg.vocab_size} (another tokenizer than the "
                 f"model's? give a --prompt, or the model's tokenizer)")
    return cfg, tok, ids


# ---- python -m llmz.bench ------------------------------------------------------------------------------
def check_bench(args) -> None:
    positive(args, "batch_size", "seq_len", "steps", "vocab_size", "rounds")
    non_negative(args, "warmup")
    check_preset(args)


# ---- the lessons: python -m lessons.NN_name ------------------------------------------------------------
# the flags a lesson may take beyond --device, --steps and --diff, which every lesson takes; each lesson names
# those it uses (lessons.common.main), so its --help lists nothing it ignores
LESSON_FLAGS = ("--comm", "--kernels", "--attention", "--model", "--grad-accum", "--out", "--print-every",
                "--mine")
# the settings of a flag a lesson does not take (the library's defaults: what the lesson runs with)
LESSON_DEFAULTS = {"comm": "auto", "kernels": "auto", "attention": "auto", "model": None, "batch_size": None,
                   "seq_len": None, "grad_accum": 1, "out": "lessons_out", "print_every": None, "mine": None}


def parse_lesson(argv, name: str, doc: str, steps: int, sim_steps: int, grad_accum: int = 2,
                 steps_help: str = "optimizer steps", uses: tuple[str, ...] = LESSON_FLAGS) -> argparse.Namespace:
    """A lesson's flags, checked (one line for a bad one, as for every command): the device, its own --steps,
    --diff, and those of LESSON_FLAGS it `uses` (--model brings -b and -t; --grad-accum defaults to
    `grad_accum`). Defaults the lesson fills in for the device are None here. The device is not resolved
    yet: the lesson does that (lessons.common)."""
    unknown = set(uses) - set(LESSON_FLAGS)
    assert not unknown, f"lesson flags {unknown} are not among {LESSON_FLAGS}"
    p = Parser(prog=f"python -m lessons.{name}", description=doc.split("\n\n")[0],
               epilog=f"N ranks: mpiexec -n N python -m lessons.{name}. lessons/README.md says what "
               "each checkpoint measures.")
    p.set_defaults(**LESSON_DEFAULTS)
    a = p.add_argument
    a("--device", choices=KINDS, default="auto",
      help="gpu, cpu (NumPy, fp64), sim (the kernels in Numba's CUDA simulator), or auto: gpu where CuPy sees "
      "one, else cpu")
    if "--comm" in uses:
        a("--comm", choices=("auto", "nccl", "mpi"), default="auto",
          help="as in llmz.train (default auto: NCCL with a GPU per rank, else MPI)")
    if "--kernels" in uses:
        a("--kernels", choices=KERNEL_SETS, default="auto",
          help="as in llmz.train (default auto: fast, llmz/fast/, on a GPU; teaching, llmz/kernels/, elsewhere)")
    if "--attention" in uses:
        a("--attention", choices=ATTENTIONS, default="auto",
          help="as in llmz.train (default auto: on a GPU flash in bf16, gemm in fp32; direct elsewhere; "
          "flash: FlashAttention-2)")
    a("--steps", type=int, default=None, help=f"{steps_help} (default {steps}; {sim_steps} on sim)")
    if "--model" in uses:
        a("--model", default=None, help="a preset of llmz.config (default thin; tiny on sim)")
        a("--batch-size", "-b", type=int, default=None, help="B per rank (default 2; 4 on gpu, 1 on sim)")
        a("--seq-len", "-t", type=int, default=None,
          help="T, also the model's max_seq_len (default 32; 4 on sim)")
    if "--grad-accum" in uses:
        a("--grad-accum", type=int, default=grad_accum, help=f"K micro-steps per step (default {grad_accum})")
    if "--print-every" in uses:
        a("--print-every", type=int, default=None, metavar="N",
          help="a line every N steps, and at the first and the last; 1 = every step (default: as in "
          "llmz.train, about 25 lines: every step up to 35 steps)")
    if "--out" in uses:
        a("--out", default="lessons_out",
          help="where figures go, named by model, ranks and K (default lessons_out)")
    if "--mine" in uses:
        a("--mine", metavar="FILE", default=None, help="train with FILE, your version of the lesson's plain "
          "code (start from its exercise, lessons/exercises/), and grade it with the lesson's checkpoints "
          "(default: none, the plain code of llmz/plain/)")
    a("--diff", action="store_true",
      help="print what this lesson changed from the one it builds on (a unified diff) and exit")
    args = p.parse_args(argv)
    args.lesson = name
    positive(args, "steps", "batch_size", "seq_len", "grad_accum", "print_every")
    check_preset(args)
    return args
