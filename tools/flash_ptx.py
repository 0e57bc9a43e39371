"""Compile the fast flash-attention kernels for sm_90 without a GPU and report ptxas's registers and spills.

    NUMBA_FORCE_CUDA_CC=9.0 python tools/flash_ptx.py [OUTDIR]

Needs the CUDA toolkit's libnvvm and ptxas (not a GPU, not NVRTC). Writes OUTDIR/<kernel>.ptx (default
/tmp/flash_ptx) and prints, per kernel, the mma count in the PTX, local-memory use, float64 instructions
(there should be none) and ptxas's summary line.
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
    "flash_forward_mma_kernel": (u32_3d, f32_3d, u32_3d, f32),
    "flash_rowsum_kernel": (f32_3d, u32_3d, u32_3d),
    "flash_dkv_mma_kernel": (u32_3d, u32_3d, u32_3d, f32_3d, f32_3d, f32, f32, b1),
    "flash_dq_mma_kernel": (u32_3d, u32_3d, u32_3d, f32_3d, f32_3d, f32, f32, b1),
}


def main(outdir="/tmp/flash_ptx"):
    os.makedirs(outdir, exist_ok=True)
    for name, sig in KERNELS.items():
        kernel = getattr(mma if name.startswith("mma") else fa, name)
        bounds = kernel.targetoptions.get("launch_bounds")
        ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0), fastmath=True, launch_bounds=bounds)
        path = os.path.join(outdir, name + ".ptx")
        with open(path, "w") as f:
            f.write(ptx)
        r = subprocess.run(["ptxas", "-arch=sm_90", "-v", path, "-o", os.devnull], check=False,
                           capture_output=True, text=True)
        info = " ".join(line.split("info    : ", 1)[-1].strip() for line in r.stderr.splitlines()
                        if "registers" in line or "spill" in line)
        f64 = len(re.findall(r"\.f64", ptx))
        print(f"{name}: {ptx.count('mma.sync')} mma, {ptx.count('ld.local') + ptx.count('st.local')} local ld/st, "
              f"{f64} f64 ops; ptxas: {info or r.stderr.strip()}")


if __name__ == "__main__":
    main(*sys.argv[1:])
