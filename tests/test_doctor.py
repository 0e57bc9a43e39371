"""python -m llmz.doctor reports the machine in one screen and exits 0 where the CPU path works; a Python
without llmz's requirements, or a rank alone under a launcher of several, ends in one line (llmz/run/environment.py)."""
import os
import subprocess
import sys

import pytest

from llmz import doctor
from llmz.run import environment
from mpirun import REPO


def test_doctor_fits_a_screen_names_every_part_and_exits_0_where_the_cpu_path_works():
    p = subprocess.run([sys.executable, "-m", "llmz.doctor"], cwd=REPO, capture_output=True, text=True,
                       check=False, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stdout + p.stderr and p.stderr == ""
    lines = p.stdout.splitlines()
    assert len(lines) <= 40 and max(map(len, lines)) <= 160, p.stdout
    for part in ("python", "numpy", "numba", "mpi4py", "mpiexec", "cupy", "what will run"):
        assert any(line.strip().startswith(part) for line in lines), (part, p.stdout)
    assert "yes  python -m llmz.train --device cpu" in p.stdout
    # every "no" names its fix
    assert all("-> " in line for line in lines if line.startswith("  no ")), p.stdout


def test_a_stdout_that_cannot_be_written_is_one_line_and_a_non_zero_status():
    with open("/dev/full", "w") as full:
        p = subprocess.run([sys.executable, "-m", "llmz.doctor"], cwd=REPO, stdout=full, stderr=subprocess.PIPE,
                           text=True, check=False, timeout=120)
    assert p.returncode != 0 and p.stderr == "error: cannot write to standard output (No space left on device)\n", \
        p.stderr


def test_a_broken_cpu_path_is_reported_with_status_1(monkeypatch, capsys):
    monkeypatch.setattr(doctor, "cpu_path_works", lambda: "ImportError: no numba")
    assert doctor.main([]) == 1
    out, err = capsys.readouterr()
    assert "no   python -m llmz.train --device cpu" in out and "ImportError: no numba" in out
    assert "the CPU path does not work" in err


def test_a_python_without_numpy_says_so_in_one_line_with_status_2(tmp_path):
    # a Python that cannot import numpy: the same interpreter, isolated from every site-packages
    (tmp_path / "numpy.py").write_text("raise ModuleNotFoundError(\"No module named 'numpy'\", name='numpy')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    p = subprocess.run([sys.executable, "-m", "llmz.train", "--steps", "1"], cwd=REPO, env=env,
                       capture_output=True, text=True, check=False, timeout=120)
    assert p.returncode == 2, p.stderr
    assert p.stderr.count("\n") == 1 and p.stderr.startswith(f"error: no module named 'numpy' in {sys.executable}")
    assert 'pip install -e ".[mpi]"' in p.stderr


def test_under_another_environments_launcher_the_line_names_it(monkeypatch, tmp_path):
    monkeypatch.setenv("PMI_RANK", "0")
    monkeypatch.setattr(environment, "launcher_bin", lambda: str(tmp_path))
    (tmp_path / "activate").write_text("")
    line = environment.missing_module_line("numpy")
    assert f"the mpiexec of {tmp_path} started a Python that is not its environment's" in line
    assert f". {tmp_path}/activate" in line


def test_a_lone_rank_under_a_launcher_of_two_is_refused_in_one_line():
    pytest.importorskip("mpi4py")
    code = "import mpi4py; mpi4py.rc.initialize = False\nfrom mpi4py import MPI; print(MPI.Get_library_version())"
    lib = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                         timeout=60).stdout
    # the other MPI's launcher variable, which this one ignores: MPI sees a world of 1 (mpi4py's own warning
    # about it silenced)
    var = "PMI_SIZE" if "open mpi" in lib.lower() else "OMPI_COMM_WORLD_SIZE"
    env = {**os.environ, var: "2", "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, "-W", "ignore", "-m", "llmz.train", "--steps", "1"], cwd=REPO, env=env,
                       capture_output=True, text=True, check=False, timeout=120)
    assert p.returncode == 2, p.stderr
    assert p.stderr.count("\n") == 1 and "mpiexec started 2 ranks, but this Python's MPI" in p.stderr, p.stderr
