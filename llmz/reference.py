"""The reference op set: every layer function of llmz.kernels (the same names, the same arguments, the Device
first) computed by its NumPy reference, the `*_ref` function written beside the kernels in
llmz/kernels/<layer>.py. It is what a cpu Device runs (llmz.device.op_set) and what the kernels are tested
against. The Device, the stream and the fast set's hints (encoder_backward's buckets, attention's
upper_is_zero) mean nothing on the host: everything runs in program order, on NumPy arrays.
"""
from __future__ import annotations

import functools
import inspect

from .kernels.accumulate import accumulate_shard_bf16_ref, accumulate_shard_ref, check_split
from .kernels.adamw import adamw_update_bf16_ref, adamw_update_ref
from .kernels.attention import attention_backward_ref, attention_forward_ref
from .kernels.bf16 import from_bf16_ref, to_bf16_ref
from .kernels.classifier import (
    classifier_backward_ref,
    classifier_forward_ref,
    classifier_fused_ref,
    classifier_loss_ref,
)
from .kernels.encoder import encoder_backward_ref, encoder_forward_ref
from .kernels.fill import fill_ref
from .kernels.flash_attention import flash_attention_backward_ref, flash_attention_forward_ref
from .kernels.gelu import gelu_backward_ref, gelu_forward_ref
from .kernels.layernorm import layernorm_backward_ref, layernorm_forward_ref
from .kernels.matmul import matmul_backward_ref, matmul_forward_ref
from .kernels.norm import clip_scale_ref, norm_squared_ref, sum_into_ref
from .kernels.residual import residual_backward_ref, residual_forward_ref


def on_host(ref):
    """The op of a reference whose arguments are the op's after the Device: ref(*args) for op(dev, *args)."""
    @functools.wraps(ref)
    def op(dev, *args, **kwargs):
        return ref(*args, **kwargs)
    op.__name__ = op.__qualname__ = ref.__name__.removesuffix("_ref")
    signature = inspect.signature(ref)          # help() shows the op's arguments: the Device first
    device = inspect.Parameter("dev", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    op.__signature__ = signature.replace(parameters=[device, *signature.parameters.values()])
    return op


encoder_forward = on_host(encoder_forward_ref)
layernorm_forward = on_host(layernorm_forward_ref)
layernorm_backward = on_host(layernorm_backward_ref)
matmul_forward = on_host(matmul_forward_ref)
matmul_backward = on_host(matmul_backward_ref)
flash_attention_forward = on_host(flash_attention_forward_ref)
flash_attention_backward = on_host(flash_attention_backward_ref)
gelu_forward = on_host(gelu_forward_ref)
gelu_backward = on_host(gelu_backward_ref)
residual_forward = on_host(residual_forward_ref)
residual_backward = on_host(residual_backward_ref)
classifier_forward = on_host(classifier_forward_ref)
classifier_backward = on_host(classifier_backward_ref)
classifier_loss = on_host(classifier_loss_ref)
classifier_fused = on_host(classifier_fused_ref)
adamw_update = on_host(adamw_update_ref)
adamw_update_bf16 = on_host(adamw_update_bf16_ref)
norm_squared = on_host(norm_squared_ref)
clip_scale = on_host(clip_scale_ref)
sum_into = on_host(sum_into_ref)
to_bf16 = on_host(to_bf16_ref)
from_bf16 = on_host(from_bf16_ref)


def encoder_backward(dev, dwte, dwpe, dout, inp, buckets=None) -> None:
    """As llmz.kernels.encoder.encoder_backward; the reference walks the positions itself (no buckets)."""
    encoder_backward_ref(dwte, dwpe, dout, inp)


def attention_forward(dev, out, preatt, att, inp, num_heads, upper_is_zero=False) -> None:
    """As llmz.kernels.attention.attention_forward (the reference writes att's upper triangle anyway)."""
    attention_forward_ref(out, preatt, att, inp, num_heads)


def attention_backward(dev, dinp, dpreatt, datt, dout, inp, att, num_heads, accumulate=True,
                       upper_is_zero=False) -> None:
    """As llmz.kernels.attention.attention_backward."""
    attention_backward_ref(dinp, dpreatt, datt, dout, inp, att, num_heads, accumulate)


def accumulate_shard(dev, shard, slot, rank, stream=None) -> None:
    """As llmz.kernels.accumulate.accumulate_shard."""
    check_split(shard.size, slot.size, rank)
    accumulate_shard_ref(shard, slot, rank)


def accumulate_shard_bf16(dev, shard_u16, slot_u16, rank, seed, step, stochastic=True, stream=None,
                          offset=0) -> None:
    """As llmz.kernels.accumulate.accumulate_shard_bf16; step an int or a (1,) array holding it."""
    check_split(shard_u16.size, slot_u16.size, rank)
    step = step if isinstance(step, int) else int(step[0])
    accumulate_shard_bf16_ref(shard_u16, slot_u16, rank, seed, step, stochastic, offset)


def fill(dev, x, value=0.0, stream=None) -> None:
    """As llmz.kernels.fill.fill."""
    fill_ref(x, value)


def zero(dev, x, stream=None) -> None:
    """As llmz.kernels.fill.zero."""
    fill_ref(x, 0.0)
