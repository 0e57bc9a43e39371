"""The op sets and --kernels teaching|fast end to end: the three sets (llmz.reference, llmz.kernels,
llmz.fast) offer the same functions and the Device picks one, the flags refuse what cannot run in one line, the ZeRO
update takes the set the device says (the fast set's bits where it claims them), and `python -m llmz.bench
--layer` prints the teaching and fast rows of a layer (a smoke test at tiny size in the simulator: its times
mean nothing)."""
import inspect
import subprocess
import sys

import numpy as np
import pytest

from llmz.bf16 import f32_to_bf16
from llmz.comm import LocalCommunicator
from llmz.config import GPT2Config
from llmz.device import gpu_available
from llmz.layout import Layout, init_parameters
from llmz.optim import AdamW
from llmz.run.launch import RankInfo
from llmz.zero import make_stage
from mpirun import REPO


def run(module, *args, timeout=300):
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, check=False, timeout=timeout)


@pytest.mark.parametrize("flags, words", [(["--device", "cpu", "--kernels", "fast"], "--kernels fast"),
                                          (["--device", "cpu", "--kernels", "teaching", "--matmul", "cublas"],
                                           "--matmul cublas"),
                                          (["--device", "cpu", "--attention", "gemm"], "--attention gemm")])
def test_train_refuses_a_kernel_set_that_cannot_run_in_one_line(flags, words):
    p = run("llmz.train", *flags, "--model", "tiny", "--steps", "1", timeout=120)
    assert p.returncode != 0
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in p.stderr and words in err[0], p.stderr


def shape_of(fn) -> tuple:
    """What a caller relies on: how many arguments come first, then the names and defaults of the rest."""
    params = list(inspect.signature(fn).parameters.values())
    return (sum(p.default is p.empty for p in params),
            [(p.name, p.default) for p in params if p.default is not p.empty])


def test_the_three_op_sets_offer_the_same_functions_with_the_same_arguments():
    import llmz.fast
    import llmz.kernels
    import llmz.reference
    for name in llmz.kernels.__all__:
        shapes = {m.__name__: shape_of(getattr(m, name)) for m in (llmz.reference, llmz.kernels, llmz.fast)}
        assert len({repr(s) for s in shapes.values()}) == 1, (name, shapes)
        assert next(iter(inspect.signature(getattr(llmz.reference, name)).parameters)) == "dev", name


def test_the_precision_is_one_record_of_dtypes():
    from llmz.precision import PRECISIONS, as_precision
    f32, f64, u16 = np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.uint16)
    want = {"fp32": (f32, f32, None, False, 4), "fp64": (f64, f64, None, False, 8), "bf16": (u16, f32, f32, True, 2)}
    for name, p in PRECISIONS.items():
        assert (p.storage, p.stats, p.master, p.bf16, p.value_bytes) == want[name]
        assert as_precision(name) is as_precision(p.storage) is as_precision(p) is p
    with pytest.raises(ValueError):
        as_precision(np.int32)


@pytest.mark.parametrize("kind, kernel_set, ops", [("cpu", "auto", "llmz.reference"),
                                                   ("cpu", "teaching", "llmz.reference"),
                                                   ("sim", "auto", "llmz.kernels"),
                                                   ("sim", "fast", "llmz.fast")])
def test_a_device_runs_the_op_set_its_kind_and_kernels_say(kind, kernel_set, ops):
    from llmz.device import Device
    if kind == "sim" and gpu_available():
        pytest.skip("the simulator cannot start beside a GPU in this process")
    assert Device(kind, np.float32, kernel_set=kernel_set).ops.__name__ == ops


