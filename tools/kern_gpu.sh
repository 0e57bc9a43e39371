#!/usr/bin/env bash
# What the next session needs to decide which dev/ candidates replace the fast kernels (BENCHMARKS.md, "How to
# promote"), in ONE command on a lent H200, ~4-5 minutes:   tools/kern_gpu.sh [vs-torch]
#   1. the fast kernels' GPU tests (tests/test_fast_*.py -m gpu: what llmz/fast/ runs, at GPT-2 sizes) and every
#      test of the dev/ candidates on the GPU (tests/test_dev_kernels.py: tiny shapes, exact references), and
#   2. every dev/<layer>.py at d12 and d48 (KERN_MODELS=all for d12..d48), side by side with the tests: each
#      script checks while the others run, then times alone (dev/harness.py's lock); each version's us, GB/s
#      and % of the copy ceiling, PASS or FAIL against float64; then
#   3. the bf16 d48 step kernel by kernel (python -m llmz.bench --model d48 -b 8 --per-kernel).
#   vs-torch: instead, the step at d12 and d48 beside torch.compile (python -m llmz.bench --vs-torch compile).
# Logs under $OUT (else ./out), at most 8 files. Wheels the machine lacks (../shared/device/wheels.sh: numpy,
# nvmath-python for dev/matmul.py's version 4) are installed from .whl/ when it travels with the tree.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
what=${1:-candidates}
py=python3
if [[ -d .whl ]]; then
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || exit 1
fi
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/machine.txt"
$py -c "import numpy, numba, numba_cuda, cupy; print('numpy', numpy.__version__, 'numba', numba.__version__, 'numba-cuda', numba_cuda.__version__, 'cupy', cupy.__version__)" | tee -a "$OUT/machine.txt"
layers="layernorm column_sum gelu residual adamw classifier encoder matmul"
if [[ $what == candidates ]]; then
  export KERN_GPU_LOCK=/tmp/kern_gpu.lock DEV_JSON_DIR=/tmp/kern_dev_json
  rm -f "$KERN_GPU_LOCK"; mkdir -p "$DEV_JSON_DIR"
  # the tests hold the shared lock while they run: no dev script times until they are done
  fast_tests="tests/test_fast_layernorm.py tests/test_fast_column_sum.py tests/test_fast_gelu.py
    tests/test_fast_residual.py tests/test_fast_adamw.py tests/test_fast_classifier.py tests/test_fast_encoder.py
    tests/test_fast_matmul.py tests/test_fast_attention.py"
  ( flock -s "$KERN_GPU_LOCK" timeout 150 $py -m pytest -q -p no:cacheprovider -n 6 -m gpu -rfE $fast_tests
    flock -s "$KERN_GPU_LOCK" timeout 90 $py -m pytest -q -p no:cacheprovider -n 4 -rfE tests/test_dev_kernels.py
  ) > "$OUT/pytest.txt" 2>&1 &
  sleep 2
  for layer in $layers; do
    timeout 210 $py dev/$layer.py --model "${KERN_MODELS:-d12,d48}" --reps 10 > "/tmp/kern_dev_$layer.txt" 2>&1 &
  done
  wait
  stamp "tests and dev scripts done"
  for layer in $layers; do
    echo "===== dev/$layer.py"; cat "/tmp/kern_dev_$layer.txt"
  done > "$OUT/dev.txt"
  $py -c "import json, glob, os; print(json.dumps({os.path.basename(p): json.load(open(p)) for p in sorted(glob.glob('$DEV_JSON_DIR/*.json'))}))" > "$OUT/dev.json"
  timeout 100 $py -m llmz.bench --precision bf16 --model d48 -b 8 --per-kernel --steps 5 --warmup 2 \
    > "$OUT/bench_d48.txt" 2>&1
  stamp "bench done"
  grep -E "passed|failed" "$OUT/pytest.txt"; grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | head -20
  # each script's table: model, case, version, us, GB/s, % of the copy ceiling, error, PASS/FAIL
  for layer in $layers; do
    echo "== $layer"; sed -n '/% of the copy ceiling/,$p' "/tmp/kern_dev_$layer.txt" | grep -v "^(" | head -40
  done
  grep -E "Error|Traceback" "$OUT/dev.txt" | head -20
  grep -v Warn "$OUT/bench_d48.txt" | head -60
fi
if [[ $what == vs-torch ]]; then
  for m in d12 d48; do
    b=$([[ $m == d12 ]] && echo 16 || echo 8)
    timeout 280 $py -m llmz.bench --precision bf16 --model $m -b $b --vs-torch compile --steps 10 \
      > "$OUT/bench_vs_compile_$m.txt" 2>&1
    grep -v Warn "$OUT/bench_vs_compile_$m.txt" | tail -12
  done
fi
stamp "end"
