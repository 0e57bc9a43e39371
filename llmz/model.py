"""GPT-2's forward and backward, as a straight list of layer calls (llm.c's gpt2_forward / gpt2_backward).

The model owns only activations and backward scratch; parameters and gradients live wherever the caller
keeps them, handed in as two stores of named views per bucket (llmz.layout). Forward and backward ask
`p.bucket(b)` for bucket b's parameters just before they use them. Backward asks `grads.bucket(b)` where to
accumulate bucket b's gradients and calls `grads.done(b)` the moment they are complete:
    the final layernorm first, then block L-1 ... block 0, then the embeddings (wte is tied to the output
    head: its gradient starts in the classifier and ends in the encoder, so that bucket finishes last).
The ZeRO stages (llmz.zero) attach there: stage 2 starts reduce-scattering block l while block l-1's
backward runs; stage 3, which keeps only a slice of the parameters, all-gathers block l when it is asked for
it and starts gathering the next block while block l computes. At stages 0-2 (and in tests) the stores are
FullParams and FullGrads: full buffers, nothing to wait for.

Shapes: B batch, T time, C channels, NH heads, L layers, V vocab, Vp padded vocab.
"""
from __future__ import annotations

import numpy as np

from .bf16 import bf16_to_f32
from .config import RECOMPUTE, GPT2Config
from .layout import Layout


class FullParams:
    """The plain parameter store: one full-size flat buffer, every bucket always there."""

    def __init__(self, layout: Layout, flat):
        self.views = layout.views(flat)

    def bucket(self, b: int) -> dict:
        return self.views[b]


class FullGrads:
    """The plain gradient store: one full-size flat buffer, nothing to do when a bucket is complete."""

    def __init__(self, layout: Layout, flat):
        self.views = layout.views(flat)

    def bucket(self, b: int) -> dict:
        return self.views[b]

    def done(self, b: int) -> None:
        pass


