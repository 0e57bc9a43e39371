"""llm.c file formats: token, tokenizer and model files round-trip, sit on disk in llm.c's order, and every
bad file fails with one line naming it. Writes are atomic: a failed write leaves nothing under the name."""
import os
import subprocess
import sys

import numpy as np
import pytest

import llmz.files
from llmz.config import GPT2Config
from llmz.data import read_tokens, write_tokens
from llmz.errors import LlmzError
from llmz.layout import Layout
from llmz.run.model_file import bf16_to_f32, f32_to_bf16, load_model, load_model_flat, save_model
from llmz.tokenizer import read_tokenizer, write_tokenizer

# L=2, C=16, NH=2, V=50 (padded 128), maxT=8: every tensor small, but V != Vp and L > 1
CFG = GPT2Config(max_seq_len=8, vocab_size=50, padded_vocab_size=128, num_layers=2, num_heads=2, channels=16)


def one_line_error(excinfo, path) -> str:
    """The error is one line and starts with the file's name."""
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    assert msg.startswith(str(path)), msg
    return msg


def random_params(layout: Layout, rng) -> np.ndarray:
    """A full flat buffer with random values, padding (and padded wte rows) zero, like a real model."""
    n = layout.config.num_parameters()
    flat = layout.from_llmc(rng.normal(0.0, 1.0, n).astype(np.float32))
    layout.views(flat)[0]["wte"][layout.config.vocab_size:] = 0.0
    return flat


# ---- token files --------------------------------------------------------------------------------------------
def test_token_file_round_trips_with_llmc_header_and_exact_size(tmp_path, rng):
    path = tmp_path / "t.bin"
    tokens = rng.integers(0, 65536, 1000).astype(np.uint16)
    write_tokens(str(path), tokens)
    raw = path.read_bytes()
    assert len(raw) == 1024 + 2 * 1000
    assert np.frombuffer(raw[:12], "<i4").tolist() == [20240520, 1, 1000]
    got = read_tokens(str(path))
    assert got.dtype == np.uint16 and np.array_equal(got, tokens)


def test_empty_token_file_round_trips(tmp_path):
    path = tmp_path / "e.bin"
    write_tokens(str(path), np.zeros(0, np.int32))
    assert read_tokens(str(path)).size == 0


def write_raw_tokens(path, header: list[int], tokens: np.ndarray, extra: bytes = b"", cut: int = 0):
    h = np.zeros(256, "<i4")
    h[:len(header)] = header
    raw = h.tobytes() + tokens.astype("<u2").tobytes() + extra
    path.write_bytes(raw[:len(raw) - cut])


@pytest.mark.parametrize("case, expect", [
    ("magic", "bad magic 12345 (expected 20240520"),
    ("model_magic", "this is an llm.c model file"),
    ("version", "unsupported version 2"),
    ("truncated", "truncated"),
    ("extra", "wrong size"),
    ("short_header", "shorter than the 1024-byte header"),
    ("negative_count", "bad token count"),
    ("vocab", "token 300 at position 3 is >= vocab size 256"),
])
def test_bad_token_file_fails_with_one_line_naming_it(tmp_path, case, expect):
    path = tmp_path / "bad.bin"
    tokens = np.array([1, 2, 3, 300, 5], np.uint16)
    header = {"magic": [12345, 1, 5], "model_magic": [20240326, 1, 5], "version": [20240520, 2, 5],
              "negative_count": [20240520, 1, -5]}.get(case, [20240520, 1, 5])
    write_raw_tokens(path, header, tokens, extra=b"xx" if case == "extra" else b"",
                     cut={"truncated": 3, "short_header": 1024 + 10 - 100}.get(case, 0))
    with pytest.raises(LlmzError) as e:
        read_tokens(str(path), vocab_size=256)
    assert expect in one_line_error(e, path)


def test_missing_token_file_fails_with_one_line_naming_it(tmp_path):
    path = tmp_path / "nope.bin"
    with pytest.raises(LlmzError) as e:
        read_tokens(str(path))
    assert "no such" in one_line_error(e, path)


def test_tokens_that_do_not_fit_uint16_are_refused(tmp_path):
    path = tmp_path / "t.bin"
    with pytest.raises(LlmzError) as e:
        write_tokens(str(path), np.array([1, 70000]))
    one_line_error(e, path)
    assert not path.exists()


