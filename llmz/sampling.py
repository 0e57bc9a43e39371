"""The samples a training run prints (--sample-every, and one at the end): llmz.sample's generation, from the
parameters the run trains, on a second GPT2 of batch 1 (cheap activations), with seeds drawn from the run's
own RNG, whose state every checkpoint keeps, so a resumed run prints the samples the uninterrupted one would.
"""
from __future__ import annotations

import numpy as np

from .config import GPT2Config, TrainConfig
from .model import GPT2
from .sample import generate


class Sampler:
    def __init__(self, cfg: TrainConfig, tok, config: GPT2Config, dev, notes: list[str]):
        self.tok, self.config, self.dev = tok, config, dev
        self.n_tokens, self.T = cfg.sample_tokens, cfg.seq_len
        self.rng = np.random.default_rng(cfg.seed)          # draws the seeds of the samples
        self.model = None                                    # the B=1 model, built for the first sample
        # among the tokens the tokenizer can decode (a model wider than its tokenizer, e.g. --vocab-size 50257
        # on byte data, would otherwise sample ids it cannot print)
        self.vocab = min(config.vocab_size, tok.vocab_size)
        if self.vocab < config.vocab_size and cfg.sample_tokens:
            notes.append(f"note: the model has {config.vocab_size} tokens, the tokenizer {tok.vocab_size}: "
                         f"samples are drawn among the tokenizer's {tok.vocab_size} only")

    def next_seed(self) -> int:
        """The seed of the next printed sample, from the run's RNG (saved in checkpoints)."""
        return int(self.rng.integers(2**31))

    def sample(self, pviews, prompt_ids, n_tokens: int, seed: int) -> list[int]:
        """n_tokens ids after prompt_ids, from the parameter store pviews (llmz.model): at ZeRO stage 3 it
        gathers the parameters, so every rank calls it."""
        if self.model is None:
            self.model = GPT2(self.config, self.dev, 1, self.T)
        return generate(self.model, pviews, self.tok, prompt_ids, n_tokens, seed, vocab=self.vocab)

    def text(self, pviews) -> str:
        """A sample of --sample-tokens tokens from an empty prompt, decoded, with the run's next seed."""
        return self.tok.decode(self.sample(pviews, [], self.n_tokens, self.next_seed()))
