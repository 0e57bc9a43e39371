"""Fuzzing every file reader (hypothesis): a model, token, tokenizer or training-state file, truncated, with
bytes flipped, header fields overwritten or bytes appended, must either load or fail with a one-line
LlmzError that names the file; never another exception, a crash or a hang. The readers run in this process.
The number of cases tried per kind is printed (pytest -s) and must reach MIN_CASES."""
import json
import os
import signal
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmz.config import GPT2Config
from llmz.data import read_tokens, write_tokens
from llmz.errors import LlmzError
from llmz.layout import Layout, init_parameters
from llmz.run.model_file import load_model, save_model
from llmz.run.state import (
    DONE_FILE,
    MODEL_FILE,
    load_checkpoint,
    read_state,
    shard_table,
    state_path,
    write_done,
    write_state,
)
from llmz.tokenizer import read_tokenizer, write_tokenizer

CFG = GPT2Config(max_seq_len=8, vocab_size=50, padded_vocab_size=128, num_layers=2, num_heads=2, channels=16)
CASES, MIN_CASES = 300, 200
SETTINGS = settings(max_examples=CASES, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
tried: Counter = Counter()
outcomes: Counter = Counter()

# header values that reach the readers' edge cases: zero, negative, huge, off by one
SPECIAL = st.sampled_from([0, 1, 2, 3, 5, 7, -1, -2, 255, 256, 2**31 - 1, -2**31, 20240326, 20240328,
                           20240520, 20261203, 50257, 1 << 20])


@st.composite
def damage(draw, size: int):
    """A list of edits to a file of `size` bytes: truncate, flip bytes, set a header int32, append."""
    pos = st.one_of(st.integers(0, 63), st.integers(0, max(size - 1, 0)))     # often the header's start
    edits = draw(st.lists(st.one_of(
        st.tuples(st.just("flip"), pos, st.integers(1, 255)),
        st.tuples(st.just("int"), st.integers(0, 15), st.one_of(SPECIAL, st.integers(-2**31, 2**31 - 1))),
        st.tuples(st.just("cut"), st.integers(0, size), st.just(0)),
        st.tuples(st.just("append"), st.integers(1, 64), st.integers(0, 255)),
    ), min_size=1, max_size=4))
    return edits


def apply(raw: bytes, edits) -> bytes:
    b = bytearray(raw)
    for op, a, x in edits:
        if op == "flip" and a < len(b):
            b[a] ^= x
        elif op == "int" and 4 * a + 4 <= len(b):
            b[4 * a:4 * a + 4] = int(x).to_bytes(4, "little", signed=x < 0) if x < 0 else \
                (x % 2**32).to_bytes(4, "little")
        elif op == "cut":
            del b[a:]
        elif op == "append":
            b += bytes([x]) * a
    return bytes(b)


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang()


def check_reader(kind: str, path: str, reader, name_in_error: str | None = None) -> None:
    """Run reader(); it loads, or raises a one-line LlmzError naming the file; within 10 s."""
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(10)
    try:
        reader()
        outcomes[kind, "loaded"] += 1
    except LlmzError as e:
        msg = str(e)
        assert "\n" not in msg, msg
        assert msg.startswith(name_in_error or path), msg
        outcomes[kind, "LlmzError"] += 1
    except Hang:
        pytest.fail(f"{kind}: the reader was still running after 10 s")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    tried[kind] += 1


# ---- the files, valid to begin with ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def originals(tmp_path_factory):
    d = tmp_path_factory.mktemp("orig")
    rng = np.random.default_rng(0)
    lay = Layout(CFG, 1)
    save_model(str(d / "model.bin"), CFG, init_parameters(lay, 0), lay)
    write_tokens(str(d / "tokens.bin"), rng.integers(0, CFG.vocab_size, 500))
    table = [bytes(rng.integers(0, 256, rng.integers(1, 6)).astype(np.uint8)) for _ in range(60)]
    write_tokenizer(str(d / "tok.bin"), table, eot_token=59)
    # a 2-rank checkpoint folder of this model: DONE, model.bin, one state file per rank
    folder = d / "step_000007"
    folder.mkdir()
    lay2 = Layout(CFG, 2)
    params = init_parameters(lay2, 0)
    save_model(str(folder / MODEL_FILE), CFG, params, lay2)
    for r in range(2):
        slices = {"params": np.concatenate([lay2.bucket_buffer(params, b)[slice(*lay2.shard_range(b, r))]
                                            for b in lay2.buckets])}
        slices["m"] = rng.normal(size=lay2.shard_total) * 1e-3
        slices["v"] = rng.random(lay2.shard_total) * 1e-6
        meta = {"step": 7, "world_size": 2, "rank": r, "zero_stage": 2, "precision": "fp64",
                "config": CFG.to_dict(), "flags": {"lr": 1e-3, "steps": 20},
                "data": {"position": 7, "epoch": 0, "num_batches": 9, "num_tokens": 500, "B": 2, "T": 8,
                         "world_size": 2, "shuffle": False, "seed": 1337},
                "rng": np.random.default_rng(1).bit_generator.state, "buckets": shard_table(lay2, r)}
        write_state(state_path(str(folder), r), meta, slices)
    write_done(str(folder), {"step": 7})
    files = {"model": d / "model.bin", "tokens": d / "tokens.bin", "tokenizer": d / "tok.bin",
             "state": folder / "state_rank1.bin"}
    # the originals load
    load_model(str(files["model"]))
    read_tokens(str(files["tokens"]), CFG.vocab_size)
    read_tokenizer(str(files["tokenizer"]))
    read_state(str(files["state"]))
    load_checkpoint(str(folder))
    return {k: p.read_bytes() for k, p in files.items()}, folder


READERS = {
    "model": load_model,
    "tokens": lambda p: read_tokens(p, CFG.vocab_size),
    "tokenizer": read_tokenizer,
    "state": read_state,
}


@pytest.mark.parametrize("kind", list(READERS))
def test_damaged_file_loads_or_fails_with_one_line_naming_it(originals, tmp_path_factory, kind):
    raws, _ = originals
    path = str(tmp_path_factory.mktemp(kind) / f"damaged_{kind}.bin")

    @SETTINGS
    @given(edits=damage(len(raws[kind])))
    def case(edits):
        damaged = apply(raws[kind], edits)
        with open(path, "wb") as f:
            f.write(damaged)
        before = outcomes[kind, "LlmzError"]
        check_reader(kind, path, lambda: READERS[kind](path))
        if kind == "state" and damaged != raws[kind]:     # CRC-32s and checks cover every byte of it
            assert outcomes[kind, "LlmzError"] == before + 1, edits

    case()
    print(f"\n{kind}: {tried[kind]} cases, {outcomes[kind, 'LlmzError']} LlmzError, "
          f"{outcomes[kind, 'loaded']} loaded")
    assert tried[kind] >= MIN_CASES
    assert outcomes[kind, "LlmzError"] > tried[kind] // 2         # most damage must be noticed


def test_damaged_checkpoint_folder_loads_or_fails_with_one_line(originals, tmp_path_factory):
    """One file of a complete 2-rank checkpoint damaged: load_checkpoint loads it or names what is wrong.
    Every byte of a state file is covered by a CRC-32, so any change to one must be refused."""
    _, folder = originals
    names = [MODEL_FILE, "state_rank0.bin", "state_rank1.bin", DONE_FILE]
    work = tmp_path_factory.mktemp("ck") / "step_000007"
    work.mkdir()
    orig = {n: (folder / n).read_bytes() for n in names}

    @SETTINGS
    @given(which=st.sampled_from(names), edits=st.data())
    def case(which, edits):
        e = edits.draw(damage(len(orig[which])))
        for n in names:
            (work / n).write_bytes(apply(orig[n], e) if n == which else orig[n])
        changed = (work / which).read_bytes() != orig[which]
        before = outcomes["checkpoint", "LlmzError"]
        check_reader("checkpoint", str(work), lambda: load_checkpoint(str(work)))
        if which.startswith("state") and changed:
            assert outcomes["checkpoint", "LlmzError"] == before + 1, e

    case()
    print(f"\ncheckpoint folder: {tried['checkpoint']} cases, {outcomes['checkpoint', 'LlmzError']} "
          f"LlmzError, "
          f"{outcomes['checkpoint', 'loaded']} loaded")
    assert tried["checkpoint"] >= MIN_CASES


def test_state_file_json_fields_are_each_validated(originals, tmp_path):
    """A well-formed file (right CRC) whose JSON says something impossible is refused, field by field."""
    import zlib

    from llmz.run.state import STATE_MAGIC, STATE_VERSION, _align8
    raws, _ = originals
    raw = raws["state"]
    n = int(np.frombuffer(raw[8:12], "<u4")[0])
    meta = json.loads(raw[1024:1024 + n])
    body = raw[_align8(1024 + n):]
    bad = [("step", -1), ("world_size", 0), ("rank", 2), ("zero_stage", 4), ("precision", "bf16"),
           ("config", {**meta["config"], "num_heads": 0}), ("config", {**meta["config"], "channels": 17}),
           ("data", {**meta["data"], "world_size": 4}), ("data", {**meta["data"], "position": "7"}),
           ("rng", {"bit_generator": "MT19937"}), ("buckets", meta["buckets"][:-1]),
           ("buckets", [*meta["buckets"][:-1], ["lnf", 32, 0, 16]]), ("arrays", meta["arrays"][::-1]),
           ("flags", None)]
    path = str(tmp_path / "s.bin")
    for key, value in bad:
        text = json.dumps({**meta, key: value}).encode()
        header = np.zeros(256, "<u4")
        header[:4] = STATE_MAGIC, STATE_VERSION, len(text), zlib.crc32(text)
        pad = bytes(_align8(1024 + len(text)) - 1024 - len(text))
        with open(path, "wb") as f:
            f.write(header.tobytes() + text + pad + body)
        with pytest.raises(LlmzError, match="bad training state") as e:
            read_state(path)
        assert str(e.value).startswith(path) and "\n" not in str(e.value)
    assert os.path.getsize(path) > 0
