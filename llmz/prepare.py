"""python -m llmz.prepare FILE.txt [...] -o PREFIX: your own text -> llm.c token files and a tokenizer file.

    python -m llmz.prepare my.txt -o data/mine     # data/mine_train.bin, data/mine_val.bin, data/mine_tokenizer.bin
    python -m llmz.train --train-data data/mine_train.bin --val-data data/mine_val.bin \\
        --tokenizer data/mine_tokenizer.bin

Each file is one document of UTF-8 text, taken in the order given. The last --val-share of the text (from
the start of a line) is held out for validation. Tokens are bytes by default (one token per UTF-8 byte,
vocabulary 256, as the shipped Shakespeare), with documents joined by a blank line; with --tokenizer gpt2
they are GPT-2's BPE (through tiktoken, where it can load its encoding), each document opening with the
end-of-text token, as llm.c's data scripts do. Every input is checked before anything is written, and the
three files appear together, each whole, or not at all.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from .data import write_tokens
from .errors import LlmzError, UsageError
from .files import fit_name, open_regular, read_bytes
from .run.outputs import prepare_output
from .tokenizer import ByteTokenizer, Gpt2Tokenizer, tokenizer_name, write_tokenizer

LINE_SEARCH = 1000          # characters before the cut searched for a line start


def read_text(path: str) -> str:
    """A file's text: a regular, non-empty file of UTF-8 (a byte-order mark is dropped)."""
    f, size = open_regular(path, "text file")
    with f:
        raw = read_bytes(f, size, path, "text file")
    if not raw.strip():
        raise LlmzError(f"{path}: {'is empty' if not raw else 'holds only white space'}; nothing to train on")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise LlmzError(f"{path}: not UTF-8 text (byte {e.start:,} is {raw[e.start]:#04x}); convert it first, "
                        f"e.g. iconv -f latin1 -t utf-8 {path}") from None


def split_documents(texts: list[str], val_share: float) -> tuple[list[str], list[str]]:
    """(train documents, val documents): val is the last `val_share` of all the characters, its start moved
    back to the start of a line (or of a document) when one lies within LINE_SEARCH characters before the cut,
    and on past blank lines (they stay with train); val_share 0: every document is train."""
    if val_share == 0:
        return list(texts), []
    total = sum(len(t) for t in texts)
    cut = round(total * (1 - val_share))
    for k, t in enumerate(texts):
        if cut <= len(t):
            break
        cut -= len(t)
    line = t.rfind("\n", max(0, cut - LINE_SEARCH), cut)
    at = line + 1 if line >= 0 else 0 if cut <= LINE_SEARCH else cut      # a document starts a line too
    while 0 < at < len(t) and t[at] == "\n":      # blank lines stay with train: val starts on a line of text
        at += 1
    train, val = texts[:k] + [t[:at]], [t[at:]] + texts[k + 1:]
    return [d for d in train if d], [d for d in val if d]


def encode_documents(tok, texts: list[str]) -> np.ndarray:
    """One token stream of the documents: GPT-2's end-of-text before each (special tokens written in the text
    stay text, llm.c's encode_ordinary); bytes: the texts joined by a blank line."""
    if isinstance(tok, Gpt2Tokenizer):
        ids = [[tok.eot] + tok.enc.encode_ordinary(t) for t in texts]
        return np.asarray([i for doc in ids for i in doc], dtype=np.uint16)
    return tok.encode(join_documents(texts))


def join_documents(texts: list[str]) -> str:
    """The texts as one, each starting after a blank line (one newline added where a text already ends in
    one, two where it does not)."""
    joined = texts[0] if texts else ""
    for t in texts[1:]:
        joined += ("\n" if joined.endswith("\n") else "\n\n") + t
    return joined


