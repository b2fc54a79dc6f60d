#!/usr/bin/env bash
# Issue 21's GPU half in one batch, for a session lent a GPU (the device tool's `run`, from the repo root):
#   bash benchmarks/gpu_session.sh          # logs and JSON under $OUT (at most 8 files come back)
# (env.log, gpu_tests.log, sanitizer.log, bench.log, gpu_bench.json, trace + timeline of case e: 7 files)
# 1. the gpu-marked tests; 2. the same under TORCH_CUDA_SANITIZER=1; 3. bench_gpu cases a-e.
# Missing packages (safetensors, transformers, peft, deepspeed) travel as wheels in a carried folder
# named by $WHEELS (pip install --no-index --find-links "$WHEELS" ...); without deepspeed, case d is skipped.
set -u
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD
if [ -n "${WHEELS:-}" ]; then
  python -m pip install --quiet --no-index --find-links "$WHEELS" psutil safetensors transformers peft deepspeed \
    pytest pytest-timeout >>"$OUT/env.log" 2>&1 || echo "pip from $WHEELS failed" | tee -a "$OUT/env.log"
fi
nvidia-smi >>"$OUT/env.log" 2>&1; python -c "import torch; print(torch.__version__, torch.version.cuda)" >>"$OUT/env.log" 2>&1
timeout 900 python -m pytest -q -m gpu -p no:cacheprovider -rs tests >"$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?" | tee -a "$OUT/gpu_tests.log"
TORCH_CUDA_SANITIZER=1 timeout 900 python -m pytest -q -m gpu -p no:cacheprovider -x tests >"$OUT/sanitizer.log" 2>&1
echo "sanitizer rc=$?" | tee -a "$OUT/sanitizer.log"
mkdir -p /tmp/bench_disk
cases=a,b,c; python -c "import deepspeed" 2>/dev/null && cases=a,b,c,d
timeout 1500 python benchmarks/bench_gpu.py --cases "$cases" --dir /tmp/bench_disk --profile /tmp/gpu_profile \
  --json "$OUT/gpu_bench.json" >"$OUT/bench.log" 2>&1
echo "bench_gpu rc=$?" | tee -a "$OUT/bench.log"
# case e: the profile of case c2 (or b) comes back as two files ($OUT holds at most 8, two folders down)
for c in c2 b; do
  if [ -f /tmp/gpu_profile/case_$c/rank0/trace.json ]; then
    cp /tmp/gpu_profile/case_$c/rank0/trace.json "$OUT/trace_case_$c.json"
    cp /tmp/gpu_profile/case_$c/rank0/timeline.png "$OUT/timeline_case_$c.png"; break
  fi
done
