"""python -m llmz.train: train GPT-2 on one or many ranks (mpiexec -n N python -m llmz.train).

Reads top to bottom like nanoGPT's train.py: flags, ranks and device, data, model, ZeRO stage, the loop.
With no flags it trains a small byte-level model on the shipped Shakespeare and prints a sample.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time

import numpy as np

from . import threads
from .args import TRACE_STAGES
from .bf16 import bf16_to_f32
from .device import ATTENTIONS, KERNEL_SETS, KINDS, MATMULS, resolve
from .trace import overlap
from .watchdog import DEFAULT_TIMEOUT_S

# storage dtype of each --precision: bf16 values are kept as their uint16 bit patterns (llmz.bf16)
PRECISIONS = {"fp32": np.float32, "fp64": np.float64, "bf16": np.uint16}
# MFU denominators (dense, per GPU, TFLOP/s), llm.c's table: fp32 training runs its matmuls in TF32.
PEAK_TFLOPS = {"H100": {"fp32": 494.7, "bf16": 989.4}, "H200": {"fp32": 494.7, "bf16": 989.4},
               "A100": {"fp32": 156.0, "bf16": 312.0}}
DEFAULT_DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")


def build_parser() -> argparse.ArgumentParser:
    from .args import Parser
    from .config import PRESETS
    p = Parser(prog="python -m llmz.train", description=__doc__.splitlines()[0])
    a = p.add_argument
    a("--device", choices=KINDS, default="auto", help="gpu: Numba kernels on CuPy memory; cpu: NumPy "
      "references; sim: the kernels in Numba's CUDA simulator (tiny models only); auto: gpu if there is one")
    a("--precision", choices=("fp32", "fp64", "bf16"), default="fp32", help="fp64 only on cpu and sim; bf16: "
      "parameters, gradients and activations in bf16, fp32 master weights, m, v, layernorm statistics and "
      "losses, stochastic rounding in AdamW and in ZeRO-2's accumulation")
    a("--comm", choices=("auto", "nccl", "mpi"), default="auto", help="collective backend between ranks")
    a("--kernels", choices=KERNEL_SETS, default="auto", help="fast (GPU default: llmz/fast/, the kernels that "
      "won) or teaching (llmz/kernels/: the simplest correct kernel per layer; the default in the simulator, "
      "and on cpu, where it means the NumPy references)")
    a("--matmul", choices=MATMULS, default="auto", help="the products: cublas (cuBLAS, TF32 for fp32; the "
      "default with --kernels fast on a GPU) or numba (the tiled teaching kernel)")
    a("--attention", choices=ATTENTIONS, default="auto", help="flash (FlashAttention-2: no T x T buffers; on "
      "tensor cores for bf16 with --kernels fast, the default there), gemm (the fp32 default with cuBLAS: "
      "batched per-head products around a softmax kernel, llm.c's non-cuDNN path) or direct (the teaching "
      "kernels, one per step of the math)")
    a("--no-tf32", action="store_true", help="cuBLAS fp32 products in full fp32 instead of TF32")
    a("--no-cuda-graph", action="store_true", help="launch every kernel from Python each step instead of "
      "replaying the step captured as a CUDA graph (the GPU default with --comm nccl or one rank)")
    a("--zero-stage", type=int, choices=(0, 1, 2, 3), default=0, help="0: every rank keeps everything; 1: the "
      "optimizer state sharded; 2: the gradients sharded too, reduce-scattered during backward; 3: the "
      "parameters sharded too, each block all-gathered just before it runs")
    a("--no-overlap", action="store_true", help="stages 2 and 3: serialise each reduce-scatter with backward "
      "(stage 3: and gather each block's parameters only when it runs, no prefetch)")
    a("--model", default=None, help=f"preset: {', '.join(PRESETS)} (default: small on cpu, d6 on gpu; "
      "the file's model with --init-from or --resume)")
    a("--init-from", default=None, metavar="FILE.bin", help="start from an llm.c model file (default: a "
      "freshly initialised --model)")
    a("--max-seq-len", type=int, default=None, help="model's maxT for a preset (default: 1024)")
    a("--vocab-size", type=int, default=None, help="model's V for a preset (default: the tokenizer's; "
      "50257 gives GPT-2's shapes with any token file, and samples are then drawn among the tokenizer's "
      "tokens only)")
    a("--seed", type=int, default=1337, help="initialisation, data order with --shuffle, sampling, bf16 "
      "rounding (0 .. 2^32-1)")
    a("--train-data", default=os.path.join(DEFAULT_DATA, "shakespeare_train.bin"), metavar="GLOB",
      help="llm.c token files (default: the shipped data/shakespeare_train.bin)")
    a("--val-data", default=os.path.join(DEFAULT_DATA, "shakespeare_val.bin"), metavar="GLOB",
      help="llm.c token files for the validation loss; '' for none (default: the shipped "
      "data/shakespeare_val.bin)")
    a("--tokenizer", default="byte", help="byte, gpt2 (tiktoken) or an llm.c tokenizer file")
    a("--shuffle", action="store_true", help="shuffle the batch order every epoch (llm.c keeps the files' "
      "order)")
    a("--batch-size", "-b", type=int, default=None, help="B per rank (default: 16 on cpu, 32 on gpu)")
    a("--seq-len", "-t", type=int, default=None, help="T (default: 64 on cpu, 256 on gpu)")
    a("--grad-accum", type=int, default=1, help="K micro-steps per optimizer step")
    a("--steps", type=int, default=None, help="optimizer steps, counted from the start of training "
      "(default: 1500 on cpu, 2000 on gpu)")
    a("--lr", type=float, default=1e-3, help="peak learning rate of AdamW")
    a("--warmup-steps", type=int, default=20, help="steps of linear warmup to --lr")
    a("--lr-schedule", choices=("cosine", "constant"), default="cosine", help="after warmup: cosine decay to "
      "--final-lr-frac x --lr, or constant")
    a("--final-lr-frac", type=float, default=0.1, help="where the cosine decay ends, as a fraction of --lr")
    a("--weight-decay", type=float, default=0.0, help="AdamW's decoupled weight decay (2-D weights only)")
    a("--beta1", type=float, default=0.9, help="AdamW's first-moment decay")
    a("--beta2", type=float, default=0.95, help="AdamW's second-moment decay")
    a("--eps", type=float, default=1e-8, help="AdamW's epsilon in m / (sqrt(v) + eps); > 0")
    a("--grad-clip", type=float, default=1.0, help="clip the global gradient norm to this; 0 = off")
    a("--max-loss", type=float, default=None, help="stop, naming the step, when the training loss exceeds "
      "this: the run diverged (default: 3 ln V, three times the loss of a uniform guess)")
    a("--val-every", type=int, default=250, help="validation loss every N steps and at the last; 0 = only "
      "at the last")
    a("--val-batches", type=int, default=10, help="batches per validation loss (at most the val data's)")
    a("--sample-every", type=int, default=0, help="print a sample every N steps; 0 = only at the end")
    a("--sample-tokens", type=int, default=200, help="tokens per printed sample (at most 1,000,000); 0 = no "
      "samples")
    a("--log", default=None, metavar="FILE.jsonl", help="one JSON object per step, flushed line by line; a "
      "new run starts the file, a resumed run continues it (default: no log)")
    a("--save", default=None, metavar="FILE.bin", help="write the final model, llm.c format (default: not "
      "saved)")
    a("--trace", default=None, metavar="FILE.json", help=f"ZeRO stage {'/'.join(map(str, TRACE_STAGES))}: "
      "Chrome trace (+ PNG) of one step (default: none)")
    a("--checkpoint-dir", default=None, metavar="DIR", help="write checkpoints to DIR/step_NNNNNN/ "
      "(model.bin, state_rank<r>.bin, DONE); DIR is locked while the run lives (default: none)")
    a("--checkpoint-every", type=int, default=0, metavar="N", help="checkpoint every N steps and after the "
      "last (0 = after the last only)")
    a("--keep", type=int, default=0, metavar="K", help="keep the newest K complete checkpoints, deleting only "
      "older ones (0 = all)")
    a("--resume", nargs="?", const="latest", default=None, metavar="DIR/step_N|latest",
      help="continue from a checkpoint: a step folder, or 'latest' (the newest complete one in "
      "--checkpoint-dir; none there: start afresh). --steps still counts from the start of training; "
      "another world size or ZeRO stage re-shards the optimizer state (default: start afresh)")
    a("--quiet", action="store_true", help="no per-step lines")
    a("--resume-other-run", action="store_true", help="take the checkpoint --resume names even though it is of "
      "another run than the rest of --checkpoint-dir or the --log (checkpoints carry their run's id)")
    a("--collective-timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS", help="end the job, naming "
      "the collective, the step and the rank(s) that did not arrive, when a collective between ranks waits longer "
      "than this (a rank stopped, hung or dead). The default, PyTorch's, is 40x the longest legitimate wait of "
      "one rank for another (BENCHMARKS.md: the checkpoint whose model file rank 0 writes alone, the first step's "
      "compilation, CUDA graph capture: seconds); raise it only for a filesystem that takes minutes to write a "
      "checkpoint")
    return p


def defaults_for(args, kind: str) -> None:
    """Fill the device-dependent defaults: a small model on a laptop CPU, a bigger one on a GPU."""
    gpu = kind == "gpu"
    if args.model is None and args.init_from is None and args.resume is None:
        args.model = default_model(kind)     # resuming: the checkpoint says which model
    if args.batch_size is None:
        args.batch_size = 32 if gpu else 16
    if args.seq_len is None:
        args.seq_len = 256 if gpu else 64
    if args.steps is None:
        args.steps = 2000 if gpu else 1500


def parse_args(argv=None, kind: str | None = None, world_size: int = 1):
    """Flags -> (args, device kind): parsed, the device resolved (before numba is imported: the simulator
    needs that) unless `kind` is given, the device-dependent defaults filled in, and every flag checked
    (llmz.args.check_train: a UsageError, one line, for anything wrong). world_size: the job's ranks."""
    from .args import check_train
    from .errors import UsageError
    args = build_parser().parse_args(argv)
    if kind is None:
        try:
            kind = resolve(args.device)
        except (ValueError, RuntimeError) as e:
            raise UsageError(str(e)) from None
    defaults_for(args, kind)
    check_train(args, kind, world_size)
    return args, kind