def write_dataset(token_files: dict[str, np.ndarray], tokenizer_path: str, tok) -> None:
    """Write llm.c token files {path: ids} and the tokenizer file, all or none: each goes whole to a temporary
    name beside its final one (llmz.data.atomic_write), and they take their names only once all are written."""
    writes = [(path, lambda tmp, ids=ids: write_tokens(tmp, ids)) for path, ids in token_files.items()]
    writes.append((tokenizer_path, lambda tmp: write_tokenizer(tmp, tok.token_table(), tok.eot)))
    written = []
    try:
        for path, write in writes:
            tmp = fit_name(path, f".{os.getpid()}.part")     # cut to fit wherever the final name fits
            write(tmp)
            written.append((tmp, path))
        for tmp, path in written:
            os.replace(tmp, path)
    except BaseException as e:
        for tmp, _ in written:
            if os.path.exists(tmp):
                os.unlink(tmp)
        if isinstance(e, OSError):
            raise LlmzError(f"{e.filename or tokenizer_path}: cannot write ({e.strerror or e})") from None
        raise


def build_parser() -> argparse.ArgumentParser:
    from .args import Parser
    p = Parser(prog="python -m llmz.prepare", description=__doc__.splitlines()[0])
    a = p.add_argument
    a("files", nargs="+", metavar="FILE.txt", help="UTF-8 text files, one document each, in this order")
    a("-o", "--out", default=None, metavar="PREFIX", help="writes PREFIX_train.bin, PREFIX_val.bin and "
      "PREFIX_tokenizer.bin; missing folders are created (default: the first file's name without its "
      "extension)")
    a("--tokenizer", type=tokenizer_name, choices=("byte", "gpt2"), default="byte", help="byte: one token per "
      "UTF-8 byte (vocabulary 256; 'bytes' is taken too); gpt2: GPT-2's BPE through tiktoken (vocabulary 50257)")
    a("--val-share", type=float, default=0.1, help="the share of the text, at its end, held out for validation "
      "(0 <= share < 1; 0: no validation file, train with --val-data '')")
    return p


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if not 0 <= args.val_share < 1:                      # NaN fails this too
            raise UsageError(f"--val-share {args.val_share}: must be at least 0 and below 1")
        prefix = args.out if args.out is not None else os.path.splitext(args.files[0])[0]
        if not prefix or os.path.basename(prefix) == "":
            raise UsageError(f"-o {args.out!r}: name a file prefix (PREFIX_train.bin ...), not a folder")
        paths = {part: f"{prefix}_{part}.bin" for part in ("train", "val", "tokenizer")}
        if not args.val_share:
            del paths["val"]
        try:
            texts = [read_text(path) for path in args.files]
            tok = Gpt2Tokenizer() if args.tokenizer == "gpt2" else ByteTokenizer()
            for path in paths.values():
                prepare_output(path, "-o")
            # bytes: the documents are one text (joined by a blank line), so train + val is that text exactly,
            # wherever the cut falls; GPT-2: each document keeps its own end-of-text token
            docs = texts if isinstance(tok, Gpt2Tokenizer) else [join_documents(texts)]
            train_docs, val_docs = split_documents(docs, args.val_share)
            ids = {"train": encode_documents(tok, train_docs), "val": encode_documents(tok, val_docs)}
            for part in sorted(paths.keys() - {"tokenizer"}):
                if ids[part].size < 2:
                    raise LlmzError(f"{', '.join(args.files)}: too short for a {part} file of at least 2 tokens "
                                    f"(--val-share {args.val_share} leaves it {ids[part].size})")
        except LlmzError as e:                               # refused before anything is written
            raise UsageError(str(e)) from None
        write_dataset({paths[p]: ids[p] for p in paths if p != "tokenizer"}, paths["tokenizer"], tok)
    except LlmzError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    print(summary(len(args.files), sum(len(t) for t in texts), ids, paths, tok))
    return 0


def summary(nfiles: int, chars: int, ids: dict, paths: dict, tok) -> str:
    """The line llmz.prepare ends with: what it read, and each file it wrote with its tokens."""
    ntok = ids["train"].size + (ids["val"].size if "val" in paths else 0)
    val = (f", {paths['val']} {ids['val'].size:,} tokens ({ids['val'].size / ntok:.1%} held out)" if "val" in paths
           else " (no validation file: train with --val-data '')")
    return (f"{nfiles} file{'s' if nfiles > 1 else ''}, {chars:,} characters -> {paths['train']} "
            f"{ids['train'].size:,} tokens{val}, {paths['tokenizer']} ({tok.name}, {tok.vocab_size:,} tokens)")


if __name__ == "__main__":
    sys.exit(main())
