"""The test harness's mpiexec command line works under either MPI: Open MPI gets --allow-run-as-root when the
tests run as root (containers, the GPU machine) and --oversubscribe for more ranks than cores; mpich's Hydra
gets neither. The version texts are what each launcher's `mpiexec --version` prints."""
import os
import sys

import pytest

from mpirun import find_mpiexec, is_open_mpi, mpiexec_command, mpiexec_version

OPEN_MPI_5 = "mpiexec (Open MPI) 5.0.3\n\nReport bugs to https://www.open-mpi.org/community/help/\n"
OPEN_MPI_4 = "mpiexec (OpenRTE) 4.1.2\n\nReport bugs to http://www.open-mpi.org/community/help/\n"
HYDRA = ("HYDRA build details:\n    Version:                                 4.2.0\n"
         "    Release Date:                            Fri Feb  9 12:29:21 CST 2024\n")
INTEL = "Intel(R) MPI Library for Linux* OS, Version 2021.11 Build 20231005\nHYDRA build details:\n"


@pytest.mark.parametrize("text, open_mpi", [(OPEN_MPI_5, True), (OPEN_MPI_4, True), (HYDRA, False),
                                            (INTEL, False), ("", False)])
def test_open_mpi_is_told_apart_from_hydra(text, open_mpi):
    assert is_open_mpi(text) is open_mpi


@pytest.mark.parametrize("text", [OPEN_MPI_5, OPEN_MPI_4])
def test_open_mpi_as_root_gets_allow_run_as_root_and_oversubscribe_beyond_the_cores(text):
    cmd = mpiexec_command("mpiexec", 4, ["-m", "x"], text, as_root=True, cores=2)
    assert cmd == ["mpiexec", "--allow-run-as-root", "--oversubscribe", "-n", "4", sys.executable, "-m", "x"]
    assert mpiexec_command("mpiexec", 2, ["a.py"], text, as_root=False, cores=16) == \
        ["mpiexec", "-n", "2", sys.executable, "a.py"]
    assert "--allow-run-as-root" in mpiexec_command("mpiexec", 2, [], text, as_root=True, cores=16)


@pytest.mark.parametrize("text", [HYDRA, INTEL])
def test_hydra_needs_no_flag_even_as_root(text):
    assert mpiexec_command("/v/bin/mpiexec", 4, ["a.py"], text, as_root=True, cores=2) == \
        ["/v/bin/mpiexec", "-n", "4", sys.executable, "a.py"]


@pytest.mark.mpi
def test_this_machines_mpiexec_is_recognised_and_runs_two_ranks():
    """The real launcher here, whichever it is, with the flags chosen for it (as root too)."""
    from mpirun import run_mpi
    mpiexec = find_mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec (pip install mpich)")
    text = mpiexec_version(mpiexec)
    assert is_open_mpi(text) or "hydra" in text.lower(), text
    code = "import os; print('rank', os.environ.get('PMI_RANK', os.environ.get('OMPI_COMM_WORLD_RANK')))"
    p = run_mpi(2, ["-c", code], timeout=60)
    assert p.returncode == 0, p.stderr
    assert sorted(p.stdout.splitlines()) == ["rank 0", "rank 1"], (p.stdout, os.geteuid())
