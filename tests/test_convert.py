"""python -m llmz.convert: llm.c model file -> Hugging Face GPT-2 folder -> llm.c model file gives back the same
bytes (fp32 and bf16); the folder is what transformers loads, and its logits are llmz's forward (where
transformers and torch are installed); every bad input is one line and status 2."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from llmz import convert
from llmz.config import preset
from llmz.layout import Layout, init_parameters
from llmz.run.model_file import load_model, model_header, save_model
from mpirun import REPO

# V = 100 is not a multiple of 128: wte has 28 padded rows in the llm.c file and none in the folder
CFG = preset("tiny", vocab_size=100, max_seq_len=32)


def run(*args):
    return subprocess.run([sys.executable, "-m", "llmz.convert", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, check=False, timeout=120)


def model_file(path, rng, dtype="fp32", seq_len=16):
    """A model file of random parameters (every tensor distinct, so a transposed or swapped tensor shows)."""
    layout = Layout(CFG, 1)
    flat = init_parameters(layout, 0)
    flat += rng.normal(0, 0.1, flat.shape) * (flat != 0)          # biases and norms stay, weights move
    for v in layout.views(flat)[1:-1]:
        for name in ("ln1b", "qkvb", "attprojb", "ln2b", "fcb", "fcprojb"):
            v[name][...] = rng.normal(0, 0.1, v[name].shape)
    save_model(str(path), CFG, flat, layout, dtype=dtype, seq_len=seq_len)
    return path


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_llmc_to_hf_to_llmc_gives_back_the_same_bytes(tmp_path, rng, dtype):
    src = model_file(tmp_path / "m.bin", rng, dtype)
    p = run(src, "--to-hf", tmp_path / "hf")
    assert p.returncode == 0, p.stderr
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "generation_config.json", "model.safetensors"]
    p = run(tmp_path / "hf", "--to-llmc", tmp_path / "back.bin", *(["--dtype", "bf16"] if dtype == "bf16" else []))
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "back.bin").read_bytes() == src.read_bytes()
    assert model_header(str(tmp_path / "back.bin")) == (CFG, dtype, 16)


def test_the_folder_holds_hugging_face_names_shapes_and_config(tmp_path, rng):
    src = model_file(tmp_path / "m.bin", rng)
    convert.to_hf(str(src), str(tmp_path / "hf"))
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert {k: cfg[k] for k in ("model_type", "vocab_size", "n_positions", "n_embd", "n_layer", "n_head",
                                "layer_norm_epsilon", "activation_function", "tie_word_embeddings")} == {
        "model_type": "gpt2", "vocab_size": 100, "n_positions": 32, "n_embd": CFG.channels,
        "n_layer": CFG.num_layers, "n_head": CFG.num_heads, "layer_norm_epsilon": 1e-5,
        "activation_function": "gelu_new", "tie_word_embeddings": True}
    w = convert.read_safetensors(str(tmp_path / "hf" / "model.safetensors"))
    _, llmc = load_model(str(src))
    t = convert.llmc_tensors(CFG, llmc)
    C = CFG.channels
    assert "lm_head.weight" not in w and len(w) == 4 + 12 * CFG.num_layers
    assert np.array_equal(w["transformer.wte.weight"], t["wte"][:100])           # padded rows dropped
    assert w["transformer.h.1.attn.c_attn.weight"].shape == (C, 3 * C)           # Conv1D: (in, out)
    assert np.array_equal(w["transformer.h.1.attn.c_attn.weight"], t["qkvw"][1].T)
    assert np.array_equal(w["transformer.h.0.mlp.c_proj.weight"], t["fcprojw"][0].T)
    assert np.array_equal(w["transformer.h.1.ln_2.bias"], t["ln2b"][1])


@pytest.mark.parametrize("seq_len, window", [(16, 16), (0, 32)])
def test_generate_stops_at_the_trained_window_and_says_so(tmp_path, rng, seq_len, window):
    """generation_config.json's max_length is the T the model was trained at (maxT where the file does not
    say it): transformers' generate() reads it, and stops there unless told otherwise."""
    src = model_file(tmp_path / "m.bin", rng, seq_len=seq_len)
    p = run(src, "--to-hf", tmp_path / "hf")
    assert p.returncode == 0, p.stderr
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text()) == {
        "max_length": window, "bos_token_id": None, "eos_token_id": None}
    note = p.stdout.strip().splitlines()[-1]
    assert note.startswith(f"note: generation_config.json max_length {window}, "), p.stdout
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    model = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf"))
    out = model.generate(torch.tensor([[1, 2, 3]]), do_sample=False, pad_token_id=0)
    assert out.shape[1] == window


