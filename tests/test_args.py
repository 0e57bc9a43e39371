"""The one start-up check of every command line (llmz/args.py): a bad flag, or a file a flag names that
cannot serve, is refused at start in one `error:` line with exit status 2, never with a traceback and never
after work it would waste; every flag's --help says its default. A hypothesis fuzz drives llmz.train's
parser and check with random flag values and trains whatever it accepts, to the end, in this process."""
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmz.config import PRESETS, preset
from llmz.data import write_tokens
from llmz.errors import LlmzError, UsageError
from llmz.layout import Layout, init_parameters
from llmz.run.launch import RankInfo
from llmz.run.model_file import save_model
from mpirun import REPO

BASE = ["--device", "cpu", "--model", "tiny", "-b", "2", "-t", "8", "--steps", "2", "--val-batches", "1",
        "--sample-tokens", "4", "--quiet"]


def parse(*argv, base=BASE):
    from llmz.train import parse_args
    return parse_args([*base, *map(str, argv)], kind="cpu")


def test_the_flags_map_one_to_one_onto_the_run_configuration():
    """Every train flag is a TrainConfig field and every field a flag, with the field's default; a
    configuration built in code (the lessons, llmz.bench) equals the one the same flags give."""
    import dataclasses

    from llmz.config import TrainConfig
    from llmz.train import build_parser
    dests = {a.dest for a in build_parser()._actions if a.dest != "help"}
    assert dests == {f.name for f in dataclasses.fields(TrainConfig)}
    assert TrainConfig(**vars(build_parser().parse_args([]))) == TrainConfig()
    cfg, _ = parse("--zero-stage", 2, "--lr", 3e-3, "--precision", "bf16")
    assert cfg == TrainConfig(device="cpu", model="tiny", batch_size=2, seq_len=8, steps=2, val_batches=1,
                              sample_tokens=4, quiet=True, zero_stage=2, lr=3e-3, precision="bf16", print_every=1)


@pytest.mark.parametrize("kind, want", [("cpu", ("small", 16, 64, 1500)), ("gpu", ("d6", 32, 256, 2000))])
def test_a_configuration_gets_its_devices_defaults_and_keeps_what_it_says(kind, want):
    from llmz.config import TrainConfig
    cfg = TrainConfig().for_device(kind)
    assert (cfg.model, cfg.batch_size, cfg.seq_len, cfg.steps) == want
    given = TrainConfig(model="tiny", batch_size=0, seq_len=3, steps=0).for_device(kind)
    assert (given.model, given.batch_size, given.seq_len, given.steps) == ("tiny", 0, 3, 0)   # 0 is refused later
    assert TrainConfig(resume="latest").for_device(kind).model is None       # the checkpoint says which model


