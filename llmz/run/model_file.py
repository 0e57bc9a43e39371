"""llm.c model files: GPT-2's parameters in llm.c's tensor order, in fp32 or bf16.

Model file: a header of 256 int32 ([0]=20240326 magic, [1]=3 for fp32 or 5 for bf16, [2]=max_seq_len,
[3]=vocab_size, [4]=num_layers, [5]=num_heads, [6]=channels, [7]=padded_vocab_size), then every
parameter tensor by tensor in llm.c's order (Layout.llmc_order): wte (Vp, C) with rows >= V zero, wpe,
then each per-layer tensor for all layers together, ..., lnfw, lnfb. Weights are (out, in).

llmz adds one field: [8] = the sequence length T the model was trained at (0: not known). llm.c's readers
(train_gpt2.c, train_gpt2.cu, dev/eval/export_hf.py) read [0]..[7] only and its writers leave [8]..[255]
zero, so the files stay llm.c's. llmz.sample samples with a window of that length by default: positions
past it were never trained.

Models live in memory in llmz's bucket layout (llmz.layout); `Layout.to_llmc` / `Layout.from_llmc`
convert between that and the file's order.
"""
from __future__ import annotations

import numpy as np

from ..bf16 import bf16_to_f32, f32_to_bf16
from ..config import GPT2Config
from ..errors import LlmzError
from ..files import HEADER_BYTES, HEADER_INTS, atomic_write, check_header, check_size, read_array, read_header
from ..layout import Layout

MODEL_MAGIC = 20240326
MODEL_VERSIONS = {3: "fp32", 5: "bf16"}
VERSION_OF = {"fp32": 3, "bf16": 5}
TRAINED_SEQ_LEN_SLOT = 8            # header slot of the trained T (llmz's; llm.c reads [0]..[7] only)


# ---- model files ---------------------------------------------------------------------------------------------
def save_model(path: str, config: GPT2Config, params_flat: np.ndarray, layout: Layout,
               dtype: str = "fp32", seq_len: int = 0) -> None:
    """Write the parameters (a full flat host buffer in `layout`'s bucket order) as an llm.c model file,
    atomically. dtype 'fp32' (version 3) or 'bf16' (version 5, round to nearest even). seq_len: the T the
    model was trained at, recorded in header slot 8 (0: not known)."""
    if layout.config != config:
        raise LlmzError(f"{path}: the layout is for {layout.config}, not {config}")
    params_flat = np.asarray(params_flat)
    if params_flat.shape != (layout.total,):
        raise LlmzError(f"{path}: parameter buffer has shape {params_flat.shape}, the layout needs ({layout.total},)")
    save_llmc(path, config, layout.to_llmc(params_flat), dtype, seq_len)


def save_llmc(path: str, config: GPT2Config, llmc: np.ndarray, dtype: str = "fp32", seq_len: int = 0) -> None:
    """Write parameters already in llm.c's order (a flat buffer of config.num_parameters() values) as an
    llm.c model file, atomically; dtype and seq_len as in save_model."""
    if dtype not in VERSION_OF:
        raise LlmzError(f"{path}: unknown model dtype {dtype!r}; choose fp32 or bf16")
    if not 0 <= seq_len <= config.max_seq_len:
        raise LlmzError(f"{path}: trained sequence length {seq_len} is outside 0..maxT={config.max_seq_len}")
    if llmc.shape != (config.num_parameters(),):
        raise LlmzError(f"{path}: {llmc.shape} parameters, the model needs ({config.num_parameters()},)")
    c = config
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:8] = (MODEL_MAGIC, VERSION_OF[dtype], c.max_seq_len, c.vocab_size, c.num_layers,
                  c.num_heads, c.channels, c.padded_vocab_size)
    header[TRAINED_SEQ_LEN_SLOT] = seq_len
    llmc = np.asarray(llmc, dtype=np.float32)
    body = llmc.astype("<f4") if dtype == "fp32" else f32_to_bf16(llmc).astype("<u2")
    atomic_write(path, [header, body])


def _open_model(path: str):
    """Open a model file and check its header against its size -> (file positioned at the parameters,
    config, version, trained T or 0). Nothing of the payload is read."""
    f, raw, size = read_header(path, "model file")
    try:
        header = check_header(path, raw, MODEL_MAGIC, "an llm.c model file")
        version = int(header[1])
        if version not in MODEL_VERSIONS:
            raise LlmzError(f"{path}: unsupported version {version} (expected 3 = fp32 or 5 = bf16)")
        maxT, V, L, NH, C, Vp = (int(v) for v in header[2:8])
        try:
            config = GPT2Config(max_seq_len=maxT, vocab_size=V, padded_vocab_size=Vp, num_layers=L,
                                num_heads=NH, channels=C)
        except ValueError as e:
            raise LlmzError(f"{path}: bad model header: {e}") from None
        itemsize = 4 if version == 3 else 2
        check_size(path, size, HEADER_BYTES + itemsize * config.num_parameters(),
                   f"a {MODEL_VERSIONS[version]} model with L={L} C={C} NH={NH} V={V} Vp={Vp} maxT={maxT}")
        # a value no llmz run can have written (another tool's use of the slot) means: not known
        seq_len = int(header[TRAINED_SEQ_LEN_SLOT])
        seq_len = seq_len if 0 < seq_len <= maxT else 0
    except BaseException:
        f.close()
        raise
    return f, config, version, seq_len


def model_config(path: str) -> GPT2Config:
    """The config of an llm.c model file, from its header checked against its size (reads no parameter)."""
    return model_header(path)[0]


def model_header(path: str) -> tuple[GPT2Config, str, int]:
    """(config, 'fp32' or 'bf16', the T it was trained at or 0 when the file does not say) of an llm.c model
    file, from its header checked against its size (reads no parameter)."""
    f, config, version, seq_len = _open_model(path)
    f.close()
    return config, MODEL_VERSIONS[version], seq_len


def load_model(path: str) -> tuple[GPT2Config, np.ndarray]:
    """Read an llm.c model file -> (config, parameters as float32 in llm.c's order). Padded wte rows are
    kept as read. Use `Layout(config, world_size).from_llmc(...)` (or load_model_flat) for llmz's layout.
    The header and the size it implies are checked before a byte of the parameters is read; a model with a
    NaN or an infinity anywhere is refused (nothing can be trained or sampled from it)."""
    f, config, version, _ = _open_model(path)
    with f:
        nparams = config.num_parameters()
        if version == 3:
            params = read_array(f, "<f4", nparams, path, "model file").astype(np.float32, copy=False)
        else:
            params = bf16_to_f32(read_array(f, "<u2", nparams, path, "model file"))
    bad = int(np.count_nonzero(~np.isfinite(params)))
    if bad:
        raise LlmzError(f"{path}: {bad:,} of {nparams:,} parameters are NaN or infinite (a diverged model?): "
                        f"nothing to train or sample from")
    return config, params


def load_model_flat(path: str, world_size: int = 1, dtype=np.float32) -> tuple[GPT2Config, Layout, np.ndarray]:
    """load_model, then into llmz's bucket layout for `world_size` ranks: (config, layout, flat buffer)."""
    config, llmc = load_model(path)
    layout = Layout(config, world_size)
    return config, layout, layout.from_llmc(llmc, dtype=dtype)
