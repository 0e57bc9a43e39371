"""The reference op set: every layer function of llmz.kernels (the same names, the same arguments, the Device
first) computed by its NumPy reference, the `*_ref` function written beside the kernels in
llmz/kernels/<layer>.py. It is what a cpu Device runs (llmz.device.op_set) and what the kernels are tested
against. The Device, the stream and the fast set's hints (encoder_backward's buckets, attention's
upper_is_zero) mean nothing on the host: everything runs in program order, on NumPy arrays.

The layers that take a CPU step's time are written out once more below, with their reference's bits
(tests/test_reference.py checks each against its `_ref` on fresh random inputs): the products and exp/tanh
stay NumPy's, every head of every batch row in one stacked product, written straight into their destination
or a buffer kept from call to call (`buffer`); the row-by-row rest (layernorm, the softmax's rows, GELU's
arithmetic, AdamW, the embedding gradient) runs in llmz.host_loops, one loop over the rows. At the default
run's sizes (B=16, T=64, C=128) NumPy spends more time starting each short row's reduction and each pass
over an array larger than the cache than computing (BENCHMARKS.md: the CPU step before and after). bf16
storage takes the `_ref` (it computes in float32 copies anyway).

Shapes: B batch, T time, C channels, NH heads, hs head size, OC output channels, N rows (B*T), V vocab, Vp
padded vocab.
"""
from __future__ import annotations

import functools
import inspect
import math
import weakref

import numpy as np

from . import host_loops
from .bf16 import is_bf16
from .kernels.accumulate import accumulate_shard_bf16_ref, accumulate_shard_ref, check_split
from .kernels.adamw import adamw_update_bf16_ref, adamw_update_ref
from .kernels.attention import _split_heads, attention_backward_ref, attention_forward_ref
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
from .kernels.gelu import GELU_SCALE, gelu_backward_ref, gelu_forward_ref
from .kernels.layernorm import LN_EPS, layernorm_backward_ref, layernorm_forward_ref
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


# the ops whose reference runs as it is, each under its layer function's name (encoder_forward is
# on_host(encoder_forward_ref), ...); the others are written out below
(encoder_forward, flash_attention_forward, flash_attention_backward, residual_backward, classifier_forward,
 classifier_backward, classifier_loss, adamw_update_bf16, norm_squared, clip_scale, sum_into, to_bf16,
 from_bf16) = map(on_host, (encoder_forward_ref, flash_attention_forward_ref, flash_attention_backward_ref,
                            residual_backward_ref, classifier_forward_ref, classifier_backward_ref,
                            classifier_loss_ref, adamw_update_bf16_ref, norm_squared_ref, clip_scale_ref,
                            sum_into_ref, to_bf16_ref, from_bf16_ref))


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


# ---- the hot layers: NumPy's products and exp/tanh around llmz.host_loops, the reference's bits -------------
_buffers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()       # Device -> {(name, dtype): flat array}


def buffer(dev, name: str, shape, dtype):
    """A temporary of `shape` for an op, reused from call to call: one flat array per (name, dtype) on each
    Device, grown to the largest size asked for, viewed as `shape`. The first step allocates; later ones don't.
    Only the op that names it uses it, and only during the call."""
    bufs = _buffers.setdefault(dev, {})
    key, n = (name, np.dtype(dtype).str), math.prod(shape)
    flat = bufs.get(key)
    if flat is None or flat.size < n:
        flat = bufs[key] = np.empty(n, dtype)
    return flat[:n].reshape(shape)


def view_as(a, shape):
    """a viewed as `shape`, never a copy (what is written into a copy is lost): an AttributeError for an array
    that cannot be (one not contiguous enough)."""
    view = a.view()
    view.shape = shape
    return view


def looped(*arrays) -> bool:
    """Do llmz.host_loops take these arrays: float32 or float64 all alike (None aside), each C-contiguous? Else
    the op runs its reference (bf16 storage, mixed dtypes, strided views: nothing the model hands in)."""
    given = [a for a in arrays if a is not None]
    dtype = given[0].dtype
    return dtype in (np.float32, np.float64) and all(a.dtype == dtype and a.flags.c_contiguous for a in given)


def encoder_backward(dev, dwte, dwpe, dout, inp, buckets=None) -> None:
    """As encoder_backward_ref (the reference walks the positions itself: no buckets): dwte[token] += each
    position's gradient in the positions' order (np.add.at's), dwpe += the sum over the batch."""
    if not looped(dwte, dwpe, dout) or inp.size == 0 or not 0 <= inp.min() <= inp.max() < dwte.shape[0]:
        return encoder_backward_ref(dwte, dwpe, dout, inp)      # (a token out of range: its IndexError)
    T, C = dout.shape[1:]
    host_loops.add_rows_at(dwte, inp.reshape(-1), dout.reshape(-1, C))
    dwpe[:T] += dout.sum(axis=0)


