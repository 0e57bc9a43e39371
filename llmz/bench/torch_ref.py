"""python -m llmz.bench.torch_ref: a PyTorch GPT-2, the yardstick `python -m llmz.bench --vs-torch [compile]` uses.

The model of llm.c's train_gpt2.py / nanoGPT at the shapes of an llmz GPT2Config, trained on one fixed
batch of random tokens: AdamW (fused where torch has it), gradient clipping to 1.0; eager, or with the loss
(forward and backward of the model) compiled by torch.compile (nanoGPT's `compile = True`, default mode).
  fp32  fp32 weights and activations, TF32 matmuls
  bf16  fp32 master weights; forward and loss under torch.autocast(bfloat16), PyTorch's usual mixed precision
PyTorch is an optional benchmark dependency: it is imported inside the functions, so this module imports
without it.

Shapes: B batch, T time, C channels, NH heads, hs head size, L layers, V vocab, Vp padded vocab.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
import time

from ..config import GPT2Config, preset

PRECISIONS = ("fp32", "bf16")
ATTENTIONS = ("sdpa", "manual")


def _build(config: GPT2Config):
    """GPT-2's modules under nanoGPT's names, initialised as llm.c does (llmz.layout.init_parameters)."""
    import torch
    from torch import nn
    C, L = config.channels, config.num_layers

    def block():                                            # one transformer block
        return nn.ModuleDict({
            "ln_1": nn.LayerNorm(C),
            "attn": nn.ModuleDict({"c_attn": nn.Linear(C, 3 * C), "c_proj": nn.Linear(C, C)}),
            "ln_2": nn.LayerNorm(C),
            "mlp": nn.ModuleDict({"c_fc": nn.Linear(C, 4 * C), "c_proj": nn.Linear(4 * C, C)}),
        })

    model = nn.ModuleDict({
        "wte": nn.Embedding(config.padded_vocab_size, C),   # (Vp, C), tied: also the output head
        "wpe": nn.Embedding(config.max_seq_len, C),         # (maxT, C)
        "h": nn.ModuleList(block() for _ in range(L)),
        "ln_f": nn.LayerNorm(C),
    })
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:        # weights N(0, 0.02); the residual projections N(0, 0.02/sqrt(2L))
                p.normal_(0.0, 0.02 / math.sqrt(2 * L) if name.endswith("c_proj.weight") else 0.02)
            elif name.endswith("bias"):
                p.zero_()           # layernorm weights stay 1 (torch's default)
        model.wte.weight[config.vocab_size:] = 0.0          # padded rows zero, as in llmz
    return model


def _loss(model, config: GPT2Config, idx, targets, attention: str, mask):
    """idx, targets (B, T) int64 -> mean cross-entropy of the next token over the first V logits."""
    import torch
    import torch.nn.functional as F
    B, T = idx.shape
    C, NH, V = config.channels, config.num_heads, config.vocab_size
    x = model.wte(idx) + model.wpe(torch.arange(T, device=idx.device))           # (B, T, C)
    for h in model.h:
        qkv = h.attn.c_attn(h.ln_1(x))                                           # (B, T, 3C)
        q, k, v = (a.view(B, T, NH, C // NH).transpose(1, 2) for a in qkv.split(C, dim=2))  # (B, NH, T, hs)
        if attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)          # (B, NH, T, hs)
        else:                                                                    # llm.c without cuDNN
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // NH))         # (B, NH, T, T)
            att = att.masked_fill(mask[:T, :T], float("-inf")).softmax(dim=-1)   # causal softmax
            y = att @ v                                                          # (B, NH, T, hs)
        x = x + h.attn.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))      # residual += attention
        x = x + h.mlp.c_proj(F.gelu(h.mlp.c_fc(h.ln_2(x)), approximate="tanh"))  # residual += MLP (4C)
    logits = F.linear(model.ln_f(x), model.wte.weight)                           # (B, T, Vp), tied wte
    return F.cross_entropy(logits[..., :V].reshape(B * T, V), targets.reshape(B * T))


def torch_bench(config: GPT2Config, B: int, T: int, precision: str, steps: int, warmup: int,
                attention: str = "sdpa", lr: float = 3e-4, weight_decay: float = 0.0, seed: int = 0,
                device: str = "cuda", compile: bool = False) -> dict:
    """Train a PyTorch GPT-2 of `config`'s shape on random tokens for `warmup` + `steps` optimizer steps, eager
    or with the loss function compiled (compile=True: torch.compile, compiled during the warm-up steps);
    returns {"ms": median ms per timed step, "tokens_per_s", "peak_bytes" (max allocated during the timed
    steps; None on CPU), "reserved_bytes" (max reserved by the caching allocator), "losses": one float per
    step, "torch_version", "attention", "precision", "compiled"}.
    One step = zero_grad, forward, backward, clip to norm 1.0, AdamW step."""
    import torch
    if precision not in PRECISIONS or attention not in ATTENTIONS:
        raise ValueError(f"precision must be one of {PRECISIONS} and attention one of {ATTENTIONS}")
    if steps < 1 or warmup < 0 or not 0 < T <= config.max_seq_len:
        raise ValueError(f"need steps >= 1, warmup >= 0 and 0 < T <= {config.max_seq_len}")
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if cuda:                        # TF32 for every fp32 matmul (under bf16 autocast none is left)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.set_float32_matmul_precision("high")
    torch.manual_seed(seed)
    model = _build(config).to(dev)
    gen = torch.Generator().manual_seed(seed)
    x, y = (torch.randint(0, config.vocab_size, (B, T), generator=gen).to(dev) for _ in range(2))  # (B, T)
    mask = torch.ones(T, T, dtype=torch.bool, device=dev).triu(1)                # True above the diagonal
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() == 2], "weight_decay": weight_decay},  # as llmz
              {"params": [p for p in params if p.dim() != 2], "weight_decay": 0.0}]
    try:
        opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
    except (RuntimeError, TypeError, ValueError):                                # no fused kernel here
        opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)

    loss_fn = torch.compile(_loss) if compile else _loss

    def step():
        opt.zero_grad(set_to_none=True)
        amp = torch.autocast(dev.type, dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
        with amp:
            loss = loss_fn(model, config, x, y, attention, mask)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return loss.detach()        # read back at the end: no host sync inside a step

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    losses = [step() for _ in range(warmup)]
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)         # the compiled graph's warm-up allocations stay reserved
    times = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        losses.append(step())
        sync()
        times.append(time.perf_counter() - t0)
    ms = statistics.median(times) * 1e3
    return {"ms": ms, "tokens_per_s": B * T / (ms / 1e3),
            "peak_bytes": torch.cuda.max_memory_allocated(dev) if cuda else None,
            "reserved_bytes": torch.cuda.max_memory_reserved(dev) if cuda else None,
            "losses": [float(v) for v in losses], "torch_version": torch.__version__,
            "attention": attention, "precision": precision, "compiled": compile}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m llmz.bench.torch_ref", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="d12")
    p.add_argument("--vocab-size", type=int, default=None, help="V (default: the preset's, as in llmz.bench)")
    p.add_argument("-b", "--batch-size", type=int, default=4)
    p.add_argument("-t", "--seq-len", type=int, default=1024)
    p.add_argument("--precision", choices=PRECISIONS, default="fp32")
    p.add_argument("--attention", choices=ATTENTIONS, default="sdpa")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    p.add_argument("--compile", action="store_true", help="torch.compile the model's loss (nanoGPT's compile)")
    args = p.parse_args(argv)
    cfg = preset(args.model, vocab_size=args.vocab_size)
    B, T = args.batch_size, args.seq_len
    try:
        r = torch_bench(cfg, B, T, args.precision, args.steps, args.warmup, args.attention, device=args.device,
                        compile=args.compile)
    except ModuleNotFoundError as e:
        if e.name != "torch":
            raise
        print("python -m llmz.bench.torch_ref needs PyTorch: pip install torch", file=sys.stderr)
        return 2
    peak = f"peak {r['peak_bytes'] / 2**30:.2f} GiB" if r["peak_bytes"] is not None else "peak n/a on cpu"
    mode = "compiled" if args.compile else "eager"
    print(f"torch {r['torch_version']} {mode} {args.attention} {args.precision} on {args.device}, model "
          f"{args.model} B={B} T={T}: {r['ms']:.1f} ms/step (median of {args.steps}) "
          f"{r['tokens_per_s']:.0f} tokens/s {peak}, loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
