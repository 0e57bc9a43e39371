"""python -m llmz.convert: llm.c model files <-> Hugging Face GPT-2 folders (config.json, generation_config.json,
model.safetensors).

    python -m llmz.convert model.bin --to-hf hf_model/          # then GPT2LMHeadModel.from_pretrained("hf_model")
    python -m llmz.convert hf_model/ --to-llmc model.bin        # fp32 (version 3); --dtype bf16: version 5

What changes between the two (llm.c's dev/eval/export_hf.py does the same mapping):
- names: llm.c's tensors hold all layers (qkvw is (L, 3C, C)); Hugging Face names one tensor a layer,
  transformer.h.{l}.attn.c_attn.weight, ...
- the four weight matrices: llm.c keeps them (out, in), as nn.Linear does; GPT-2's Conv1D keeps (in, out):
  each is transposed on the way.
- wte: llm.c pads it to Vp rows (a multiple of 128; the rows past V are zero and never used); Hugging Face
  has the V real rows. The output head is wte itself (tied) in both: no lm_head.weight is written.
- config.json: n_positions = maxT, layer_norm_epsilon 1e-5 and activation gelu_new (the tanh GELU), as llm.c
  computes; llmz_trained_seq_len keeps the T the model was trained at (llmz.run.model_file's header slot 8), so
  that llm.c -> Hugging Face -> llm.c gives back the same bytes.
- generation_config.json: max_length = that trained T (maxT where the file does not say it), so transformers'
  generate() stops inside the window the model learned (positions past it were never trained: their text is
  noise) unless told max_length or max_new_tokens; llmz.sample's window is the same. --to-llmc ignores it.

safetensors, written and read here without the package: an 8-byte little-endian header length N, N bytes of
JSON ({name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {"format": "pt"}}), then the
tensors' little-endian bytes, back to back. Tensors are F32, or BF16 for a bf16 (version 5) model file;
F32, BF16 and F16 are read, one file or shards listed by model.safetensors.index.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np

from .bf16 import bf16_to_f32, f32_to_bf16
from .config import GPT2Config, padded_vocab
from .errors import LlmzError, UsageError
from .files import atomic_write, check_memory, loads_json, open_regular, read_bytes
from .layout import Layout
from .run.model_file import load_model, model_header, save_llmc
from .run.outputs import make_folders, remove_folders

CONFIG_FILE, WEIGHTS_FILE, INDEX_FILE = "config.json", "model.safetensors", "model.safetensors.index.json"
GENERATION_FILE = "generation_config.json"
# llm.c tensor -> (Hugging Face name, with {l} for the layer; transposed: a Conv1D weight, stored (in, out))
HF_NAMES = {
    "wte": ("transformer.wte.weight", False), "wpe": ("transformer.wpe.weight", False),
    "ln1w": ("transformer.h.{l}.ln_1.weight", False), "ln1b": ("transformer.h.{l}.ln_1.bias", False),
    "qkvw": ("transformer.h.{l}.attn.c_attn.weight", True), "qkvb": ("transformer.h.{l}.attn.c_attn.bias", False),
    "attprojw": ("transformer.h.{l}.attn.c_proj.weight", True),
    "attprojb": ("transformer.h.{l}.attn.c_proj.bias", False),
    "ln2w": ("transformer.h.{l}.ln_2.weight", False), "ln2b": ("transformer.h.{l}.ln_2.bias", False),
    "fcw": ("transformer.h.{l}.mlp.c_fc.weight", True), "fcb": ("transformer.h.{l}.mlp.c_fc.bias", False),
    "fcprojw": ("transformer.h.{l}.mlp.c_proj.weight", True),
    "fcprojb": ("transformer.h.{l}.mlp.c_proj.bias", False),
    "lnfw": ("transformer.ln_f.weight", False), "lnfb": ("transformer.ln_f.bias", False),
}
SAFETENSORS_DTYPES = {"F32": np.dtype("<f4"), "BF16": np.dtype("<u2"), "F16": np.dtype("<f2")}
MAX_HEADER = 100_000_000            # the safetensors format's own bound on the JSON header
# what llm.c computes, as GPT-2's config says it; the rest of config.json is GPT2Config's defaults
SAME_MATH = {"activation_function": ("gelu_new", "gelu_pytorch_tanh"), "layer_norm_epsilon": (1e-5,),
             "scale_attn_weights": (True,), "scale_attn_by_inverse_layer_idx": (False,),
             "tie_word_embeddings": (True,), "add_cross_attention": (False,)}


# ---- safetensors ----------------------------------------------------------------------------------------------
def write_safetensors(path: str, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """{name: (dtype 'F32' | 'BF16', array)} -> one safetensors file, atomically (bf16 as uint16 bits)."""
    header, offset = {}, 0
    for name, (dtype, a) in tensors.items():
        nbytes = a.size * SAFETENSORS_DTYPES[dtype].itemsize
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)                   # the tensors start 8-byte aligned
    parts = [np.array([len(raw)], "<u8"), raw]
    parts += [np.ascontiguousarray(a, SAFETENSORS_DTYPES[dtype]) for dtype, a in tensors.values()]
    atomic_write(path, parts)


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """A safetensors file -> {name: float32 array}, its header checked against the file's size first."""
    f, size = open_regular(path, "safetensors file")
    with f:
        if size < 8:
            raise LlmzError(f"{path}: truncated: {size} bytes, shorter than the 8-byte header length")
        n = int(np.frombuffer(read_bytes(f, 8, path, "safetensors file"), "<u8")[0])
        if n > min(MAX_HEADER, size - 8):
            raise LlmzError(f"{path}: not a safetensors file (a header of {n:,} bytes in a file of {size:,})")
        try:
            header = loads_json(read_bytes(f, n, path, "safetensors file"))
        except ValueError as e:
            raise LlmzError(f"{path}: not a safetensors file (its header is not JSON: {e})") from None
        if not isinstance(header, dict):
            raise LlmzError(f"{path}: not a safetensors file (its header is not a JSON object)")
        header.pop("__metadata__", None)
        check_memory(size, f"{path}: reading these tensors")
        out = {}
        for name, t in header.items():
            out[name] = _read_tensor(f, path, name, t, size - 8 - n, 8 + n)
    return out