def layernorm_forward(dev, out, mean, rstd, inp, weight, bias) -> None:
    """As layernorm_forward_ref: out = (x - mean) * rstd * weight + bias; mean and rstd kept."""
    if not looped(out, mean, rstd, inp, weight, bias):
        return layernorm_forward_ref(out, mean, rstd, inp, weight, bias)
    C = inp.shape[-1]
    host_loops.layernorm_forward(view_as(out, (-1, C)), view_as(mean, (-1,)), view_as(rstd, (-1,)),
                                 view_as(inp, (-1, C)), weight, bias, inp.dtype.type(LN_EPS))


def layernorm_backward(dev, dinp, dweight, dbias, dout, inp, weight, mean, rstd) -> None:
    """As layernorm_backward_ref: dinp += rstd (dnorm - mean(dnorm) - norm mean(dnorm norm)); dweight, dbias +=."""
    if not looped(dinp, dweight, dbias, dout, inp, weight, mean, rstd):
        return layernorm_backward_ref(dinp, dweight, dbias, dout, inp, weight, mean, rstd)
    C = inp.shape[-1]
    host_loops.layernorm_backward(view_as(dinp, (-1, C)), dweight, dbias, view_as(dout, (-1, C)),
                                  view_as(inp, (-1, C)), weight, view_as(mean, (-1,)), view_as(rstd, (-1,)))


def residual_forward(dev, out, inp1, inp2) -> None:
    """As residual_forward_ref: out = inp1 + inp2, written straight into out."""
    if not looped(out, inp1, inp2):
        return residual_forward_ref(out, inp1, inp2)
    np.add(inp1, inp2, out=out)


def matmul_forward(dev, out, inp, weight, bias) -> None:
    """As matmul_forward_ref: out = inp @ weight.T, then + bias on every row."""
    if not looped(out, inp, weight, bias):
        return matmul_forward_ref(out, inp, weight, bias)
    OC, C = weight.shape
    out2 = view_as(out, (-1, OC))
    np.matmul(view_as(inp, (-1, C)), weight.T, out=out2)
    if bias is not None:
        host_loops.add_bias(out2, bias)


def matmul_backward(dev, dinp, dweight, dbias, dout, inp, weight, dinp_accumulate=True) -> None:
    """As matmul_backward_ref: dinp (+)= dout @ weight, dweight += dout.T @ inp, dbias += rows' sum of dout;
    the products written into their destination or a kept buffer, not a fresh array."""
    if not looped(dinp, dweight, dbias, dout, inp, weight):
        return matmul_backward_ref(dinp, dweight, dbias, dout, inp, weight, dinp_accumulate)
    OC, C = weight.shape
    dout2 = view_as(dout, (-1, OC))                                     # (N, OC)
    if dinp_accumulate:
        product = buffer(dev, "matmul dinp", (dout2.shape[0], C), dinp.dtype)
        np.matmul(dout2, weight, out=product)
        view_as(dinp, (-1, C))[...] += product
    else:
        np.matmul(dout2, weight, out=view_as(dinp, (-1, C)))
    product = buffer(dev, "matmul dweight", weight.shape, dweight.dtype)
    np.matmul(dout2.T, view_as(inp, (-1, C)), out=product)
    dweight += product
    if dbias is not None:
        host_loops.add_column_sums(dbias, dout2)


def attention_forward(dev, out, preatt, att, inp, num_heads, upper_is_zero=False) -> None:
    """As attention_forward_ref (the upper triangle of att written anyway): every head of every batch row in
    one stacked product, the softmax's rows in host_loops around NumPy's exp."""
    if not looped(out, preatt, att, inp):
        return attention_forward_ref(out, preatt, att, inp, num_heads)
    B, T, C3 = inp.shape
    hs = C3 // 3 // num_heads
    q, k, v = _split_heads(inp, num_heads)                              # (B, NH, T, hs) views
    np.matmul(q, k.swapaxes(-1, -2), out=preatt)                        # q.k, (B, NH, T, T)
    host_loops.causal_logits(preatt, att, att.dtype.type(1.0 / math.sqrt(hs)))
    np.exp(att, out=att)
    host_loops.normalize_rows(att)
    y = buffer(dev, "attention y", (B, num_heads, T, hs), att.dtype)
    np.matmul(att, v, out=y)
    view_as(out, (B, T, num_heads, hs))[...] = y.transpose(0, 2, 1, 3)  # heads back side by side


