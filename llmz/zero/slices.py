"""The stretches of the flat buffer a rank holds, on the host: what it starts from and what a checkpoint saves
and loads back (llmz.run.state). Every rank saves slice r of every bucket whatever its stage, so another world size
or another stage can re-shard the files (llmz.run.state.Checkpoint.assemble)."""
from __future__ import annotations

import numpy as np

from ..layout import Layout


def whole_ranges(layout: Layout) -> list[tuple]:
    """(bucket, start, end) of every bucket whole."""
    return [(b, 0, b.padded_size) for b in layout.buckets]


def shard_ranges(layout: Layout, rank: int) -> list[tuple]:
    """(bucket, start, end) of slice `rank` of every bucket: what a rank's shard buffers hold, one after another."""
    return [(b, *layout.shard_range(b, rank)) for b in layout.buckets]


def owned_values(full: np.ndarray, ranges: list[tuple]) -> np.ndarray:
    """The stretches `ranges` of a full host buffer, one after another."""
    return np.concatenate([full[b.offset + s:b.offset + e] for b, s, e in ranges])


def state_slices(optimizer, params_host: np.ndarray) -> dict[str, np.ndarray]:
    """params, m and v of slice r of every bucket, bucket by bucket, on the host (whatever the stage: at stage 0
    the N ranks' slices make the whole). params_host: the full host parameters. bf16: the full-precision
    parameters are the fp32 master, which holds slice r at every stage."""
    ctx = optimizer.ctx
    ranges = optimizer.owned_ranges()
    # what the optimizer owns, laid out as m and v are: the ranges one after another
    owned = {"params": ctx.dev.to_host(optimizer.master) if ctx.bf16 else owned_values(params_host, ranges),
             "m": ctx.dev.to_host(optimizer.m), "v": ctx.dev.to_host(optimizer.v)}
    out: dict[str, list] = {name: [] for name in owned}
    at = 0
    for b, s0, e0 in ranges:
        s, e = ctx.layout.shard_range(b, ctx.rank)      # slice r of the bucket, inside the owned [s0, e0)
        for name, x in owned.items():
            out[name].append(x[at + s - s0:at + e - s0])
        at += e0 - s0
    return {name: np.concatenate(x) for name, x in out.items()}


def load_optimizer_state(optimizer, m_owned: np.ndarray, v_owned: np.ndarray) -> None:
    """Set m and v from host arrays laid out as optimizer.owned_ranges() (llmz.run.state.Checkpoint.assemble)."""
    assert m_owned.shape == optimizer.m.shape and v_owned.shape == optimizer.v.shape, \
        (m_owned.shape, optimizer.m.shape)
    optimizer.ctx.dev.copy_from_host(optimizer.m, m_owned)
    optimizer.ctx.dev.copy_from_host(optimizer.v, v_owned)
