"""llmz.bench.torch_ref, the PyTorch eager GPT-2 the benchmark compares against, at tiny sizes on the CPU.
Skipped without torch (CI has none); importing llmz.bench.torch_ref above the skip checks it needs no torch."""
import math

import pytest

from llmz.bench.torch_ref import torch_bench
from llmz.config import preset

pytest.importorskip("torch")

V = 100     # padded to Vp = 128, so the sliced logits[..., :V] path is exercised


def run(**kw):
    args = {"B": 2, "T": 16, "precision": "fp32", "steps": 3, "warmup": 1, "device": "cpu"} | kw
    return torch_bench(preset("tiny", vocab_size=V), **args)


@pytest.mark.parametrize("attention", ["sdpa", "manual"])
def test_torch_ref_starts_at_ln_vocab_and_trains(attention):
    r = run(attention=attention)
    assert len(r["losses"]) == 4 and all(math.isfinite(v) for v in r["losses"])
    # random init N(0, 0.02): logits ~0.02*sqrt(C) ~ 0.08, so the first loss is ln V plus ~var/2
    assert abs(r["losses"][0] - math.log(V)) < 0.05
    assert r["losses"][-1] < r["losses"][0]        # the same batch every step: the loss goes down
    assert r["ms"] > 0 and r["tokens_per_s"] == pytest.approx(2 * 16 / (r["ms"] / 1e3))
    assert r["attention"] == attention and r["precision"] == "fp32" and r["peak_bytes"] is None


def test_sdpa_and_manual_attention_give_the_same_losses():
    sdpa, manual = run(attention="sdpa")["losses"], run(attention="manual")["losses"]
    # same seed, same init and tokens; only the attention's summation order differs (fp32 rounding)
    assert sdpa[0] == pytest.approx(manual[0], abs=1e-5)
    assert sdpa == pytest.approx(manual, abs=1e-4)


def test_bf16_autocast_stays_close_to_fp32():
    fp32, bf16 = run()["losses"], run(precision="bf16")["losses"]
    assert bf16 == pytest.approx(fp32, abs=1e-2)     # bf16 keeps 8 mantissa bits: ~3 digits of the loss


def test_torch_ref_rejects_unknown_precision_and_attention():
    with pytest.raises(ValueError):
        run(precision="fp16")
    with pytest.raises(ValueError):
        run(attention="flash")
