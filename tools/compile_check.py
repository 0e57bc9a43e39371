"""Compile every GPU kernel for sm_90 without a GPU: Numba -> PTX (libnvvm), then ptxas -> registers and spills.

    python tools/compile_check.py [--only SUBSTRING] [--ptx-dir DIR] [--dev]

The simulator runs the kernels' Python, not their compiled form: a kernel that only a GPU compiles (warp
shuffles, launch bounds, syncwarp, the bf16 overloads' typing) can break unseen on a CPU machine. This script
compiles each fast kernel (llmz/fast/) and each teaching kernel (llmz/kernels/) with the argument types the
layer functions pass on a GPU, in float32 and bf16 (arrays as CuPy hands them to Numba: C-contiguous; bf16 as
uint16, paired words as uint32 / uint64), assembles the PTX with ptxas and prints one line a kernel: registers,
spill bytes, stack frame bytes, the PTX's size. --ptx-dir writes each PTX with its mangled names numbered, to
diff two trees (a refactor of a kernel's source that leaves its PTX the same changes nothing that runs).
--dev compiles the candidate versions kept in dev/<layer>.py too (kernels built per width C at each of
GPT-2's widths).
Needs the CUDA toolkit (libnvvm, libdevice, ptxas), not a GPU or a driver. Exit status 1 if any fails.
"""
from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
import tempfile
import types as pytypes

if __name__ == "__main__":
    # before numba is imported: compile for sm_90 without asking a driver which GPU there is
    os.environ.pop("NUMBA_ENABLE_CUDASIM", None)
    os.environ.setdefault("NUMBA_FORCE_CUDA_CC", "9.0")
    for home in ("/usr/local/cuda", "/usr/local/cuda-13.0"):
        if os.path.isdir(os.path.join(home, "nvvm")):
            os.environ.setdefault("CUDA_HOME", home)
            break
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from numba import cuda, types

f32, f64, u16, u32, u64, i32, i64, b1 = (types.float32, types.float64, types.uint16, types.uint32, types.uint64,
                                         types.int32, types.int64, types.boolean)


# the widths C of GPT-2's sizes (d12, d24, d36, d48): the kernels built per width are compiled at each
WIDTHS = (768, 1024, 1280, 1600)


def A(dtype, ndim=1):
    """A C-contiguous device array type."""
    return types.Array(dtype, ndim, "C")


def value(bf16: bool):
    """The storage of values (activations, parameters): float32, or bf16 bits."""
    return u16 if bf16 else f32


def word(bf16: bool):
    """A paired view's word: two bf16 in a uint32, two float32 in a uint64."""
    return u32 if bf16 else u64


def signatures(bf16: bool) -> dict:
    """"module:kernel" -> argument types, as the layer functions launch it on a GPU: the fast set's, the
    teaching set's, and those of the precision's own kernels."""
    sigs = {**fast_signatures(bf16), **teaching_signatures(bf16)}
    sigs.update(precision_signatures(bf16))
    return sigs


