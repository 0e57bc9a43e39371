"""Test setup. Without a GPU the Numba kernels run in the CUDA simulator, which must be switched on
before numba is first imported, so this happens here, at collection time."""
import atexit
import collections
import os
import shutil
import sys
import tempfile
import time
import zlib

sys.path.insert(0, os.path.dirname(__file__))
from llmz.device import gpu_available

HAVE_GPU = gpu_available()
if not HAVE_GPU:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

import numpy as np
import pytest

# Runs the tests start without --run-dir or --no-run-dir (llmz.train's default) make their numbered folders
# here, not under runs/ in the checkout; the commands the tests start inherit it. tests/test_rundir.py sets
# its own.
os.environ["LLMZ_RUNS"] = RUNS = tempfile.mkdtemp(prefix="llmz-test-runs-")
atexit.register(shutil.rmtree, RUNS, True)

# The quick suite (`python -m pytest -q -m quick`, about a minute on 2 cores): every layer's teaching kernels
# against their NumPy reference, the whole model's kernels (both sets) against the reference model, the
# reference model against finite differences, each ZeRO stage against the others under mpiexec, the file
# formats, a training run, and the commands around them. tests/test_suite.py checks that each name exists.
QUICK = [
    "tests/test_encoder.py::test_encoder_forward_kernel_matches_reference",
    "tests/test_encoder.py::test_encoder_backward_kernel_matches_reference_and_accumulates",
    "tests/test_layernorm.py::test_layernorm_forward_kernel_matches_reference[shape0]",
    "tests/test_layernorm.py::test_layernorm_backward_kernel_matches_reference_and_accumulates[shape0]",
    "tests/test_matmul.py::test_matmul_forward_kernel_matches_reference[True]",
    "tests/test_matmul.py::test_matmul_backward_kernel_matches_reference_and_accumulates[True]",
    "tests/test_gemm.py::test_gemm_tiled_kernel_matches_numpy_for_every_transpose[True-False]",
    "tests/test_attention.py::test_attention_forward_kernel_matches_reference",
    "tests/test_attention.py::test_attention_backward_kernel_matches_reference_and_overwrites_scratch",
    "tests/test_flash_attention.py::test_flash_kernels_match_reference[17]",
    "tests/test_gelu.py::test_gelu_forward_kernel_matches_reference",
    "tests/test_gelu.py::test_gelu_backward_kernel_matches_reference_and_accumulates",
    "tests/test_residual.py::test_residual_forward_kernel_matches_reference",
    "tests/test_residual.py::test_residual_backward_kernel_matches_reference_and_accumulates",
    "tests/test_classifier.py::test_classifier_forward_kernel_matches_reference[float32-1e-06]",
    "tests/test_classifier.py::test_classifier_backward_kernel_matches_reference",
    "tests/test_adamw.py::test_adamw_kernel_matches_reference_over_steps[float32-1e-06]",
    "tests/test_norm.py::test_norm_squared_kernel_matches_float64_sum[float32-1007]",
    "tests/test_accumulate.py::test_accumulate_shard_kernel_adds_my_part_and_zeroes_slot[2-1-float32]",
    "tests/test_fill.py::test_fill_kernel_writes_every_element[float32]",
    "tests/test_bf16.py::test_to_bf16_kernel_matches_reference_bit_for_bit[stochastic]",
    "tests/test_model.py::test_model_reference_backward_matches_finite_differences",
    "tests/test_model.py::test_model_kernels_match_reference_logits_loss_and_every_gradient[teaching]",
    "tests/test_model.py::test_model_kernels_match_reference_logits_loss_and_every_gradient[fast]",
    "tests/test_zero.py::test_stages_agree_with_each_other[2]",
    "tests/test_zero3.py::test_stage3_is_stage2_bit_for_bit",
    "tests/test_files.py::test_fp32_model_file_round_trips_bit_exactly_in_llmc_order[1]",
    "tests/test_files.py::test_token_file_round_trips_with_llmc_header_and_exact_size",
    "tests/test_data.py::test_rank_r_micro_batch_i_starts_at_llmc_offset_and_wraps_after_n",
    "tests/test_train.py::test_tiny_model_overfits_one_batch",
    "tests/test_sample_window.py::test_sample_states_its_window_first_and_seq_len_overrides_it",
    "tests/test_prepare.py::test_files_decode_back_to_the_text_with_the_last_share_held_out_at_a_line_start",
    "tests/test_convert.py::test_llmc_to_hf_to_llmc_gives_back_the_same_bytes[fp32]",
    "tests/test_doctor.py::test_doctor_fits_a_screen_names_every_part_and_exits_0_where_the_cpu_path_works",
    "tests/test_data.py::test_a_files_digest_is_sha256_of_all_its_bytes_the_same_for_copies_and_changed_by_one_token_anywhere",
    "tests/test_watchdog.py::test_the_start_up_watch_names_a_stopped_rank_at_the_deadline_and_a_dead_one_at_once",
    "tests/test_watchdog.py::test_a_rank_that_cannot_start_mpi_says_why_in_its_own_line_and_ends_the_job",
]
GPU_SKIP = "needs a CUDA GPU (CuPy sees none)"
# The tests that take 10 s or more on the 2-core machine (the simulator's whole-model runs, a tool's fault
# case, lessons and resumes across world sizes; --durations=40 shows them), every parametrization of each: run
# first, so that the workers end on short tests instead of one waiting for the other's long one.
SLOW = [
    "tests/test_recompute.py::test_recompute_gives_the_same_losses_and_gradients_bit_for_bit",
    "tests/test_model.py::test_model_kernels_match_reference_logits_loss_and_every_gradient",
    "tests/test_tools.py::test_hostile_check_a_stopped_rank_and_a_live_log_under_another_name",
    "tests/test_flash_attention.py::test_model_step_with_flash_attention_matches_direct_attention",
    "tests/test_lessons.py::test_lesson_on_two_ranks_passes_every_checkpoint",
    "tests/test_resume.py::test_resume_across_world_sizes_and_stages_matches_the_straight_run",
]


