"""Tokenizers: bytes (vocabulary 256, the shipped data), GPT-2's BPE (through tiktoken), and llm.c tokenizer
files, which store every token's bytes so ids can be decoded without the BPE merges.

Tokenizer file: a header of 256 uint32 ([0]=20240328 magic, [1]=version 1 or 2, [2]=vocab size,
[3]=end-of-text token, version 2 only), then per token a uint8 length (1..255) and that many bytes.

All tokenizers share: `vocab_size`, `eot` (the end-of-text id, or None), `encode(str) -> uint16 array`,
`decode(ids) -> str` (invalid UTF-8 becomes U+FFFD) and `token_table() -> list[bytes]`.
"""
from __future__ import annotations

import codecs
import os

import numpy as np

from .config import padded_vocab
from .errors import LlmzError
from .files import HEADER_BYTES, HEADER_INTS, atomic_write, check_header, read_bytes, read_header

TOKENIZER_MAGIC = 20240328
GPT2_EOT = 50256          # llm.c's rule for version 1 files: they are GPT-2's, eot 50256


def padded_vocab_size(vocab_size: int) -> int:
    """Rows of wte: the vocabulary rounded up to a multiple of 128, as llm.c does."""
    return padded_vocab(vocab_size)


def _decode_bytes(table: list[bytes], ids) -> str:
    """Join the tokens' bytes first, then decode: one character may span two tokens."""
    ids = np.asarray(ids).ravel()
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= len(table)):
        raise LlmzError(f"cannot decode token ids {ids.min()}..{ids.max()} with a vocabulary of {len(table)}")
    return b"".join(table[i] for i in ids.tolist()).decode("utf-8", errors="replace")


