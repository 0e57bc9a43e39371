"""Tokenizers encode and decode losslessly; GPT-2's BPE fails with one clear line when tiktoken cannot load;
the shipped data files load and decode back to the shipped text, and prepare.py reproduces them."""
import importlib.util
import os
import shutil
import sys
import types

import numpy as np
import pytest

from llmz.data import DataLoader, read_tokens
from llmz.errors import LlmzError
from llmz.tokenizer import (
    ByteTokenizer,
    FileTokenizer,
    Gpt2Tokenizer,
    load_tokenizer,
    padded_vocab_size,
    read_tokenizer,
    write_tokenizer,
)

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
TEXT = "To be, or not to be: that is the question.\nNaïve café — ✓ 漢字\n"


def test_byte_tokenizer_round_trips_utf8_text():
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    assert tok.vocab_size == 256 and tok.eot is None
    assert ids.dtype == np.uint16 and ids.max() < 256 and ids.size == len(TEXT.encode("utf-8"))
    assert tok.decode(ids) == TEXT


def test_byte_tokenizer_decodes_broken_utf8_with_replacement_and_refuses_ids_beyond_255():
    tok = ByteTokenizer()
    assert tok.decode([104, 105, 0xE2, 0x9C]) == "hi\ufffd"       # a character cut in half
    with pytest.raises(LlmzError):
        tok.decode([65, 256])


def test_file_tokenizer_joins_token_bytes_before_decoding(tmp_path):
    path = tmp_path / "tok.bin"
    table = [b"a", b" b", b"\xe2\x9c", b"\x93", b"<|endoftext|>"]     # "✓" split across tokens 2 and 3
    write_tokenizer(str(path), table, 4)
    tok = FileTokenizer(str(path))
    assert tok.vocab_size == 5 and tok.eot == 4
    assert tok.decode(np.array([0, 1, 2, 3, 4])) == "a b✓<|endoftext|>"
    with pytest.raises(LlmzError) as e:                               # no merges in the file: cannot encode
        tok.encode("a b")
    assert str(e.value).startswith(str(path))
    with pytest.raises(LlmzError):
        tok.decode([5])


def test_byte_vocabulary_file_encodes_like_the_byte_tokenizer(tmp_path):
    path = tmp_path / "bytes.bin"
    write_tokenizer(str(path), ByteTokenizer().token_table(), None)
    tok = load_tokenizer(str(path))
    assert isinstance(tok, FileTokenizer) and tok.eot is None
    assert np.array_equal(tok.encode(TEXT), ByteTokenizer().encode(TEXT)) and tok.decode(tok.encode(TEXT)) == TEXT


def test_load_tokenizer_by_name_and_path(tmp_path):
    assert isinstance(load_tokenizer("byte"), ByteTokenizer) and isinstance(load_tokenizer("bytes"), ByteTokenizer)
    path = str(tmp_path / "missing.bin")
    with pytest.raises(LlmzError) as e:
        load_tokenizer(path)
    assert str(e.value) == f"{path}: no such tokenizer file"


def test_gpt2_without_tiktoken_fails_with_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "tiktoken", None)                # import tiktoken -> ImportError
    with pytest.raises(LlmzError) as e:
        load_tokenizer("gpt2")
    assert "tiktoken" in str(e.value) and "\n" not in str(e.value)


def test_gpt2_when_tiktoken_cannot_load_its_encoding_fails_with_one_line(monkeypatch):
    def get_encoding(name):
        raise ConnectionError("HTTPSConnectionPool: Max retries exceeded\nwith a second line")
    monkeypatch.setitem(sys.modules, "tiktoken", types.SimpleNamespace(get_encoding=get_encoding))
    with pytest.raises(LlmzError) as e:
        Gpt2Tokenizer()
    msg = str(e.value)
    assert "\n" not in msg and "ConnectionError" in msg and "'gpt2'" in msg


def gpt2_or_skip():
    pytest.importorskip("tiktoken")
    try:
        return Gpt2Tokenizer()
    except LlmzError as e:
        pytest.skip(str(e))


def test_gpt2_round_trips_text_and_knows_its_eot():
    tok = gpt2_or_skip()
    ids = tok.encode(TEXT + "<|endoftext|>")
    assert tok.vocab_size == 50257 and tok.eot == 50256 and ids[-1] == 50256 and ids.dtype == np.uint16
    assert tok.decode(ids) == TEXT + "<|endoftext|>"


def test_gpt2_tokenizer_file_decodes_like_tiktoken(tmp_path):
    tok = gpt2_or_skip()
    path = str(tmp_path / "gpt2_tokenizer.bin")
    write_tokenizer(path, tok.token_table(), tok.eot)
    ftok = load_tokenizer(path)
    ids = tok.encode(TEXT)
    assert ftok.vocab_size == 50257 and ftok.eot == 50256 and ftok.decode(ids) == TEXT


def test_padded_vocab_size_is_the_next_multiple_of_128():
    assert [padded_vocab_size(v) for v in (1, 128, 129, 256, 257, 50257)] == [128, 128, 256, 256, 384, 50304]


# ---- the shipped files -----------------------------------------------------------------------------------------
def shipped(name):
    return os.path.join(DATA, name)


def test_shipped_token_files_decode_back_to_the_shipped_text():
    with open(shipped("shakespeare.txt"), encoding="utf-8", newline="") as f:
        text = f.read()
    tok = load_tokenizer(shipped("byte_tokenizer.bin"))
    assert tok.vocab_size == 256 and tok.eot is None
    assert read_tokenizer(shipped("byte_tokenizer.bin"))[0] == ByteTokenizer().token_table()
    train = read_tokens(shipped("shakespeare_train.bin"), vocab_size=tok.vocab_size)
    val = read_tokens(shipped("shakespeare_val.bin"), vocab_size=tok.vocab_size)
    assert tok.decode(train) + tok.decode(val) == text
    assert tok.decode(train).startswith("HAMLET, PRINCE OF DENMARK\n")
    assert tok.decode(val).startswith("THE TEMPEST\n\nby William Shakespeare\n")
    assert 0.05 < val.size / (train.size + val.size) < 0.15
    assert "gutenberg" not in text.lower()
    ld = DataLoader(shipped("shakespeare_train.bin"), 4, 64, vocab_size=256)   # the loader takes them as is
    assert ld.num_batches == (train.size - 1) // 256


def test_prepare_reproduces_the_shipped_bin_files(tmp_path):
    spec = importlib.util.spec_from_file_location("prepare", shipped("prepare.py"))
    prepare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prepare)
    shutil.copy(shipped("shakespeare.txt"), tmp_path / "shakespeare.txt")
    assert prepare.main(["--out", str(tmp_path)]) == 0
    for name in ("shakespeare_train.bin", "shakespeare_val.bin", "byte_tokenizer.bin"):
        with open(shipped(name), "rb") as f:
            assert (tmp_path / name).read_bytes() == f.read(), name