def pytest_collection_modifyitems(config, items):
    quick = set(QUICK)
    for item in items:
        if item.nodeid in quick:
            item.add_marker(pytest.mark.quick)
        if "gpu" in item.keywords and not HAVE_GPU:
            item.add_marker(pytest.mark.skip(reason=GPU_SKIP))
    items.sort(key=lambda item: item.nodeid.split("[")[0] not in SLOW)     # stable: the rest keep their order


# Fresh random inputs on every run, reproducible: one seed a session (printed in pytest's header; set
# LLMZ_TEST_SEED to rerun a failure on the same inputs) mixed with a stable hash of the test's name.
SESSION_SEED = int(os.environ.get("LLMZ_TEST_SEED") or np.random.SeedSequence().entropy % 2**32)
os.environ["LLMZ_TEST_SEED"] = str(SESSION_SEED)    # pytest-xdist's workers, started after this, draw the same


# ---- both cores: pytest-xdist (setup.cfg's addopts: -n auto), and a line per test file as it starts and ends --
def pytest_xdist_auto_num_workers(config):
    """-n auto: a worker per core this process may use; none (every test in this process) with a GPU, whose
    tests would share one card, or with -s, whose output workers do not show."""
    if HAVE_GPU or config.getoption("capture") == "no":
        return 0
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class FileLines:
    """A plugin of the main process (with or without workers): 'tests/test_zero.py: started' when a file's first
    test starts, 'tests/test_zero.py: 9 passed, 1 skipped in 41s' when its last one ends, so a CI log says which
    files run while the dots go by."""

    def __init__(self, reporter):
        self.reporter = reporter
        self.left: collections.Counter = collections.Counter()     # file -> its tests not finished yet
        self.started: dict[str, float] = {}
        self.tally: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def say(self, line: str) -> None:
        """line on a line of its own, after the dots of the line it breaks into."""
        if getattr(self.reporter._tw, "width_of_current_line", 0):
            self.reporter._tw.line()
        self.reporter.write_line(line)

    def collected(self, nodeids) -> None:
        if not self.left:                                           # every worker collects the same tests
            self.left.update(n.split("::")[0] for n in nodeids)

    def pytest_collection_finish(self, session):
        self.collected(item.nodeid for item in session.items)

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids):
        self.collected(ids)

    def pytest_runtest_logstart(self, nodeid, location):
        file = nodeid.split("::")[0]
        if file not in self.started:
            self.started[file] = time.perf_counter()
            self.say(f"{file}: started")

    def pytest_runtest_logreport(self, report):
        file = report.nodeid.split("::")[0]
        if report.failed or (report.skipped and report.when != "teardown") or (report.passed and report.when == "call"):
            self.tally[file]["error" if report.failed and report.when != "call" else report.outcome] += 1
        if report.when == "teardown" and self.left[file] > 0:
            self.left[file] -= 1
            if self.left[file] == 0:
                took = time.perf_counter() - self.started.get(file, time.perf_counter())
                counts = ", ".join(f"{n} {outcome}" for outcome, n in sorted(self.tally[file].items()))
                self.say(f"{file}: {counts or 'done'} in {took:.0f}s")


