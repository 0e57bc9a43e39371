"""What to train: GPT-2's shape (GPT2Config) and its presets, from `tiny` (tests) to `d12` (GPT-2 124M); and
how to train it (TrainConfig), the run configuration `python -m llmz.train` maps its flags onto."""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, replace


def padded_vocab(vocab_size: int, multiple: int = 128) -> int:
    """llm.c pads the vocabulary to a multiple of 128 so the classifier matmul tiles evenly."""
    return (vocab_size + multiple - 1) // multiple * multiple


@dataclass(frozen=True)
class GPT2Config:
    max_seq_len: int = 1024         # maxT
    vocab_size: int = 50257         # V: real tokens
    padded_vocab_size: int = 50304  # Vp: rows of wte; rows >= V stay zero and never win the softmax
    num_layers: int = 12            # L
    num_heads: int = 12             # NH
    channels: int = 768             # C

    def __post_init__(self):
        if min(self.max_seq_len, self.vocab_size, self.num_layers, self.num_heads, self.channels) <= 0:
            raise ValueError(f"every size in {self} must be positive")      # first: num_heads 0 divides below
        if self.channels % self.num_heads:
            raise ValueError(f"channels {self.channels} is not a multiple of num_heads {self.num_heads}")
        if self.padded_vocab_size < self.vocab_size:
            raise ValueError(f"padded_vocab_size {self.padded_vocab_size} < vocab_size {self.vocab_size}")

    def num_parameters(self) -> int:
        """Parameters including the padded wte rows (llm.c counts them too)."""
        C, L = self.channels, self.num_layers
        per_block = 12 * C * C + 13 * C    # ln1 2C, qkv 3C*C+3C, attproj C*C+C, ln2 2C, fc 4C*C+4C, fcproj 4C*C+C
        return self.padded_vocab_size * C + self.max_seq_len * C + L * per_block + 2 * C

    def to_dict(self) -> dict:
        return asdict(self)


# name -> (num_layers, num_heads, channels, vocab_size): one model per name, in every command. dN follows
# llm.c's depth naming with GPT-2's vocabulary (d12 is GPT-2 124M, as llm.c's `-e d12`); tiny, small and thin
# are byte-level, the vocabulary of llmz's default tokenizer. A run whose tokenizer has more tokens widens V
# to the tokenizer's (model_vocab); --vocab-size sets it outright.
GPT2_VOCAB, BYTE_VOCAB = 50257, 256
# --recompute (llm.c's -r), what backward computes again instead of keeping (llmz.model.Activations): 0 keep
# everything, 1 GELU, 2 also the two layernorms a block, 3 also attention's (T, T) softmax (flash keeps none)
RECOMPUTE = (0, 1, 2, 3)
# --zero-stage: the ZeRO stages (llmz.zero.STAGES says what each shards)
ZERO_STAGES = (0, 1, 2, 3)

PRESETS = {
    "tiny": (2, 2, 16, BYTE_VOCAB),
    "small": (4, 4, 128, BYTE_VOCAB),   # the laptop default: trains on the shipped data in minutes on 2 cores
    "thin": (8, 2, 32, BYTE_VOCAB),     # deep and narrow (the lessons): ZeRO-2's per-block gradient buckets pay off
    "d2": (2, 2, 128, GPT2_VOCAB),
    "d4": (4, 4, 256, GPT2_VOCAB),
    "d6": (6, 6, 384, GPT2_VOCAB),
    "d12": (12, 12, 768, GPT2_VOCAB),
    "d24": (24, 16, 1024, GPT2_VOCAB),
    "d36": (36, 20, 1280, GPT2_VOCAB),
    "d48": (48, 25, 1600, GPT2_VOCAB),
}


def model_vocab(name: str, vocab_size: int | None = None, tokens: int = 0) -> int:
    """V of preset `name` in a run: vocab_size (--vocab-size) where given, else the preset's own, widened to
    `tokens` (the tokenizer's) where the tokenizer has more."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    return vocab_size or max(PRESETS[name][3], tokens)


def preset(name: str, vocab_size: int | None = None, max_seq_len: int = 1024,
           padded_vocab_size: int | None = None, tokens: int = 0) -> GPT2Config:
    """Preset `name` as a GPT2Config; V as model_vocab says (the preset's own unless vocab_size or a
    tokenizer of `tokens` tokens widens it)."""
    V = model_vocab(name, vocab_size, tokens)
    L, NH, C, _ = PRESETS[name]
    Vp = padded_vocab_size or padded_vocab(V)
    return GPT2Config(max_seq_len=max_seq_len, vocab_size=V, padded_vocab_size=Vp,
                      num_layers=L, num_heads=NH, channels=C)


def describe_presets() -> str:
    """Every preset with its shape and parameter count at maxT 1024, for --help:
    'tiny (L=2 C=16 V=256: 41K), ...'."""
    return ", ".join(f"{name} (L={L} C={C} V={V}: {fmt_count(preset(name).num_parameters())})"
                     for name, (L, NH, C, V) in PRESETS.items())


def fmt_count(n: int) -> str:
    """957,184 -> '957K', 124,475,904 -> '124M', 1,557,686,400 -> '1.56B' (three significant digits)."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def fmt_bytes(n: float) -> str:
    """512 -> '512 B', 3 * 2**30 -> '3.00 GiB' (binary units, up to GiB)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.2f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.2f} GiB"


def default_model(kind: str) -> str:
    """The preset a run trains when none is named: d6 on a GPU, `small` on a laptop's CPU."""
    return "d6" if kind == "gpu" else "small"


