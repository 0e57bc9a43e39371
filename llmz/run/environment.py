"""Which Python runs, and which mpiexec started it: a Python without llmz's requirements says so in one line.

`mpiexec -n 2 python -m llmz.train` with the mpiexec of a virtual environment but the system's Python (the
environment not activated, its mpiexec called by path) died in a traceback per rank on `import numpy`.
llmz/__init__.py installs `explain_missing_modules` when a command starts, before the command's own imports:
a missing module then ends the job with one line from rank 0, naming the Python, the launcher's folder and
the fix. This module imports nothing beyond the standard library, so it runs where nothing else is installed.

`process_state` reads what /proc says of a process of this host (running, stopped, dead; when it started): the
locks ask it whether their owner still runs (llmz.run.lock), the watchdog whether a peer rank does (llmz.run.watchdog).
"""
from __future__ import annotations

import os
import sys

LAUNCHER_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
LAUNCHER_PROCESSES = ("hydra_pmi_proxy", "orted", "prted", "mpiexec", "mpirun")
INSTALL = 'pip install -e ".[mpi]"'
EXTRAS = {"cupy": "gpu", "cupyx": "gpu", "cupy_backends": "gpu", "ml_dtypes": "gpu", "tiktoken": "bpe"}


# ---- a Python that lacks llmz's requirements -------------------------------------------------------------
def launcher_bin() -> str | None:
    """The folder of the MPI launcher that started this process (its parent: mpich's hydra_pmi_proxy, Open
    MPI's prted/orted), or None when no launcher did (or /proc cannot say)."""
    if not any(v in os.environ for v in LAUNCHER_RANK_VARS):
        return None
    try:
        exe = os.readlink(f"/proc/{os.getppid()}/exe")
    except OSError:
        return None
    return os.path.dirname(exe) if os.path.basename(exe).startswith(LAUNCHER_PROCESSES) else None


def missing_module_line(name: str) -> str:
    """One line for `No module named NAME` at start: which Python lacks it, and what to do."""
    here = sys.executable or "this Python"
    launcher = launcher_bin()
    if launcher and os.path.realpath(launcher) != os.path.realpath(os.path.dirname(here)):
        activate = os.path.join(launcher, "activate")
        fix = f". {activate}" if os.path.exists(activate) else f"the python beside it, {launcher}/python"
        return (f"error: no module named {name!r} in {here}: the mpiexec of {launcher} started a Python "
                f"that is not its environment's; use that environment's Python ({fix}) or that Python's own "
                f"mpiexec")
    if name in EXTRAS:
        return f"error: no module named {name!r} in {here}: install llmz's {EXTRAS[name]} extra: " \
               f'pip install -e ".[{EXTRAS[name]}]"'
    venv = "activate the virtual environment they are in (. .venv/bin/activate), or " \
        if sys.prefix == sys.base_prefix else ""
    return (f"error: no module named {name!r} in {here}: llmz's requirements are not installed in this Python; "
            f"{venv}install them: {INSTALL}")


def lone_rank_line(launched: int, library_version: str) -> str:
    """The launcher started `launched` ranks but this Python's MPI sees a world of one: the mpiexec belongs to
    another MPI library than mpi4py's, and every rank would train alone."""
    lib = mpi_library(library_version)
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    use = beside if os.path.exists(beside) else f"the mpiexec of {lib}"
    return (f"mpiexec started {launched} ranks, but this Python's MPI ({lib}, through mpi4py) sees a world of 1: "
            f"that mpiexec belongs to another MPI, and each rank would train alone; start it with {use}")


def explain_missing_modules() -> None:
    """A command that dies on a missing module while starting prints missing_module_line (rank 0 of a job
    alone) and exits with status 2 instead of a traceback per rank."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        name = getattr(value, "name", None)
        if not issubclass(kind, ModuleNotFoundError) or not name or name.split(".")[0] == "llmz":
            return previous(kind, value, tb)
        if all(os.environ.get(v, "0") == "0" for v in LAUNCHER_RANK_VARS):
            print(missing_module_line(name.split(".")[0]), file=sys.stderr, flush=True)
        os._exit(2)
    sys.excepthook = hook


def mpi_library(library_version: str) -> str:
    """'MPICH 5.0.2' or 'Open MPI v4.1.5' from MPI.Get_library_version()'s text."""
    first = (library_version.strip().splitlines() or ["?"])[0]
    return " ".join(first.split(",")[0].replace("Version:", "").split())


# ---- a process of this host, from /proc ------------------------------------------------------------------
def process_state(pid: int | None) -> tuple[str | None, int | None]:
    """(state, start tick) of a process of this host: the state letter of /proc/PID/stat (R running, S
    sleeping, D in the kernel, T stopped, Z zombie: dead, not yet reaped by its parent) and its start time in
    clock ticks since boot (field 22: a pid reused by another process has another). (None, None): there is
    no such process. ("?", None): it exists, but there is no /proc to read (not Linux)."""
    if not isinstance(pid, int) or pid <= 0:
        return None, None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[19])
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None, None
    except PermissionError:
        pass                                    # it exists, under another user
    return "?", None