def default_model(kind: str) -> str:
    return "d6" if kind == "gpu" else "small"


# the flags that shape the training trajectory: saved in every checkpoint, compared on resume
RESUME_FLAGS = ("precision", "zero_stage", "batch_size", "seq_len", "grad_accum", "steps", "lr",
                "warmup_steps", "lr_schedule", "final_lr_frac", "weight_decay", "beta1", "beta2", "eps",
                "grad_clip", "seed", "shuffle", "train_data")
# what the CUDA context, cuBLAS and NCCL workspaces and the memory pool's slack take beyond the formula
GPU_RESERVE_BYTES = 1 << 30


def resume_flags(args) -> dict:
    return {k: getattr(args, k) for k in RESUME_FLAGS}


def restore_loader(loader, saved: dict, path: str) -> list[str]:
    """Put `loader` where the saved one stopped. With the same tokens per micro-step over all ranks
    (world size x B x T; B may change with the world size) the token stream continues exactly; with
    another global batch it continues at the same token count, rounded down. Returns notes to print."""
    from .errors import LlmzError
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


def check_fits(predicted: dict, free: int, total: int, gpu_index: int = 0,
               reserve: int = GPU_RESERVE_BYTES) -> None:
    """Refuse a configuration whose predicted bytes per rank (llmz.memory.predicted) plus `reserve` exceed
    the GPU's free bytes (cupy.cuda.runtime.memGetInfo): one line with both numbers, before allocating."""
    from .errors import LlmzError
    from .memory import fmt_bytes
    need = sum(predicted.values())
    if need + reserve > free:
        parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in predicted.items() if v)
        raise LlmzError(f"this configuration does not fit on GPU {gpu_index}: predicted {fmt_bytes(need)} "
                        f"per rank ({parts}) + {fmt_bytes(reserve)} reserve, available {fmt_bytes(free)} "
                        f"free of {fmt_bytes(total)}; lower -b or -t, or raise --zero-stage")


