#!/usr/bin/env bash
# Which dev/ candidates replace the fast kernels (BENCHMARKS.md, "How to promote"), in ONE command on a lent
# H100/H200, under 10 minutes:   OUT=out tools/kern_gpu.sh [candidates|flash|step|vs-torch]
#   candidates (default):
#     0. the timing method on known cases first (python dev/harness.py --check-timing: a 16-byte-unit copy
#        kernel by graph replay, by launches queued behind a hold kernel, and by one launch between events);
#     1. every test of the dev/ candidates on the GPU (tests/test_dev_kernels.py), beside
#     2. every dev/<layer>.py at d12 and d48 (KERN_MODELS=all for d12..d48): each script checks while the
#        others run, then times alone (dev/harness.py's lock): each version as K calls replayed from a CUDA
#        graph over copies of its arrays that pass twice the L2; us, GB/s and % of the copy ceiling, PASS or
#        FAIL against float64; then
#     3. the step kernel by kernel at d12 (B=16) and d48 (B=8) in bf16 (python -m llmz.bench --per-kernel: the
#        table's sum against the graphed step, which it must match within 5% for the table to rank anything).
#   flash: dev/flash_attention.py, every version at d12 and d48.
#   step: 3. alone.   vs-torch: the step at d12 and d48 beside torch.compile (python -m llmz.bench).
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
step() {   # the step kernel by kernel at d12 and d48, bf16 (the per-kernel table's sum against the graphed step)
  timeout 150 $py -m llmz.bench --precision bf16 --per-kernel --steps 10 --warmup 3 > "$OUT/step_d12.txt" 2>&1
  stamp "d12 step done"
  timeout 200 $py -m llmz.bench --precision bf16 --model d48 -b 8 --per-kernel --steps 5 --warmup 2 \
    > "$OUT/step_d48.txt" 2>&1
  stamp "d48 step done"
}
if [[ $what == candidates ]]; then
  timeout 120 $py dev/harness.py --check-timing 2>&1 | grep -v Warn | tee "$OUT/timing_check.txt" | tail -12
  stamp "timing check done"
  export KERN_GPU_LOCK=/tmp/kern_gpu.lock DEV_JSON_DIR=/tmp/kern_dev_json
  rm -f "$KERN_GPU_LOCK"; mkdir -p "$DEV_JSON_DIR"
  # the tests hold the shared lock while they run: no dev script times until they are done
  ( flock -s "$KERN_GPU_LOCK" timeout 120 $py -m pytest -q -p no:cacheprovider -n 4 -rfE tests/test_dev_kernels.py
  ) > "$OUT/pytest.txt" 2>&1 &
  sleep 2
  for layer in $layers; do
    timeout 300 $py dev/$layer.py --model "${KERN_MODELS:-d12,d48}" --reps 10 > "/tmp/kern_dev_$layer.txt" 2>&1 &
  done
  wait
  stamp "tests and dev scripts done"
  for layer in $layers; do
    echo "===== dev/$layer.py"; cat "/tmp/kern_dev_$layer.txt"
  done > "$OUT/dev.txt"
  $py -c "import json, glob, os; print(json.dumps({os.path.basename(p): json.load(open(p)) for p in sorted(glob.glob('$DEV_JSON_DIR/*.json'))}))" > "$OUT/dev.json"
  step
  grep -E "passed|failed" "$OUT/pytest.txt"; grep -E "^(FAILED|ERROR)" "$OUT/pytest.txt" | head -20
  # each script's table: model, case, version, us, GB/s, % of the copy ceiling, error, PASS/FAIL, timing
  for layer in $layers; do
    echo "== $layer"; sed -n '/% of the copy ceiling/,$p' "/tmp/kern_dev_$layer.txt" | grep -v "^(" | head -40
  done
  grep -E "Error|Traceback" "$OUT/dev.txt" | head -20
  for m in d12 d48; do grep -v Warn "$OUT/step_$m.txt" | grep -E "training step|per kernel|^  [a-z_]" | head -24; done
fi
if [[ $what == step ]]; then
  step
  for m in d12 d48; do grep -v Warn "$OUT/step_$m.txt" | head -40; done
fi
if [[ $what == flash ]]; then
  timeout ${FLASH_TIMEOUT:-400} $py dev/flash_attention.py --model d12 d48 ${FLASH_VERSIONS:-} > "$OUT/flash.txt" 2>&1
  grep -v Warn "$OUT/flash.txt" | sed -n '/^flash attention, bf16/,$p' | head -60
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
