"""python -m llmz.doctor: what this machine has, and what of llmz will or will not run on it, each gap with its fix.

One screen: Python and its environment, NumPy and its BLAS threads, Numba and numba-cuda, CuPy, NCCL, mpi4py
and the MPI library under it, the mpiexec on PATH (and whether it belongs to this environment), GPUs with
their bf16 support, cores. Then the commands that will run, and why the others will not. Exit status 0
when the CPU path works (a tiny model's forward pass on the NumPy references), 1 when it does not.

A Python without llmz's requirements does not get this far: llmz/run/environment.py says so in one line.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys

from .errors import LlmzError, print_out
from .run.environment import INSTALL, mpi_library


# ---- what this machine has ----------------------------------------------------------------------------------
def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def python_row() -> tuple[str, str | None]:
    venv = sys.prefix != sys.base_prefix
    where = f"virtual environment {sys.prefix}" if venv else "not in a virtual environment"
    fix = None if venv else "python3 -m venv .venv && . .venv/bin/activate, then " + INSTALL
    return f"{sys.version.split()[0]} ({sys.executable}; {where})", fix


def numpy_row() -> tuple[str, str | None]:
    if version("numpy") is None:
        return "not installed", INSTALL
    import numpy  # noqa: F401  (loads the BLAS whose pool is reported)

    from .run import threads
    try:
        pools = ", ".join(f"{k} {v} threads" for k, v in threads.pool_sizes().items()) or "no BLAS pool found"
    except ImportError:
        pools = "threadpoolctl missing: pool sizes unknown"
    n = threads.cores()
    return f"{version('numpy')} ({pools}; {n} cores: N ranks on this host get max(1, ({n} - 1) // N) each)", None


def numba_row() -> tuple[str, str | None]:
    nb, nc = version("numba"), version("numba-cuda")
    if nb is None or nc is None:
        return f"numba {nb or 'missing'}, numba-cuda {nc or 'missing'}", INSTALL
    return f"numba {nb}, numba-cuda {nc} (kernels on a GPU, or in its CUDA simulator: --device sim)", None


def mpi_rows() -> list[tuple[str, str, str | None]]:
    """mpi4py and its MPI library; the mpiexec on PATH and whether it is this environment's."""
    rows = []
    lib = None
    if version("mpi4py") is None:
        rows.append(("mpi4py", "not installed: one rank only", INSTALL))
    else:
        # in a process of its own: a broken libmpi may crash it, and MPI, once imported here uninitialised,
        # could not serve this process later
        code = "import mpi4py; mpi4py.rc.initialize = False\nfrom mpi4py import MPI; print(MPI.Get_library_version())"
        try:
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
            ok = out.returncode == 0
        except (OSError, subprocess.TimeoutExpired) as e:
            out, ok = e, False
        if ok:
            lib = mpi_library(out.stdout)
            rows.append(("mpi4py", f"{version('mpi4py')} on {lib}", None))
        else:
            why = str(getattr(out, "stderr", None) or out).strip().splitlines()[-1:] or ["?"]
            rows.append(("mpi4py", f"{version('mpi4py')}, but its MPI library does not load ({why[0][:100]})", INSTALL))
    on_path = shutil.which("mpiexec")
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if on_path is None:
        fix = f"activate this environment (. {os.path.dirname(sys.executable)}/activate)" \
            if os.path.exists(beside) else INSTALL
        rows.append(("mpiexec", "none on PATH", fix))
        return rows
    ours = os.path.realpath(on_path) == os.path.realpath(beside)
    try:
        out = subprocess.run([on_path, "--version"], capture_output=True, text=True, timeout=30, check=False)
        text = (out.stdout + out.stderr).lower()
    except (OSError, subprocess.TimeoutExpired):
        text = ""
    kind = "Open MPI" if "open mpi" in text or "openrte" in text else "MPICH (Hydra)" if "hydra" in text else "?"
    same_family = lib is None or ("open mpi" in lib.lower()) == (kind == "Open MPI")
    fix = None
    if not same_family:
        fix = (f"mpi4py runs on {lib.split()[0]}, this mpiexec is {kind}'s: every rank would run alone; use "
               + (beside if os.path.exists(beside) else "the mpiexec of mpi4py's MPI"))
    elif not ours and os.path.exists(beside):
        fix = f"not this environment's ({beside}): activate the environment so that its mpiexec comes first"
    rows.append(("mpiexec", f"{on_path} ({kind}" + ("; this environment's)" if ours else ")"), fix))
    return rows