# ---- tokenizer files ------------------------------------------------------------------------------------------
TABLE = [b"a", b"bc", b"\xe2\x9c", b"\x93", b"<|endoftext|>", bytes(range(1, 256))]


@pytest.mark.parametrize("eot, version", [(None, 1), (4, 2)])
def test_tokenizer_file_round_trips_v1_and_v2(tmp_path, eot, version):
    path = tmp_path / "tok.bin"
    write_tokenizer(str(path), TABLE, eot)
    raw = path.read_bytes()
    assert np.frombuffer(raw[:16], "<u4").tolist() == [20240328, version, len(TABLE), eot or 0]
    assert raw[1024:1026] == b"\x01a"          # per token: a length byte, then its bytes
    table, got_eot = read_tokenizer(str(path))
    assert table == TABLE and got_eot == eot


def test_tokenizer_file_v1_with_gpt2_vocab_means_eot_50256(tmp_path):
    path = tmp_path / "gpt2like.bin"
    write_tokenizer(str(path), [b"x"] * 50257, None)
    assert read_tokenizer(str(path))[1] == 50256


def write_raw_tokenizer(path, header: list[int], body: bytes):
    h = np.zeros(256, "<u4")
    h[:len(header)] = header
    path.write_bytes(h.tobytes() + body)


@pytest.mark.parametrize("case, expect", [
    ("magic", "bad magic"),
    ("token_magic", "this is an llm.c token file"),
    ("version", "unsupported version 3"),
    ("truncated", "truncated"),
    ("extra", "wrong size"),
    ("zero_length", "token 1 has length 0"),
    ("eot", "eot token 7 is outside"),
])
def test_bad_tokenizer_file_fails_with_one_line_naming_it(tmp_path, case, expect):
    path = tmp_path / "badtok.bin"
    body = b"\x01a\x02bc\x01d"
    header = {"magic": [1, 2, 3, 0], "token_magic": [20240520, 2, 3, 0], "version": [20240328, 3, 3, 0],
              "eot": [20240328, 2, 3, 7]}.get(case, [20240328, 2, 3, 0])
    if case == "truncated":
        body = body[:-1]
    elif case == "extra":
        body += b"\x00"
    elif case == "zero_length":
        body = b"\x01a\x00\x01d\x01e"
    write_raw_tokenizer(path, header, body)
    with pytest.raises(LlmzError) as e:
        read_tokenizer(str(path))
    assert expect in one_line_error(e, path)


# ---- bfloat16 -------------------------------------------------------------------------------------------------
def test_bf16_rounds_to_nearest_even_and_keeps_nan_inf_and_signed_zero():
    x = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, -0.0, np.inf, -np.inf,
                  np.finfo(np.float32).max, 2.0**-130], np.float32)
    b = f32_to_bf16(x)
    assert b.dtype == np.uint16
    assert b[0] == 0x3F80
    assert b[1] == 0x3F80          # exactly halfway between 1 and 1+2^-7: ties to even (down)
    assert b[2] == 0x3F82          # halfway between 1+2^-7 (odd) and 1+2^-6: ties to even (up)
    assert b[3] == 0x3F81          # just above halfway: up
    assert b[4] == 0x8000 and b[5] == 0x7F80 and b[6] == 0xFF80
    assert b[7] == 0x7F80          # float32's max is beyond bf16's range: rounds to inf
    assert bf16_to_f32(b[8:9])[0] == np.float32(2.0**-130)   # a subnormal with few bits survives exactly
    assert np.all(np.isnan(bf16_to_f32(f32_to_bf16(np.array([np.nan, -np.nan], np.float32)))))
    # a NaN whose payload lives only in the low 16 bits must stay NaN, not round to inf
    low_nan = np.array([0x7F800001, 0xFF80FFFF, 0x7FFFFFFF], np.uint32).view(np.float32)
    assert np.all(np.isnan(bf16_to_f32(f32_to_bf16(low_nan))))


