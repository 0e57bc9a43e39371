"""The fast kernels (llm.c's llmc/ role): the GPU kernels that won, one file per layer named as its teaching
twin in llmz/kernels/ (llmz/kernels/layernorm.py <-> llmz/fast/layernorm.py). Each file opens with the
teaching kernel it replaces, what it changes and the contract it keeps (the same bits, or a stated
tolerance), and each is tested against that teaching kernel. The history of how they got fast is in
BENCHMARKS.md; `python -m llmz.bench --layer NAME` times one layer's teaching and fast versions.

This package is an op set (llmz.device.op_set): the same layer functions as llmz.kernels, with the same
names and arguments: the fast version where there is one, the teaching one otherwise (imported from
llmz.kernels below; tests/test_kernel_sets.py checks the three sets offer the same). It assumes a Device with
kernels (gpu, or the simulator, which emulates its warp shuffles); cuBLAS needs a GPU.

    device_helpers.py  warp reductions, words of two elements, four slots a thread, launch helpers
    column_sum.py      the one-launch deterministic column sums (matmul's bias gradient, layernorm's pieces)
    gemm.py            cuBLAS (TF32 / bf16 tensor cores) through our own ctypes handle
    mma.py             tensor cores from Numba: the mma.sync, ldmatrix and cp.async intrinsics (inline PTX)
"""
# no fast version: the teaching kernels
from ..kernels import (
    accumulate_shard,
    accumulate_shard_bf16,
    adamw_update,
    classifier_backward,
    classifier_forward,
    clip_scale,
    encoder_forward,
    from_bf16,
    norm_squared,
    sum_into,
    to_bf16,
)

# the fast versions
from .adamw import adamw_update_bf16
from .attention import attention_backward, attention_forward
from .classifier import classifier_fused, classifier_loss
from .encoder import encoder_backward
from .fill import fill, zero
from .flash_attention import flash_attention_backward, flash_attention_forward
from .gelu import gelu_backward, gelu_forward
from .layernorm import layernorm_backward, layernorm_forward
from .matmul import matmul_backward, matmul_forward
from .residual import residual_backward, residual_forward
