"""python -m llmz.train: train GPT-2 on one or many ranks (mpiexec -n N python -m llmz.train).

The command line of llmz.trainer: the flags map one to one onto a TrainConfig (--zero-stage is zero_stage),
are checked (llmz.args.check_train), and every rank trains (llmz.run.loop.train). With no flags it trains a
small byte-level model on the shipped Shakespeare and prints a sample.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from .args import TRACE_STAGES, Parser, check_train, flag
from .config import RECOMPUTE, ZERO_STAGES, TrainConfig, describe_presets
from .device import ATTENTIONS, KERNEL_SETS, KINDS, MATMULS, resolve
from .errors import LlmzError, UsageError
from .precision import PRECISIONS
from .run.folder import check_given, with_folder
from .run.launch import abort_on_error, agree, init_ranks, start_failed
from .run.watchdog import peek_timeout


def build_parser() -> argparse.ArgumentParser:
    """Every flag, named as its TrainConfig field (--zero-stage: zero_stage), its default the field's."""
    p = Parser(prog="python -m llmz.train", description=__doc__.splitlines()[0])
    for flags in (device_flags, model_and_data_flags, optimizer_flags, output_flags):
        flags(p.add_argument)
    p.set_defaults(**TrainConfig().to_dict())
    return p


def device_flags(a) -> None:
    """Where and how the step runs: the device, precision, kernels, communication, ZeRO stage."""
    a("--device", choices=KINDS, help="gpu: Numba kernels on CuPy memory; cpu: NumPy "
      "references; sim: the kernels in Numba's CUDA simulator (tiny models only); auto: gpu if there is one")
    a("--precision", choices=tuple(PRECISIONS), help="fp64 only on cpu and sim; bf16: "
      "parameters, gradients and activations in bf16, fp32 master weights, m, v, layernorm statistics and "
      "losses, stochastic rounding in AdamW and in ZeRO-2's accumulation")
    a("--comm", choices=("auto", "nccl", "mpi"), help="collective backend between ranks")
    a("--kernels", choices=KERNEL_SETS, help="fast (GPU default: llmz/fast/, the kernels "
      "that won) or teaching (llmz/kernels/: the simplest correct kernel per layer; the default in the "
      "simulator, and on cpu, where it means the NumPy references)")
    a("--matmul", choices=MATMULS, help="the products: cublas (cuBLAS, TF32 for fp32; the "
      "default with --kernels fast on a GPU) or numba (the tiled teaching kernel)")
    a("--attention", choices=ATTENTIONS, help="flash (FlashAttention-2: no T x T "
      "buffers; on tensor cores for bf16 with --kernels fast, the default there), gemm (the fp32 default with "
      "cuBLAS: batched per-head products around a softmax kernel, llm.c's non-cuDNN path) or direct (the teaching "
      "kernels, one per step of the math)")
    a("--no-tf32", action="store_true", help="cuBLAS fp32 products in full fp32 instead of TF32")
    a("--no-cuda-graph", action="store_true", help="launch every kernel from Python each step instead of "
      "replaying the step captured as a CUDA graph (the GPU default with --comm nccl or one rank)")
    a("--zero-stage", type=int, choices=ZERO_STAGES, help="0: every rank keeps "
      "everything; 1: the optimizer state sharded; 2: the gradients sharded too, reduce-scattered during "
      "backward; 3: the parameters sharded too, each block all-gathered just before it runs")
    a("--no-overlap", action="store_true", help="stages 2 and 3: serialise each reduce-scatter with backward "
      "(stage 3: and gather each block's parameters only when it runs, no prefetch)")
    a("--recompute", "-r", type=int, choices=RECOMPUTE, help="llm.c's -r: less activation memory for a little "
      "time, the same numbers. 0: keep every activation; 1: recompute GELU in backward (its output not kept "
      "per layer); 2: also the two layernorms of each block (their mean and rstd still kept); 3: also "
      "attention's (T, T) softmax, one layer's at a time (--attention gemm or direct; flash keeps none)")


