"""The training precision, resolved once into one record (llm.c's floatX): which dtype each kind of array has.

    --precision  storage (params, grads, activations)   statistics (layernorm, losses, lse)   master (AdamW)
    fp32         float32                                 float32                                none
    fp64         float64 (cpu and sim)                   float64                                none
    bf16         bf16, kept as uint16 bit patterns       float32                                float32

With no master copy AdamW updates the parameters in place and its m and v have the storage dtype; in bf16 it
updates an fp32 master copy of what the rank owns (m and v fp32 too) and writes the bf16 parameters by
rounding the master stochastically (llmz.kernels.adamw). Every kernel reads bf16 into float32, computes
there and rounds its result back (llmz.kernels.bf16).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Precision:
    name: str                   # the --precision flag: fp32, fp64 or bf16
    storage: np.dtype           # parameters, gradients, activations (bf16: uint16 bit patterns)
    stats: np.dtype             # layernorm mean and rstd, the losses, flash attention's log-sum-exp
    master: np.dtype | None     # AdamW's master copy of the parameters (bf16: float32), or None

    @property
    def bf16(self) -> bool:
        """Values stored as bf16 bits: AdamW keeps an fp32 master, the roundings are stochastic."""
        return self.master is not None

    @property
    def optimizer(self) -> np.dtype:
        """The dtype of AdamW's state (the master if any, m, v): the precision the parameters move in."""
        return self.master if self.master is not None else self.storage

    @property
    def value_bytes(self) -> int:
        """Bytes per stored value (parameter, gradient, activation): 4, 8 or 2."""
        return self.storage.itemsize

    @property
    def model_file(self) -> str:
        """The llm.c model file a run writes: version 5 (bf16) for bf16 training, else version 3 (fp32)."""
        return "bf16" if self.bf16 else "fp32"


F32, F64 = np.dtype(np.float32), np.dtype(np.float64)
PRECISIONS = {"fp32": Precision("fp32", F32, F32, None),
              "fp64": Precision("fp64", F64, F64, None),
              "bf16": Precision("bf16", np.dtype(np.uint16), F32, F32)}


def as_precision(p) -> Precision:
    """A Precision from itself, its name ('bf16') or its storage dtype (np.float32; np.uint16 is bf16)."""
    if isinstance(p, Precision):
        return p
    if isinstance(p, str) and p in PRECISIONS:
        return PRECISIONS[p]
    storage = np.dtype(p)
    for precision in PRECISIONS.values():
        if precision.storage == storage:
            return precision
    raise ValueError(f"no training precision stores {storage}; choose one of {', '.join(PRECISIONS)}")
