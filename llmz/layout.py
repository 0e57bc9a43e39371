"""Where every parameter lives: one flat buffer, laid out bucket by bucket.

    flat = [embeddings: wte, wpe] [block 0] [block 1] ... [block L-1] [lnf: lnfw, lnfb]

Gradients use the same layout. Each bucket is padded to a multiple of the world size N, so rank r owns
slice r of every bucket (its shard): one reduce-scatter per bucket hands each rank the gradient of exactly
what it owns, one all-gather per bucket restores the full parameters (ZeRO, Rajbhandari et al. 2019).

Inside a bucket the weight-decayed 2-D weights come first and the biases / layernorm parameters after, so
AdamW needs just one number per bucket slice (`decay_size`): elements before it get weight decay.

llm.c's model file stores tensor by tensor (all layers' qkvw together): `llmc_order()` lists that order, and
the checkpoint code converts between it and this layout.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .config import GPT2Config

# A block's tensors, weight-decayed first. Shapes are (out, in) for weights, as in llm.c.
BLOCK_DECAYED = ("qkvw", "attprojw", "fcw", "fcprojw")
BLOCK_OTHERS = ("ln1w", "ln1b", "qkvb", "attprojb", "ln2w", "ln2b", "fcb", "fcprojb")
# llm.c's order of the 16 parameter tensors in a model file.
LLMC_ORDER = ("wte", "wpe", "ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb",
              "ln2w", "ln2b", "fcw", "fcb", "fcprojw", "fcprojb", "lnfw", "lnfb")


def block_shapes(C: int) -> dict[str, tuple[int, ...]]:
    return {"qkvw": (3 * C, C), "attprojw": (C, C), "fcw": (4 * C, C), "fcprojw": (C, 4 * C),
            "ln1w": (C,), "ln1b": (C,), "qkvb": (3 * C,), "attprojb": (C,),
            "ln2w": (C,), "ln2b": (C,), "fcb": (4 * C,), "fcprojb": (C,)}


@dataclass
class Bucket:
    name: str                      # "embeddings", "block0" .. "block{L-1}", "lnf"
    index: int                     # position in backward-independent order 0..L+1
    tensors: dict[str, tuple]      # name -> shape, in storage order
    world_size: int
    offset: int = 0                # start in the flat buffer
    offsets: dict[str, int] = field(default_factory=dict)   # tensor -> start inside the bucket
    size: int = 0                  # elements actually used
    decay_size: int = 0            # the first decay_size elements get weight decay

    def __post_init__(self):
        at = 0
        for name, shape in self.tensors.items():
            self.offsets[name] = at
            at += int(np.prod(shape))
        self.size = at

    @property
    def padded_size(self) -> int:
        """size rounded up to a multiple of the world size, so it splits into equal shards."""
        n = self.world_size
        return (self.size + n - 1) // n * n

    @property
    def shard_size(self) -> int:
        return self.padded_size // self.world_size

    def views(self, buf) -> dict:
        """Named views into `buf`, any 1-D array (NumPy or CuPy) holding exactly this bucket."""
        assert buf.shape[0] >= self.size, (buf.shape, self.size)
        return {name: buf[o:o + int(np.prod(self.tensors[name]))].reshape(self.tensors[name])
                for name, o in self.offsets.items()}


class Layout:
    """The bucket-by-bucket layout of GPT-2's parameters for a world of `world_size` ranks."""

    def __init__(self, config: GPT2Config, world_size: int = 1):
        c = config
        self.config, self.world_size = c, world_size
        C, L = c.channels, c.num_layers
        self.buckets: list[Bucket] = []
        emb = Bucket("embeddings", 0, {"wte": (c.padded_vocab_size, C), "wpe": (c.max_seq_len, C)}, world_size)
        emb.decay_size = emb.size
        self.buckets.append(emb)
        for layer in range(L):
            shapes = block_shapes(C)
            b = Bucket(f"block{layer}", 1 + layer, {k: shapes[k] for k in BLOCK_DECAYED + BLOCK_OTHERS},
                       world_size)
            b.decay_size = sum(int(np.prod(shapes[k])) for k in BLOCK_DECAYED)
            self.buckets.append(b)
        self.buckets.append(Bucket("lnf", L + 1, {"lnfw": (C,), "lnfb": (C,)}, world_size))
        at = 0
        for b in self.buckets:
            b.offset = at
            at += b.padded_size
        self.total = at                                  # flat buffer length, padding included
        self.shard_total = at // world_size              # one rank's shard: its slice of every bucket
        self.num_parameters = sum(b.size for b in self.buckets)

    # ---- the pieces the model talks to ---------------------------------------------------------
    @property
    def embeddings(self) -> Bucket:
        return self.buckets[0]

    def block(self, layer: int) -> Bucket:
        return self.buckets[1 + layer]

    @property
    def lnf(self) -> Bucket:
        return self.buckets[-1]

    def bucket_buffer(self, flat, b: Bucket):
        """The padded stretch of `flat` (a full-size buffer) that holds bucket b."""
        return flat[b.offset:b.offset + b.padded_size]

    def views(self, flat) -> list[dict]:
        """Named views of every bucket of a full-size flat buffer: [embeddings, block0.., lnf]."""
        return [b.views(self.bucket_buffer(flat, b)) for b in self.buckets]

    # ---- shards ----------------------------------------------------------------------------------
    def shard_range(self, b: Bucket, rank: int) -> tuple[int, int]:
        """Rank's slice of bucket b, as [start, end) inside the bucket."""
        return rank * b.shard_size, (rank + 1) * b.shard_size

    def shard_offset(self, b: Bucket) -> int:
        """Where bucket b's slice starts inside a rank's shard buffer (the same on every rank)."""
        return b.offset // self.world_size

    @staticmethod
    def decay_size_in(b: Bucket, start: int, end: int) -> int:
        """How many leading elements of the stretch [start, end) of bucket b get weight decay."""
        return int(min(max(b.decay_size - start, 0), end - start))

    # ---- llm.c's order ---------------------------------------------------------------------------
    def llmc_order(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of each tensor in llm.c's file order; per-layer tensors have a leading L axis."""
        c = self.config
        shapes = block_shapes(c.channels)
        out = []
        for name in LLMC_ORDER:
            if name in ("wte", "wpe"):
                out.append((name, self.embeddings.tensors[name]))
            elif name in ("lnfw", "lnfb"):
                out.append((name, self.lnf.tensors[name]))
            else:
                out.append((name, (c.num_layers,) + shapes[name]))
        return out

    def to_llmc(self, flat: np.ndarray) -> np.ndarray:
        """Flat bucket-ordered host buffer -> llm.c's flat tensor-ordered buffer (no padding)."""
        v = self.views(flat)
        parts = []
        for name, _ in self.llmc_order():
            if name in ("wte", "wpe"):
                parts.append(v[0][name].ravel())
            elif name in ("lnfw", "lnfb"):
                parts.append(v[-1][name].ravel())
            else:
                parts.extend(v[1 + layer][name].ravel() for layer in range(self.config.num_layers))
        return np.concatenate(parts)

    def from_llmc(self, llmc: np.ndarray, dtype=None) -> np.ndarray:
        """llm.c's flat tensor-ordered buffer -> a new flat bucket-ordered host buffer (padding zero)."""
        flat = np.zeros(self.total, dtype=dtype or llmc.dtype)
        v = self.views(flat)
        at = 0
        for name, shape in self.llmc_order():
            n = int(np.prod(shape))
            t = llmc[at:at + n].reshape(shape)
            at += n
            if name in ("wte", "wpe"):
                v[0][name][...] = t
            elif name in ("lnfw", "lnfb"):
                v[-1][name][...] = t
            else:
                for layer in range(self.config.num_layers):
                    v[1 + layer][name][...] = t[layer]
        if at != llmc.size:
            raise ValueError(f"llm.c buffer holds {llmc.size} values, the config needs {at}")
        return flat


def init_parameters(layout: Layout, seed: int = 0) -> np.ndarray:
    """llm.c / GPT-2 initialisation on the host in float64: weights N(0, 0.02), residual projections
    N(0, 0.02/sqrt(2L)), biases 0, layernorm weights 1; padded wte rows zero. Same on every rank."""
    rng = np.random.default_rng(seed)
    c = layout.config
    flat = np.zeros(layout.total, dtype=np.float64)
    v = layout.views(flat)
    v[0]["wte"][:c.vocab_size] = rng.normal(0.0, 0.02, (c.vocab_size, c.channels))
    v[0]["wpe"][...] = rng.normal(0.0, 0.02, v[0]["wpe"].shape)
    resid_std = 0.02 / np.sqrt(2 * c.num_layers)
    for layer in range(c.num_layers):
        b = v[1 + layer]
        for name in BLOCK_DECAYED:
            std = resid_std if name in ("attprojw", "fcprojw") else 0.02
            b[name][...] = rng.normal(0.0, std, b[name].shape)
        b["ln1w"][...] = 1.0
        b["ln2w"][...] = 1.0
    v[-1]["lnfw"][...] = 1.0
    return flat
