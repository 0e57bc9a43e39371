#!/usr/bin/env bash
# The fast kernels' GPU run (issue: the fast set near the roofline at every GPT-2 size), one command for a lent
# H200, ~4 minutes:   tools/kern_gpu.sh [call1|call2]   (logs under $OUT, else ./out; at most 8 files)
#   call1  side by side: the fast kernels' GPU tests and every dev/<layer>.py at d12..d48 (each script checks
#          while the others do, then times alone: dev/harness.py's lock), then the d48 step kernel by kernel
#   call2  the step at d12 and d48 beside torch.compile (python -m llmz.bench --vs-torch compile)
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
what=${1:-call1}
py=python3
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/machine.txt"
$py -c "import numpy, numba, numba_cuda, cupy, torch; print('numpy', numpy.__version__, 'numba', numba.__version__, 'numba-cuda', numba_cuda.__version__, 'cupy', cupy.__version__, 'torch', torch.__version__)" | tee -a "$OUT/machine.txt"
if [[ $what == call1 ]]; then
  export KERN_GPU_LOCK=/tmp/kern_gpu.lock DEV_JSON_DIR=/tmp/kern_dev_json
  rm -f "$KERN_GPU_LOCK"; mkdir -p "$DEV_JSON_DIR"
  # the GPU tests hold the shared lock while they run: no dev script times until they are done
  tests="tests/test_fast_layernorm.py tests/test_fast_column_sum.py tests/test_fast_gelu.py tests/test_fast_residual.py
    tests/test_fast_adamw.py tests/test_fast_classifier.py tests/test_fast_encoder.py tests/test_fast_matmul.py
    tests/test_fast_cublaslt.py"
  flock -s "$KERN_GPU_LOCK" timeout 110 $py -m pytest -q -p no:cacheprovider -n 8 -m gpu -rfE $tests \
    > "$OUT/pytest.txt" 2>&1 &
  sleep 2
  for layer in layernorm column_sum gelu residual adamw classifier encoder matmul; do
    timeout 200 $py dev/$layer.py --model all --reps 10 > "/tmp/kern_dev_$layer.txt" 2>&1 &
  done
  wait
  stamp "tests and dev scripts done"
  for layer in layernorm column_sum gelu residual adamw classifier encoder matmul; do
    echo "===== dev/$layer.py"; cat "/tmp/kern_dev_$layer.txt"
  done > "$OUT/dev.txt"
  $py -c "import json, glob, os; print(json.dumps({os.path.basename(p): json.load(open(p)) for p in sorted(glob.glob('$DEV_JSON_DIR/*.json'))}))" > "$OUT/dev.json"
  timeout 100 $py -m llmz.bench --precision bf16 --model d48 -b 8 --per-kernel --steps 5 --warmup 2 \
    > "$OUT/bench_d48.txt" 2>&1
  stamp "bench done"
  tail -3 "$OUT/pytest.txt"; grep -E "FAIL|Error" "$OUT/pytest.txt" | head -20
  grep -hE "^(d12|d24|d36|d48) " "$OUT/dev.txt" | grep -E "v[0-9]" | head -150
  grep -E "FAIL|Error|Traceback" "$OUT/dev.txt" | head -20
  cat "$OUT/bench_d48.txt" | grep -v Warn | head -60
fi
if [[ $what == call2 ]]; then
  for m in d12 d48; do
    b=$([[ $m == d12 ]] && echo 16 || echo 8)
    timeout 280 $py -m llmz.bench --precision bf16 --model $m -b $b --vs-torch compile --steps 10 \
      > "$OUT/bench_vs_compile_$m.txt" 2>&1
    grep -v Warn "$OUT/bench_vs_compile_$m.txt" | tail -12
  done
fi
stamp "end"