class Run:
    """Everything one rank needs to train: device, communicator, data, model and its ZeRO stage."""

    def __init__(self, args, kind: str, ranks):
        from . import checkpoint, comm, config, data, layout, memory, model, optim, tokenizer, zero
        from .errors import LlmzError
        self.args, self.ranks = args, ranks
        self.rank, self.world_size = ranks.rank, ranks.world_size
        self.notes: list[str] = []                  # lines for rank 0 to print (resume decisions)
        dtype = PRECISIONS[args.precision]
        from .device import Device
        self.dev = Device(kind, dtype, gpu_index=ranks.local_rank, matmul=args.matmul,
                          attention=args.attention, tf32=not args.no_tf32, kernel_set=args.kernels)
        self.comm = comm.make_communicator(args.comm, ranks, self.dev)
        self.tok = tokenizer.load_tokenizer(args.tokenizer)
        # model: a checkpoint to resume, an llm.c file, or a preset (llmz.args.check_train has checked
        # that the flags describe it, that the tokenizer fits it and that T fits its maxT)
        self.resumed = self.find_checkpoint()
        self.last_checkpoint = self.resumed.path if self.resumed else None     # the newest good one
        from .state import run_identity
        self.run_id = run_identity(self.resumed, ranks)                          # kept across resumes
        if self.resumed:
            cfg = self.resumed.config
            self.layout = layout.Layout(cfg, self.world_size)
            from .state import full_ranges
            params = self.resumed.assemble("params", full_ranges(self.layout))
        elif args.init_from:
            cfg, llmc = checkpoint.load_model(args.init_from)
            self.layout = layout.Layout(cfg, self.world_size)
            params = self.layout.from_llmc(llmc, np.float64)
        else:
            cfg = config.preset(args.model or default_model(kind),
                                vocab_size=args.vocab_size or self.tok.vocab_size,
                                max_seq_len=args.max_seq_len or 1024)
            self.layout = layout.Layout(cfg, self.world_size)
            params = layout.init_parameters(self.layout, args.seed)
        if cfg.vocab_size < self.tok.vocab_size or args.seq_len > cfg.max_seq_len:
            raise LlmzError(f"the model (V={cfg.vocab_size}, maxT={cfg.max_seq_len}) does not fit the tokenizer "
                            f"({self.tok.vocab_size} tokens) or -t {args.seq_len}")
        # samples: among the tokens the tokenizer can decode (a model wider than its tokenizer, e.g.
        # --vocab-size 50257 on byte data, would otherwise sample ids it cannot print)
        self.sample_vocab = min(cfg.vocab_size, self.tok.vocab_size)
        if self.sample_vocab < cfg.vocab_size and args.sample_tokens:
            self.notes.append(f"note: the model has {cfg.vocab_size} tokens, the tokenizer {self.tok.vocab_size}: "
                              f"samples are drawn among the tokenizer's {self.tok.vocab_size} only")
        # divergence: a loss this far above a uniform guess's (ln V) means the run has left training
        self.max_loss = args.max_loss or 3 * math.log(cfg.vocab_size)
        self.config = cfg
        B, T = args.batch_size, args.seq_len
        self.train_loader = data.DataLoader(args.train_data, B, T, self.rank, self.world_size,
                                            shuffle=args.shuffle, seed=args.seed, vocab_size=cfg.vocab_size)
        self.val_loader = (data.DataLoader(args.val_data, B, T, self.rank, self.world_size,
                                           vocab_size=cfg.vocab_size) if args.val_data else None)
        self.opt = optim.AdamW(lr=args.lr, beta1=args.beta1, beta2=args.beta2, eps=args.eps,
                               weight_decay=args.weight_decay, grad_clip=args.grad_clip,
                               warmup_steps=args.warmup_steps, schedule=args.lr_schedule,
                               final_lr_frac=args.final_lr_frac, total_steps=args.steps)
        self.rng = np.random.default_rng(args.seed)     # draws the seeds of the samples printed in training
        if self.dev.kind == "gpu":                     # refuse before the big allocations, not halfway
            free, total = self.dev.xp.cuda.runtime.memGetInfo()
            check_fits(memory.predicted(self.layout, args.zero_stage, B, T, np.dtype(dtype).itemsize,
                                        flash=self.dev.attention == "flash"), free, total, self.dev.gpu_index)
        self.model = model.GPT2(cfg, self.dev, B, T)
        self.tracer = None
        if args.trace:
            from .trace import Tracer
            self.tracer = Tracer(self.dev, self.rank)
        self.zero = zero.make_stage(args.zero_stage, self.layout, self.dev, self.comm, self.opt, params,
                                    overlap=not args.no_overlap, tracer=self.tracer, seed=args.seed,
                                    start_step=self.resumed.step if self.resumed else 0)
        self.memory = memory.report(self.layout, args.zero_stage, B, T, np.dtype(dtype).itemsize,
                                    self.zero, self.model, self.dev, flash=self.dev.attention == "flash")
        self.tokens_per_step = B * T * args.grad_accum * self.world_size
        self.x = self.dev.zeros((B, T), np.int32)
        self.y = self.dev.zeros((B, T), np.int32)
        self.loss_sum = self.dev.zeros(1, np.float64)    # the step's summed per-position losses, on device
        self.prepared = None                             # the next batch's host side (prepare_batch)
        self.mean_buf = self.dev.zeros(1, np.float64)    # mean_over_ranks' all-reduce (no allocation a step)
        from .kernels.norm import NORM_BLOCKS
        self.finite_sq = self.dev.zeros(1, np.float64)   # all_finite's sum of squares, and its scratch
        self.finite_scratch = self.dev.zeros(NORM_BLOCKS, np.float64)
        # the micro-step and the update replay as CUDA graphs where every call in them can be captured:
        # not with MPI's host-staged collectives, not while tracing (host timestamps). bf16 as well: AdamW's
        # and ZeRO-2's stochastic rounding read their step from device memory (zero.set_scalars,
        # zero.set_micro_step)
        from .graph import Graphs
        self.graphs = Graphs(self.dev, enabled=not (args.no_cuda_graph or args.trace)
                             and self.comm.name in ("local", "nccl"), after_launch=self.comm.after_graph)
        self.start_step = 0
        if self.resumed:
            self.restore(self.resumed)

    # ---- checkpoints (llmz.state) ----------------------------------------------------------------------
    def find_checkpoint(self):
        """The checkpoint --resume names, read and checked (every rank reads every state file), or None."""
        from .state import latest_checkpoint, load_checkpoint_agreed
        a = self.args
        if not a.resume:
            return None
        path = a.resume
        if path == "latest":
            path = latest_checkpoint(a.checkpoint_dir)
            if path is None:
                self.notes.append(f"resume: no complete checkpoint in {a.checkpoint_dir}; starting afresh")
                return None
        if a.init_from:     # `--init-from F --resume --checkpoint-dir D`: one command for launch and relaunch
            self.notes.append(f"resume: {path} found, so --init-from {a.init_from} is not used")
        return load_checkpoint_agreed(path, self.ranks)

    def restore(self, ckpt) -> None:
        """Continue from `ckpt`: this rank's m and v re-sharded for this layout, the step, the data position,
        the RNG. Parameters were assembled in __init__."""
        meta = ckpt.meta
        self.zero.load_optimizer_state(ckpt.assemble("m", self.zero.owned_ranges()),
                                       ckpt.assemble("v", self.zero.owned_ranges()))
        self.start_step = ckpt.step
        self.notes += restore_loader(self.train_loader, meta["data"], ckpt.path)
        # the RNG of this rank's file (a bigger world: of rank r mod the saved world size)
        self.rng.bit_generator.state = ckpt.states[self.rank % ckpt.world_size].meta["rng"]
        saved = meta["flags"]
        mine = resume_flags(self.args)
        changed = [f"--{k.replace('_', '-')} {mine[k]} (was {saved.get(k)})"
                   for k in mine if saved.get(k) != mine[k]]
        self.notes.append(f"resume: step {ckpt.step} from {ckpt.path} ({ckpt.world_size} rank(s), ZeRO stage "
                          f"{meta['zero_stage']}, {meta['precision']})" + (f"; changed: {', '.join(changed)}"
                                                                          if changed else ""))

    def all_finite(self) -> bool:
        """Are the parameters and the optimizer state (bf16: the fp32 master; m, v) all finite, on every rank?
        One reduction on the device: the sum of their squares, accumulated in float64 (llmz.kernels.norm), is
        finite exactly when every value is (a float32 or bf16 value squares to at most 1.2e77; an fp64 one
        beyond 1e154 counts as non-finite: such a model has diverged anyway), summed over the ranks (m and v
        are sharded), read once."""
        from .kernels.norm import norm_squared
        z = self.zero
        params = z.param_shard if z.stage == 3 else z.params       # stage 3: my slice; else all of them
        arrays = [a for a in (params, z.master, z.m, z.v) if a is not None]
        for i, x in enumerate(arrays):
            norm_squared(self.dev, self.finite_sq, x, self.finite_scratch, accumulate=i > 0)
        z.comm_waits_for_compute()
        self.comm.all_reduce(self.finite_sq, op="sum")
        z.compute_waits_for_comm()
        return math.isfinite(float(self.dev.to_host(self.finite_sq)[0]))

    def refuse_non_finite(self, step: int, what: str) -> None:
        """Before writing `what` after `step` optimizer steps: stop, on every rank alike, if anything is
        not finite (nothing non-finite is ever saved)."""
        if not self.all_finite():
            from .launch import AgreedError
            raise AgreedError(f"step {step - 1}: the update left non-finite parameters or optimizer state; "
                              f"{what} not written; last good checkpoint: {self.last_checkpoint or 'none'}", 1)

    def save_checkpoint(self, root: str, step: int) -> str:
        """Checkpoint after `step` optimizer steps: DIR/step_NNNNNN/{model.bin, state_rank<r>.bin, DONE}.
        Only from finite parameters and optimizer state. Every file is written to a temporary name and
        renamed; DONE comes last, after a barrier, so a folder without it is ignored by --resume. --keep
        then deletes complete checkpoints older than the newest K up to this one (never later ones).
        Returns the folder."""
        from . import state
        from .checkpoint import save_model
        folder = state.step_dir(root, step)
        self.refuse_non_finite(step, f"checkpoint {folder}")
        if self.rank == 0:
            state.prepare_step_dir(folder, self.world_size)
        self.comm.barrier()                    # the folder exists and holds no stale DONE
        host = self.host_params()
        if self.rank == 0:
            save_model(os.path.join(folder, state.MODEL_FILE), self.config, host, self.layout,
                       dtype=self.model_dtype(), seq_len=self.args.seq_len)
        meta = {"step": step, "world_size": self.world_size, "rank": self.rank,
                "zero_stage": self.args.zero_stage, "precision": self.args.precision,
                "config": self.config.to_dict(), "flags": resume_flags(self.args),
                "data": self.train_loader.state(), "rng": self.rng.bit_generator.state,
                "buckets": state.shard_table(self.layout, self.rank), "run_id": self.run_id}
        state.write_state(state.state_path(folder, self.rank), meta, self.zero.state_slices(host))
        self.comm.barrier()                    # every rank's file is in place
        if self.rank == 0:
            state.write_done(folder, {"step": step, "world_size": self.world_size,
                                      "zero_stage": self.args.zero_stage, "run_id": self.run_id})
            if self.args.keep:
                state.prune(root, self.args.keep, newest=step)
        self.last_checkpoint = folder
        return folder

    def save_model(self, path: str, step: int) -> None:
        """--save: the model file, from finite parameters only (rank 0 writes it)."""
        from .checkpoint import save_model
        self.refuse_non_finite(step, f"--save {path}")
        host = self.host_params()
        if self.rank == 0:
            save_model(path, self.config, host, self.layout, dtype=self.model_dtype(), seq_len=self.args.seq_len)

    def diverged(self, step: int, loss: float, grad_norm: float | None = None) -> str | None:
        """Why the run must stop at `step`, or None: a non-finite loss or gradient norm, or a loss above
        self.max_loss (--max-loss; default 3 ln V: three times what a uniform guess scores)."""
        if not math.isfinite(loss) or (grad_norm is not None and not math.isfinite(grad_norm)):
            return f"step {step}: non-finite loss {loss}" + (f" or grad norm {grad_norm}" if grad_norm is not None
                                                             else "")
        if loss > self.max_loss:
            bound = "--max-loss" if self.args.max_loss else "3 ln V; see --max-loss"
            return f"step {step}: loss {loss:.6g} is above {self.max_loss:.4g} ({bound}): the run diverged"
        return None

    def forget_checkpoint_of(self, step: int) -> str:
        """The run stopped at `step` because of what the parameters after `step` updates gave: if this run
        checkpointed those parameters, its DONE goes (the folder stays, for a look; --resume skips it).
        Returns the words for the error line."""
        from . import state
        folder = state.step_dir(self.args.checkpoint_dir, step) if self.args.checkpoint_dir else None
        if folder is None or folder != self.last_checkpoint or (self.resumed and self.resumed.path == folder):
            return f"last good checkpoint: {self.last_checkpoint or 'none'}"
        if self.rank == 0:
            done = os.path.join(folder, state.DONE_FILE)
            if os.path.exists(done):
                os.unlink(done)
        self.comm.barrier()
        previous = [p for s, p, ok in state.checkpoints(self.args.checkpoint_dir) if ok and s < step]
        self.last_checkpoint = previous[-1] if previous else (self.resumed.path if self.resumed else None)
        return (f"{folder}, which holds these parameters, is marked incomplete (DONE removed); last good "
                f"checkpoint: {self.last_checkpoint or 'none'}")

    # ---- one optimizer step ------------------------------------------------------------------------
    def step(self, step: int) -> dict:
        """K micro-steps of forward+backward, then the ZeRO stage's reduce / update / gather.
        Returns the step's mean loss (over all micro-steps and ranks, before the update) and grad norm.
        On the GPU both parts replay as CUDA graphs (llmz.graph); the loss and the norm are read once, at
        the end."""
        z = self.zero
        self.model.kernels.zero(self.dev, self.loss_sum)
        K = self.args.grad_accum
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
        from .kernels.norm import sum_into
        a, z, m = self.args, self.zero, self.model
        # forward to the logits; backward's fused classifier computes the losses and dlogits in one pass
        m.forward(z.pviews, self.x)
        m.backward(z.pviews, z, self.x, self.y, 1.0 / (a.batch_size * a.seq_len * a.grad_accum))
        sum_into(self.dev, self.loss_sum, m.acts.losses)
        z.backward_done()

    def next_batch(self, loader, backward: bool = False) -> None:
        """The loader's next (x, y) into the device buffers self.x, self.y (on the compute stream). backward:
        the batch's backward follows, so with the fast kernels also its positions sorted by token (their wte
        backward; a forward-only batch, as in validation, needs none). Uses what prepare_batch made, when it is this
        batch's."""
        prepared = self.prepared
        if prepared is None or prepared[:2] != (loader, loader.position):
            prepared = self.prepare_batch(loader, backward)
        self.prepared = None
        _, _, x, y, table = prepared
        loader.position += 1
        self.dev.copy_from_host(self.x, x)
        self.dev.copy_from_host(self.y, y)
        if backward and table is not None:
            from .fast.encoder import wte_buckets_upload
            self.model.wte_buckets = wte_buckets_upload(self.dev, x, table)

    def prepare_batch(self, loader, backward: bool = True) -> tuple:
        """The host side of the loader's next batch: (loader, position, x, y, its wte bucket table for a
        backward with the fast kernels, else None), kept for next_batch. Called while the GPU is busy (after the update is
        queued), so the sort of the next batch's tokens (~2-3 ms at B=16, T=1024) costs no GPU time."""
        from .fast.encoder import wte_buckets
        x, y = loader.peek()
        table = wte_buckets(x) if backward and self.dev.fast else None
        self.prepared = (loader, loader.position, x, y, table)
        return self.prepared

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
            self.model.forward(self.zero.pviews, self.x, self.y)
            total += self.model.mean_loss()
        return self.mean_over_ranks(total / n)

    def host_params(self) -> np.ndarray:
        """The full parameters on the host (bf16 runs: the bf16 values, widened to float32)."""
        p = self.zero.full_parameters()             # stage 3 gathers them: every rank calls this
        return bf16_to_f32(p) if p.dtype == np.uint16 else p

    def model_dtype(self) -> str:
        """The llm.c model file a run writes: version 5 (bf16) for bf16 training, else version 3 (fp32)."""
        return "bf16" if self.args.precision == "bf16" else "fp32"

    def sample_seed(self) -> int:
        """The seed of the next printed sample, from the run's RNG (saved in checkpoints)."""
        return int(self.rng.integers(2**31))

    def sample(self, prompt_ids, n_tokens: int, seed: int) -> list[int]:
        from .model import GPT2
        from .sample import generate
        if not hasattr(self, "sampler"):
            self.sampler = GPT2(self.config, self.dev, 1, self.args.seq_len)   # B=1: cheap activations
        return generate(self.sampler, self.zero.pviews, self.tok, prompt_ids, n_tokens, seed,
                        vocab=self.sample_vocab)

    def sample_text(self) -> str:
        """A sample of --sample-tokens tokens from an empty prompt, decoded, with the run's next seed."""
        return self.tok.decode(self.sample([], self.args.sample_tokens, self.sample_seed()))


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