@pytest.mark.parametrize("steps, every", [(1, 1), (35, 1), (36, 2), (100, 5), (1500, 50), (2000, 100), (10**5, 5000)])
def test_the_default_progress_interval_prints_about_25_lines_at_round_steps(steps, every):
    from llmz.config import TrainConfig, default_print_every
    assert default_print_every(steps) == every
    assert TrainConfig(steps=steps).for_device("cpu").print_every == every
    assert TrainConfig(steps=steps, print_every=7).for_device("cpu").print_every == 7     # what it says, kept
    assert 16 <= -(-steps // every) <= 40 or steps <= 35


@pytest.mark.parametrize("name", PRESETS)
def test_a_preset_name_is_one_model_in_train_bench_and_the_library(name):
    """--model NAME: the model llmz.train builds with its default (byte) tokenizer is the one llmz.bench times
    and preset(NAME) gives: the vocabulary belongs to the preset (256 for the byte-level presets, GPT-2's for dN)."""
    from llmz.args import check_train_model
    from llmz.bench import build_parser
    from llmz.config import TrainConfig
    trained = check_train_model(TrainConfig(model=name).for_device("cpu"), "cpu")[2]
    args = build_parser().parse_args(["--model", name])
    assert trained == preset(name) == preset(args.model, vocab_size=args.vocab_size)
    assert trained.vocab_size == (50257 if name.startswith("d") else 256)
    # a tokenizer with more tokens widens V to its own; --vocab-size sets it
    assert preset(name, tokens=300).vocab_size == max(300, trained.vocab_size)
    assert preset(name, vocab_size=1000, tokens=300).vocab_size == 1000


def test_the_presets_parameters_in_help_are_the_models():
    from llmz.config import describe_presets
    assert "small (L=4 C=128 V=256: 957K)" in describe_presets()
    assert "d12 (L=12 C=768 V=50257: 124M)" in describe_presets()
    assert preset("small").num_parameters() == 957_184 and preset("d12").num_parameters() == 124_475_904


def refused(*argv, match: str = "", base=BASE) -> str:
    """The flags are refused with a one-line UsageError (exit status 2) containing `match`."""
    with pytest.raises(UsageError) as e:
        parse(*argv, base=base)
    msg = str(e.value)
    assert "\n" not in msg and match in msg, msg
    assert e.value.exit_code == 2
    return msg


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("files")
    write_tokens(str(d / "tokens.bin"), np.random.default_rng(0).integers(0, 256, 400))
    write_tokens(str(d / "empty.bin"), np.zeros(0, np.int64))
    lay = Layout(preset("tiny", vocab_size=256, max_seq_len=16), 1)
    save_model(str(d / "tiny.bin"), lay.config, init_parameters(lay, 1), lay)
    os.mkfifo(d / "fifo")
    return d


# ---- each class of bad flag -----------------------------------------------------------------------------------
@pytest.mark.parametrize("flags, match", [
    (["--lr", "nan"], "--lr nan: must be a finite number"),
    (["--lr", "inf"], "finite"),
    (["--lr=-1e-3"], ">= 0"),
    (["--lr", "1e300"], "beyond the largest fp32 value"),
    (["--weight-decay", "nan"], "finite"),
    (["--eps", "nan"], "finite"),
    (["--eps", "0"], "smallest normal fp32 number"),
    (["--eps", "-1"], "--eps"),
    (["--eps", "1e-300"], "smallest normal fp32"),
    (["--grad-clip", "nan"], "finite"),
    (["--grad-clip", "-1"], ">= 0"),
    (["--beta1", "1"], "in [0, 1)"),
    (["--beta2", "nan"], "finite"),
    (["--final-lr-frac", "-1"], "in [0, 1]"),
    (["--final-lr-frac", "1.5"], "in [0, 1]"),
    (["--warmup-steps", "-5"], ">= 0"),
    (["--val-every", "-1"], ">= 0"),
    (["--val-batches", "0"], "positive"),
    (["--val-batches", "-1"], "positive"),
    (["--sample-tokens", "-1"], ">= 0"),
    (["--max-seq-len", "0"], "positive"),
    (["--vocab-size", "0"], "positive"),
    (["--vocab-size", "100"], "smaller than the tokenizer's 256"),
    (["--model", ""], "not a preset"),
    (["--model", "huge"], "not a preset; choose one of tiny, small, thin"),
    (["--seed", "-1"], "32-bit seed"),
    (["--seed", str(2**32)], "32-bit seed"),
    (["--steps", "0"], "positive"),
    (["-b", "0"], "positive"),
    (["--max-loss", "0"], "positive"),
    (["--max-loss", "nan"], "finite"),
    (["--collective-timeout", "1e-9"], "--collective-timeout 1e-09: must be at least 1 s: a shorter deadline cannot "
                                       "tell a stopped rank from one the scheduler paused"),
    (["--collective-timeout", "0.99"], "must be at least 1 s"),
    (["--lr", "x"], "argument --lr: invalid float value: 'x'"),
    (["--steps", "1e3"], "invalid int value"),
    (["--no-such-flag"], "unrecognized arguments"),
    (["--zero-stage", "5"], "invalid choice"),
    (["--keep", "1", "--no-run-dir"], "need --checkpoint-dir"),
    (["--resume"], "--resume latest needs --checkpoint-dir"),
    (["--max-seq-len", "4"], "--seq-len 8 > max_seq_len 4"),
    (["--trace", "t.json"], "at --zero-stage 0 there is nothing to trace"),
    (["--trace", "t.json", "--zero-stage", "1"], "at --zero-stage 1 there is nothing to trace"),
    (["--precision", "fp64", "--matmul", "cublas"], "--matmul cublas needs a GPU"),
])
def test_a_bad_flag_is_refused_at_start_in_one_line(flags, match):
    refused(*flags, match=match)


def test_files_and_flags_that_disagree_are_refused_at_start(files, tmp_path):
    d = files
    refused("--init-from", d / "tiny.bin", "--model", "d2", match="--model d2 does not describe the model of")
    refused("--init-from", d / "tiny.bin", "--vocab-size", "300", match="do not describe")
    refused("--init-from", d / "tiny.bin", "-t", "32", match="--seq-len 32 > max_seq_len 16")
    parse("--init-from", d / "tiny.bin", "--model", "tiny", "--max-seq-len", "16")      # agrees: accepted
    refused("--init-from", d / "nothing.bin", match="no such model file")
    refused("--train-data", d / "empty.bin", match="0 tokens cannot fill one batch")
    refused("--val-data", d / "empty.bin", match="--val-data '' skips validation")
    refused("--train-data", d / "tokens.bin", "-b", "64", match="cannot fill one batch")
    refused("--tokenizer", d / "tokens.bin", match="this is an llm.c token file")
    refused("--resume", tmp_path / "step_000003", match="no such checkpoint folder")
    (tmp_path / "step_000003").mkdir()
    refused("--resume", tmp_path / "step_000003", match="incomplete checkpoint")
    refused("--log", tmp_path, match="is a folder; name a file")
    refused("--save", d / "fifo", match="not a regular file")
    refused("--log", "x.jsonl", "--save", "x.jsonl", match="--save and --log name the same file")
    (tmp_path / "file").write_text("")
    refused("--checkpoint-dir", tmp_path / "file", match="Not a directory")
    refused("--save", tmp_path / "file" / "m.bin", match="cannot create the folder")


def test_outputs_into_folders_that_do_not_exist_get_their_folders_at_start(tmp_path):
    """--save runs/m.bin, --log runs/a.jsonl, --trace runs/t.json and --checkpoint-dir a/b/c get their folders
    when the flags are checked, so nothing fails after training (once, a missing folder failed the run at its
    end, after all the training)."""
    parse("--save", tmp_path / "runs" / "m.bin", "--log", tmp_path / "logs" / "a.jsonl", "--zero-stage", "2",
          "--trace", tmp_path / "traces" / "t.json", "--checkpoint-dir", tmp_path / "a" / "b" / "c")
    for sub in ("runs", "logs", "traces", "a/b/c"):
        assert (tmp_path / sub).is_dir()


def test_a_readonly_output_folder_is_refused_at_start(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes anywhere")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        refused("--save", ro / "m.bin", match="cannot write in")
    finally:
        ro.chmod(0o700)


def test_a_configuration_that_cannot_fit_in_host_memory_is_refused_at_start(monkeypatch):
    import llmz.files
    monkeypatch.setattr(llmz.files, "available_memory", lambda: 1 << 20)           # 1 MiB
    refused("--model", "small", match="does not fit in memory")


# ---- --help ---------------------------------------------------------------------------------------------------
def help_entries(module: str) -> dict[str, str]:
    """flag -> its help text, from `python -m MODULE --help` on a wide terminal (one line per flag)."""
    p = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO, capture_output=True, text=True,
                       check=True, env={**os.environ, "COLUMNS": "1000"}, timeout=60)
    entries, current = {}, None
    for line in p.stdout.split("options:")[1].splitlines():
        if line.startswith("  -"):
            head, _, text = line.strip().partition("  ")
            current = next(f for f in head.split() if f.startswith("--")).rstrip(",")
            entries[current] = text.strip()
        elif current and line.strip():
            entries[current] += " " + line.strip()
    return entries


@pytest.mark.parametrize("module", ["llmz.train", "llmz.sample", "llmz.bench", "lessons.00_one_device",
                                    "lessons.04_stochastic_rounding", "lessons.05_stage3_parameter_sharding"])
def test_every_flag_has_a_help_line_that_says_its_default_once(module):
    entries = help_entries(module)
    if module.startswith("llmz."):          # (a lesson's parser is llmz.args.parse_lesson's, with the flags it uses)
        parser = __import__(module, fromlist=["build_parser"]).build_parser()
        flags = {o for a in parser._actions for o in a.option_strings if o.startswith("--")} - {"--help"}
        assert flags <= set(entries), flags - set(entries)
    for f, text in entries.items():
        if f == "--help":
            continue
        assert text, f"{f} has no help"
        assert text.count("(default") == 1 or f == "--init-from" and "(required)" in text, f"{f}: {text}"
        assert "(default: None)" not in text, f"{f}: {text}"
    if module in ("llmz.train", "llmz.bench"):            # every preset named, with its parameters
        assert all(f"{name} (L=" in entries["--model"] for name in PRESETS), entries["--model"]
    assert not any("see above" in text for text in entries.values())


# ---- the fuzz ---------------------------------------------------------------------------------------------------
# per flag, values that reach the check's edges: invalid, boundary, valid; sizes bounded so that whatever is
# accepted trains in well under a second
NUM = ["nan", "inf", "-inf", "-1", "0", "1e-320", "x", ""]
POOLS = {
    "--model": ["tiny", "thin", "d2", "", "bogus", "small"],
    "-b": ["-1", "0", "1", "2", "3", str(10**9), "1.5"],
    "-t": ["-1", "0", "1", "4", "8", "2000"],
    "--steps": ["-1", "0", "1", "2", "3", "x"],
    "--grad-accum": ["-1", "0", "1", "2"],
    "--max-seq-len": ["-1", "0", "4", "8", "16", str(10**9)],
    "--vocab-size": ["-1", "0", "1", "255", "256", "300", "50257", str(10**9)],
    "--lr": [*NUM, "1e-3", "1e-2", "1e300", "3e38"],
    "--warmup-steps": ["-5", "0", "1", "100"],
    "--final-lr-frac": [*NUM, "0.1", "1", "1.5"],
    "--weight-decay": [*NUM, "0.1"],
    "--beta1": [*NUM, "0.9", "1", "0.999"],
    "--beta2": [*NUM, "0.95", "1"],
    "--eps": [*NUM, "1e-8", "1e-30", "1e-300"],
    "--grad-clip": [*NUM, "1.0"],
    "--max-loss": [*NUM, "100", "1e300"],
    "--seed": ["-1", "0", "7", str(2**32 - 1), str(2**32), str(2**64)],
    "--val-every": ["-1", "0", "1", "5"],
    "--val-batches": ["-1", "0", "1", "2"],
    "--sample-every": ["-1", "0", "1"],
    "--sample-tokens": ["-1", "0", "3"],
    "--zero-stage": ["0", "1", "2", "3", "-1"],
    "--precision": ["fp32", "fp64", "bf16", "fp16"],
    "--lr-schedule": ["cosine", "constant", "linear"],
    "--checkpoint-every": ["-1", "0", "1"],
    "--keep": ["-1", "0", "1"],
    "--tokenizer": ["byte", "bytes", "{tokens}", "{fifo}", "{nothing}", "{dir}"],
    "--train-data": ["{tokens}", "{empty}", "{fifo}", "{nothing}", "{dir}", "/dev/zero"],
    "--val-data": ["{tokens}", "", "{empty}", "{fifo}", "{nothing}"],
    "--init-from": ["{model}", "{tokens}", "{fifo}", "{nothing}"],
    "--log": ["{out}/log.jsonl", "{out}/new/log.jsonl", "{dir}", "{fifo}", "/dev/null"],
    "--save": ["{out}/m.bin", "{out}/new/m.bin", "{dir}", "{fifo}"],
    "--checkpoint-dir": ["{out}/ck", "{out}/new/ck", "{tokens}"],
    "--resume": ["latest", "{out}/ck/step_000001", "{nothing}"],
    "--trace": ["{out}/t.json", "{dir}"],
}
SWITCHES = ["--shuffle", "--quiet", "--no-overlap", "--no-cuda-graph"]
FUZZ = settings(max_examples=150, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@st.composite
def command_lines(draw):
    names = draw(st.lists(st.sampled_from(sorted(POOLS)), min_size=1, max_size=6, unique=True))
    argv = []
    for n in names:
        argv += [n, draw(st.sampled_from(POOLS[n]))]
    return argv + draw(st.lists(st.sampled_from(SWITCHES), max_size=2, unique=True))


def test_fuzzed_flags_start_cleanly_and_train_to_the_end_or_are_refused_in_one_line(files):
    """Random flag values: the check refuses them in one line (UsageError, exit 2), or the run they describe
    trains to its end in this process (a few steps at most) and writes what it was asked to. A run whose
    (valid) flags make it diverge, such as --lr 3e38, is stopped by the divergence check, naming the step,
    with nothing non-finite saved. No late failure, no other exception."""
    from llmz.run.loop import train
    from llmz.run.state import checkpoints, load_checkpoint
    from llmz.train import parse_args
    outcomes = {"started": 0, "refused": 0, "stopped": 0}

    @FUZZ
    @given(argv=command_lines())
    def case(argv):
        with tempfile.TemporaryDirectory() as out:
            subs = {"tokens": files / "tokens.bin", "empty": files / "empty.bin", "fifo": files / "fifo",
                    "nothing": files / "nothing.bin", "dir": files, "model": files / "tiny.bin", "out": out}
            argv = [a.format(**subs) for a in argv]
            full = ["--device", "cpu", "--model", "tiny", "-b", "2", "-t", "4", "--steps", "2", "--val-batches",
                    "1", "--sample-tokens", "2", "--train-data", str(files / "tokens.bin"),
                    "--val-data", str(files / "tokens.bin"), *argv]
            try:
                args, kind = parse_args(full, kind="cpu")
            except UsageError as e:
                assert "\n" not in str(e) and e.exit_code == 2, str(e)
                outcomes["refused"] += 1
                return
            try:
                summary = train(args, kind, RankInfo(0, 1, 0, 1, "here"))
            except LlmzError as e:
                assert str(e).startswith("step ") and "stopped" in str(e) and "\n" not in str(e), (full, str(e))
                outcomes["stopped"] += 1
                for _, folder, done in checkpoints(args.checkpoint_dir) if args.checkpoint_dir else []:
                    if done:
                        ck = load_checkpoint(folder)
                        assert all(np.isfinite(s.arrays[k]).all() for s in ck.states for k in s.arrays)
                assert not args.save or not os.path.exists(args.save)
                return
            outcomes["started"] += 1
            assert summary["final_loss"] is not None or args.resume
            if args.save:
                assert os.path.isfile(args.save)
            if args.log:
                with open(args.log) as f:
                    assert '"event": "end"' in f.read()

    case()
    print(f"\nfuzzed command lines: {outcomes}")
    assert outcomes["started"] >= 5 and outcomes["refused"] >= 50, outcomes


# ---- the same through the command lines --------------------------------------------------------------------------
@pytest.mark.parametrize("module, flags", [
    ("llmz.train", ["--lr", "nan"]),
    ("llmz.train", ["--eps", "0"]),
    ("llmz.train", ["--steps", "x"]),
    ("llmz.train", ["--model", ""]),
    ("llmz.train", ["--log", "."]),
    ("llmz.sample", ["--init-from", "nothing.bin"]),
    ("llmz.sample", ["--init-from", "data/shakespeare_val.bin"]),
    ("llmz.sample", ["--tokens", "-1", "--init-from", "x"]),
    ("llmz.sample", ["--temperature", "-1", "--init-from", "x"]),
    ("llmz.bench", ["--steps", "0"]),
    ("llmz.bench", ["--model", "nope"]),
    ("llmz.bench", ["--vs-torch", "--rounds", "0"]),
    ("llmz.train", ["--run-dir", "x", "--no-run-dir"]),
    ("lessons.01_stage0_data_parallel", ["--steps", "-1"]),
])
def test_every_command_refuses_a_bad_flag_in_one_error_line_with_status_2(module, flags):
    p = subprocess.run([sys.executable, "-m", module, "--device", "cpu", *flags], cwd=REPO, capture_output=True,
                       text=True, check=False, timeout=120)
    assert p.returncode == 2, (p.returncode, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in p.stderr, p.stderr
