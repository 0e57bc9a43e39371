"""GPT-2's shape (GPT2Config) and its presets, from `tiny` (tests) to `d12` (GPT-2 124M)."""
from __future__ import annotations

from dataclasses import asdict, dataclass


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

    @property
    def head_size(self) -> int:
        return self.channels // self.num_heads

    def num_parameters(self) -> int:
        """Parameters including the padded wte rows (llm.c counts them too)."""
        C, L = self.channels, self.num_layers
        per_block = 12 * C * C + 13 * C    # ln1 2C, qkv 3C*C+3C, attproj C*C+C, ln2 2C, fc 4C*C+4C, fcproj 4C*C+C
        return self.padded_vocab_size * C + self.max_seq_len * C + L * per_block + 2 * C

    def to_dict(self) -> dict:
        return asdict(self)


# name -> (num_layers, num_heads, channels). dN follows llm.c's depth naming: d12 is GPT-2 124M.
PRESETS = {
    "tiny": (2, 2, 16),
    "small": (4, 4, 128),       # the laptop default: trains on the shipped data in minutes on 2 cores
    "thin": (8, 2, 32),         # deep and narrow (the lessons): ZeRO-2's per-block gradient buckets pay off
    "d2": (2, 2, 128),
    "d4": (4, 4, 256),
    "d6": (6, 6, 384),
    "d12": (12, 12, 768),
    "d24": (24, 16, 1024),
    "d36": (36, 20, 1280),
    "d48": (48, 25, 1600),
}


def preset(name: str, vocab_size: int = 50257, max_seq_len: int = 1024,
           padded_vocab_size: int | None = None) -> GPT2Config:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    L, NH, C = PRESETS[name]
    Vp = padded_vocab_size or padded_vocab(vocab_size)
    return GPT2Config(max_seq_len=max_seq_len, vocab_size=vocab_size, padded_vocab_size=Vp,
                      num_layers=L, num_heads=NH, channels=C)