def train(args, kind: str, ranks) -> dict:
    """Train as the flags say, on this rank. The end of a run goes in the order that loses nothing: the
    last checkpoint, --save, the log's end record and close, and only then the sample (its failure can no
    longer cost anything). A non-finite or diverged step stops the run, naming the step, on every rank."""
    from .data import check_same_data
    from .errors import LlmzError, before_any_work
    from .files import JsonLog
    from .launch import AgreedError, agree, interrupted
    from .lock import take_locks
    from .memory import table
    from .progress import Progress, fmt_duration
    from .state import check_run_identity
    r0 = ranks.rank == 0
    say = print if r0 else (lambda *a, **k: None)
    # the printed samples: every rank generates them, each drawing the same tokens from the same seed, rank 0
    # prints them (at ZeRO stage 3 generating gathers the parameters, a collective; at the other stages a
    # rank that did not generate would wait that long for rank 0 in its next collective, a wait the collective
    # watchdog's deadline would have to cover)
    locks: list = []
    log = run = None
    step = None
    try:
        notes = agree(ranks, lambda: take_locks(args, locks) + check_run_identity(args) if r0 else [])
        check_same_data(ranks, {"--train-data": args.train_data, "--val-data": args.val_data})
        with before_any_work():                     # a file found wrong while reading it: status 2
            run = Run(args, kind, ranks)
        c = run.config
        d = run.dev
        kernels = (f"{d.kernel_set} kernels (matmul {d.matmul}, attention {d.attention})" if d.kernels
                   else "the NumPy references")
        say(f"llmz: {d.kind} {args.precision}, {kernels}, {ranks.world_size} rank(s), comm {run.comm.name}, "
            f"ZeRO stage {args.zero_stage}; {threads.note(ranks.local_size)}")
        say(f"model: L={c.num_layers} NH={c.num_heads} C={c.channels} V={c.vocab_size} Vp={c.padded_vocab_size} "
            f"maxT={c.max_seq_len}: {c.num_parameters():,} parameters")
        say(f"batch: B={args.batch_size} T={args.seq_len} K={args.grad_accum} x {ranks.world_size} ranks = "
            f"{run.tokens_per_step:,} tokens/step; {run.train_loader.num_batches} batches per epoch")
        say(table(run.memory))
        for note in notes + run.notes:
            say(note)
        start = step = run.start_step
        if start >= args.steps:
            say(f"nothing to train: the checkpoint is at step {start}, --steps is {args.steps}")
        if r0 and args.log:
            log = JsonLog(args.log, resume_step=start if run.resumed else None)
            if log.dropped:
                say(f"resume: {args.log}: dropped {log.dropped} record(s) an earlier attempt wrote past step {start}")
            log.write({"event": "start", "run_id": run.run_id, "config": c.to_dict(), "args": vars(args),
                       "world_size": ranks.world_size, "memory": run.memory, "start_step": start,
                       "resumed_from": run.resumed.path if run.resumed else None})

        def stop(why: str):
            """End the run at `step` on every rank alike (the loss is the same on all): one line."""
            where = run.forget_checkpoint_of(step)
            if log:
                log.write({"event": "stopped", "step": step, "reason": why})
            raise AgreedError(f"{why}; stopped; {where}", 1)

        first_loss = last = None
        val_losses = []
        step_times = []
        progress = Progress(args.steps, start)
        trace_step = min(start + 1, args.steps - 1)
        every = args.checkpoint_every
        for step in range(start, args.steps):
            run.comm.watch.step = step                  # for the collective watchdog's lines
            last_step = step == args.steps - 1
            if args.val_every and run.val_loader and (step % args.val_every == 0 or last_step) \
                    or (last_step and run.val_loader):
                vl = run.val_loss(args.val_batches)
                val_losses.append((step, vl))
                say(f"step {step:5d} | val loss {vl:.4f}")
                if log:
                    log.write({"step": step, "val_loss": vl})
                if not math.isfinite(vl):
                    stop(f"step {step}: non-finite validation loss {vl}")
            if args.sample_every and args.sample_tokens and step > 0 and step % args.sample_every == 0:
                say("---\n" + run.sample_text() + "\n---")
            if args.trace and step == trace_step:
                run.tracer.start()
            run.dev.synchronize()
            t0 = time.perf_counter()
            out = run.step(step)
            run.dev.synchronize()
            dt = time.perf_counter() - t0
            if args.trace and step == trace_step:
                events = run.tracer.stop(args.trace)["traceEvents"]
                say(f"timeline {args.trace} (and .png), step {step}: {overlap(events)}")
            step_times.append(dt)
            progress.tick()
            loss = out["loss"]
            why = run.diverged(step, loss, out["grad_norm"])
            if why:
                stop(why)
            first_loss = loss if first_loss is None else first_loss
            last = loss
            tps = run.tokens_per_step / dt
            util = mfu(tps, c, args.seq_len, run.dev, args.precision)
            rec = {"step": step, "loss": loss, "lr": run.opt.lr_at(step), "grad_norm": out["grad_norm"],
                   "ms": dt * 1e3, "tokens_per_s": tps, "elapsed_s": progress.elapsed, "eta_s": progress.eta}
            if util is not None:
                rec["mfu"] = util
            if log:
                log.write(rec)
            if not args.quiet:
                say(f"step {step:5d}/{args.steps} | loss {loss:.4f} | lr {rec['lr']:.2e} | norm {out['grad_norm']:.3f}"
                    f" | {dt * 1e3:8.1f} ms | {tps:9.0f} tok/s" + (f" | MFU {util * 100:.1f}%" if util else "")
                    + f" | {progress.line()}")
            # a checkpoint after this step: every N steps and after the last (only good steps get here)
            done = step + 1
            if args.checkpoint_dir and (done == args.steps or (every and done % every == 0)):
                folder = run.save_checkpoint(args.checkpoint_dir, done)
                say(f"step {step:5d} | checkpoint {folder}")
                if log:
                    log.write({"event": "checkpoint", "step": done, "path": folder})
        step = max(args.steps, start)
        # the mean step time leaves out the first step (compiles, warms caches) unless it is the only one
        timed = step_times[1:] or step_times
        summary = {"first_loss": first_loss, "final_loss": last, "val_losses": val_losses,
                   "mean_ms": sum(timed) * 1e3 / len(timed) if timed else None,
                   "tokens_per_s": run.tokens_per_step * len(timed) / sum(timed) if timed else None,
                   "elapsed_s": progress.elapsed}
        if args.save:
            run.save_model(args.save, step)
            say(f"saved {args.save}")
        if log:
            log.write({"event": "end", **summary})
            log.close()
        vals = ", ".join(f"{s}: {v:.4f}" for s, v in val_losses)
        if first_loss is not None:
            said = f"{summary['mean_ms']:.1f} ms/step" + (" (one step, with warm-up)" if len(step_times) == 1 else "")
            say(f"done: loss {first_loss:.4f} -> {last:.4f}; val loss by step {{{vals}}}; {said}; "
                f"{fmt_duration(progress.elapsed)} in all")
    except KeyboardInterrupt as e:             # Ctrl-C, SIGTERM, SIGHUP
        last_ck = (run.last_checkpoint if run else None) or ("none" if args.checkpoint_dir else
                                                             "none (no --checkpoint-dir)")
        where = "before training began" if step is None else f"at step {step}"
        raise interrupted(e, f"{where}; last checkpoint {last_ck}" + (f"; log {args.log}" if log else "")) from None
    finally:
        if log:
            with contextlib.suppress(LlmzError):    # already failing: the first error is the one to report
                log.close()
        for lock in locks:
            lock.release()
    run.comm.barrier()
    # only now, with everything written, the sample
    if args.sample_tokens:
        say("--- sample ---\n" + run.sample_text() + "\n--------------")
    return summary


def main(argv=None) -> int:
    """The ranks first, then the flags: every rank checks them and all agree (llmz.launch.agree), so a bad
    flag on any rank ends the whole job with one line, exit status 2, and no rank left waiting."""
    from .args import flag
    from .errors import LlmzError
    from .launch import abort_on_error, agree, init_ranks, start_failed
    from .watchdog import peek_timeout
    try:
        ranks = init_ranks(collective_timeout=peek_timeout(argv))
    except LlmzError as e:
        return start_failed(e)
    with abort_on_error(ranks), np.errstate(all="ignore"):   # overflow is caught as a non-finite loss
        args, kind = agree(ranks, lambda: parse_args(argv, world_size=ranks.world_size),
                           same=lambda result: {**{flag(k): v for k, v in vars(result[0]).items()},
                                                "--device (resolved)": result[1]})
        ranks.watch.timeout = args.collective_timeout
        train(args, kind, ranks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
