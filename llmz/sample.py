"""python -m llmz.sample --init-from FILE.bin --prompt TEXT: generate text from an llm.c model file.

Generation as llm.c does it (llmz.model.generate): run the whole window forward, take the logits at the last
position, sample from the softmax over the first V (real) tokens, append, repeat. The window slides once it
is T long. The text is printed as it is generated; on a terminal, stderr shows the progress (tokens, elapsed, ETA).
"""
from __future__ import annotations

import sys
import time

import numpy as np

from .args import MAX_TOKENS, UNKNOWN_WINDOW_MAX, Parser, check_sample, window
from .device import KERNEL_SETS, KINDS, resolve


def build_parser():
    p = Parser(prog="python -m llmz.sample", description=__doc__.splitlines()[0])
    a = p.add_argument
    a("--init-from", required=True, metavar="FILE.bin", help="the llm.c model file (fp32 or bf16) to sample from "
      "(required)")
    a("--prompt", default="", help="text the sample continues (default: '': start from the end-of-text token, "
      "or a newline, and print the sample alone)")
    a("--tokens", type=int, default=200, help=f"tokens to generate (at most {MAX_TOKENS:,})")
    a("--tokenizer", default="byte", help="byte, gpt2 (tiktoken) or an llm.c tokenizer file (decodes only: no "
      "--prompt with one)")
    a("--device", choices=KINDS, default="auto", help="gpu, cpu or sim (Numba's CUDA simulator); auto: gpu if "
      "there is one")
    a("--kernels", choices=KERNEL_SETS, default="auto", help="fast (llmz/fast/) or teaching (llmz/kernels/); "
      "auto: fast on a GPU, teaching elsewhere")
    a("--seq-len", type=int, default=None, help="the window the model sees (default: the length the model "
      "was trained at, which llmz records in the model file; for a file that does not say, its maxT, at most "
      f"{UNKNOWN_WINDOW_MAX})")
    a("--temperature", type=float, default=1.0, help="divides the logits; 0 = always the most likely token")
    a("--seed", type=int, default=0, help="the sampling RNG's seed (0 .. 2^32-1)")
    return p


def main(argv=None) -> int:
    from .errors import INTERRUPTED_EXIT, LlmzError, UsageError, before_any_work
    done = [0]
    try:
        args = build_parser().parse_args(argv)
        try:
            kind = resolve(args.device)
        except (ValueError, RuntimeError) as e:
            raise UsageError(str(e)) from None
        cfg, tok, prompt_ids = check_sample(args, kind)
        from .device import Device
        from .layout import Layout
        from .model import GPT2, FullParams, generate
        from .run.model_file import load_model, model_header
        from .run.progress import Progress
        from .tokenizer import TextStream, start_id
        with before_any_work():                 # found wrong while reading it: status 2
            _, llmc = load_model(args.init_from)
            T, why = window(args.seq_len, cfg.max_seq_len, model_header(args.init_from)[2])
        print(f"note: sampling with a window of T={T}, {why}", file=sys.stderr, flush=True)
        layout = Layout(cfg, 1)
        dev = Device(kind, np.float32, kernel_set=args.kernels)
        params = dev.asarray(layout.from_llmc(llmc), np.float32)
        model = GPT2(cfg, dev, 1, T)
        vocab = min(cfg.vocab_size, tok.vocab_size)
        if vocab < cfg.vocab_size:
            print(f"note: the model has {cfg.vocab_size} tokens, the tokenizer {tok.vocab_size}: sampling among "
                  f"the tokenizer's {vocab} only", file=sys.stderr)
        # the text as it comes: the prompt, then each token's bytes through one UTF-8 decoder
        stream = TextStream(tok)
        out = sys.stdout
        if prompt_ids:
            out.write("".join(stream.push(i) for i in prompt_ids))
            out.flush()
        progress = Progress(args.tokens)
        live = sys.stderr.isatty() and not out.isatty()     # on a terminal the text itself shows progress
        last_shown = [0.0]

        def on_token(i):
            done[0] += 1
            progress.tick()
            out.write(stream.push(i))
            out.flush()
            if live and (time.perf_counter() - last_shown[0] > 0.5 or done[0] == args.tokens):
                last_shown[0] = time.perf_counter()
                sys.stderr.write(f"\rsample: {done[0]}/{args.tokens} tokens, {progress.line()}, "
                                 f"{done[0] / max(progress.elapsed, 1e-9):.1f} tokens/s ")
                sys.stderr.flush()
        generate(model, FullParams(layout, params), prompt_ids or [start_id(tok)], args.tokens, args.seed,
                 args.temperature, vocab=vocab, on_token=on_token)
        out.write(stream.end() + "\n")
        out.flush()
        if live:
            sys.stderr.write("\n")
    except LlmzError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except MemoryError:
        print(f"error: out of host memory for the model of {args.init_from}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\ninterrupted after {done[0]} token(s)", file=sys.stderr)
        return INTERRUPTED_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main())
