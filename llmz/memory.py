"""Bytes per rank by category: predicted by the ZeRO formula and measured from what the code allocated.

With Ψ parameters, N ranks, and b bytes per value (4 in fp32; 8 when the cpu path runs in float64):

  stage | parameters                              | gradients                               | optimizer state
  0     | bΨ                                      | bΨ                                      | 2bΨ
  1     | bΨ                                      | bΨ                                      | 2bΨ/N
  2     | bΨ                                      | bΨ/N + 2 block slots + embeddings + lnf | 2bΨ/N
  3     | bΨ/N + 2 block slots + embeddings + lnf | bΨ/N + 2 block slots + embeddings + lnf | 2bΨ/N

In bf16 (b = 2) the optimizer also keeps an fp32 master copy of what it updates: the optimizer state is
master + m + v = 12Ψ at stage 0 and 12Ψ/N at stages 1-3: the ZeRO paper's 2Ψ + 2Ψ + 12Ψ/N at stage 1,
(2Ψ + 2Ψ + 12Ψ)/N + slots + embeddings at stage 3 (fp32: (4Ψ + 4Ψ + 8Ψ)/N + the same). A slot holds the
largest block bucket; at stage 3 the parameter slots are filled by all-gathers, the gradient slots emptied by
reduce-scatters (llmz.zero.params). Layernorm statistics and the losses stay fp32 in every precision.
The measured side sums the sizes of the buffers actually allocated (llmz.zero records each one), and on
the GPU also reads the memory CuPy's pool holds.
"""
from __future__ import annotations

from .config import GPT2Config
from .layout import Layout

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "communication_buffers")


def activation_elements(c: GPT2Config, B: int, T: int, flash: bool = False) -> tuple[int, int]:
    """Elements of llmz.model.Activations: (values, statistics). Values, in the run's precision: per layer
    18C + NH*T per position (att), plus the rest; statistics (layernorm mean and rstd, losses), fp32 or
    wider: 4 per layer per position, plus 3. Flash attention keeps no T x T buffer (no att, preatt, dpreatt,
    datt) and instead a statistic per layer, head and position (the softmax's logsumexp)."""
    C, L, NH, Vp = c.channels, c.num_layers, c.num_heads, c.padded_vocab_size
    square = 0 if flash else NH * T             # att per layer; preatt, dpreatt, datt in the scratch
    per_layer = 18 * C + square
    outside = C + C + Vp                        # encoded, lnf, logits (dlogits in place; no probs: fused classifier)
    scratch = 13 * C + 3 * square               # dresidual, dbtc, dqkv, dfch_gelu, dfch, preatt, dpreatt, datt
    stats = 4 * L + 3 + (L * NH if flash else 0)
    return B * T * (L * per_layer + outside + scratch), B * T * stats


def predicted(layout: Layout, stage: int, B: int, T: int, value_bytes: int, flash: bool = False) -> dict[str, int]:
    """The formula, with Ψ = the real parameter count (no padding). value_bytes 2 is bf16: the optimizer
    state is then 4-byte master, m and v. flash: --attention flash's activations."""
    psi, N, b = layout.num_parameters, layout.world_size, value_bytes
    opt = 12 * psi if b == 2 else 2 * b * psi
    out = {"parameters": b * psi, "optimizer_state": opt if stage == 0 else opt // N}
    # stage 2's gradients, stage 3's parameters and gradients: my slice, two block slots, the two ends whole
    slots = 2 * max(bk.padded_size for bk in layout.buckets[1:-1])
    sharded = b * psi // N + b * (slots + layout.embeddings.padded_size + layout.lnf.padded_size)
    out["gradients"] = b * psi if stage < 2 else sharded
    if stage == 3:
        out["parameters"] = sharded
    values, stats = activation_elements(layout.config, B, T, flash)
    out["activations"] = b * values + max(b, 4) * stats
    out["communication_buffers"] = 0
    return out


def measured(stage_obj, model) -> dict[str, int]:
    out = {k: 0 for k in CATEGORIES}
    for k, v in stage_obj.state_bytes().items():
        out[k] = out.get(k, 0) + v
    out["activations"] = model.acts.nbytes()
    return out


def device_used_bytes(dev) -> int | None:
    """On the GPU: bytes CuPy's memory pool holds (every llmz buffer comes from it). Else None."""
    if dev.kind != "gpu":
        return None
    return int(dev.xp.get_default_memory_pool().used_bytes())


def report(layout: Layout, stage: int, B: int, T: int, value_bytes: int, stage_obj, model, dev,
           flash: bool = False) -> dict:
    pred = predicted(layout, stage, B, T, value_bytes, flash)
    meas = measured(stage_obj, model)
    rep = {"stage": stage, "world_size": layout.world_size, "value_bytes": value_bytes,
           "predicted": pred, "measured": meas,
           "predicted_total": sum(pred.values()), "measured_total": sum(meas.values())}
    used = device_used_bytes(dev)
    if used is not None:
        rep["device_used"] = used
    return rep


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.2f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.2f} GiB"


def table(rep: dict) -> str:
    lines = [f"memory per rank (ZeRO stage {rep['stage']}, {rep['world_size']} ranks)",
             f"  {'category':<22}{'predicted':>14}{'measured':>14}"]
    for k in CATEGORIES:
        lines.append(f"  {k:<22}{fmt_bytes(rep['predicted'][k]):>14}{fmt_bytes(rep['measured'][k]):>14}")
    lines.append(f"  {'total':<22}{fmt_bytes(rep['predicted_total']):>14}{fmt_bytes(rep['measured_total']):>14}")
    if "device_used" in rep:
        lines.append(f"  {'GPU pool in use':<22}{'':>14}{fmt_bytes(rep['device_used']):>14}")
    return "\n".join(lines)
