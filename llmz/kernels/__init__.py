"""The teaching kernels (llm.c's train_gpt2.c and dev/cuda version 1 or 2): one file per layer, each with the
NumPy reference of its math and the simplest correct @cuda.jit kernels for it, one thread per output element
or one block per row. They run in Numba's CUDA simulator and on a GPU, in float32, float64 and bf16 (uint16
bits, through llmz.kernels.bf16's load / store). The kernels that replace some of them for speed are in
llmz.fast, each tested against its teaching twin here; `--kernels teaching|fast` picks the set.

Every layer function takes the Device first and then its arrays, llm.c style (outputs first):
    gelu_forward(dev, out, inp)
and launches its kernels on the Device (gpu or sim). Its NumPy reference, `gelu_forward_ref(out, inp)`, is in
the same file; llmz.reference offers the references under the layer functions' names and arguments: the op
set a cpu Device runs. The names below (`__all__`) are what every op set offers: llmz.reference, this
package, and llmz.fast (llmz.device.op_set picks one per Device). Backward functions accumulate (+=) into
parameter and input gradients, as llm.c's do; each says so.

    encoder.py     encoder_forward / encoder_backward
    layernorm.py   layernorm_forward / layernorm_backward
    matmul.py      matmul_forward / matmul_backward, on gemm.py's tiled product
    attention.py   attention_forward / attention_backward
    flash_attention.py  flash_attention_forward / flash_attention_backward (FlashAttention-2: no T x T buffer)
    gelu.py        gelu_forward / gelu_backward
    residual.py    residual_forward / residual_backward
    classifier.py  classifier_forward / classifier_backward (softmax + cross-entropy); classifier_loss and
                   classifier_fused, the two calls the model makes
    adamw.py       adamw_update, adamw_update_bf16
    norm.py        norm_squared, clip_scale, sum_into (the global gradient norm and clipping)
    accumulate.py  accumulate_shard, accumulate_shard_bf16 (ZeRO-2: a reduced slot into this rank's shard)
    fill.py        fill, zero;   bf16.py  bf16 storage: load / store, rounding, to_bf16 / from_bf16
"""
from .accumulate import accumulate_shard, accumulate_shard_bf16
from .adamw import adamw_update, adamw_update_bf16
from .attention import attention_backward, attention_forward
from .bf16 import from_bf16, to_bf16
from .classifier import classifier_backward, classifier_forward, classifier_fused, classifier_loss
from .encoder import encoder_backward, encoder_forward
from .fill import fill, zero
from .flash_attention import flash_attention_backward, flash_attention_forward
from .gelu import gelu_backward, gelu_forward
from .layernorm import layernorm_backward, layernorm_forward
from .matmul import matmul_backward, matmul_forward
from .norm import clip_scale, norm_squared, sum_into
from .residual import residual_backward, residual_forward

__all__ = ["accumulate_shard", "accumulate_shard_bf16", "adamw_update", "adamw_update_bf16", "attention_backward",
           "attention_forward", "classifier_backward", "classifier_forward", "classifier_fused", "classifier_loss",
           "clip_scale", "encoder_backward", "encoder_forward", "fill", "flash_attention_backward",
           "flash_attention_forward", "from_bf16", "gelu_backward",
           "gelu_forward", "layernorm_backward", "layernorm_forward", "matmul_backward", "matmul_forward",
           "norm_squared", "residual_backward", "residual_forward", "sum_into", "to_bf16", "zero"]