def gpu_rows() -> list[tuple[str, str, str | None]]:
    """CuPy, NCCL and every GPU with its compute capability and bf16 support (tensor cores from sm_80)."""
    if version("cupy-cuda13x") is None and importlib.util.find_spec("cupy") is None:
        return [("cupy", "not installed: no GPU runs", 'pip install -e ".[gpu]" (on a machine with a CUDA GPU)')]
    try:
        import cupy
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001  (no driver, no device: CuPy raises its own kinds)
        why = (str(e).splitlines() or [""])[0][:80]
        return [("cupy", f"installed, but sees no GPU ({type(e).__name__}: {why})",
                 "check the NVIDIA driver: nvidia-smi")]
    rows = [("cupy", f"{cupy.__version__}, {n} GPU{'s' if n != 1 else ''}", None if n else "no CUDA device visible")]
    try:
        from cupy.cuda import nccl
        v = nccl.get_version()
        rows.append(("nccl", f"{v // 10000}.{v // 100 % 100}.{v % 100} (--comm nccl)", None))
    except Exception as e:  # noqa: BLE001
        rows.append(("nccl", f"not available ({type(e).__name__}); ranks use MPI", 'pip install nvidia-nccl-cu13'))
    for i in range(n):
        p = cupy.cuda.runtime.getDeviceProperties(i)
        cc = (p["major"], p["minor"])
        bf16 = cc >= (8, 0)
        name = p["name"].decode() if isinstance(p["name"], bytes) else p["name"]
        what = f"{name}, sm_{cc[0]}{cc[1]}, {p['totalGlobalMem'] / 2**30:.0f} GiB"
        rows.append((f"gpu {i}", f"{what}; bf16 {'yes' if bf16 else 'no'}",
                     None if bf16 else "bf16 needs sm_80 or newer (A100, H100): train in fp32 (the default)"))
    return rows


def optional_rows() -> list[tuple[str, str, str | None]]:
    rows = []
    for dist, use, fix in (("tiktoken", "--tokenizer gpt2", 'pip install -e ".[bpe]"'),
                           ("threadpoolctl", "one BLAS pool per rank", INSTALL),
                           ("matplotlib", "figures: llmz.plot, --trace, the lessons", INSTALL)):
        v = version(dist)
        rows.append((dist, f"{v} ({use})" if v else f"not installed ({use} will not run)", None if v else fix))
    return rows


def cpu_path_works() -> str | None:
    """Run a tiny model's forward pass on the NumPy references; None when it works, else why not."""
    try:
        import numpy as np

        from .config import preset
        from .device import Device
        from .layout import Layout, init_parameters
        from .model import GPT2, FullParams
        cfg = preset("tiny", vocab_size=256, max_seq_len=16)
        layout = Layout(cfg, 1)
        model = GPT2(cfg, Device("cpu", np.float32), 1, 8)
        ids = np.arange(8, dtype=np.int32).reshape(1, 8)
        model.forward(FullParams(layout, init_parameters(layout, 0).astype(np.float32)), ids, ids)
        loss = model.mean_loss()
        return None if np.isfinite(loss) else f"a tiny model's loss came out {loss}"
    except Exception as e:  # noqa: BLE001  (whatever breaks, the doctor reports it in a line)
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def report() -> tuple[list[str], bool]:
    """The screen's lines, and whether the CPU path works."""
    rows = [("python", *python_row()), ("numpy", *numpy_row()), ("numba", *numba_row())]
    rows += mpi_rows() + gpu_rows() + optional_rows()
    cpu = cpu_path_works()
    gpus = [r for r in rows if r[0].startswith("gpu ")]
    has = {name: fix is None for name, _, fix in rows}
    mpi = has.get("mpi4py") and has.get("mpiexec")
    runs = [("python -m llmz.train --device cpu", cpu is None, cpu or "", "the NumPy references"),
            ("python -m llmz.train --device sim --model tiny", cpu is None and has["numba"], "",
             "the kernels in Numba's CUDA simulator (slow: tiny models)"),
            ("mpiexec -n 2 python -m llmz.train", cpu is None and mpi, next((f for n, _, f in rows if n in (
                "mpi4py", "mpiexec") and f), ""), "ranks over MPI"),
            ("python -m llmz.train --device gpu", bool(gpus), next((f for n, _, f in rows if n == "cupy" and f),
                                                                   "no GPU"), "the fast kernels on the GPU"),
            ("--precision bf16 on the GPU", any(f is None for *_, f in gpus), "needs a GPU of sm_80 or newer",
             "bf16 tensor cores"),
            ("mpiexec -n 2 ... --comm nccl", len(gpus) >= 2 and has.get("nccl", False),
             f"needs a GPU per rank ({len(gpus)} here) and CuPy's NCCL", "NCCL between GPUs"),
            ("--tokenizer gpt2", has["tiktoken"], 'pip install -e ".[bpe]"', "GPT-2's BPE")]
    width = max(len(name) for name, *_ in rows)
    lines = ["llmz doctor: what this machine has"]
    for name, text, fix in rows:
        lines.append(f"  {name:<{width}}  {text}" + (f"\n  {'':<{width}}  -> {fix}" if fix else ""))
    lines.append("what will run")
    for cmd, ok, why, what in runs:
        lines.append(f"  {'yes' if ok else 'no ':<3}  {cmd:<48} " + (what if ok else f"-> {why}"))
    return lines, cpu is None


def main(argv=None) -> int:
    import argparse
    argparse.ArgumentParser(prog="python -m llmz.doctor", description=__doc__.splitlines()[0]).parse_args(argv)
    lines, cpu_ok = report()
    try:
        print_out("\n".join(lines))
    except LlmzError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    if not cpu_ok:
        print("the CPU path does not work: llmz cannot train here until the lines marked -> are fixed",
              file=sys.stderr)
    return 0 if cpu_ok else 1


if __name__ == "__main__":
    sys.exit(main())