def test_safetensors_layout_is_length_json_then_aligned_data(tmp_path, rng):
    a, b = rng.normal(size=(3, 5)).astype(np.float32), rng.integers(0, 2**16, 7).astype(np.uint16)
    convert.write_safetensors(str(tmp_path / "t.safetensors"), {"a": ("F32", a), "b": ("BF16", b)})
    raw = (tmp_path / "t.safetensors").read_bytes()
    n = int(np.frombuffer(raw[:8], "<u8")[0])
    header = json.loads(raw[8:8 + n])
    assert (8 + n) % 8 == 0 and header["__metadata__"] == {"format": "pt"}
    assert header["a"] == {"dtype": "F32", "shape": [3, 5], "data_offsets": [0, 60]}
    assert header["b"] == {"dtype": "BF16", "shape": [7], "data_offsets": [60, 74]}
    assert len(raw) == 8 + n + 74 and raw[8 + n:8 + n + 60] == a.tobytes()


def hf_folder(tmp_path, rng):
    src = model_file(tmp_path / "m.bin", rng)
    convert.to_hf(str(src), str(tmp_path / "hf"))
    return tmp_path / "hf"


def edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def edit_weights(folder, fn):
    path = str(folder / "model.safetensors")
    w = convert.read_safetensors(path)
    fn(w)
    convert.write_safetensors(path, {k: ("F32", v) for k, v in w.items()})


def corrupt_header(folder):
    raw = bytearray((folder / "model.safetensors").read_bytes())
    raw[0:8] = np.array([10**12], "<u8").tobytes()
    (folder / "model.safetensors").write_bytes(bytes(raw))


def nested_header(folder):
    deep = b"[" * 100_000 + b"]" * 100_000                      # deeper than Python's JSON reader goes
    (folder / "model.safetensors").write_bytes(np.array([len(deep)], "<u8").tobytes() + deep)


def wrapping_shape(folder):
    """A tensor whose shape's product is 2^64: 0 in int64 arithmetic, as its data_offsets [0, 0] claim."""
    head = json.dumps({"transformer.wte.weight": {"dtype": "F32", "shape": [2**32, 2**32], "data_offsets": [0, 0]}})
    (folder / "model.safetensors").write_bytes(np.array([len(head)], "<u8").tobytes() + head.encode())


def truncate(folder):
    raw = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(raw[:-100])


BAD_FOLDERS = {
    "not gpt2": (lambda d: edit_config(d, model_type="llama"), "model_type 'llama': only GPT-2"),
    "relu": (lambda d: edit_config(d, activation_function="relu"), "activation_function 'relu'"),
    "eps": (lambda d: edit_config(d, layer_norm_epsilon=1e-6), "layer_norm_epsilon 1e-06"),
    "no config": (lambda d: os.unlink(d / "config.json"), "config.json: no such config.json"),
    "missing tensor": (lambda d: edit_weights(d, lambda w: w.pop("transformer.h.1.ln_1.bias")),
                       "has no tensor transformer.h.1.ln_1.bias"),
    "wrong shape": (lambda d: edit_weights(d, lambda w: w.update({"transformer.h.0.attn.c_attn.weight":
                                                                   w["transformer.h.0.attn.c_attn.weight"].T})),
                    "transformer.h.0.attn.c_attn.weight has shape"),
    "untied head": (lambda d: edit_weights(d, lambda w: w.update({"lm_head.weight": w["transformer.wte.weight"] + 1})),
                    "an untied output head"),
    "extra tensor": (lambda d: edit_weights(d, lambda w: w.update({"transformer.h.9.mlp.c_fc.weight": np.ones(2)})),
                     "tensor transformer.h.9.mlp.c_fc.weight is not part of GPT-2"),
    "nan": (lambda d: edit_weights(d, lambda w: w["transformer.ln_f.bias"].__setitem__(0, np.nan)),
            "NaN or infinite"),
    "bad header": (corrupt_header, "not a safetensors file"),
    "header nested 100,000 deep": (nested_header, "not a safetensors file (its header is not JSON: nested too deeply"),
    "config nested 100,000 deep": (lambda d: (d / "config.json").write_text("[" * 100_000 + "]" * 100_000),
                                   "config.json: not JSON (nested too deeply"),
    "shape product wraps to 0": (wrapping_shape, "shape [4294967296, 4294967296] and data_offsets [0, 0] do not fit"),
    "truncated": (truncate, "do not fit the"),
}