def _read_tensor(f, path: str, name: str, t, data_size: int, data_start: int) -> np.ndarray:
    """One tensor of a safetensors file, as float32, after checking its entry against the data's size."""
    if not isinstance(t, dict) or t.get("dtype") not in SAFETENSORS_DTYPES:
        dtype = t.get("dtype") if isinstance(t, dict) else t
        raise LlmzError(f"{path}: tensor {name}: dtype {dtype!r} (this reader takes {', '.join(SAFETENSORS_DTYPES)})")
    dt = SAFETENSORS_DTYPES[t["dtype"]]
    shape, span = t.get("shape"), t.get("data_offsets")
    ok = (isinstance(shape, list) and all(isinstance(s, int) and s >= 0 for s in shape)
          and isinstance(span, list) and len(span) == 2 and all(isinstance(s, int) for s in span)
          and 0 <= span[0] <= span[1] <= data_size and span[1] - span[0] == math.prod(shape) * dt.itemsize)
    if not ok:
        raise LlmzError(f"{path}: tensor {name}: shape {shape} and data_offsets {span} do not fit the "
                        f"{data_size:,} bytes of data")
    f.seek(data_start + span[0])
    a = np.frombuffer(read_bytes(f, span[1] - span[0], path, "safetensors file"), dt).reshape(shape)
    return bf16_to_f32(a) if t["dtype"] == "BF16" else a.astype(np.float32)