def model_and_data_flags(a) -> None:
    """The model and the data it trains on."""
    a("--model", help=f"a preset, the same model in every llmz command (layers, width, vocabulary; "
      f"parameters at maxT 1024): {describe_presets()} (default: small on cpu, d6 on gpu; the file's model "
      "with --init-from or --resume)")
    a("--init-from", metavar="FILE.bin", help="start from an llm.c model file (default: a "
      "freshly initialised --model)")
    a("--max-seq-len", type=int, help="model's maxT for a preset (default: 1024)")
    a("--vocab-size", type=int, help="model's V for a preset (default: the preset's, 256 or GPT-2's 50257 as "
      "--model says, or the tokenizer's where it has more tokens; a V above the tokenizer's trains with any "
      "token file, and samples are then drawn among the tokenizer's tokens only)")
    a("--seed", type=int, help="initialisation, data order with --shuffle, sampling, bf16 "
      "rounding (0 .. 2^32-1)")
    a("--train-data", metavar="GLOB",
      help="llm.c token files (default: the shipped data/shakespeare_train.bin)")
    a("--val-data", metavar="GLOB",
      help="llm.c token files for the validation loss; '' for none (default: the shipped "
      "data/shakespeare_val.bin)")
    a("--tokenizer", help="byte ('bytes' is taken too), gpt2 (tiktoken) or an llm.c tokenizer file")
    a("--shuffle", action="store_true", help="shuffle the batch order every epoch (llm.c keeps the files' "
      "order)")
    a("--batch-size", "-b", type=int, help="B per rank (default: 16 on cpu, 32 on gpu)")
    a("--seq-len", "-t", type=int, help="T (default: 64 on cpu, 256 on gpu)")
    a("--grad-accum", type=int, help="K micro-steps per optimizer step")


def optimizer_flags(a) -> None:
    """The optimizer's steps, schedule and AdamW settings, and the divergence bound."""
    a("--steps", type=int, help="optimizer steps, counted from the start of training "
      "(default: 1500 on cpu, 2000 on gpu)")
    a("--lr", type=float, help="peak learning rate of AdamW")
    a("--warmup-steps", type=int, help="steps of linear warmup to --lr")
    a("--lr-schedule", choices=("cosine", "constant"), help="after warmup: cosine "
      "decay to --final-lr-frac x --lr, or constant")
    a("--final-lr-frac", type=float, help="where the cosine decay ends, as a fraction of --lr")
    a("--weight-decay", type=float, help="AdamW's decoupled weight decay (2-D weights only)")
    a("--beta1", type=float, help="AdamW's first-moment decay")
    a("--beta2", type=float, help="AdamW's second-moment decay")
    a("--eps", type=float, help="AdamW's epsilon in m / (sqrt(v) + eps); > 0")
    a("--grad-clip", type=float, help="clip the global gradient norm to this; 0 = off")
    a("--max-loss", type=float, help="stop, naming the step, when the training loss exceeds "
      "this: the run diverged (default: 3 ln V, three times the loss of a uniform guess)")