def fast_signatures(bf16: bool) -> dict:
    v, w = value(bf16), word(bf16)
    ln_fwd, ln_bwd = layernorm_signatures(bf16)
    return {
        # ---- the fast set ----
        "llmz.fast.gelu:gelu_forward_pairs_kernel": (A(w), A(w), i64),
        "llmz.fast.gelu:gelu_backward_pairs_kernel": (A(w), A(w), A(w), i64, b1),
        "llmz.fast.residual:residual_forward_pairs_kernel": (A(w), A(w), A(w), i64),
        "llmz.fast.residual:residual_backward_pairs_kernel": (A(w), A(w), A(w), i64),
        "llmz.fast.layernorm:layernorm_forward_warp_kernel": ln_fwd,
        "llmz.fast.layernorm:layernorm_forward_warp_loop_kernel": ln_fwd,
        "llmz.fast.layernorm:layernorm_backward_inp_warp_kernel": ln_bwd,
        "llmz.fast.layernorm:layernorm_backward_inp_warp_loop_kernel": ln_bwd,
        "llmz.fast.layernorm:layernorm_backward_params_kernel": (A(v), A(v), A(f64, 2), A(f64, 2), A(i32), A(v, 2),
                                                                 A(v, 2), A(f32), A(f32), i64),
        "llmz.fast.column_sum:column_sum_kernel": (A(v), A(f64, 2), A(i32), A(v, 2), i64),
        "llmz.fast.column_sum:column_sum_pairs_kernel": (A(v), A(f64, 2), A(i32), A(w, 2), i64),
        "llmz.fast.matmul:matmul_bias_fill_kernel": (A(w, 2), A(w)),
        "llmz.fast.encoder:encoder_backward_wte_bucket_kernel": (A(v, 2), A(v, 2), A(i32)),
        "llmz.fast.classifier:classifier_fused_kernel": (A(f32), A(v, 2), A(i32), f64, i64),
        "llmz.fast.classifier:classifier_loss_kernel": (A(f32), A(v, 2), A(i32), i64),
        "llmz.fast.classifier:classifier_fused_pairs_kernel": (A(f32), A(w, 2), A(i32), f64, i64),
        "llmz.fast.classifier:classifier_loss_pairs_kernel": (A(f32), A(w, 2), A(i32), i64),
        "llmz.fast.attention:softmax_rows_pairs_regs_kernel": (A(w, 3), A(w, 3), b1),
        "llmz.fast.attention:softmax_rows_pairs_kernel": (A(w, 3), A(w, 3), b1),
        "llmz.fast.attention:softmax_rows_backward_pairs_kernel": (A(w, 3), A(w, 3), A(w, 3), b1),
        # flash attention on tensor cores (bf16 pairs as uint32 words; the same kernels whatever the values)
        "llmz.fast.flash_attention:flash_forward_mma_kernel": (A(u32, 3), A(f32, 3), A(u32, 3), f32),
        "llmz.fast.flash_attention:flash_rowsum_kernel": (A(f32, 3), A(u32, 3), A(u32, 3)),
        "llmz.fast.flash_attention:flash_dkv_mma_kernel": (A(u32, 3), A(u32, 3), A(u32, 3), A(f32, 3), A(f32, 3),
                                                           f32, f32, b1),
        "llmz.fast.flash_attention:flash_dq_mma_kernel": (A(u32, 3), A(u32, 3), A(u32, 3), A(f32, 3), A(f32, 3),
                                                          f32, f32, b1),
        "llmz.fast.mma:mma_tile_kernel": (A(f32, 2), A(u32, 2), A(u32, 2), A(u32, 2), A(f32, 2)),
        "llmz.fast.mma:tile_probe_kernel": (A(u32), A(f32), A(u32, 3), A(u32, 3), A(u32, 2), A(u32, 2), A(f32),
                                            i64),
    }


def layernorm_signatures(bf16: bool) -> tuple:
    """The layernorm forward's and backward's argument types, alike in both sets."""
    v = value(bf16)
    return (A(v, 2), A(f32), A(f32), A(v, 2), A(v), A(v)), (A(v, 2), A(v, 2), A(v, 2), A(v), A(f32), A(f32))


def teaching_signatures(bf16: bool) -> dict:
    v = value(bf16)
    ln_fwd, ln_bwd = layernorm_signatures(bf16)
    return {
        # ---- the teaching set ----
        "llmz.kernels.encoder:encoder_forward_kernel": (A(v, 3), A(i32, 2), A(v, 2), A(v, 2)),
        "llmz.kernels.encoder:encoder_backward_wpe_kernel": (A(v, 2), A(v, 3)),
        "llmz.kernels.encoder:encoder_backward_wte_kernel": (A(v, 2), A(v, 3), A(i32, 2)),
        "llmz.kernels.layernorm:layernorm_forward_kernel": ln_fwd,
        "llmz.kernels.layernorm:layernorm_backward_inp_kernel": ln_bwd,
        "llmz.kernels.layernorm:layernorm_backward_params_kernel": (A(v), A(v), A(v, 2), A(v, 2), A(f32), A(f32)),
        "llmz.kernels.gemm:gemm_tiled_kernel": (A(v, 3), A(v, 3), A(v, 3), b1, b1, b1, f64),
        "llmz.kernels.matmul:matmul_forward_bias_kernel": (A(v, 2), A(v)),
        "llmz.kernels.matmul:matmul_backward_bias_kernel": (A(v), A(v, 2)),
        "llmz.kernels.attention:attention_scores_kernel": (A(v, 4), A(v, 3), i64, A(v, 3), i64, i64, f64),
        "llmz.kernels.attention:attention_softmax_kernel": (A(v, 4), A(v, 4)),
        "llmz.kernels.attention:attention_values_kernel": (A(v, 3), A(v, 4), A(v, 3)),
        "llmz.kernels.attention:attention_softmax_backward_kernel": (A(v, 4), A(v, 4), A(v, 4)),
        "llmz.kernels.attention:attention_dinp_kernel": (A(v, 3), A(v, 4), A(v, 4), A(v, 3), A(v, 3), f64),
        "llmz.kernels.flash_attention:flash_attention_forward_kernel": (A(v, 3), A(f32, 3), A(v, 3), f64),
        "llmz.kernels.flash_attention:flash_attention_rowsum_kernel": (A(f32, 3), A(v, 3), A(v, 3)),
        "llmz.kernels.flash_attention:flash_attention_dkv_kernel": (A(v, 3), A(v, 3), A(v, 3), A(f32, 3), A(f32, 3),
                                                                    f64, b1),
        "llmz.kernels.flash_attention:flash_attention_dq_kernel": (A(v, 3), A(v, 3), A(v, 3), A(f32, 3), A(f32, 3),
                                                                   f64, b1),
        "llmz.kernels.gelu:gelu_forward_kernel": (A(v), A(v), i64),
        "llmz.kernels.gelu:gelu_backward_kernel": (A(v), A(v), A(v), i64, b1),
        "llmz.kernels.residual:residual_forward_kernel": (A(v), A(v), A(v), i64),
        "llmz.kernels.residual:residual_backward_kernel": (A(v), A(v), A(v), i64),
        "llmz.kernels.classifier:classifier_forward_kernel": (A(f32), A(v, 2), A(v, 2), A(i32), i64),
        "llmz.kernels.classifier:classifier_backward_kernel": (A(v), A(v), A(i32), f64, i64, i64, i64),
        "llmz.kernels.norm:norm_partial_kernel": (A(f64), A(v), i64),
        "llmz.kernels.norm:norm_final_kernel": (A(f64), A(f64), i64, b1),
        "llmz.kernels.norm:clip_scale_kernel": (A(f64), A(f64), f64),
        "llmz.kernels.fill:fill_kernel": (A(v), i64, f64),
    }