# ---- llm.c -> Hugging Face ----------------------------------------------------------------------------------
def hf_config(config: GPT2Config, dtype: str, seq_len: int) -> dict:
    """config.json of a Hugging Face GPT-2 with this shape, computing what llm.c computes."""
    c = config
    eot = c.vocab_size - 1 if c.vocab_size == 50257 else None      # GPT-2's end-of-text, where it is GPT-2's
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": c.vocab_size,
            "n_positions": c.max_seq_len, "n_ctx": c.max_seq_len, "n_embd": c.channels, "n_layer": c.num_layers,
            "n_head": c.num_heads, "n_inner": None, "activation_function": "gelu_new",
            "layer_norm_epsilon": 1e-5, "initializer_range": 0.02, "resid_pdrop": 0.1, "embd_pdrop": 0.1,
            "attn_pdrop": 0.1, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False, "tie_word_embeddings": True, "bos_token_id": eot,
            "eos_token_id": eot, "torch_dtype": {"fp32": "float32", "bf16": "bfloat16"}[dtype],
            "llmz_trained_seq_len": seq_len or None}


def generation_config(config: GPT2Config, seq_len: int) -> dict:
    """generation_config.json: generate() stops at the trained window (seq_len; maxT when 0: not known)."""
    eot = config.vocab_size - 1 if config.vocab_size == 50257 else None
    return {"max_length": seq_len or config.max_seq_len, "bos_token_id": eot, "eos_token_id": eot}


def llmc_tensors(config: GPT2Config, llmc: np.ndarray) -> dict[str, np.ndarray]:
    """llm.c's flat buffer -> {llm.c tensor name: view with its shape (per-layer tensors lead with L)}."""
    out, at = {}, 0
    for name, shape in Layout(config, 1).llmc_order():
        n = int(np.prod(shape))
        out[name] = llmc[at:at + n].reshape(shape)
        at += n
    return out


def to_hf(model_path: str, folder: str, dtype: str | None = None) -> str:
    """An llm.c model file -> a Hugging Face GPT-2 folder; returns the summary line."""
    config, file_dtype, seq_len = model_header(model_path)
    dtype = dtype or file_dtype
    _, llmc = load_model(model_path)
    w = llmc_tensors(config, llmc)
    tag = {"fp32": "F32", "bf16": "BF16"}[dtype]
    tensors = {}
    for name, (hf, transposed) in HF_NAMES.items():
        for layer in range(config.num_layers) if "{l}" in hf else [None]:
            a = w[name] if layer is None else w[name][layer]
            a = a[:config.vocab_size] if name == "wte" else a.T if transposed else a
            tensors[hf.format(l=layer)] = (tag, a if dtype == "fp32" else f32_to_bf16(a))
    texts = [(name, json.dumps(content, indent=2) + "\n") for name, content in
             ((CONFIG_FILE, hf_config(config, dtype, seq_len)), (GENERATION_FILE, generation_config(config, seq_len)))]
    made = make_folders(folder)             # only now: a model refused above leaves no folder behind
    written = []
    try:                                    # the three files, or none (nor a folder this call made)
        write_safetensors(os.path.join(folder, WEIGHTS_FILE), tensors)
        written.append(os.path.join(folder, WEIGHTS_FILE))
        for name, text in texts:
            atomic_write(os.path.join(folder, name), [text.encode()])
            written.append(os.path.join(folder, name))
    except BaseException:
        for path in written:
            os.unlink(path)
        remove_folders(made)
        raise
    window = ("the window it was trained at (model file header slot 8)" if seq_len else
              "maxT: the model file does not say the window it was trained at")
    return (f"{model_path} ({file_dtype}) -> {folder}/{CONFIG_FILE}, {folder}/{GENERATION_FILE}, "
            f"{folder}/{WEIGHTS_FILE} ({tag}, {sum(a.size for _, a in tensors.values()):,} parameters; load with "
            f"transformers.GPT2LMHeadModel.from_pretrained({folder!r}))\n"
            f"note: generation_config.json max_length {seq_len or config.max_seq_len}, {window}: generate() "
            f"stops there unless given max_length or max_new_tokens (positions past it were never trained)")