@pytest.hookimpl(trylast=True)             # after pytest's own, which registers the terminal reporter
def pytest_configure(config):
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and not hasattr(config, "workerinput"):     # the main process only
        config.pluginmanager.register(FileLines(reporter), "llmz-file-lines")


def pytest_report_header(config):
    return f"llmz: random test inputs from LLMZ_TEST_SEED={SESSION_SEED} (set it to rerun these inputs)"


def skip_reason(report) -> str:
    """The reason a test (or a whole module, at collection) was skipped, as pytest's -rs would print it."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Under -q too: the seed to rerun a failure; the skips in one line, counted by reason (setup.cfg's -rfE
    lists failures and errors one by one, but not the GPU tests every machine without a GPU skips)."""
    stats = terminalreporter.stats
    if stats.get("failed") or stats.get("error"):
        terminalreporter.write_line(f"rerun these inputs: LLMZ_TEST_SEED={SESSION_SEED} python -m pytest ...")
    reasons = collections.Counter(skip_reason(r) for r in stats.get("skipped", []))
    if reasons:
        gpu = reasons.pop(GPU_SKIP, 0)
        parts = [f"{gpu} need a CUDA GPU (python -m pytest -q -m gpu -s on a machine with one)"] if gpu else []
        parts += [f"{n} {reason}" for reason, n in sorted(reasons.items())]
        terminalreporter.write_line("skipped: " + "; ".join(parts))


@pytest.fixture
def rng(request):
    """Fresh random inputs for every test: the session seed and the test's name (see SESSION_SEED)."""
    return np.random.default_rng([SESSION_SEED, zlib.crc32(request.node.nodeid.encode())])


@pytest.fixture(scope="session")
def kdev():
    """The teaching kernels (llmz/kernels/: the tiled matmul, direct attention): the simulator on CI, the real GPU
    where there is one."""
    from llmz.device import Device
    return Device("gpu" if HAVE_GPU else "sim", np.float32, kernel_set="teaching")


@pytest.fixture(scope="session")
def fdev():
    """The fast kernels (llmz/fast/): on a GPU with cuBLAS (TF32) products and gemm attention; in the simulator
    (warp shuffles emulated) with the tiled product and direct attention, the rest of the fast set as on a GPU."""
    from llmz.device import Device
    return Device("gpu" if HAVE_GPU else "sim", np.float32, kernel_set="fast")


@pytest.fixture(scope="session")
def fdev_exact():
    """The fast kernels with cuBLAS in full fp32 (TF32 off) and gemm attention: their wiring checked to fp32
    accuracy (a GPU only)."""
    if not HAVE_GPU:
        pytest.skip("needs a CUDA GPU (CuPy sees none)")
    from llmz.device import Device
    return Device("gpu", np.float32, kernel_set="fast", tf32=False)


@pytest.fixture
def launched(monkeypatch):
    """launched(dev): from then on (this test), the names of the kernels dev launches, in order, collect in the
    list it returns (dev still launches them)."""
    def record(dev):
        names, launch = [], dev.launch

        def recording(kernel, *args, **kw):
            names.append(kernel.py_func.__name__)
            launch(kernel, *args, **kw)
        monkeypatch.setattr(dev, "launch", recording)
        return names
    return record


@pytest.fixture(scope="session")
def cpu64():
    from llmz.device import Device
    return Device("cpu", np.float64)
