"""The test commands README promises: the full suite is exactly what .ci/run runs; the quick suite names only
tests that exist and takes every layer and every ZeRO stage; every command setup.cfg installs answers --help."""
import configparser
import functools
import re
import subprocess
import sys

import pytest
from conftest import QUICK, SLOW

from mpirun import REPO


@functools.cache
def collected() -> frozenset[str]:
    p = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q"], cwd=REPO,
                       capture_output=True, text=True, check=False, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    return frozenset(line for line in p.stdout.splitlines() if "::" in line)


def test_every_quick_test_exists():
    missing = sorted(set(QUICK) - collected())
    assert not missing, f"tests/conftest.py's QUICK names tests that do not exist (renamed?): {missing}"


def test_every_slow_test_exists():
    names = {nodeid.split("[")[0] for nodeid in collected()}
    missing = sorted(set(SLOW) - names)
    assert not missing, f"tests/conftest.py's SLOW names tests that do not exist (renamed?): {missing}"


def test_the_quick_suite_takes_every_layer_and_every_zero_stage():
    files = {q.split("::")[0] for q in QUICK}
    layers = {p.stem for p in (REPO / "llmz" / "kernels").glob("*.py")
              if p.stem not in ("__init__", "grid")}         # grid.py: ceil_div, the launches' sizes, no layer
    assert {f"tests/test_{layer}.py" for layer in layers} <= files, layers - {f[11:-3] for f in files}
    # stages 0, 1 and 2 against each other, 3 against 2; both kernel sets through the whole model
    assert "tests/test_zero.py::test_stages_agree_with_each_other[2]" in QUICK
    assert "tests/test_zero3.py::test_stage3_is_stage2_bit_for_bit" in QUICK
    assert {f"tests/test_model.py::test_model_kernels_match_reference_logits_loss_and_every_gradient[{k}]"
            for k in ("teaching", "fast")} <= set(QUICK)


def test_readme_test_commands_are_ci_s_and_the_quick_one():
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    full = ci.split("# --- the README's test command, verbatim ---\n")[1].splitlines()[0]
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.DOTALL)
    assert blocks[1].strip() == full, (blocks[1], full)
    assert "python -m pytest -q -m quick" in readme


def console_scripts() -> dict[str, str]:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    lines = cfg["options.entry_points"]["console_scripts"].strip().splitlines()
    return dict(line.replace(" ", "").split("=") for line in lines)


@pytest.mark.parametrize("script", console_scripts())
def test_every_console_script_is_a_command_with_help(script):
    module, func = console_scripts()[script].split(":")
    p = subprocess.run([sys.executable, "-c", f"import sys; from {module} import {func}; sys.exit({func}(['--help']))"],
                       cwd=REPO, capture_output=True, text=True, check=False, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("usage: python -m " + module), p.stdout[:200]