def precision_signatures(bf16: bool) -> dict:
    """The kernels of the precision alone: bf16's conversions, AdamW and shard accumulation, or fp32's."""
    if bf16:
        return {
            "llmz.fast.adamw:adamw_bf16_pairs_kernel": (A(u32), A(u64), A(u32), A(u64), A(u64), i64, A(f64), f64,
                                                        f64, f64, f64, b1, u64, u64, i64),
            "llmz.kernels.adamw:adamw_bf16_kernel": (A(u16), A(f32), A(u16), A(f32), A(f32), i64, A(f64), f64, f64,
                                                     f64, f64, b1, u64, u64, i64),
            "llmz.kernels.accumulate:accumulate_shard_bf16_kernel": (A(u16), A(u16), i64, i64, i64, b1, u64,
                                                                     A(u64), u64),
            "llmz.kernels.bf16:to_bf16_kernel": (A(u16), A(f32), b1, u64, u64, u64, i64),
            "llmz.kernels.bf16:from_bf16_kernel": (A(f32), A(u16), i64),
        }
    return {
        "llmz.kernels.adamw:adamw_kernel": (A(f32), A(f32), A(f32), A(f32), i64, A(f64), f64, f64, f64, f64, i64),
        "llmz.kernels.accumulate:accumulate_shard_kernel": (A(f32), A(f32), i64, i64, i64),
    }


def dev_signatures(bf16: bool) -> dict:
    """The candidate versions kept in dev/<layer>.py (--dev), as their layer functions launch them on a GPU:
    "dev.module:kernel", or "dev.module:factory@C" for a kernel built per width C (at every GPT-2 width)."""
    v = value(bf16)
    flat_fwd = (A(v), A(f32), A(f32), A(v), A(v), A(v))
    sigs = {
        "dev.gelu:gelu_forward_units_kernel": (A(v), A(v), i64),
        "dev.gelu:gelu_backward_units_kernel": (A(v), A(v), A(v), i64, b1),
        "dev.residual:residual_forward_units_kernel": (A(v), A(v), A(v), i64),
        "dev.residual:residual_backward_units_kernel": (A(v), A(v), A(v), i64),
        "dev.column_sum:column_sum_units_kernel": (A(v), A(v), i64, A(f64, 2), A(i32), A(v), i64),
        "dev.column_sum:column_sum_units_kernel#layernorm": (A(v), A(v), i64, A(f64, 2), A(i32), A(f32), i64),
        "dev.matmul:matmul_bias_fill_units_kernel": (A(v), A(v), i64),
        "dev.encoder:encoder_forward_units_kernel": (A(v), A(i32), A(v), A(v), i64, i64, i64),
        "dev.encoder:encoder_backward_wte_units_kernel": (A(v), A(v), A(i32), i64),
        "dev.encoder:encoder_backward_wpe_units_kernel": (A(v), A(v), i64, i64, i64),
    }
    for C in WIDTHS:
        sigs[f"dev.layernorm:forward_kernel@{C}"] = flat_fwd + (A(v), A(v))
        sigs[f"dev.layernorm:forward_kernel@{C},1#residual"] = flat_fwd + (A(v), A(v))
        sigs[f"dev.layernorm:backward_kernel@{C}"] = (A(v), A(f32), A(v), A(v), A(v), A(f32), A(f32))
    if bf16:
        sigs.update({
            "dev.classifier:units_kernel@50304,1024": (A(f32), A(u16), A(i32), f64, i64, b1),
            "dev.adamw:adamw_bf16_units_kernel": (A(u16), A(f32), A(u16), A(f32), A(f32), i64, A(f64), f64, f64,
                                                  f64, f64, b1, u64, u64, i64),
        })
    return sigs


