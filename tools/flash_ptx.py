"""Compile the fast flash-attention kernels for sm_90 without a GPU and report ptxas's registers and spills.

    NUMBA_FORCE_CUDA_CC=9.0 python tools/flash_ptx.py [OUTDIR] [--dev] [--only=NAME]

Needs the CUDA toolkit's libnvvm and ptxas (not a GPU, not NVRTC). Writes OUTDIR/<kernel>.ptx and .cubin
(default /tmp/flash_ptx) and prints, per kernel, the counts of the instructions that matter in the PTX (mma,
ldmatrix, cp.async, 16-byte loads), local-memory use, float64 instructions (there should be none) and
ptxas's summary line (registers, spills, shared memory). --dev: also dev/flash_attention.py's versions'
kernels that llmz.fast does not have (version 1's, and the other block shapes of versions 2, 3, 6);
--only=SUBSTRING (repeatable): just the kernels whose names contain it.
"""
import os
import re
import subprocess
import sys

os.environ.setdefault("NUMBA_FORCE_CUDA_CC", "9.0")
os.environ.pop("NUMBA_ENABLE_CUDASIM", None)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from numba import cuda, types
from numba.cuda import cuda_paths

# compile_ptx asks for NVRTC's path only to report it; without NVRTC installed, answer "none"
cuda_paths._get_nvrtc_path = lambda: cuda_paths._env_path_tuple("none", None)
# a device function compiles for the current device's compute capability: without a GPU, say sm_90
from numba.cuda import dispatcher

dispatcher.get_current_device = lambda: type("Sm90", (), {"compute_capability": (9, 0)})()

from llmz.fast import flash_attention as fa
from llmz.fast import mma

u32_3d, f32_3d = types.uint32[:, :, ::1], types.float32[:, :, ::1]
f32, b1 = types.float32, types.boolean
KERNELS = {
    "mma_tile_kernel": (types.float32[:, ::1], types.uint32[:, ::1], types.uint32[:, ::1], types.uint32[:, ::1],
                        types.float32[:, ::1]),
    "tile_probe_kernel": (types.uint32[::1], types.float32[::1], types.uint32[:, :, ::1], types.uint32[:, :, ::1],
                          types.uint32[:, ::1], types.uint32[:, ::1], types.float32[::1], types.int64),
    "flash_forward_mma_kernel": (u32_3d, f32_3d, u32_3d, f32),
    "flash_rowsum_kernel": (f32_3d, u32_3d, u32_3d),
    "flash_dkv_mma_kernel": (u32_3d, u32_3d, u32_3d, f32_3d, f32_3d, f32, f32, b1),
    "flash_dq_mma_kernel": (u32_3d, u32_3d, u32_3d, f32_3d, f32_3d, f32, f32, b1),
}


def dev_kernels():
    """dev/flash_attention.py's kernels that are not llmz.fast's: (label, kernel, signature)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dev"))
    import flash_attention as dev
    import flash_attention_v1 as v1
    fwd_sig, bwd_sig = KERNELS["flash_forward_mma_kernel"], KERNELS["flash_dq_mma_kernel"]
    return [("dev_v1_forward", v1.flash_forward_mma_kernel, fwd_sig),
            ("dev_v1_rowsum", v1.flash_rowsum_kernel, KERNELS["flash_rowsum_kernel"]),
            ("dev_v1_dkv", v1.flash_dkv_mma_kernel, bwd_sig), ("dev_v1_dq", v1.flash_dq_mma_kernel, bwd_sig),
            ("dev_rows64_forward", dev.FWD64, fwd_sig), ("dev_rows64_dq", dev.DQ64, bwd_sig),
            ("dev_rows64_dq_2blocks", dev.DQ64B2, bwd_sig),
            ("dev_rows128_forward", dev.FWD128, fwd_sig), ("dev_rows128_dkv", dev.DKV128, bwd_sig)]


def compile_and_report(name, kernel, sig, outdir):
    bounds = kernel.targetoptions.get("launch_bounds")
    ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0), fastmath=True, launch_bounds=bounds)
    path = os.path.join(outdir, name + ".ptx")
    with open(path, "w") as f:
        f.write(ptx)
    r = subprocess.run(["ptxas", "-arch=sm_90", "-v", path, "-o", path[:-4] + ".cubin"], check=False,
                       capture_output=True, text=True)
    info = " ".join(line.split("info    : ", 1)[-1].strip() for line in r.stderr.splitlines()
                    if "registers" in line or "spill" in line)
    f64 = len(re.findall(r"\.f64", ptx))
    counts = {"mma": ptx.count("mma.sync"), "ldmatrix": ptx.count("ldmatrix"), "cp.async": ptx.count("cp.async."),
              "ld.v4": len(re.findall(r"ld(\.global)?\.v4", ptx))}
    print(f"{name}: " + "".join(f"{v} {k}, " for k, v in counts.items() if v)
          + f"{ptx.count('ld.local') + ptx.count('st.local')} local ld/st, {f64} f64 ops; ptxas: "
          + (info or r.stderr.strip()), flush=True)


def main(*args):
    outdir = next((a for a in args if not a.startswith("--")), "/tmp/flash_ptx")
    os.makedirs(outdir, exist_ok=True)
    todo = [(name, getattr(mma if hasattr(mma, name) else fa, name), sig) for name, sig in KERNELS.items()]
    if "--dev" in args:
        todo += dev_kernels()
    only = [a.split("=", 1)[1] for a in args if a.startswith("--only=")]
    for name, kernel, sig in todo:
        if only and not any(o in name for o in only):
            continue
        compile_and_report(name, kernel, sig, outdir)


if __name__ == "__main__":
    main(*sys.argv[1:])