# ---- Hugging Face -> llm.c ----------------------------------------------------------------------------------
def read_hf_config(folder: str) -> tuple[GPT2Config, int]:
    """(config, trained T or 0) from a Hugging Face GPT-2 folder's config.json, refusing other models and
    settings whose math llm.c does not compute."""
    path = os.path.join(folder, CONFIG_FILE)
    f, size = open_regular(path, "config.json")
    with f:
        try:
            cfg = loads_json(read_bytes(f, size, path, "config.json"))
        except ValueError as e:
            raise LlmzError(f"{path}: not JSON ({e})") from None
    if not isinstance(cfg, dict) or cfg.get("model_type") != "gpt2":
        kind = cfg.get("model_type") if isinstance(cfg, dict) else None
        raise LlmzError(f"{path}: model_type {kind!r}: only GPT-2 ('gpt2') models convert to llm.c's format")
    for key, ok in SAME_MATH.items():
        if key in cfg and cfg[key] not in ok:
            raise LlmzError(f"{path}: {key} {cfg[key]!r}: llm.c computes {ok[0]!r}, this model would change "
                            f"its outputs")
    need = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")
    if any(not isinstance(cfg.get(k), int) or isinstance(cfg.get(k), bool) for k in need):
        raise LlmzError(f"{path}: needs integer {', '.join(need)}")
    C = cfg["n_embd"]
    if cfg.get("n_inner") not in (None, 4 * C):
        raise LlmzError(f"{path}: n_inner {cfg['n_inner']}: llm.c's MLP is 4 x n_embd = {4 * C} wide")
    try:
        config = GPT2Config(max_seq_len=cfg["n_positions"], vocab_size=cfg["vocab_size"],
                            padded_vocab_size=padded_vocab(cfg["vocab_size"]), num_layers=cfg["n_layer"],
                            num_heads=cfg["n_head"], channels=C)
    except ValueError as e:
        raise LlmzError(f"{path}: {e}") from None
    seq_len = cfg.get("llmz_trained_seq_len")
    return config, seq_len if isinstance(seq_len, int) and 0 < seq_len <= config.max_seq_len else 0


def read_hf_weights(folder: str) -> dict[str, np.ndarray]:
    """Every tensor of a Hugging Face folder (model.safetensors, or the shards its index lists), as float32,
    named as GPT2LMHeadModel names them (a GPT2Model's names, without 'transformer.', get it)."""
    index = os.path.join(folder, INDEX_FILE)
    if os.path.exists(os.path.join(folder, WEIGHTS_FILE)) or not os.path.exists(index):
        files = [WEIGHTS_FILE]
    else:
        f, size = open_regular(index, "safetensors index")
        with f:
            try:
                files = sorted(set(loads_json(read_bytes(f, size, index, "safetensors index"))["weight_map"].values()))
            except (ValueError, KeyError, TypeError, AttributeError):
                raise LlmzError(f"{index}: not a safetensors index (no weight_map of file names)") from None
    if not os.path.exists(os.path.join(folder, files[0])) and os.path.exists(os.path.join(folder, "pytorch_model.bin")):
        raise LlmzError(f"{folder}: holds pytorch_model.bin, not {WEIGHTS_FILE}; save it with "
                        f"save_pretrained(..., safe_serialization=True) first")
    out = {}
    for name in files:
        for key, a in read_safetensors(os.path.join(folder, os.path.basename(name))).items():
            out[key if key.startswith(("transformer.", "lm_head.")) else "transformer." + key] = a
    return out


