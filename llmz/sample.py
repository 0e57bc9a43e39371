"""python -m llmz.sample --init-from FILE.bin --prompt TEXT: generate text from an llm.c model file.

Generation as llm.c does it: run the whole window forward, take the logits at the last position, sample
from the softmax over the first V (real) tokens, append, repeat. The window slides once it is T long.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from .bf16 import bf16_to_f32
from .device import KERNEL_SETS, KINDS, resolve


def generate(model, pviews, tok, prompt_ids, n_tokens: int, seed: int, temperature: float = 1.0) -> list[int]:
    """model: a GPT2 built for B=1; returns the prompt plus n_tokens sampled token ids."""
    dev, T, V = model.dev, model.T, model.config.vocab_size
    rng = np.random.default_rng(seed)
    ids = list(prompt_ids) or [tok.eot if tok.eot is not None else tok.encode("\n")[0]]
    start = len(ids)
    x = dev.zeros((1, T), np.int32)
    window = np.zeros((1, T), np.int32)
    for _ in range(n_tokens):
        ctx = ids[-T:]
        window[...] = 0
        window[0, :len(ctx)] = ctx
        dev.copy_from_host(x, window)
        model.forward(pviews, x)                    # causal: positions after len(ctx) change nothing
        logits = dev.to_host(model.acts.logits[0, len(ctx) - 1, :V])
        logits = (bf16_to_f32(logits) if logits.dtype == np.uint16 else logits).astype(np.float64)
        z = logits / max(temperature, 1e-6)
        p = np.exp(z - z.max())
        p /= p.sum()
        ids.append(int(rng.choice(V, p=p)))
    return ids if prompt_ids else ids[start:]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m llmz.sample", description=__doc__.splitlines()[0])
    p.add_argument("--init-from", required=True, metavar="FILE.bin")
    p.add_argument("--prompt", default="")
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--tokenizer", default="byte")
    p.add_argument("--device", choices=KINDS, default="auto")
    p.add_argument("--kernels", choices=KERNEL_SETS, default="auto", help="fast (GPU default, llmz/fast/) or "
                   "teaching (llmz/kernels/; the simulator's default)")
    p.add_argument("--seq-len", type=int, default=None, help="window (default: model's maxT, at most 256)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from .errors import LlmzError
    try:
        kind = resolve(args.device)
        from .checkpoint import load_model
        from .device import Device
        from .layout import Layout
        from .model import GPT2
        from .tokenizer import load_tokenizer
        cfg, llmc = load_model(args.init_from)
        tok = load_tokenizer(args.tokenizer)
        layout = Layout(cfg, 1)
        dev = Device(kind, np.float32, kernel_set=args.kernels)
        params = dev.asarray(layout.from_llmc(llmc), np.float32)
        T = args.seq_len or min(cfg.max_seq_len, 256)
        model = GPT2(cfg, dev, 1, T)
        ids = generate(model, layout.views(params), tok, tok.encode(args.prompt).tolist(), args.tokens,
                       args.seed, args.temperature)
        print(tok.decode(ids))
    except (LlmzError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
