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
Activations are the same at every stage (activation_elements); --recompute (llm.c's -r) keeps fewer of them
per layer and computes those again in backward. The measured side sums the sizes of the buffers actually allocated (llmz.zero records each one), and on
the GPU also reads the memory CuPy's pool holds.
"""
from __future__ import annotations

from .config import GPT2Config, fmt_bytes
from .errors import LlmzError
from .layout import Layout

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "communication_buffers")


def activation_elements(c: GPT2Config, B: int, T: int, flash: bool = False, recompute: int = 0) -> tuple[int, int]:
    """Elements of llmz.model.Activations: (values, statistics). Values, in the run's precision: per layer
    18C + NH*T per position (att), plus the rest; statistics (layernorm mean and rstd, losses), fp32 or
    wider: 4 per layer per position, plus 3. Flash attention keeps no T x T buffer (no att, preatt, dpreatt,
    datt) and instead a statistic per layer, head and position (the softmax's logsumexp). recompute (llm.c's
    -r) keeps fewer values per layer: 1 no fch_gelu (4C), 2 no ln1 and ln2 either (2C), and adds one shared
    4C buffer they are recomputed into; 3 also keeps one att (NH*T) for all layers instead of one a layer."""
    C, L, NH, Vp = c.channels, c.num_layers, c.num_heads, c.padded_vocab_size
    square = 0 if flash else NH * T             # att per layer; preatt, dpreatt, datt in the scratch
    kept = 18 * C - (4 * C if recompute >= 1 else 0) - (2 * C if recompute >= 2 else 0)
    per_layer = kept + (square if recompute < 3 else 0)
    outside = C + C + Vp                        # encoded, lnf, logits (dlogits in place; no probs: fused classifier)
    scratch = 13 * C + 3 * square               # dresidual, dbtc, dqkv, dfch_gelu, dfch, preatt, dpreatt, datt
    scratch += 4 * C if recompute >= 1 else 0   # recomputed: fch_gelu (and ln1, ln2) of one layer at a time
    scratch += square if recompute >= 3 else 0  # recomputed: att of one layer at a time
    stats = 4 * L + 3 + (L * NH if flash else 0)
    return B * T * (L * per_layer + outside + scratch), B * T * stats


def predicted(layout: Layout, stage: int, B: int, T: int, value_bytes: int, flash: bool = False,
              recompute: int = 0) -> dict[str, int]:
    """The formula, with Ψ = the real parameter count (no padding). value_bytes 2 is bf16: the optimizer
    state is then 4-byte master, m and v. flash: --attention flash's activations; recompute: --recompute's."""
    psi, N, b = layout.num_parameters, layout.world_size, value_bytes
    opt = 12 * psi if b == 2 else 2 * b * psi
    out = {"parameters": b * psi, "optimizer_state": opt if stage == 0 else opt // N}
    # stage 2's gradients, stage 3's parameters and gradients: my slice, two block slots, the two ends whole
    slots = 2 * max(bk.padded_size for bk in layout.buckets[1:-1])
    sharded = b * psi // N + b * (slots + layout.embeddings.padded_size + layout.lnf.padded_size)
    out["gradients"] = b * psi if stage < 2 else sharded
    if stage == 3:
        out["parameters"] = sharded
    values, stats = activation_elements(layout.config, B, T, flash, recompute)
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
           flash: bool = False, recompute: int = 0) -> dict:
    pred = predicted(layout, stage, B, T, value_bytes, flash, recompute)
    meas = measured(stage_obj, model)
    rep = {"stage": stage, "world_size": layout.world_size, "value_bytes": value_bytes, "recompute": recompute,
           "predicted": pred, "measured": meas,
           "predicted_total": sum(pred.values()), "measured_total": sum(meas.values())}
    used = device_used_bytes(dev)
    if used is not None:
        rep["device_used"] = used
    return rep


def table(rep: dict) -> str:
    again = {0: "", 1: ", --recompute 1: GELU recomputed", 2: ", --recompute 2: GELU and layernorms recomputed",
             3: ", --recompute 3: GELU, layernorms and attention's softmax recomputed"}
    lines = [f"memory per rank (ZeRO stage {rep['stage']}, {rep['world_size']} ranks{again[rep['recompute']]})",
             f"  {'category':<22}{'predicted':>14}{'measured':>14}"]
    for k in CATEGORIES:
        lines.append(f"  {k:<22}{fmt_bytes(rep['predicted'][k]):>14}{fmt_bytes(rep['measured'][k]):>14}")
    lines.append(f"  {'total':<22}{fmt_bytes(rep['predicted_total']):>14}{fmt_bytes(rep['measured_total']):>14}")
    if "device_used" in rep:
        lines.append(f"  {'GPU pool in use':<22}{'':>14}{fmt_bytes(rep['device_used']):>14}")
    return "\n".join(lines)


# what the CUDA context, cuBLAS and NCCL workspaces and the memory pool's slack take beyond the formula
GPU_RESERVE_BYTES = 1 << 30


def check_fits(predicted: dict, free: int, total: int, gpu_index: int = 0,
               reserve: int = GPU_RESERVE_BYTES) -> None:
    """Refuse a configuration whose predicted bytes per rank (llmz.memory.predicted) plus `reserve` exceed
    the GPU's free bytes (cupy.cuda.runtime.memGetInfo): one line with both numbers, before allocating."""
    need = sum(predicted.values())
    if need + reserve > free:
        parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in predicted.items() if v)
        raise LlmzError(f"this configuration does not fit on GPU {gpu_index}: predicted {fmt_bytes(need)} "
                        f"per rank ({parts}) + {fmt_bytes(reserve)} reserve, available {fmt_bytes(free)} "
                        f"free of {fmt_bytes(total)}; lower -b or -t, or raise --zero-stage")