def test_bf16_matches_ml_dtypes_where_installed(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    # magnitudes from float32's subnormals to beyond bf16's largest finite value, plus inf and NaN
    with np.errstate(over="ignore"):
        x = (rng.normal(0, 1, 20000) * np.exp(rng.uniform(-100, 89, 20000))).astype(np.float32)
    x[:4] = np.inf, -np.inf, np.nan, -0.0
    ours, theirs = f32_to_bf16(x), x.astype(ml_dtypes.bfloat16).view(np.uint16)
    nan = np.isnan(x)
    assert np.array_equal(ours[~nan], theirs[~nan])
    assert np.all(np.isnan(bf16_to_f32(ours[nan])))


# ---- llm.c's order --------------------------------------------------------------------------------------------
def llmc_sizes(c: GPT2Config) -> list[tuple[str, int]]:
    """llm.c's 16 tensor sizes, written out from its file format (independent of llmz.layout)."""
    Vp, T, L, C = c.padded_vocab_size, c.max_seq_len, c.num_layers, c.channels
    return [("wte", Vp * C), ("wpe", T * C), ("ln1w", L * C), ("ln1b", L * C), ("qkvw", L * 3 * C * C),
            ("qkvb", L * 3 * C), ("attprojw", L * C * C), ("attprojb", L * C), ("ln2w", L * C), ("ln2b", L * C),
            ("fcw", L * 4 * C * C), ("fcb", L * 4 * C), ("fcprojw", L * C * 4 * C), ("fcprojb", L * C),
            ("lnfw", C), ("lnfb", C)]


@pytest.mark.parametrize("world_size", [1, 3])
def test_layout_puts_every_tensor_where_llmc_expects_it(world_size):
    layout = Layout(CFG, world_size)
    n = CFG.num_parameters()
    llmc = np.arange(n, dtype=np.float64)           # value = position in llm.c's file
    flat = layout.from_llmc(llmc)
    v = layout.views(flat)
    start, at = {}, 0
    for name, size in llmc_sizes(CFG):
        start[name] = at
        at += size
    assert at == n
    L, C = CFG.num_layers, CFG.channels
    # qkvw of layer 1 starts after wte, wpe, ln1w, ln1b and layer 0's qkvw
    assert v[2]["qkvw"][0, 0] == CFG.padded_vocab_size * C + CFG.max_seq_len * C + 2 * L * C + 3 * C * C
    per_layer = dict(llmc_sizes(CFG))
    for layer in range(L):
        for name in ("ln1w", "qkvw", "qkvb", "attprojw", "fcw", "fcprojw", "fcprojb", "ln2b"):
            size = per_layer[name] // L
            expect = np.arange(start[name] + layer * size, start[name] + (layer + 1) * size)
            assert np.array_equal(v[1 + layer][name].ravel(), expect), (layer, name)
    assert v[0]["wte"][0, 0] == 0 and v[0]["wpe"][0, 0] == start["wpe"]
    assert np.array_equal(v[-1]["lnfb"], np.arange(start["lnfb"], n))
    # the padding between buckets stays zero and the conversion is lossless both ways
    assert np.array_equal(layout.to_llmc(flat), llmc)
    assert np.array_equal(layout.from_llmc(layout.to_llmc(flat)), flat)


# ---- model files --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [1, 3])
def test_fp32_model_file_round_trips_bit_exactly_in_llmc_order(tmp_path, rng, world_size):
    path = tmp_path / "m.bin"
    layout = Layout(CFG, world_size)
    flat = random_params(layout, rng)
    save_model(str(path), CFG, flat, layout, dtype="fp32")
    raw = path.read_bytes()
    c = CFG
    assert np.frombuffer(raw[:32], "<i4").tolist() == [20240326, 3, c.max_seq_len, c.vocab_size,
                                                       c.num_layers, c.num_heads, c.channels, c.padded_vocab_size]
    assert len(raw) == 1024 + 4 * c.num_parameters()
    assert np.array_equal(np.frombuffer(raw[1024:], "<f4"), layout.to_llmc(flat))
    cfg, llmc = load_model(str(path))
    assert cfg == CFG and llmc.dtype == np.float32
    assert np.array_equal(Layout(cfg, world_size).from_llmc(llmc), flat)
    _, layout2, flat2 = load_model_flat(str(path), world_size=2)   # another world size: same parameters
    assert np.array_equal(layout2.to_llmc(flat2), layout.to_llmc(flat))


def test_bf16_model_file_round_trips_within_bf16_rounding_and_exactly_when_representable(tmp_path, rng):
    path = tmp_path / "m16.bin"
    layout = Layout(CFG, 1)
    flat = random_params(layout, rng)
    save_model(str(path), CFG, flat, layout, dtype="bf16")
    raw = path.read_bytes()
    assert np.frombuffer(raw[:8], "<i4").tolist() == [20240326, 5]
    assert len(raw) == 1024 + 2 * CFG.num_parameters()
    _, llmc = load_model(str(path))
    ref = layout.to_llmc(flat)
    # bf16 keeps 8 significant bits: round to nearest is off by at most half a unit, 2^-8 relative
    assert np.all(np.abs(llmc - ref) <= 2.0**-8 * np.abs(ref))
    # values already bf16 go through unchanged
    exact = layout.from_llmc(llmc)
    save_model(str(path), CFG, exact, layout, dtype="bf16")
    assert np.array_equal(load_model(str(path))[1], llmc)


def model_bytes(rng, header_changes=None) -> bytes:
    """A valid fp32 model file for CFG, with some header entries changed."""
    c = CFG
    h = np.zeros(256, "<i4")
    h[:8] = [20240326, 3, c.max_seq_len, c.vocab_size, c.num_layers, c.num_heads, c.channels,
             c.padded_vocab_size]
    for i, v in (header_changes or {}).items():
        h[i] = v
    body = rng.normal(0, 1, c.num_parameters()).astype("<f4")
    return h.tobytes() + body.tobytes()


@pytest.mark.parametrize("case, expect", [
    ("magic", "bad magic 20240520 (expected 20240326; this is an llm.c token file)"),
    ("version", "unsupported version 4 (expected 3 = fp32 or 5 = bf16)"),
    ("truncated", "truncated"),
    ("extra", "wrong size"),
    ("short_header", "shorter than the 1024-byte header"),
    ("heads", "bad model header: channels 16 is not a multiple of num_heads 3"),
    ("padded", "bad model header: padded_vocab_size 40 < vocab_size 50"),
    ("negative", "bad model header"),
    ("size_mismatch", "truncated"),
])
def test_bad_model_file_fails_with_one_line_naming_it(tmp_path, rng, case, expect):
    path = tmp_path / "badmodel.bin"
    changes = {"magic": {0: 20240520}, "version": {1: 4}, "heads": {5: 3}, "padded": {7: 40},
               "negative": {4: -2}, "size_mismatch": {4: 3}}.get(case)
    raw = model_bytes(rng, header_changes=changes)
    raw = {"truncated": raw[:-5], "extra": raw + b"\0" * 4, "short_header": raw[:500]}.get(case, raw)
    path.write_bytes(raw)
    with pytest.raises(LlmzError) as e:
        load_model(str(path))
    assert expect in one_line_error(e, path)


def test_missing_model_file_fails_with_one_line_naming_it(tmp_path):
    path = tmp_path / "none.bin"
    with pytest.raises(LlmzError) as e:
        load_model(str(path))
    assert "no such model file" in one_line_error(e, path)


def test_save_model_refuses_an_unknown_dtype(tmp_path, rng):
    path = tmp_path / "m.bin"
    layout = Layout(CFG, 1)
    with pytest.raises(LlmzError) as e:
        save_model(str(path), CFG, random_params(layout, rng), layout, dtype="fp16")
    one_line_error(e, path)
    assert not path.exists()


# ---- atomic writes --------------------------------------------------------------------------------------------------
def writers(rng):
    layout = Layout(CFG, 1)
    flat = random_params(layout, rng)
    return {"tokens": lambda p: write_tokens(p, np.arange(100)),
            "tokenizer": lambda p: write_tokenizer(p, TABLE, 4),
            "model": lambda p: save_model(p, CFG, flat, layout, dtype="fp32")}


def fail_after_first_part(exc):
    """A _write_part that writes the header, then fails the way `exc` says."""
    calls = []
    real = llmz.files._write_part

    def part(f, data):
        if calls:
            raise exc
        calls.append(1)
        real(f, data)
    return part


@pytest.mark.parametrize("which", ["tokens", "tokenizer", "model"])
def test_failed_write_leaves_no_file_under_the_final_name(tmp_path, rng, monkeypatch, which):
    write = writers(rng)[which]
    path = tmp_path / f"{which}.bin"
    monkeypatch.setattr(llmz.files, "_write_part", fail_after_first_part(OSError(28, "No space left on device")))
    with pytest.raises(LlmzError) as e:
        write(str(path))
    assert "No space left on device" in one_line_error(e, path)
    assert os.listdir(tmp_path) == []          # neither the final name nor the temporary one


@pytest.mark.parametrize("which", ["tokens", "tokenizer", "model"])
def test_failed_overwrite_keeps_the_previous_file(tmp_path, rng, monkeypatch, which):
    write = writers(rng)[which]
    path = tmp_path / f"{which}.bin"
    write(str(path))
    before = path.read_bytes()
    monkeypatch.setattr(llmz.files, "_write_part", fail_after_first_part(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        write(str(path))
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == [path.name]


def test_file_modules_import_no_numba():
    code = ("import sys, llmz.data, llmz.tokenizer, llmz.run.model_file; "
            "assert 'numba' not in sys.modules, 'numba imported'")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


# ---- names at the filesystem's limits; the log and its lock ------------------------------------------------------
def test_a_file_of_the_longest_name_is_written_through_a_temporary_name_cut_to_fit(tmp_path, monkeypatch):
    from llmz.files import atomic_write, fit_name, name_limits, nbytes
    name_max = name_limits(str(tmp_path))[0]
    seen = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: seen.append(os.path.basename(src)) or real(src, dst))
    for name in ("é" * ((name_max - 4) // 2) + ".bin", "m" * name_max):   # two-byte characters, and ASCII
        atomic_write(str(tmp_path / name), [b"payload"])
        assert (tmp_path / name).read_bytes() == b"payload"
    assert all(nbytes(t) <= name_max and t.endswith(".tmp") for t in seen), seen
    # side names (locks): the name itself when it fits, else cut with a hash of the whole name
    assert fit_name(str(tmp_path / "run.jsonl"), ".lock") == str(tmp_path / "run.jsonl.lock")
    a, b = (fit_name(str(tmp_path / (c * name_max)), ".lock") for c in "ab")
    assert a != b and all(nbytes(os.path.basename(x)) <= name_max and x.endswith(".lock") for x in (a, b))
    assert fit_name(str(tmp_path / ("a" * name_max)), ".lock") == a                       # the same every time


def test_check_log_takes_llmz_logs_and_a_torn_last_line_and_refuses_anything_else(tmp_path):
    from llmz.run.outputs import check_log
    cases = {"empty": ("", None), "new": (None, None),
             "log": ('{"event": "start"}\n{"step": 0, "loss": 5.0}\n', None),
             "torn": ('{"event": "start"}\n{"step": 0, "lo', None), "torn start": ('{"event": "start", "con', None),
             "notes": ("my notes\n", "line 1, 'my notes', is not a start record"),
             "json but no start": ('{"step": 0}\n', "line 1"), "a list": ('[1, 2]\n', "line 1"),
             "note inside": ('{"event": "start"}\nhello\n{"step": 1}\n', "line 2, 'hello', is not a JSON record"),
             "binary": ("\x00\x01\x02" * 1000, "line 1")}
    for what, (text, expect) in cases.items():
        path = tmp_path / f"{what}.jsonl"
        if text is not None:
            path.write_text(text)
        if expect is None:
            check_log(str(path))
        else:
            with pytest.raises(LlmzError) as e:
                check_log(str(path))
            assert f"--log {path}: not an llmz log ({expect}" in one_line_error(e, "--log"), what


def test_an_open_log_is_locked_under_every_name_and_truncated_only_once_locked(tmp_path):
    from llmz.run.outputs import JsonLog, check_not_written
    log = tmp_path / "run.jsonl"
    first = JsonLog(str(log))
    first.write({"event": "start"})
    os.link(log, tmp_path / "hard.jsonl")
    os.symlink(log, tmp_path / "soft.jsonl")
    for name in ("hard.jsonl", "soft.jsonl", "run.jsonl"):
        with pytest.raises(LlmzError) as e:
            JsonLog(str(tmp_path / name))                  # a second run's log, another name, same file
        assert f"is in use by another run (pid {os.getpid()}), which writes the same file" in str(e.value)
        with pytest.raises(LlmzError):
            check_not_written(str(tmp_path / name), "log")
    assert log.read_text() == '{"event": "start"}\n'      # not truncated by the refused ones
    first.close()
    JsonLog(str(tmp_path / "hard.jsonl")).close()          # free once the first is closed
    assert log.read_text() == ""
