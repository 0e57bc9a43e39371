"""Test setup. Without a GPU the Numba kernels run in the CUDA simulator, which must be switched on
before numba is first imported, so this happens here, at collection time."""
import os
import sys
import zlib

sys.path.insert(0, os.path.dirname(__file__))
from llmz.device import gpu_available

HAVE_GPU = gpu_available()
if not HAVE_GPU:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

import numpy as np
import pytest


def pytest_collection_modifyitems(config, items):
    if HAVE_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (CuPy sees none)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Fresh random inputs on every run, reproducible: one seed a session (printed in pytest's header; set
# LLMZ_TEST_SEED to rerun a failure on the same inputs) mixed with a stable hash of the test's name.
SESSION_SEED = int(os.environ.get("LLMZ_TEST_SEED") or np.random.SeedSequence().entropy % 2**32)


def pytest_report_header(config):
    return f"llmz: random test inputs from LLMZ_TEST_SEED={SESSION_SEED} (set it to rerun these inputs)"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if terminalreporter.stats.get("failed") or terminalreporter.stats.get("error"):     # shown under -q too
        terminalreporter.write_line(f"rerun these inputs: LLMZ_TEST_SEED={SESSION_SEED} python -m pytest ...")


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