def attention_backward(dev, dinp, dpreatt, datt, dout, inp, att, num_heads, accumulate=True,
                       upper_is_zero=False) -> None:
    """As attention_backward_ref: dq, dk, dv (+)= into dinp's three thirds, in place."""
    if not looped(dinp, dpreatt, datt, dout, inp, att):
        return attention_backward_ref(dinp, dpreatt, datt, dout, inp, att, num_heads, accumulate)
    if not accumulate:
        dinp[...] = 0
    B, T, C3 = inp.shape
    hs = C3 // 3 // num_heads
    scale = 1.0 / math.sqrt(hs)
    q, k, v = _split_heads(inp, num_heads)                              # (B, NH, T, hs) views
    dq, dk, dv = _split_heads(dinp, num_heads)                          # views into dinp
    do = view_as(dout, (B, T, num_heads, hs)).transpose(0, 2, 1, 3)    # (B, NH, T, hs)
    y = buffer(dev, "attention y", (B, num_heads, T, hs), att.dtype)
    # datt = dout . v (0 above the diagonal: softmax_backward), dv += att^T dout
    np.matmul(do, v.swapaxes(-1, -2), out=datt)
    np.matmul(att.swapaxes(-1, -2), do, out=y)
    dv += y
    host_loops.softmax_backward(dpreatt, datt, att)                    # dpreatt = att (datt - sum att datt)
    # dq += dpreatt @ k * scale, dk += dpreatt^T @ q * scale
    np.matmul(dpreatt, k, out=y)
    y *= scale
    dq += y
    np.matmul(dpreatt.swapaxes(-1, -2), q, out=y)
    y *= scale
    dk += y


def gelu_forward(dev, out, inp) -> None:
    """As gelu_forward_ref: out = 0.5 x (1 + tanh(s (x + 0.044715 x^3))), tanh NumPy's."""
    if not looped(out, inp):
        return gelu_forward_ref(out, inp)
    x, t, one = view_as(inp, (-1,)), buffer(dev, "gelu t", (inp.size,), inp.dtype), inp.dtype.type
    host_loops.gelu_inner(t, x, one(GELU_SCALE), one(0.044715))
    np.tanh(t, out=t)
    host_loops.gelu_outer(view_as(out, (-1,)), x, t, one(0.5), one(1.0))


def gelu_backward(dev, dinp, inp, dout, accumulate: bool = True) -> None:
    """As gelu_backward_ref: dinp (+)= (0.5 (1 + t) + 0.5 x (1 - t^2) s (1 + 3 * 0.044715 x^2)) dout."""
    if not looped(dinp, inp, dout):
        return gelu_backward_ref(dinp, inp, dout, accumulate)
    x, t, one = view_as(inp, (-1,)), buffer(dev, "gelu t", (inp.size,), inp.dtype), inp.dtype.type
    host_loops.gelu_inner(t, x, one(GELU_SCALE), one(0.044715))
    np.tanh(t, out=t)
    host_loops.gelu_grad_times(view_as(dinp, (-1,)), x, t, view_as(dout, (-1,)), accumulate, one(0.5),
                               one(1.0), one(GELU_SCALE), one(3.0 * 0.044715))


def classifier_fused(dev, losses, logits, targets, dloss, vocab_size) -> None:
    """As classifier_fused_ref: the losses, and dlogits = (softmax - onehot) * dloss over the logits, in place
    (the reference's backward first copies the probabilities onto themselves: skipped)."""
    if is_bf16(logits):
        return classifier_fused_ref(losses, logits, targets, dloss, vocab_size)
    classifier_forward_ref(losses, logits, logits, targets, vocab_size)     # probs over the logits
    V = vocab_size
    t = targets[..., None].astype(np.intp)
    np.put_along_axis(logits, t, np.take_along_axis(logits, t, axis=-1) - 1, axis=-1)
    logits[..., :V] *= dloss
    logits[..., V:] = 0


def adamw_update(dev, params, grads, m, v, decay_size, scalars, beta1, beta2, eps, weight_decay) -> None:
    """As adamw_update_ref, in the arrays' dtype, one pass over the elements."""
    if not looped(params, grads, m, v):
        return adamw_update_ref(params, grads, m, v, decay_size, scalars, beta1, beta2, eps, weight_decay)
    lr, grad_scale, bc1, bc2 = (params.dtype.type(s) for s in scalars[:4])
    one = params.dtype.type
    host_loops.adamw(params, grads, m, v, decay_size, lr, grad_scale, bc1, bc2, one(beta1), one(1.0 - beta1),
                     one(beta2), one(1.0 - beta2), one(eps), one(weight_decay))
