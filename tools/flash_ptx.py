"""Compile the fast flash-attention kernels for sm_90 without a GPU and report ptxas's registers and spills.

    NUMBA_FORCE_CUDA_CC=9.0 python tools/flash_ptx.py [OUTDIR] [--dev] [--only=NAME]

Needs the CUDA toolkit's libnvvm and ptxas (not a GPU, not NVRTC). Writes OUTDIR/<kernel>.ptx and .cubin
(default /tmp/flash_ptx) and prints, per kernel, the counts of the instructions that matter in the PTX (mma,
ldmatrix, cp.async, 16-byte loads), local-memory use, float64 instructions (there should be none) and
ptxas's summary line (registers, spills, shared memory). --dev: also dev/flash_attention.py's versions'
kernels (version 1's, and llmz.fast's source compiled at the other versions' block shapes and head sizes);
--only=SUBSTRING (repeatable): just the kernels whose names contain it. ptxas's error for more than 48 KiB
of static shared memory comes out in its place.
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
from numba.cuda.cudadrv import nvrtc

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
    """dev/flash_attention.py's versions' kernels that are not llmz.fast's: (label, kernel, signature)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from dev import flash_attention as dev
    from dev import flash_attention_v1 as v1
    fwd_sig, bwd_sig = KERNELS["flash_forward_mma_kernel"], KERNELS["flash_dq_mma_kernel"]
    todo = [("dev_v1_forward", v1.flash_forward_mma_kernel, fwd_sig),
            ("dev_v1_rowsum", v1.flash_rowsum_kernel, KERNELS["flash_rowsum_kernel"]),
            ("dev_v1_dkv", v1.flash_dkv_mma_kernel, bwd_sig), ("dev_v1_dq", v1.flash_dq_mma_kernel, bwd_sig)]
    # version 7's dq kernel takes (dsum, out) where the others take dsum
    d_out = types.Tuple((f32_3d, u32_3d))
    dq_d_out = bwd_sig[:4] + (d_out,) + bwd_sig[5:]
    for ver, (_, mod, *_) in dev.VERSIONS.items():
        if mod is None or mod is fa:
            continue
        for name in ("flash_forward_mma_kernel", "flash_dkv_mma_kernel", "flash_dq_mma_kernel"):
            d_in_dq = mod.load_query_rows is dev.load_query_rows_with_d
            sig = dq_d_out if d_in_dq and name == "flash_dq_mma_kernel" else KERNELS[name]
            todo.append((f"dev_v{ver}_{name[6:-11]}", getattr(mod, name), sig))
        if mod.HS != fa.HS:
            todo.append((f"dev_v{ver}_rowsum", mod.flash_rowsum_kernel, KERNELS["flash_rowsum_kernel"]))
    u32_3d_in = types.uint32[:, :, ::1]
    todo.append(("dev_v12_forward_wgmma", dev.wg.flash_forward_wgmma_kernel, fwd_sig, "a"))
    todo.append(("dev_wgmma_probe", dev.wg.wgmma_probe_kernel, (types.float32[:, ::1],) * 2 + (u32_3d_in,) * 4, "a"))
    return todo


def compile_and_report(name, kernel, sig, outdir, arch=""):
    """arch "a": for sm_90a, the instructions of Hopper alone (wgmma; on the GPU, Numba compiles for sm_90a)."""
    bounds = kernel.targetoptions.get("launch_bounds")
    arch_option = nvrtc.get_arch_option                  # "compute_90", or "compute_90a" for arch "a"
    nvrtc.get_arch_option = lambda *cc: arch_option(*cc) + arch
    try:
        ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0), fastmath=True, launch_bounds=bounds)
    finally:
        nvrtc.get_arch_option = arch_option
    path = os.path.join(outdir, name + ".ptx")
    with open(path, "w") as f:
        f.write(ptx)
    r = subprocess.run(["ptxas", f"-arch=sm_90{arch}", "-v", path, "-o", path[:-4] + ".cubin"], check=False,
                       capture_output=True, text=True)
    info = " ".join(line.split("info    : ", 1)[-1].strip() for line in r.stderr.splitlines()
                    if "registers" in line or "spill" in line)
    f64 = len(re.findall(r"\.f64", ptx))
    counts = {"mma": ptx.count("mma.sync"), "wgmma": ptx.count("wgmma.mma_async"), "ldmatrix": ptx.count("ldmatrix"),
              "cp.async": ptx.count("cp.async."), "ld.v4": len(re.findall(r"ld(\.global)?\.v4", ptx))}
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
    for name, kernel, sig, *arch in todo:
        if only and not any(o in name for o in only):
            continue
        compile_and_report(name, kernel, sig, outdir, *arch)


if __name__ == "__main__":
    main(*sys.argv[1:])