class Activations:
    """Every activation backward needs (llm.c's ActivationTensors), plus backward's scratch buffers.

    recompute (llm.c's -r) trades memory for a little time: what is recomputed is not kept per layer but
    written, in forward and again in backward just before the op that reads it, into one (B, T, 4C) buffer
    shared by every layer (`recomputed`): 1: fch_gelu = gelu(fch); 2: also ln1 and ln2, from the block's
    input and residual2 with the mean and rstd kept per layer (the first B*T*C values of the buffer). 3 (no
    llm.c level: its attention keeps no (T, T) matrix) also the attention softmax of the gemm and direct
    paths, att, recomputed with the layer's forward attention into one (B, NH, T, T) buffer instead of one per
    layer (flash attention keeps no att: there 3 is 2). The same kernel on the same inputs: the same bits as
    keeping them. ln1_of, ln2_of, fch_gelu_of and att_of say where a layer's values are."""

    def __init__(self, config: GPT2Config, dev, B: int, T: int, recompute: int = 0):
        if recompute not in RECOMPUTE:
            raise ValueError(f"recompute {recompute}: must be one of {RECOMPUTE}")
        c = config
        L, C, NH, Vp = c.num_layers, c.channels, c.num_heads, c.padded_vocab_size
        z = dev.zeros
        self.recompute = recompute

        def zs(shape):
            """layernorm statistics and the losses: fp32 when the values are bf16, else the values' dtype"""
            return dev.zeros(shape, dev.precision.stats)
        self.encoded = z((B, T, C))             # wte[token] + wpe[t]
        if recompute < 2:
            self.ln1 = z((L, B, T, C))
        self.ln1_mean = zs((L, B, T))
        self.ln1_rstd = zs((L, B, T))
        self.qkv = z((L, B, T, 3 * C))
        self.atty = z((L, B, T, C))             # attention output, before the projection
        flash = dev.attention == "flash"        # flash attention keeps no (T, T) buffer, only the lse
        if flash:
            self.lse = zs((L, B, NH, T))        # log-sum-exp of each row of the attention softmax
        else:
            # softmax of preatt, causal; zero above the diagonal from here on (recompute 3: one layer's)
            self.att = z((L, B, NH, T, T) if recompute < 3 else (B, NH, T, T))
        self.attproj = z((L, B, T, C))
        self.residual2 = z((L, B, T, C))        # block input + attention branch
        if recompute < 2:
            self.ln2 = z((L, B, T, C))
        self.ln2_mean = zs((L, B, T))
        self.ln2_rstd = zs((L, B, T))
        self.fch = z((L, B, T, 4 * C))
        if recompute < 1:
            self.fch_gelu = z((L, B, T, 4 * C))
        else:
            self.recomputed = z((B, T, 4 * C))  # fch_gelu (and ln1, ln2) of the layer being computed
        self.fcproj = z((L, B, T, C))
        self.residual3 = z((L, B, T, C))        # block output = residual2 + MLP branch
        self.lnf = z((B, T, C))
        self.lnf_mean = zs((B, T))
        self.lnf_rstd = zs((B, T))
        self.logits = z((B, T, Vp))             # overwritten in place by dlogits in backward
        self.losses = zs((B, T))
        # backward scratch, reused by every block
        self.dresidual = z((B, T, C))           # gradient flowing down the residual stream
        self.dbtc = z((B, T, C))                # dlnf, then per block dln2, datty, dln1
        self.dqkv = z((B, T, 3 * C))
        self.dfch_gelu = z((B, T, 4 * C))
        self.dfch = z((B, T, 4 * C))
        if not flash:
            self.dpreatt = z((B, NH, T, T))     # zero above the diagonal from here on (as att)
            self.datt = z((B, NH, T, T))
            self.preatt = z((B, NH, T, T))      # scaled q.k: forward scratch (backward needs only att)

    def ln1_of(self, layer: int):
        """Block `layer`'s ln1 output (B, T, C): kept per layer, or at recompute 2 in the shared buffer."""
        return self.ln1[layer] if self.recompute < 2 else self.recomputed_btc()

    def ln2_of(self, layer: int):
        return self.ln2[layer] if self.recompute < 2 else self.recomputed_btc()

    def att_of(self, layer: int):
        """Block `layer`'s attention softmax (B, NH, T, T): kept per layer, or at recompute 3 one buffer."""
        return self.att[layer] if self.recompute < 3 else self.att

    def fch_gelu_of(self, layer: int):
        """Block `layer`'s GELU output (B, T, 4C): kept per layer, or at recompute 1 and 2 the shared buffer."""
        return self.fch_gelu[layer] if self.recompute < 1 else self.recomputed

    def recomputed_btc(self):
        """The shared buffer's first B*T*C values as (B, T, C): a view, no copy."""
        B, T, C4 = self.recomputed.shape
        return self.recomputed.reshape(-1)[:B * T * C4 // 4].reshape(B, T, C4 // 4)

    def nbytes(self) -> int:
        return sum(a.nbytes for a in vars(self).values() if hasattr(a, "shape"))


class GPT2:
    """Forward and backward for a fixed (B, T) on one device."""

    def __init__(self, config: GPT2Config, dev, B: int, T: int, recompute: int = 0):
        if T > config.max_seq_len:
            raise ValueError(f"seq-len {T} > max_seq_len {config.max_seq_len} of the model")
        self.config, self.dev, self.B, self.T = config, dev, B, T
        self.layout = None
        self.recompute = recompute              # llm.c's -r (Activations says what each level recomputes)
        self.acts = Activations(config, dev, B, T, recompute)
        # the layer functions: the op set the device runs (llmz.device.op_set: the NumPy references, the
        # teaching kernels or the fast ones); the same names and arguments in all three
        self.ops = dev.ops
        # the batch's positions sorted by token, on the device (llmz.fast.encoder.wte_buckets; backward_plan
        # makes it on the host, use_backward_plan uploads it): the fast wte backward; None: the teaching
        # kernel, which needs none
        self.wte_buckets = None

    # ---- the host's part of a backward, made ahead ----------------------------------------------------------
    def backward_plan(self, inputs_host) -> np.ndarray | None:
        """What a backward of the batch inputs_host ((B, T) int, on the host) needs the host to make: with the
        fast kernels, its positions sorted by token for the wte gradient (llmz.fast.encoder.wte_buckets, ~2-3 ms
        at B=16, T=1024: a caller makes the next batch's while the GPU runs this step); None with the others,
        which need nothing."""
        if not self.dev.fast:
            return None
        from .fast.encoder import wte_buckets
        return wte_buckets(inputs_host)

    def use_backward_plan(self, inputs_host, plan) -> None:
        """The next backward is of inputs_host: its backward_plan (None: nothing to do) to the device."""
        if plan is not None:
            from .fast.encoder import wte_buckets_upload
            self.wte_buckets = wte_buckets_upload(self.dev, inputs_host, plan)

    def forward(self, p, inputs, targets=None) -> None:
        """p: the parameter store, p.bucket(b) = bucket b's named views (b: embeddings 0, block l 1+l, lnf L+1);
        inputs, targets: (B, T) int32 on the device.
        Leaves logits in acts.logits and, with targets, per-position losses in acts.losses. No host sync.
        backward recomputes the losses itself, so a training step may call forward without targets."""
        dev, a, c, k = self.dev, self.acts, self.config, self.ops
        L = c.num_layers
        emb = p.bucket(0)
        k.encoder_forward(dev, a.encoded, inputs, emb["wte"], emb["wpe"])
        for layer in range(L):
            w = p.bucket(1 + layer)
            residual = a.encoded if layer == 0 else a.residual3[layer - 1]
            # attention branch: x + attproj(attention(qkv(ln1(x))))
            k.layernorm_forward(dev, a.ln1_of(layer), a.ln1_mean[layer], a.ln1_rstd[layer], residual,
                                w["ln1w"], w["ln1b"])
            k.matmul_forward(dev, a.qkv[layer], a.ln1_of(layer), w["qkvw"], w["qkvb"])
            if dev.attention == "flash":
                k.flash_attention_forward(dev, a.atty[layer], a.lse[layer], a.qkv[layer], c.num_heads)
            else:
                k.attention_forward(dev, a.atty[layer], a.preatt, a.att_of(layer), a.qkv[layer], c.num_heads,
                                    upper_is_zero=True)
            k.matmul_forward(dev, a.attproj[layer], a.atty[layer], w["attprojw"], w["attprojb"])
            k.residual_forward(dev, a.residual2[layer], residual, a.attproj[layer])
            # MLP branch: x + fcproj(gelu(fc(ln2(x))))
            k.layernorm_forward(dev, a.ln2_of(layer), a.ln2_mean[layer], a.ln2_rstd[layer], a.residual2[layer],
                                w["ln2w"], w["ln2b"])
            k.matmul_forward(dev, a.fch[layer], a.ln2_of(layer), w["fcw"], w["fcb"])
            k.gelu_forward(dev, a.fch_gelu_of(layer), a.fch[layer])
            k.matmul_forward(dev, a.fcproj[layer], a.fch_gelu_of(layer), w["fcprojw"], w["fcprojb"])
            k.residual_forward(dev, a.residual3[layer], a.residual2[layer], a.fcproj[layer])
        lnf = p.bucket(L + 1)
        k.layernorm_forward(dev, a.lnf, a.lnf_mean, a.lnf_rstd, a.residual3[L - 1], lnf["lnfw"], lnf["lnfb"])
        k.matmul_forward(dev, a.logits, a.lnf, emb["wte"], None)        # tied weights: logits = lnf @ wte.T
        if targets is not None:
            # the losses only (the fast set: one read of the logits)
            k.classifier_loss(dev, a.losses, a.logits, targets, c.vocab_size)

    def backward(self, p, grads, inputs, targets, dloss: float) -> None:
        """Accumulates (+=) d(loss)/d(parameters) into the buffers `grads.bucket(b)` names, where
        loss = dloss * sum of per-position losses (dloss = 1/(B*T*K) for the mean over K micro-steps).
        Needs the activations of forward(p, inputs); overwrites acts.losses (the same values as forward's).
        No host sync."""
        dev, a, c, k = self.dev, self.acts, self.config, self.ops
        L, NH = c.num_layers, c.num_heads
        emb, lnf = p.bucket(0), p.bucket(L + 1)
        # classifier (llm.c's fused_classifier): the losses, and dlogits = (softmax - onehot) * dloss written
        # over the logits (the fast set: one kernel that never materialises the probabilities)
        k.classifier_fused(dev, a.losses, a.logits, targets, dloss, c.vocab_size)
        dlogits = a.logits
        # the backward scratch (dbtc, dfch_gelu, dfch, dqkv) is overwritten by the first layer that writes it
        # (beta=0 products, overwriting kernels): no zeroing; dresidual is accumulated into, so zeroed once
        gemb = grads.bucket(0)
        k.matmul_backward(dev, a.dbtc, gemb["wte"], None, dlogits, a.lnf, emb["wte"], dinp_accumulate=False)
        # final layernorm: its bucket is complete now
        glnf = grads.bucket(L + 1)
        k.zero(dev, a.dresidual)
        k.layernorm_backward(dev, a.dresidual, glnf["lnfw"], glnf["lnfb"], a.dbtc, a.residual3[L - 1],
                             lnf["lnfw"], a.lnf_mean, a.lnf_rstd)
        grads.done(L + 1)
        for layer in reversed(range(L)):
            w, g = p.bucket(1 + layer), grads.bucket(1 + layer)
            residual = a.encoded if layer == 0 else a.residual3[layer - 1]
            # dresidual holds d(residual3). A residual add passes its gradient through unchanged to both
            # inputs, so the MLP branch reads dresidual and the layernorm below adds into it.
            # --recompute: what was not kept is computed again, as forward did, just before it is read
            if self.recompute >= 1:
                k.gelu_forward(dev, a.fch_gelu_of(layer), a.fch[layer])
            k.matmul_backward(dev, a.dfch_gelu, g["fcprojw"], g["fcprojb"], a.dresidual, a.fch_gelu_of(layer),
                              w["fcprojw"], dinp_accumulate=False)
            k.gelu_backward(dev, a.dfch, a.fch[layer], a.dfch_gelu, accumulate=False)
            if self.recompute >= 2:
                k.layernorm_forward(dev, a.ln2_of(layer), a.ln2_mean[layer], a.ln2_rstd[layer],
                                    a.residual2[layer], w["ln2w"], w["ln2b"])
            k.matmul_backward(dev, a.dbtc, g["fcw"], g["fcb"], a.dfch, a.ln2_of(layer), w["fcw"],
                              dinp_accumulate=False)
            k.layernorm_backward(dev, a.dresidual, g["ln2w"], g["ln2b"], a.dbtc, a.residual2[layer],
                                 w["ln2w"], a.ln2_mean[layer], a.ln2_rstd[layer])
            # dresidual now holds d(residual2): the attention branch
            k.matmul_backward(dev, a.dbtc, g["attprojw"], g["attprojb"], a.dresidual, a.atty[layer],
                              w["attprojw"], dinp_accumulate=False)
            if dev.attention == "flash":
                k.flash_attention_backward(dev, a.dqkv, a.dbtc, a.qkv[layer], a.atty[layer], a.lse[layer], NH,
                                           accumulate=False)
            else:
                if self.recompute >= 3:     # att again, as forward made it (atty rewritten with its own bits)
                    k.attention_forward(dev, a.atty[layer], a.preatt, a.att_of(layer), a.qkv[layer], NH,
                                        upper_is_zero=True)
                k.attention_backward(dev, a.dqkv, a.dpreatt, a.datt, a.dbtc, a.qkv[layer], a.att_of(layer), NH,
                                     accumulate=False, upper_is_zero=True)
            if self.recompute >= 2:
                k.layernorm_forward(dev, a.ln1_of(layer), a.ln1_mean[layer], a.ln1_rstd[layer], residual,
                                    w["ln1w"], w["ln1b"])
            k.matmul_backward(dev, a.dbtc, g["qkvw"], g["qkvb"], a.dqkv, a.ln1_of(layer), w["qkvw"],
                              dinp_accumulate=False)
            k.layernorm_backward(dev, a.dresidual, g["ln1w"], g["ln1b"], a.dbtc, residual,
                                 w["ln1w"], a.ln1_mean[layer], a.ln1_rstd[layer])
            # dresidual now holds d(block input); this block's bucket is complete
            grads.done(1 + layer)
        gemb = grads.bucket(0)
        k.encoder_backward(dev, gemb["wte"], gemb["wpe"], a.dresidual, inputs, buckets=self.wte_buckets)
        grads.done(0)

    # ---- conveniences for scripts and tests (host side) -----------------------------------------
    def mean_loss(self) -> float:
        """Host read of the mean loss of the last forward (a synchronisation: call outside the hot path)."""
        return float(np.mean(self.dev.to_host(self.acts.losses), dtype=np.float64))


def generate(model: GPT2, params, ids: list[int], n_tokens: int, seed: int, temperature: float = 1.0,
             vocab: int | None = None, on_token=None) -> list[int]:
    """n_tokens token ids sampled after `ids`, as llm.c samples: run the whole window forward, take the logits
    at the last position, sample from the softmax over the first V (real) tokens, append, repeat; the window
    slides once it is T long. model: a GPT2 built for B=1; params: its parameter store; ids: the prompt, at
    least one id (a sample without one starts from a start token, llmz.tokenizer.start_id). Samples among
    the first `vocab` ids (default: the model's V; fewer when the tokenizer knows fewer); temperature 0 takes
    the most likely. on_token(id): called with each new id as it is drawn (printing, progress)."""
    dev, T, V = model.dev, model.T, model.config.vocab_size
    V = min(V, vocab or V)
    rng = np.random.default_rng(seed)
    ids = list(ids)
    start = len(ids)
    x = dev.zeros((1, T), np.int32)
    window = np.zeros((1, T), np.int32)
    for _ in range(n_tokens):
        ctx = ids[-T:]
        window[...] = 0
        window[0, :len(ctx)] = ctx
        dev.copy_from_host(x, window)
        model.forward(params, x)                    # causal: positions after len(ctx) change nothing
        logits = dev.to_host(model.acts.logits[0, len(ctx) - 1, :V])
        logits = (bf16_to_f32(logits) if logits.dtype == np.uint16 else logits).astype(np.float64)
        if temperature == 0:
            ids.append(int(np.argmax(logits)))
        else:
            z = logits / temperature
            p = np.exp(z - z.max())
            p /= p.sum()
            ids.append(int(rng.choice(V, p=p)))
        if on_token:
            on_token(ids[-1])
    return ids[start:]