def from_hf(folder: str, out_path: str, dtype: str = "fp32") -> str:
    """A Hugging Face GPT-2 folder -> an llm.c model file (fp32: version 3, bf16: version 5); the summary line."""
    if not os.path.isdir(folder):
        raise LlmzError(f"{folder}: not a folder (a Hugging Face model is a folder with {CONFIG_FILE})")
    config, seq_len = read_hf_config(folder)
    weights = read_hf_weights(folder)
    c = config
    parts = []
    for name, shape in Layout(config, 1).llmc_order():
        hf, transposed = HF_NAMES[name]
        layers = range(c.num_layers) if "{l}" in hf else [None]
        for layer in layers:
            key = hf.format(l=layer)
            want = shape[1:] if layer is not None else (c.vocab_size, c.channels) if name == "wte" else shape
            want = want[::-1] if transposed else want
            a = weights.pop(key, None)
            if a is None:
                raise LlmzError(f"{folder}: has no tensor {key}")
            if a.shape != tuple(want):
                raise LlmzError(f"{folder}: {key} has shape {a.shape}, config.json's GPT-2 needs {tuple(want)}")
            if name == "wte":               # the padded rows, zero
                a = np.concatenate([a, np.zeros((c.padded_vocab_size - c.vocab_size, c.channels), np.float32)])
            parts.append((a.T if transposed else a).ravel())
    head = weights.pop("lm_head.weight", None)
    if head is not None and not np.array_equal(head, parts[0].reshape(c.padded_vocab_size, -1)[:c.vocab_size]):
        raise LlmzError(f"{folder}: lm_head.weight differs from transformer.wte.weight: an untied output head, "
                        f"which llm.c's format (wte is the head) cannot hold")
    # the causal-mask buffers some exports keep (attn.bias, attn.masked_bias) are not parameters
    extra = [k for k in weights if not k.endswith((".attn.bias", ".attn.masked_bias"))]
    if extra:
        raise LlmzError(f"{folder}: tensor {extra[0]} is not part of GPT-2 ({len(extra)} such)")
    llmc = np.concatenate(parts)
    bad = int(np.count_nonzero(~np.isfinite(llmc)))
    if bad:
        raise LlmzError(f"{folder}: {bad:,} parameters are NaN or infinite; nothing written")
    made = make_folders(os.path.dirname(os.path.abspath(out_path)))
    try:
        save_llmc(out_path, config, llmc, dtype, seq_len)
    except BaseException:
        remove_folders(made)
        raise
    return (f"{folder} -> {out_path} (llm.c {dtype}, version {3 if dtype == 'fp32' else 5}: L={c.num_layers} "
            f"NH={c.num_heads} C={c.channels} V={c.vocab_size} maxT={c.max_seq_len}"
            + (f", trained at T={seq_len}" if seq_len else "") + ")")


def build_parser() -> argparse.ArgumentParser:
    from .args import Parser
    p = Parser(prog="python -m llmz.convert", description=__doc__.splitlines()[0])
    a = p.add_argument
    a("source", metavar="MODEL.bin|DIR", help="an llm.c model file (fp32 or bf16) with --to-hf; a Hugging Face "
      "GPT-2 folder with --to-llmc")
    to = p.add_mutually_exclusive_group(required=True)
    to.add_argument("--to-hf", metavar="DIR", help="write a Hugging Face GPT-2 folder: config.json, "
                    "generation_config.json (max_length: the trained window) and model.safetensors (the folder "
                    "is created; files of those names in it are replaced)")
    to.add_argument("--to-llmc", metavar="OUT.bin", help="write an llm.c model file")
    a("--dtype", choices=("fp32", "bf16"), default=None, help="the output's precision (default: fp32 for "
      "--to-llmc, the model file's own for --to-hf); bf16 rounds to nearest, fp32 widens bf16 exactly")
    return p


def main(argv=None) -> int:
    from .run.outputs import prepare_folder, prepare_output
    try:
        args = build_parser().parse_args(argv)
        try:
            # the source first (a bad one leaves no output folder behind), then the output
            if args.to_hf:
                model_header(args.source)
                prepare_folder(args.to_hf, "--to-hf", create=False)     # made when the files are written
            else:
                if not os.path.isdir(args.source):
                    raise LlmzError(f"{args.source}: not a folder; --to-llmc reads a Hugging Face GPT-2 folder "
                                    f"(config.json, model.safetensors)")
                read_hf_config(args.source)
                prepare_output(args.to_llmc, "--to-llmc", create=False)
        except LlmzError as e:
            raise UsageError(str(e)) from None
        line = (to_hf(args.source, args.to_hf, args.dtype) if args.to_hf
                else from_hf(args.source, args.to_llmc, args.dtype or "fp32"))
    except LlmzError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