@pytest.mark.parametrize("case", BAD_FOLDERS)
def test_a_bad_folder_is_one_line_and_writes_nothing(tmp_path, rng, case):
    damage, message = BAD_FOLDERS[case]
    folder = hf_folder(tmp_path, rng)
    damage(folder)
    p = run(folder, "--to-llmc", tmp_path / "new" / "out.bin")
    assert p.returncode in (1, 2) and p.stderr.count("\n") == 1 and message in p.stderr, p.stderr
    assert not (tmp_path / "new").exists()                     # not even the folder it would have made


def test_bad_command_lines_and_sources_are_refused_at_start_with_status_2(tmp_path, rng):
    src = model_file(tmp_path / "m.bin", rng)
    (tmp_path / "junk.bin").write_bytes(b"\0" * 2000)
    for args, message in ((["--to-hf", tmp_path / "h"], "required"),
                          ([src], "one of the arguments --to-hf --to-llmc is required"),
                          ([tmp_path / "junk.bin", "--to-hf", tmp_path / "h"], "bad magic"),
                          ([src, "--to-llmc", tmp_path / "o.bin"], "not a folder"),
                          ([src, "--to-hf", src], "exists and is not a folder"),
                          ([tmp_path, "--to-llmc", tmp_path / "o.bin"], "no such config.json")):
        p = run(*args)
        assert p.returncode == 2 and p.stderr.count("\n") == 1 and message in p.stderr, (args, p.stderr)
    assert not (tmp_path / "h").exists() and not (tmp_path / "o.bin").exists()


def test_a_model_refused_while_converting_leaves_no_output_folder(tmp_path, rng):
    src = model_file(tmp_path / "m.bin", rng)
    raw = bytearray(src.read_bytes())
    raw[-4:] = np.float32(np.nan).tobytes()                     # found only when the parameters are read
    (tmp_path / "nan.bin").write_bytes(bytes(raw))
    p = run(tmp_path / "nan.bin", "--to-hf", tmp_path / "out" / "hf")
    assert p.returncode != 0 and p.stderr.count("\n") == 1 and "NaN or infinite" in p.stderr, p.stderr
    assert sorted(os.listdir(tmp_path)) == ["m.bin", "nan.bin"]


def test_a_gpt2model_folder_without_the_transformer_prefix_and_with_mask_buffers_reads(tmp_path, rng):
    folder = hf_folder(tmp_path, rng)
    w = convert.read_safetensors(str(folder / "model.safetensors"))
    plain = {k.removeprefix("transformer."): ("F32", v) for k, v in w.items()}
    plain["h.0.attn.bias"] = ("F32", np.tril(np.ones((1, 1, 32, 32), np.float32)))
    convert.write_safetensors(str(folder / "model.safetensors"), plain)
    p = run(folder, "--to-llmc", tmp_path / "back.bin")
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "back.bin").read_bytes() == (tmp_path / "m.bin").read_bytes()


def have_transformers() -> bool:
    try:
        import torch
        import transformers
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not have_transformers(), reason="needs transformers and torch (the GPU machine has them)")
def test_transformers_loads_the_folder_and_its_logits_are_llmz_forward(tmp_path, rng):
    import torch
    from transformers import GPT2LMHeadModel

    from llmz.device import Device
    from llmz.model import GPT2, FullParams
    from llmz.run.model_file import load_model_flat
    src = model_file(tmp_path / "m.bin", rng)
    convert.to_hf(str(src), str(tmp_path / "hf"))
    hf, info = GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf"), output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()     # tied
    hf.eval()
    cfg, layout, flat = load_model_flat(str(src))
    x = rng.integers(0, cfg.vocab_size, (2, cfg.max_seq_len)).astype(np.int32)
    model = GPT2(cfg, Device("cpu", np.float32), 2, cfg.max_seq_len)
    model.forward(FullParams(layout, flat), x)
    ours = np.asarray(model.acts.logits)[..., :cfg.vocab_size]
    with torch.no_grad():
        theirs = hf(torch.tensor(x, dtype=torch.long)).logits.float().numpy()
    # the same fp32 math summed in other orders: a few fp32 roundings of the largest logit (eps 1.2e-7 x 10^2)
    assert np.abs(ours - theirs).max() <= 1e-5 * max(1.0, np.abs(ours).max()), np.abs(ours - theirs).max()