def update_once(kernel_set, rng_seed):
    """One ZeRO stage-0 update of a one-block bf16 model in the simulator from fixed gradients: the parameters
    (bf16 bits, stochastic rounding), the fp32 master and m after it."""
    from llmz.device import Device
    cfg = GPT2Config(max_seq_len=4, vocab_size=32, padded_vocab_size=32, num_layers=1, num_heads=2, channels=8)
    layout = Layout(cfg, 1)
    dev = Device("sim", np.uint16, kernel_set=kernel_set)
    ranks = RankInfo(0, 1, 0, 1, "localhost")
    opt = AdamW(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_clip=1.0, warmup_steps=0,
                schedule="constant", final_lr_frac=1.0, total_steps=10)
    z = make_stage(0, layout, dev, LocalCommunicator(ranks), opt, init_parameters(layout, 0), seed=7)
    grads = np.random.default_rng(rng_seed).normal(size=layout.total) * 0.1
    dev.copy_from_host(z.grad_store.grads, f32_to_bf16(grads))
    norm = z.update(0)
    return (dev.to_host(z.param_store.params), dev.to_host(z.optimizer.master), dev.to_host(z.optimizer.m), norm,
            dev.to_host(z.grad_store.grads))


def test_zero_update_with_the_fast_kernels_gives_the_teaching_bits():
    # the fast set's paired bf16 AdamW and memset zeroing; the norm and clip are the teaching kernels in both
    teaching, fast = update_once("teaching", 3), update_once("fast", 3)
    for name, t, f in zip(("params", "master", "m"), teaching[:3], fast[:3]):
        np.testing.assert_array_equal(f.view(np.uint8), t.view(np.uint8), err_msg=name)
    assert teaching[3] == fast[3]
    assert not fast[4].any() and not teaching[4].any()             # the gradients zeroed for the next step


def test_bench_layer_prints_a_teaching_and_a_fast_row_per_pass_in_the_simulator():
    p = run("llmz.bench", "--device", "sim", "--layer", "gelu,attention", "--model", "tiny", "--vocab-size", "64",
            "-b", "1", "-t", "8", "--reps", "1")
    assert p.returncode == 0, p.stderr
    rows = [line.split() for line in p.stdout.splitlines() if line.startswith(("  teaching", "  fast"))]
    # gelu and attention, each forward and backward, each set
    assert [(r[0], r[1]) for r in rows] == [(v, d) for _ in range(2) for v in ("teaching", "fast")
                                            for d in ("forward", "backward")], p.stdout
    # every version checked against the float64 reference: float32 rounding only
    assert all(float(r[2]) < 1e-6 for r in rows), p.stdout
    assert "gelu_forward_pairs_kernel" in p.stdout and "attention_softmax_kernel" in p.stdout


def test_compile_check_covers_every_kernel_of_both_sets_and_the_dev_candidates(monkeypatch):
    # tools/compile_check.py compiles each kernel for sm_90 with the argument types the layers pass (the dev/
    # candidates with --dev): a kernel missing from its table would go unchecked on a machine without a GPU
    import importlib
    import importlib.util
    import pkgutil

    import llmz.fast
    import llmz.kernels
    spec = importlib.util.spec_from_file_location("compile_check", f"{REPO}/tools/compile_check.py")
    cc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cc)
    listed = {target.split("#")[0] for bf16 in (False, True)
              for target in {**cc.signatures(bf16), **cc.dev_signatures(bf16)}}
    modules = [f"{package.__name__}.{info.name}" for package in (llmz.kernels, llmz.fast)
               for info in pkgutil.iter_modules(package.__path__)]
    # the candidates kept in dev/ (--dev; flash attention's versions have tools/flash_ptx.py)
    monkeypatch.syspath_prepend(str(REPO))
    modules += [f"dev.{name}" for name in ("adamw", "classifier", "column_sum", "encoder", "gelu", "layernorm",
                                           "matmul", "residual", "vectors")]
    kernels = set()
    for module in map(importlib.import_module, modules):
        for name, obj in vars(module).items():
            py_func = getattr(obj, "py_func", None)
            if py_func is None or py_func.__module__ != module.__name__:
                continue
            # the simulator's FakeCUDAKernel says _device, a GPU's dispatcher its targetoptions
            device = getattr(obj, "_device", None)
            if not (obj.targetoptions.get("device") if device is None else device):
                kernels.add(f"{module.__name__}:{name}")
    assert any(k.startswith("dev.") for k in kernels) and kernels <= listed, sorted(kernels - listed)