def text_bytes(text: str) -> bytes:
    """The bytes a text stands for: UTF-8, with the bytes that were not UTF-8 in a command line given back as
    they came (Python decodes sys.argv with surrogateescape, as os.fsencode encodes it). A character no byte
    sequence stands for (a lone surrogate made in Python) is refused in one line naming it."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError as e:
        raise LlmzError(f"character U+{ord(text[e.start]):04X} at position {e.start} is a lone surrogate: it "
                        f"stands for no text and no bytes") from None


class ByteTokenizer:
    """Each byte is a token (vocab 256): the UTF-8 bytes of a text, or any bytes at all (text_bytes). There
    is no end-of-text token: eot is None (every byte value can occur in text, so none is free to mean
    "document boundary")."""
    name = "byte"
    vocab_size = 256
    eot = None

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text_bytes(text), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids) -> str:
        ids = np.asarray(ids).ravel()
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) > 255):
            raise LlmzError(f"cannot decode token ids {ids.min()}..{ids.max()} as bytes (0..255)")
        return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def token_table(self) -> list[bytes]:
        return [bytes([i]) for i in range(256)]


class Gpt2Tokenizer:
    """GPT-2's BPE (vocab 50257, eot 50256) through tiktoken, which must be installed and able to load
    its 'gpt2' encoding (it downloads it once, then reads its cache)."""
    name = "gpt2"

    def __init__(self):
        try:
            import tiktoken
        except ImportError:
            raise LlmzError("tokenizer 'gpt2' needs the tiktoken package (pip install tiktoken), "
                            "which is not installed") from None
        try:
            self.enc = tiktoken.get_encoding("gpt2")
        except Exception as e:  # noqa: BLE001  (network, cache and version errors all mean the same here)
            first = (str(e).splitlines() or [""])[0]
            first = first if len(first) <= 160 else first[:160] + "..."
            raise LlmzError(f"tokenizer 'gpt2': tiktoken cannot load its 'gpt2' encoding "
                            f"({type(e).__name__}: {first}); it needs internet once, or TIKTOKEN_CACHE_DIR "
                            f"pointing at a cache") from None
        self.vocab_size = self.enc.n_vocab
        self.eot = self.enc.eot_token

    def encode(self, text: str) -> np.ndarray:
        raw = text_bytes(text)
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise LlmzError(f"byte 0x{raw[e.start]:02x} at position {e.start} is not UTF-8: GPT-2's BPE encodes "
                            f"text; the byte tokenizer takes any bytes") from None
        return np.asarray(self.enc.encode(text, allowed_special={"<|endoftext|>"}), dtype=np.uint16)

    def decode(self, ids) -> str:
        ids = np.asarray(ids).ravel()
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise LlmzError(f"cannot decode token ids {ids.min()}..{ids.max()} with GPT-2's {self.vocab_size}")
        return self.enc.decode(ids.tolist(), errors="replace")

    def token_table(self) -> list[bytes]:
        return [self.enc.decode_single_token_bytes(i) for i in range(self.vocab_size)]


class FileTokenizer:
    """Decodes ids through an llm.c tokenizer file. It can encode only when the file is the byte
    vocabulary (token i = byte i); the BPE merges are not in the file."""

    def __init__(self, path: str):
        self.path = path
        self.table, self.eot = read_tokenizer(path)
        self.vocab_size = len(self.table)
        self.name = os.path.basename(path)
        self._bytes = self.table == ByteTokenizer().token_table()

    def encode(self, text: str) -> np.ndarray:
        if not self._bytes:
            raise LlmzError(f"{self.path}: a tokenizer file can only decode (it holds no BPE merges); "
                            f"encode with 'gpt2' or 'byte'")
        return ByteTokenizer().encode(text)

    def decode(self, ids) -> str:
        return _decode_bytes(self.table, ids)

    def token_table(self) -> list[bytes]:
        return list(self.table)


# ---- llm.c tokenizer files ---------------------------------------------------------------------------------
def write_tokenizer(path: str, table: list[bytes], eot_token: int | None) -> None:
    """Write an llm.c tokenizer file atomically: version 2 with its eot token, or version 1 when
    eot_token is None. (llm.c's C reader accepts version 1 only for GPT-2's 50257 tokens.)"""
    if not table:
        raise LlmzError(f"{path}: cannot write an empty vocabulary")
    for i, tok in enumerate(table):
        if not 1 <= len(tok) <= 255:
            raise LlmzError(f"{path}: token {i} is {len(tok)} bytes long; the format holds 1..255")
    if eot_token is not None and not 0 <= eot_token < len(table):
        raise LlmzError(f"{path}: eot token {eot_token} is outside the vocabulary of {len(table)}")
    header = np.zeros(HEADER_INTS, dtype="<u4")
    header[:3] = TOKENIZER_MAGIC, 1 if eot_token is None else 2, len(table)
    if eot_token is not None:
        header[3] = eot_token
    body = b"".join(bytes([len(tok)]) + tok for tok in table)
    atomic_write(path, [header, body])


def read_tokenizer(path: str) -> tuple[list[bytes], int | None]:
    """Read an llm.c tokenizer file -> (token bytes by id, eot token or None).
    Version 1 has no eot field; like llm.c we take 50256 when it holds GPT-2's 50257 tokens, else None."""
    f, raw, size = read_header(path, "tokenizer file")
    with f:
        header = check_header(path, raw, TOKENIZER_MAGIC, "an llm.c tokenizer file", dtype="<u4")
        version, vocab = int(header[1]), int(header[2])
        if version not in (1, 2):
            raise LlmzError(f"{path}: unsupported version {version} (expected 1 or 2)")
        if vocab <= 0:
            raise LlmzError(f"{path}: bad vocab size {vocab} in the header")
        if version == 2:
            eot = int(header[3])
            if eot >= vocab:
                raise LlmzError(f"{path}: eot token {eot} is outside the vocabulary of {vocab}")
        else:
            eot = GPT2_EOT if vocab == GPT2_EOT + 1 else None
        # every token takes 2..256 bytes (a length byte, 1..255 bytes): the size bounds the body before any
        # of it is read
        body = size - HEADER_BYTES
        if body < 2 * vocab:
            raise LlmzError(f"{path}: truncated: {size} bytes cannot hold the {vocab} tokens the header "
                            f"announces (at least {HEADER_BYTES + 2 * vocab})")
        if body > 256 * vocab:
            raise LlmzError(f"{path}: wrong size: {size} bytes, more than {vocab} tokens of at most 255 bytes "
                            f"can fill ({HEADER_BYTES + 256 * vocab})")
        raw = read_bytes(f, body, path, "tokenizer file")
    # the body: per token one length byte, then its bytes (offsets below are within the body)
    table, at = [], 0
    for i in range(vocab):
        n = raw[at] if at < body else None
        if n == 0:
            raise LlmzError(f"{path}: token {i} has length 0 (every token is at least one byte)")
        if n is None or at + 1 + n > body:
            raise LlmzError(f"{path}: truncated: {size} bytes end inside token {i} of {vocab}")
        table.append(raw[at + 1:at + 1 + n])
        at += 1 + n
    if at != body:
        raise LlmzError(f"{path}: wrong size: {size} bytes, the {vocab} tokens end at byte {HEADER_BYTES + at} "
                        f"({body - at} extra bytes)")
    return table, eot


def start_id(tok) -> int:
    """The token a sample without a prompt starts from: end-of-text where the tokenizer has one, else the
    token that is a newline, else 0. Needs no encoding (a tokenizer file only decodes)."""
    if tok.eot is not None:
        return tok.eot
    table = tok.token_table()
    return table.index(b"\n") if b"\n" in table else 0


class TextStream:
    """Ids -> text, one id at a time (printing a sample as it is generated): each token's bytes go through
    one incremental UTF-8 decoder, since a character may span two tokens; the pieces join to decode(ids)."""

    def __init__(self, tok):
        self.table = tok.token_table()
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        return self.decoder.decode(self.table[token])

    def end(self) -> str:
        return self.decoder.decode(b"", final=True)


BYTE_NAMES = ("byte", "bytes")     # one name in every command ('byte'); the other spelling is taken too


def tokenizer_name(name: str) -> str:
    """A --tokenizer value as every command spells it: 'bytes' -> 'byte', anything else as it is."""
    return "byte" if name in BYTE_NAMES else name


def load_tokenizer(path_or_name: str):
    """'byte' (or 'bytes') -> ByteTokenizer, 'gpt2' -> Gpt2Tokenizer (tiktoken), anything else ->
    FileTokenizer(path)."""
    if path_or_name in BYTE_NAMES:
        return ByteTokenizer()
    if path_or_name == "gpt2":
        return Gpt2Tokenizer()
    return FileTokenizer(path_or_name)
