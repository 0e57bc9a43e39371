"""AdamW's hyperparameters and the learning-rate schedule (llm.c's): linear warmup, then cosine decay
from lr to lr * final_lr_frac (or constant). The update itself is the kernel llmz.kernels.adamw; which
slice of the parameters each rank updates is llmz.zero's business."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class AdamW:
    lr: float = 3e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0            # 0 = off
    warmup_steps: int = 0
    schedule: str = "cosine"          # or "constant"
    final_lr_frac: float = 0.0
    total_steps: int = 1

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step `step` (0-based)."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return self.lr
        decay_steps = max(self.total_steps - self.warmup_steps, 1)
        frac = min((step - self.warmup_steps) / decay_steps, 1.0)
        coeff = 0.5 * (1.0 + math.cos(math.pi * frac))           # 1 -> 0
        final = self.lr * self.final_lr_frac
        return final + coeff * (self.lr - final)

    def scalars(self, step: int) -> list[float]:
        """What the AdamW kernel reads from device memory: [lr, grad_scale, 1 - beta1^t, 1 - beta2^t, step].
        grad_scale starts at 1 and is overwritten on the device by the clipping kernel; step (0-based, exact
        in a float64) is the bf16 stochastic rounding's step."""
        t = step + 1
        return [self.lr_at(step), 1.0, 1.0 - self.beta1 ** t, 1.0 - self.beta2 ** t, float(step)]
