"""python -m llmz.bench.torch_ref: a PyTorch GPT-2, the yardstick `python -m llmz.bench --vs-torch [compile]` uses.

The model of llm.c's train_gpt2.py / nanoGPT at the shapes of an llmz GPT2Config, trained on one fixed
batch of random tokens: AdamW (fused where torch has it), gradient clipping to 1.0; eager, or with the loss
(forward and backward of the model) compiled by torch.compile (nanoGPT's `compile = True`, default mode).
  fp32  fp32 weights and activations, TF32 matmuls on a GPU
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


class TorchRun:
    """A PyTorch GPT-2 of `config`'s shape training on one fixed batch of random tokens: `step()` is one
    optimizer step (zero_grad, forward, backward, clip to norm 1.0, AdamW), `timed(n)` times n of them (seconds
    each). Eager, or with the loss function compiled (compile=True: torch.compile, compiled by the first
    step). threads: torch.set_num_threads (the CPU's pool; None: torch's default)."""

    def __init__(self, config: GPT2Config, B: int, T: int, precision: str, attention: str = "sdpa",
                 lr: float = 3e-4, weight_decay: float = 0.0, seed: int = 0, device: str = "cuda",
                 compile: bool = False, threads: int | None = None):
        import torch
        if precision not in PRECISIONS or attention not in ATTENTIONS:
            raise ValueError(f"precision must be one of {PRECISIONS} and attention one of {ATTENTIONS}")
        if not 0 < T <= config.max_seq_len:
            raise ValueError(f"need 0 < T <= {config.max_seq_len}")
        if threads:
            torch.set_num_threads(threads)
        self.torch, self.config, self.B, self.T = torch, config, B, T
        self.precision, self.attention, self.compiled = precision, attention, compile
        self.dev = dev = torch.device(device)
        self.cuda = dev.type == "cuda"
        if self.cuda:               # TF32 for every fp32 matmul (under bf16 autocast none is left)
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
            torch.set_float32_matmul_precision("high")
        torch.manual_seed(seed)
        self.model = _build(config).to(dev)
        gen = torch.Generator().manual_seed(seed)
        self.x, self.y = (torch.randint(0, config.vocab_size, (B, T), generator=gen).to(dev) for _ in range(2))
        self.mask = torch.ones(T, T, dtype=torch.bool, device=dev).triu(1)     # True above the diagonal
        self.params = params = list(self.model.parameters())
        groups = [{"params": [p for p in params if p.dim() == 2], "weight_decay": weight_decay},  # as llmz
                  {"params": [p for p in params if p.dim() != 2], "weight_decay": 0.0}]
        try:
            self.opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
        except (RuntimeError, TypeError, ValueError):                            # no fused kernel here
            self.opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)
        self.loss_fn = torch.compile(_loss) if compile else _loss
        self.losses: list = []      # one tensor per step, read back at the end: no host sync inside a step

    def step(self) -> None:
        torch = self.torch
        self.opt.zero_grad(set_to_none=True)
        amp = (torch.autocast(self.dev.type, dtype=torch.bfloat16) if self.precision == "bf16"
               else contextlib.nullcontext())
        with amp:
            loss = self.loss_fn(self.model, self.config, self.x, self.y, self.attention, self.mask)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.losses.append(loss.detach())

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.dev)

    def timed(self, n: int) -> list[float]:
        """n steps, each timed from a synchronised start to a synchronised end: seconds each."""
        times = []
        for _ in range(n):
            self.sync()
            t0 = time.perf_counter()
            self.step()
            self.sync()
            times.append(time.perf_counter() - t0)
        return times

    def reset_peak(self) -> None:
        """The compiled graph's warm-up allocations stay reserved; the peak counts from here."""
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats(self.dev)

    def memory(self) -> tuple[int | None, int | None]:
        """(max allocated, max reserved) bytes since reset_peak; (None, None) on a CPU."""
        if not self.cuda:
            return None, None
        return self.torch.cuda.max_memory_allocated(self.dev), self.torch.cuda.max_memory_reserved(self.dev)


def torch_bench(config: GPT2Config, B: int, T: int, precision: str, steps: int, warmup: int,
                attention: str = "sdpa", lr: float = 3e-4, weight_decay: float = 0.0, seed: int = 0,
                device: str = "cuda", compile: bool = False, threads: int | None = None) -> dict:
    """Train a PyTorch GPT-2 of `config`'s shape on random tokens for `warmup` + `steps` optimizer steps, eager
    or with the loss function compiled (compile=True: torch.compile, compiled during the warm-up steps);
    returns {"ms": median ms per timed step, "tokens_per_s", "peak_bytes" (max allocated during the timed
    steps; None on CPU), "reserved_bytes" (max reserved by the caching allocator), "losses": one float per
    step, "torch_version", "attention", "precision", "compiled"}.
    One step = zero_grad, forward, backward, clip to norm 1.0, AdamW step."""
    if steps < 1 or warmup < 0:
        raise ValueError("need steps >= 1 and warmup >= 0")
    run = TorchRun(config, B, T, precision, attention, lr, weight_decay, seed, device, compile, threads)
    for _ in range(warmup):
        run.step()
    run.sync()
    run.reset_peak()
    ms = statistics.median(run.timed(steps)) * 1e3
    peak, reserved = run.memory()
    return {"ms": ms, "tokens_per_s": B * T / (ms / 1e3), "peak_bytes": peak, "reserved_bytes": reserved,
            "losses": [float(v) for v in run.losses], "torch_version": run.torch.__version__,
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
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads on a CPU (default: torch's)")
    args = p.parse_args(argv)
    cfg = preset(args.model, vocab_size=args.vocab_size)
    B, T = args.batch_size, args.seq_len
    try:
        r = torch_bench(cfg, B, T, args.precision, args.steps, args.warmup, args.attention, device=args.device,
                        compile=args.compile, threads=args.threads)
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
