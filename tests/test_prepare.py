"""python -m llmz.prepare: text files -> llm.c train/val token files and a tokenizer file that decode back to
the text, with the validation share held out at a line start; every bad input refused in one line with
status 2 before anything is written; the files train."""
import os
import subprocess
import sys

import numpy as np
import pytest

from llmz import prepare
from llmz.data import read_tokens
from llmz.tokenizer import ByteTokenizer, load_tokenizer, read_tokenizer
from mpirun import REPO

WORDS = ["to", "be", "or", "not", "thee", "thou", "hath", "naïve", "über", "—", "«»", "日本"]


def random_text(rng, lines: int) -> str:
    """Lines of random words, non-ASCII among them (multi-byte UTF-8 characters)."""
    return "".join(" ".join(rng.choice(WORDS, rng.integers(1, 9))) + "\n" for _ in range(lines))


def run(*args, cwd):
    return subprocess.run([sys.executable, "-m", "llmz.prepare", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, check=False, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_files_decode_back_to_the_text_with_the_last_share_held_out_at_a_line_start(tmp_path, rng):
    texts = [random_text(rng, int(rng.integers(50, 200))) for _ in range(3)]
    for i, t in enumerate(texts):
        (tmp_path / f"{i}.txt").write_text(t, encoding="utf-8")
    p = run("0.txt", "1.txt", "2.txt", "-o", "out/mine", "--val-share", 0.2, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("\n") == 1 and "out/mine_train.bin" in p.stdout and "held out" in p.stdout
    tok = load_tokenizer(str(tmp_path / "out" / "mine_tokenizer.bin"))
    assert tok.token_table() == ByteTokenizer().token_table() and read_tokenizer(str(tmp_path / "out" / "mine_tokenizer.bin"))[1] is None
    train = tok.decode(read_tokens(str(tmp_path / "out" / "mine_train.bin")))
    val = tok.decode(read_tokens(str(tmp_path / "out" / "mine_val.bin")))
    # documents joined by one blank line (each already ends in a newline), cut at a line start
    assert train + val == "\n".join(texts)
    assert train.endswith("\n") and not val.startswith("\n")
    share = len(val) / len(train + val)
    assert 0.2 - 0.05 < share < 0.2 + 0.05, share                 # one line's length off the exact share at most


def test_val_share_zero_writes_no_val_file_and_every_token_is_train(tmp_path, rng):
    text = random_text(rng, 30).rstrip("\n")                       # no newline at the end: still all train
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    p = run("a.txt", "--val-share", 0, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "a_tokenizer.bin", "a_train.bin"]
    assert ByteTokenizer().decode(read_tokens(str(tmp_path / "a_train.bin"))) == text
    assert "--val-data ''" in p.stdout


def test_a_cut_at_a_document_boundary_loses_no_byte_and_val_starts_on_text(tmp_path):
    # two documents of 4 bytes: joined "abc\n\ndef\n" (9 bytes), --val-share 0.5 cuts at byte 4, the blank
    # line between them; the byte files together are the joined text, val starts on "def"
    for i, t in enumerate(("abc\n", "def\n")):
        (tmp_path / f"{i}.txt").write_text(t, encoding="utf-8")
    p = run("0.txt", "1.txt", "-o", "m", "--val-share", 0.5, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    train, val = (ByteTokenizer().decode(read_tokens(str(tmp_path / f"m_{part}.bin"))) for part in ("train", "val"))
    assert (train, val) == ("abc\n\n", "def\n")


def test_split_moves_the_cut_back_to_a_document_start_within_reach():
    train, val = prepare.split_documents(["abc\n", "defghijk"], 0.5)
    assert (train, val) == (["abc\n"], ["defghijk"])
    train, val = prepare.split_documents(["x" * 5000], 0.5)         # no line start in reach: the exact cut
    assert len(train[0]) == 2500 and len(val[0]) == 2500


def test_gpt2_documents_each_open_with_end_of_text_and_specials_stay_text(tmp_path):
    tok = pytest.importorskip("llmz.tokenizer").Gpt2Tokenizer
    pytest.importorskip("tiktoken")
    try:
        tok = tok()
    except Exception as e:
        pytest.skip(str(e))
    ids = prepare.encode_documents(tok, ["hello<|endoftext|>", "world"])
    assert ids[0] == tok.eot and list(ids).count(tok.eot) == 2
    assert tok.decode(ids) == "<|endoftext|>hello<|endoftext|><|endoftext|>world"


BAD = {
    "missing": (["nope.txt"], "nope.txt: no such text file"),
    "folder": (["sub"], "sub: is a folder"),
    "fifo": (["fifo.txt"], "fifo.txt: is a FIFO"),
    "empty": (["empty.txt"], "empty.txt: is empty"),
    "blank": (["blank.txt"], "blank.txt: holds only white space"),
    "latin1": (["latin.txt"], "latin.txt: not UTF-8 text (byte 3 is 0xe9)"),
    "share 1": (["good.txt", "--val-share", "1"], "--val-share 1.0: must be at least 0 and below 1"),
    "share -0.1": (["good.txt", "--val-share", "-0.1"], "must be at least 0 and below 1"),
    "share nan": (["good.txt", "--val-share", "nan"], "must be at least 0 and below 1"),
    "too short": (["tiny.txt", "--val-share", "0.5"], "too short for a"),
    "output is a folder": (["good.txt", "-o", "taken"], "-o taken_train.bin: is a folder"),
    "output under a file": (["good.txt", "-o", "good.txt/x"], "cannot create the folder"),
    "no prefix": (["good.txt", "-o", "out/"], "name a file prefix"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line_status_2_and_nothing_written(tmp_path, case):
    args, message = BAD[case]
    (tmp_path / "sub").mkdir()
    (tmp_path / "taken_train.bin").mkdir()
    os.mkfifo(tmp_path / "fifo.txt")
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "blank.txt").write_bytes(b" \n\t\n")
    (tmp_path / "latin.txt").write_bytes("café\n".encode("latin-1"))
    (tmp_path / "good.txt").write_text("a line\nanother line\n", encoding="utf-8")
    (tmp_path / "tiny.txt").write_text("ab", encoding="utf-8")
    before = sorted(os.listdir(tmp_path))
    p = run(*args, cwd=tmp_path)
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert p.stderr.count("\n") == 1 and p.stderr.startswith("error: ") and message in p.stderr, p.stderr
    assert p.stdout == ""
    assert sorted(os.listdir(tmp_path)) == before


def test_a_prefix_whose_longest_file_name_just_fits_works_and_leaves_nothing_else(tmp_path):
    from llmz.files import name_limits
    (tmp_path / "good.txt").write_text("a line\nanother line\n" * 20, encoding="utf-8")
    prefix = "p" * (name_limits(str(tmp_path))[0] - len("_tokenizer.bin"))     # 241 where names take 255 bytes
    p = run("good.txt", "-o", prefix, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert sorted(os.listdir(tmp_path)) == sorted(["good.txt"] + [f"{prefix}_{part}.bin" for part in
                                                                 ("train", "val", "tokenizer")])


def test_a_write_failing_midway_leaves_no_file_of_the_set(tmp_path, rng, monkeypatch):
    from llmz.errors import LlmzError
    real = prepare.write_tokenizer

    def full_disk(path, table, eot):
        raise LlmzError(f"{path}: cannot write (No space left on device)")
    monkeypatch.setattr(prepare, "write_tokenizer", full_disk)
    ids = np.arange(100, dtype=np.uint16)
    with pytest.raises(LlmzError, match="No space left"):
        prepare.write_dataset({str(tmp_path / "x_train.bin"): ids, str(tmp_path / "x_val.bin"): ids},
                              str(tmp_path / "x_tokenizer.bin"), ByteTokenizer())
    assert os.listdir(tmp_path) == []
    monkeypatch.setattr(prepare, "write_tokenizer", real)


def test_prepared_files_train_and_sample_as_the_readme_shows(tmp_path, rng):
    """README's own-text commands in order: prepare, train (its run folder under runs/), then sample from
    runs/latest/model.bin with the tokenizer file prepare wrote (the byte vocabulary: it encodes a prompt)."""
    (tmp_path / "my.txt").write_text(random_text(rng, 400), encoding="utf-8")
    p = run("my.txt", "-o", "data/mine", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    env = {**os.environ, "PYTHONPATH": str(REPO), "LLMZ_RUNS": ""}            # runs/ here, as for a user
    t = subprocess.run([sys.executable, "-m", "llmz.train", "--train-data", "data/mine_train.bin", "--val-data",
                        "data/mine_val.bin", "--tokenizer", "data/mine_tokenizer.bin", "--device", "cpu",
                        "--model", "tiny", "-b", "2", "-t", "16", "--steps", "2", "--sample-tokens", "16", "--quiet"],
                       cwd=tmp_path, capture_output=True, text=True, check=False, timeout=300, env=env)
    assert t.returncode == 0, t.stderr
    assert "val loss" in t.stdout and "--- sample ---" in t.stdout
    assert t.stdout.strip().splitlines()[-1].startswith("run folder runs/001: model.bin, log.jsonl")
    s = subprocess.run([sys.executable, "-m", "llmz.sample", "--init-from", "runs/latest/model.bin", "--tokenizer",
                        "data/mine_tokenizer.bin", "--prompt", "The ", "--tokens", "8", "--device", "cpu"],
                       cwd=tmp_path, capture_output=True, text=True, check=False, timeout=300, env=env)
    assert s.returncode == 0, s.stderr
    assert s.stdout.startswith("The "), s.stdout


def test_the_byte_tokenizer_has_one_name_and_takes_the_other_spelling(tmp_path, rng):
    (tmp_path / "a.txt").write_text(random_text(rng, 40), encoding="utf-8")
    one = run("a.txt", "-o", "one", cwd=tmp_path)
    other = run("a.txt", "-o", "two", "--tokenizer", "bytes", cwd=tmp_path)
    assert one.returncode == other.returncode == 0, one.stderr + other.stderr
    assert "(byte, 256 tokens)" in one.stdout and "(byte, 256 tokens)" in other.stdout
    for part in ("train", "val", "tokenizer"):
        assert (tmp_path / f"one_{part}.bin").read_bytes() == (tmp_path / f"two_{part}.bin").read_bytes()
