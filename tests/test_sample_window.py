"""The T a model was trained at travels with it (header slot 8 of the llm.c model file, which llm.c neither
reads nor writes) and is the window llmz.sample samples with by default, saying so in its first line."""
import subprocess
import sys

import numpy as np
import pytest

from llmz.config import preset
from llmz.layout import Layout, init_parameters
from llmz.run.model_file import TRAINED_SEQ_LEN_SLOT, load_model, model_header, save_model
from llmz.sample import UNKNOWN_WINDOW_MAX, window
from mpirun import REPO

CFG = preset("tiny", vocab_size=256, max_seq_len=512)


def sample(model, *flags):
    return subprocess.run([sys.executable, "-m", "llmz.sample", "--init-from", str(model), "--device", "cpu",
                           "--tokens", "3", "--prompt", "ab", *map(str, flags)], cwd=REPO, capture_output=True,
                          text=True, check=False, timeout=120)


def write_model(path, rng, seq_len=0):
    layout = Layout(CFG, 1)
    flat = init_parameters(layout, int(rng.integers(2**31)))
    save_model(str(path), CFG, flat, layout, seq_len=seq_len)
    return flat


def test_the_trained_length_is_header_slot_8_and_llmc_reads_the_rest_unchanged(tmp_path, rng):
    flat = write_model(tmp_path / "m.bin", rng, seq_len=48)
    header = np.fromfile(tmp_path / "m.bin", "<i4", count=256)
    c = CFG
    # slots 0..7 are llm.c's, as its readers (train_gpt2.c/.cu, export_hf.py) read them; 9..255 stay zero
    assert header[:8].tolist() == [20240326, 3, c.max_seq_len, c.vocab_size, c.num_layers, c.num_heads,
                                   c.channels, c.padded_vocab_size]
    assert header[TRAINED_SEQ_LEN_SLOT] == 48 and not header[9:].any()
    assert model_header(str(tmp_path / "m.bin")) == (CFG, "fp32", 48)
    cfg, llmc = load_model(str(tmp_path / "m.bin"))
    assert cfg == CFG and np.array_equal(llmc, Layout(CFG, 1).to_llmc(flat).astype(np.float32))


@pytest.mark.parametrize("junk", [-5, 513, 2**31 - 1])
def test_a_slot_8_no_llmz_run_can_write_means_not_known(tmp_path, rng, junk):
    write_model(tmp_path / "m.bin", rng, seq_len=48)
    raw = bytearray((tmp_path / "m.bin").read_bytes())
    raw[4 * TRAINED_SEQ_LEN_SLOT:4 * TRAINED_SEQ_LEN_SLOT + 4] = np.int32(junk).tobytes()
    (tmp_path / "m.bin").write_bytes(bytes(raw))
    assert model_header(str(tmp_path / "m.bin"))[2] == 0


def test_save_model_refuses_a_trained_length_beyond_maxT(tmp_path):
    from llmz.errors import LlmzError
    layout = Layout(CFG, 1)
    with pytest.raises(LlmzError, match="outside 0..maxT=512"):
        save_model(str(tmp_path / "m.bin"), CFG, np.zeros(layout.total), layout, seq_len=513)
    assert not (tmp_path / "m.bin").exists()


def test_the_window_is_the_flag_else_the_trained_length_else_maxT_up_to_256():
    assert window(None, 1024, 64) == (64, "the length the model was trained at")
    assert window(32, 1024, 64)[0] == 32
    assert "never trained" in window(128, 1024, 64)[1] and "never trained" not in window(32, 1024, 64)[1]
    T, why = window(None, 1024, 0)
    assert T == UNKNOWN_WINDOW_MAX and "does not say" in why and "--seq-len" in why
    assert window(None, 100, 0)[0] == 100


def test_sample_states_its_window_first_and_seq_len_overrides_it(tmp_path, rng):
    write_model(tmp_path / "m.bin", rng, seq_len=24)
    p = sample(tmp_path / "m.bin")
    assert p.returncode == 0, p.stderr
    assert p.stderr.splitlines()[0] == "note: sampling with a window of T=24, the length the model was trained at"
    assert p.stdout.startswith("ab")
    p = sample(tmp_path / "m.bin", "--seq-len", 8)
    assert p.returncode == 0, p.stderr
    assert p.stderr.splitlines()[0] == "note: sampling with a window of T=8, as --seq-len asks"
    write_model(tmp_path / "old.bin", rng)                 # an llm.c file: slot 8 is zero
    p = sample(tmp_path / "old.bin")
    assert p.returncode == 0, p.stderr
    assert p.stderr.splitlines()[0].startswith(f"note: sampling with a window of T={UNKNOWN_WINDOW_MAX}, the model "
                                               f"file does not say")


def test_train_save_and_checkpoint_record_the_trained_length(tmp_path):
    p = subprocess.run([sys.executable, "-m", "llmz.train", "--device", "cpu", "--model", "tiny", "-b", "2",
                        "-t", "12", "--steps", "1", "--val-every", "0", "--sample-tokens", "0", "--quiet",
                        "--save", str(tmp_path / "m.bin"), "--checkpoint-dir", str(tmp_path / "ck")],
                       cwd=REPO, capture_output=True, text=True, check=False, timeout=300)
    assert p.returncode == 0, p.stderr
    assert model_header(str(tmp_path / "m.bin"))[2] == 12
    assert model_header(str(tmp_path / "ck" / "step_000001" / "model.bin"))[2] == 12