def default_print_every(steps: int) -> int:
    """The interval between progress lines when --print-every is not given: about 25 lines a run, at a round
    step count (1, 2 or 5 x 10^k, the one nearest steps / 25): 50 for 1500 steps, 100 for 2000, 1 up to 35."""
    target = max(steps, 1) / 25
    nice = [m * 10**k for k in range(len(str(max(steps, 1)))) for m in (1, 2, 5)]
    return min(nice, key=lambda n: abs(math.log(n / target)))


# how long a collective may wait for the other ranks (--collective-timeout, llmz.run.watchdog): PyTorch's default
# for NCCL (torch.distributed, 10 minutes)
DEFAULT_TIMEOUT_S = 600.0
DEFAULT_DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")


@dataclass
class TrainConfig:
    """One training run, every setting: the fields are `python -m llmz.train`'s flags (--zero-stage is
    zero_stage), with the same defaults and meanings (`--help` says them). None: filled in for the device by
    for_device (the model, B, T, the steps), or not used (a file not written, no --max-loss, ...)."""
    # where and how the step runs
    device: str = "auto"                # auto, gpu, cpu or sim
    precision: str = "fp32"             # fp32, fp64 or bf16 (llmz.precision)
    comm: str = "auto"                  # auto, nccl or mpi
    kernels: str = "auto"               # the kernel set: auto, teaching or fast (llmz.device)
    matmul: str = "auto"                # auto, cublas or numba
    attention: str = "auto"             # auto, gemm, direct or flash
    no_tf32: bool = False
    no_cuda_graph: bool = False
    zero_stage: int = 0                 # 0, 1, 2 or 3 (llmz.zero)
    no_overlap: bool = False
    recompute: int = 0                  # one of RECOMPUTE: what backward recomputes instead of keeping
    # the model
    model: str | None = None            # a preset of PRESETS
    init_from: str | None = None        # an llm.c model file to start from
    max_seq_len: int | None = None
    vocab_size: int | None = None
    seed: int = 1337
    # the data
    train_data: str = os.path.join(DEFAULT_DATA, "shakespeare_train.bin")
    val_data: str = os.path.join(DEFAULT_DATA, "shakespeare_val.bin")      # '': no validation
    tokenizer: str = "byte"
    shuffle: bool = False
    batch_size: int | None = None       # B per rank
    seq_len: int | None = None          # T
    grad_accum: int = 1                 # K micro-steps per optimizer step
    # the optimizer (llmz.optim)
    steps: int | None = None            # counted from the start of training
    lr: float = 1e-3
    warmup_steps: int = 20
    lr_schedule: str = "cosine"         # cosine or constant
    final_lr_frac: float = 0.1
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    max_loss: float | None = None       # None: 3 ln V (llmz.run.guards)
    # what the run reports and writes
    val_every: int = 250
    val_batches: int = 10
    sample_every: int = 0
    sample_tokens: int = 200
    run_dir: str | None = None          # the run folder (llmz.run.folder); None: the next free runs/NNN
    no_run_dir: bool = False            # no run folder: only what --log, --save, --checkpoint-dir name
    log: str | None = None              # --log FILE.jsonl (llmz.run.log)
    save: str | None = None             # --save FILE.bin
    trace: str | None = None            # --trace FILE.json (llmz.trace)
    checkpoint_dir: str | None = None   # llmz.run.checkpoints
    checkpoint_every: int = 0
    keep: int = 0
    resume: str | None = None           # a step folder, or 'latest'
    quiet: bool = False
    print_every: int | None = None      # a progress line every N steps (None: default_print_every(steps))
    resume_other_run: bool = False      # --resume a checkpoint of another run than the folder's
    resume_other_data: bool = False     # --resume with a data file that changed under its name (a note)
    collective_timeout: float = DEFAULT_TIMEOUT_S   # seconds a collective may wait (llmz.run.watchdog)

    def for_device(self, kind: str) -> TrainConfig:
        """This configuration with the device-dependent defaults filled in: a small model on a laptop CPU,
        a bigger one on a GPU (a run from a file, --init-from or --resume, takes the file's model)."""
        gpu = kind == "gpu"
        defaults = {"batch_size": 32 if gpu else 16, "seq_len": 256 if gpu else 64,
                    "steps": 2000 if gpu else 1500}
        if self.init_from is None and self.resume is None:      # resuming: the checkpoint says which model
            defaults["model"] = default_model(kind)
        filled = replace(self, **{k: v for k, v in defaults.items() if getattr(self, k) is None})
        if filled.print_every is None:
            filled = replace(filled, print_every=default_print_every(filled.steps))
        return filled

    def to_dict(self) -> dict:
        return asdict(self)