def numbered(ptx: str) -> str:
    """The PTX with its mangled names (which carry the module path) and its shared arrays' names (a counter of
    the process: they change with what was compiled before) numbered in order of appearance."""
    names: dict[str, str] = {}
    return re.sub(r"_Z\w+|_cudapy_smem_\d+", lambda m: names.setdefault(m.group(0), f"NAME{len(names)}"), ptx)


def kernel_of(target: str):
    """The kernel a target names: "module:kernel", or "module:factory@C" (or "@C,N") for a kernel built per
    width C (and block N); a "#note" at the end tells two signatures of one kernel apart."""
    module, name = target.split("#")[0].split(":")
    name, _, width = name.partition("@")
    obj = getattr(importlib.import_module(module), name)
    return obj(*(int(n) for n in width.split(","))) if width else obj


def compile_one(target: str, sig: tuple) -> tuple[str, dict]:
    """(PTX, {registers, spill bytes, stack frame bytes}) of one kernel."""
    kernel = kernel_of(target)
    bounds = kernel.targetoptions.get("launch_bounds")
    fastmath = kernel.targetoptions.get("fastmath", False)        # as the kernel's own jit compiles it
    ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0), launch_bounds=bounds, fastmath=fastmath)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        out = subprocess.run(["ptxas", "-arch=sm_90", "-v", path, "-o", os.path.join(tmp, "k.cubin")],
                             check=False, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stderr.strip())
    stats = {"registers": int(re.search(r"Used (\d+) registers", out.stderr).group(1)),
             "spill": sum(int(x) for x in re.findall(r"(\d+) bytes spill", out.stderr)),
             "stack": sum(int(x) for x in re.findall(r"(\d+) bytes stack frame", out.stderr))}
    return ptx, stats


def without_a_gpu() -> None:
    """Device functions compile for "the current device": there is none, so say it is an H200 (sm_90); libdevice
    is found through CUDA_HOME, and NVRTC (not installed here) is not needed to compile Python kernels."""
    from numba.cuda import cuda_paths, dispatcher
    dispatcher.get_current_device = lambda: pytypes.SimpleNamespace(compute_capability=(9, 0))
    cuda_paths._get_nvrtc_path = lambda: cuda_paths._env_path_tuple("not needed", None)


def main(argv=None) -> int:
    without_a_gpu()
    p = argparse.ArgumentParser(prog="python tools/compile_check.py", description=__doc__.splitlines()[0])
    p.add_argument("--only", default="", help="kernels whose module:name contains this")
    p.add_argument("--ptx-dir", default=None, help="write each kernel's PTX (names numbered) here")
    p.add_argument("--dev", action="store_true",
                   help="also the candidate versions kept in dev/<layer>.py (not yet in llmz/fast/)")
    args = p.parse_args(argv)
    failed = 0
    for bf16 in (False, True):
        targets = {**signatures(bf16), **(dev_signatures(bf16) if args.dev else {})}
        for target, sig in targets.items():
            if args.only not in target:
                continue
            tag = f"{target.split(':')[1]} ({'bf16' if bf16 else 'fp32'})"
            try:
                ptx, stats = compile_one(target, sig)
            except Exception as e:
                failed += 1
                print(f"FAIL {target} ({'bf16' if bf16 else 'fp32'}): {str(e).splitlines()[-1] if str(e) else e!r}")
                continue
            print(f"ok   {tag:<58} {stats['registers']:>4} registers, {stats['spill']:>4} bytes spilled, "
                  f"{stats['stack']:>4} bytes stack, PTX {len(ptx):>7} chars   [{target.split(':')[0]}]")
            if args.ptx_dir:
                os.makedirs(args.ptx_dir, exist_ok=True)
                name = f"{target.replace(':', '.')}_({'bf16' if bf16 else 'fp32'}).ptx"     # unique per kernel
                with open(os.path.join(args.ptx_dir, name), "w") as f:
                    f.write(numbered(ptx))
    print(f"{failed} of the kernels failed to compile" if failed else "every kernel compiled for sm_90")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