def output_flags(a) -> None:
    """What the run reports and writes: validation, samples, log, model, trace, checkpoints."""
    a("--val-every", type=int, help="validation loss every N steps and at the last; 0 = only at the last")
    a("--val-batches", type=int, help="batches per validation loss (at most the val data's)")
    a("--sample-every", type=int, help="print a sample every N steps; 0 = only at the end")
    a("--sample-tokens", type=int, help="tokens per printed sample (at most 1,000,000); 0 = no samples")
    a("--run-dir", metavar="DIR", help="the run folder: the final model (model.bin, llm.c format), the log "
      "(log.jsonl) and, with --checkpoint-every, the checkpoints (checkpoints/), each unless its own flag sends "
      "it elsewhere; a folder holding another run's model or log is refused unless --resume continues it; the "
      "run's last line names it (default: the next free number under runs/, e.g. runs/001, and runs/latest "
      "points at the last run that finished; LLMZ_RUNS=DIR in the environment for another parent)")
    a("--no-run-dir", action="store_true", help="no run folder: write only what --log, --save and "
      "--checkpoint-dir name")
    a("--log", metavar="FILE.jsonl", help="one JSON object per step, flushed line by line; a "
      "new run starts the file, a resumed run continues it (default: the run folder's log.jsonl; none with "
      "--no-run-dir)")
    a("--save", metavar="FILE.bin", help="write the final model, llm.c format (default: the run folder's "
      "model.bin; none with --no-run-dir)")
    a("--trace", metavar="FILE.json", help=f"ZeRO stage {'/'.join(map(str, TRACE_STAGES))}: "
      "Chrome trace (+ PNG) of one step (default: none)")
    a("--checkpoint-dir", metavar="DIR", help="write checkpoints to DIR/step_NNNNNN/ "
      "(model.bin, state_rank<r>.bin, DONE); DIR is locked while the run lives (default: the run folder's "
      "checkpoints/ with --checkpoint-every, --keep or --resume; else none)")
    a("--checkpoint-every", type=int, metavar="N",
      help="checkpoint every N steps and after the last (0 = after the last only)")
    a("--keep", type=int, metavar="K",
      help="keep the newest K complete checkpoints, deleting only older ones (0 = all)")
    a("--resume", nargs="?", const="latest", metavar="DIR/step_N|latest",
      help="continue from a checkpoint: a step folder, or 'latest' (the newest complete one in "
      "--checkpoint-dir; none there: start afresh). --steps still counts from the start of training; "
      "another world size or ZeRO stage re-shards the optimizer state (default: start afresh)")
    a("--quiet", action="store_true", help="no per-step lines")
    a("--print-every", type=int, metavar="N", help="a progress line every N steps, and at the first and the "
      "last step and every step that validates, samples or checkpoints; 1 = every step; --log records every "
      "step whatever N is (default: about 25 lines a run, the round number nearest --steps / 25: 50 for the "
      "default cpu run's 1500 steps, 100 for the gpu's 2000)")
    a("--resume-other-run", action="store_true", help="take the checkpoint --resume names even though it is "
      "of another run than the rest of --checkpoint-dir (checkpoints carry their run's id); another run's --log "
      "is refused all the same (a resume trims its log, and only the run that wrote a log may): name a new one")
    a("--resume-other-data", action="store_true", help="--resume even where a data file has other bytes than "
      "when the checkpoint was written, under the same name (checkpoints keep every token file's SHA-256): "
      "refused without it; with it, a note, printed and in the log's start record")
    a("--collective-timeout", type=float, metavar="SECONDS", help="end the job, naming the collective, the "
      "step and the rank(s) that did not arrive, when a collective between ranks waits longer than this (a "
      "rank stopped, hung or dead), MPI's start-up included; at least 1 s. The default, PyTorch's, is 40x the "
      "longest legitimate wait of one rank for another (BENCHMARKS.md: the checkpoint whose model file rank 0 "
      "writes alone, the first step's "
      "compilation, CUDA graph capture: seconds); raise it only for a filesystem that takes minutes to write "
      "a checkpoint")


def parse_args(argv=None, kind: str | None = None, world_size: int = 1) -> tuple[TrainConfig, str]:
    """Flags -> (TrainConfig, device kind): parsed, the device resolved (before numba is imported: the
    simulator needs that) unless `kind` is given, the device-dependent defaults filled in, and every setting
    checked (llmz.args.check_train: a UsageError, one line, for anything wrong). world_size: the job's
    ranks."""
    cfg = TrainConfig(**vars(build_parser().parse_args(argv)))
    if kind is None:
        try:
            kind = resolve(cfg.device)
        except (ValueError, RuntimeError) as e:
            raise UsageError(str(e)) from None
    cfg = cfg.for_device(kind)
    if cfg.run_dir is not None:             # a folder named: every rank fills in the same paths now
        check_given(cfg)
        cfg = with_folder(cfg, cfg.run_dir)
    check_train(cfg, kind, world_size)
    return cfg, kind


def main(argv=None) -> int:
    """The ranks first, then the flags: every rank checks them and all agree (llmz.run.launch.agree), so a bad
    flag on any rank ends the whole job with one line, exit status 2, and no rank left waiting."""
    try:
        ranks = init_ranks(collective_timeout=peek_timeout(argv))
    except LlmzError as e:
        return start_failed(e)
    with abort_on_error(ranks), np.errstate(all="ignore"):   # overflow is caught as a non-finite loss
        cfg, kind = agree(ranks, lambda: parse_args(argv, world_size=ranks.world_size),
                          same=lambda result: {**{flag(k): v for k, v in result[0].to_dict().items()},
                                               "--device (resolved)": result[1]})
        ranks.watch.timeout = cfg.collective_timeout
        from .run.loop import train  # numba loads here, after the device is resolved (the simulator)
        train(cfg, kind, ranks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
