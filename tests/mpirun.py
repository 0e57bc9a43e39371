"""Start `mpiexec -n N python ...` from a test, with a timeout so a hung collective fails the test.

    from mpirun import run_mpi
    out = run_mpi(2, ["tests/mpi_comm_worker.py", "collectives"])
    assert out.returncode == 0, out.stderr

The child runs in the repository root with the repo on PYTHONPATH, and with the CUDA simulator switched on
when no GPU is visible. No mpiexec (neither beside this Python, where the mpich wheel puts it, nor on PATH):
the test is skipped. Either MPI's launcher works: mpich's Hydra needs no flags; Open MPI's refuses to run as
root without --allow-run-as-root (containers, the GPU machines) and more ranks than cores without
--oversubscribe, so those are added where they apply (mpiexec_command).
"""
from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def find_mpiexec() -> str | None:
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("mpiexec")


def is_open_mpi(version_text: str) -> bool:
    """`mpiexec --version` of Open MPI: "mpiexec (Open MPI) 5.0.3" (4.x: "mpiexec (OpenRTE) 4.1.2", and both
    point to www.open-mpi.org); mpich and Intel MPI print "HYDRA build details"."""
    text = version_text.lower()
    return any(mark in text for mark in ("open mpi", "openrte", "open-mpi.org"))


@functools.cache
def mpiexec_version(mpiexec: str) -> str:
    try:
        p = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return p.stdout + p.stderr


def cpu_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def mpiexec_command(mpiexec: str, nproc: int, args: list[str], version_text: str, as_root: bool,
                    cores: int) -> list[str]:
    """`mpiexec -n nproc python *args`, with the flags Open MPI needs here: --allow-run-as-root as root,
    --oversubscribe for more ranks than cores (the tests start 4 ranks on a 2-core machine)."""
    flags = []
    if is_open_mpi(version_text):
        flags += ["--allow-run-as-root"] if as_root else []
        flags += ["--oversubscribe"] if nproc > cores else []
    return [mpiexec, *flags, "-n", str(nproc), sys.executable, *args]


def start_mpi(nproc: int, args: list[str], env: dict | None = None) -> subprocess.Popen:
    """Start `mpiexec -n nproc python *args` in a session of its own (stdout, stderr: text pipes), so that
    os.killpg(proc.pid, ...) reaches mpiexec, its proxies and every rank."""
    from llmz.device import gpu_available
    mpiexec = find_mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec (pip install mpich)")
    child_env = dict(os.environ)
    if not gpu_available():
        child_env["NUMBA_ENABLE_CUDASIM"] = "1"
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), child_env.get("PYTHONPATH")) if p)
    child_env["PYTHONUNBUFFERED"] = "1"
    child_env.update(env or {})
    cmd = mpiexec_command(mpiexec, nproc, args, mpiexec_version(mpiexec), os.geteuid() == 0, cpu_cores())
    return subprocess.Popen(cmd, cwd=REPO, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def run_mpi(nproc: int, args: list[str], timeout: float = 120, env: dict | None = None
            ) -> subprocess.CompletedProcess:
    """Run `mpiexec -n nproc python *args`, capturing stdout and stderr (text). A run that outlasts
    `timeout` seconds is killed, with every process it started, and fails the calling test."""
    proc = start_mpi(nproc, args, env)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{' '.join(proc.args[1:])} still running after {timeout} s (killed)\n"
                    f"--- stdout\n{stdout}\n--- stderr\n{stderr}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
