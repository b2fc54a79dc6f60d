#!/usr/bin/env bash
# One GPU lease's check (issues 41 and 42), under 8 minutes on a bare H100 or H200, from the repo root:
#   bash benchmarks/gpu_check.sh                 # the device tool's run: carry the wheels folder (.whl)
# Each part has its own timeout, so a part that runs long is cut, not the whole check; what comes back under
# $OUT (at most 8 files): check.log (the bars, measured / bar), env.log, gpu_tests.log, sanitizer.log,
# bench.log, largest.log and gpu_<date>.json (commit it as benchmarks/results/gpu_<date>.json).
# The wheels the image lacks (docs/benchmarks.md, "The GPU check"): in $WHEELS (default .whl), installed with
# --no-deps into /tmp/site. A dry run of the flow on a CPU (tests/benchmarks/test_gpu_check.py):
#   OUT=/tmp/gc BENCH_ARGS="--tiny --device cpu" LARGEST=0 bash benchmarks/gpu_check.sh
set -u
OUT=${OUT:-/tmp/gpu_check}; mkdir -p "$OUT"
CASES=/tmp/gpu_check_cases; rm -rf "$CASES"; mkdir -p "$CASES"
WHEELS=${WHEELS:-.whl}
START=$(date +%s)
elapsed() { echo $(( $(date +%s) - START )); }
log() { echo "[$(elapsed) s] $*" | tee -a "$OUT/check.log"; }

if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl >>"$OUT/env.log" 2>&1 || log "installing the wheels from $WHEELS failed (env.log)"
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
python3 -c "import torch; print('device:', torch.cuda.get_device_name(0)); print('torch', torch.__version__,
torch.version.cuda)" >>"$OUT/env.log" 2>&1
nvidia-smi >>"$OUT/env.log" 2>&1
log "installed"

# 1. the gpu-marked tests (issue 42: nothing skipped), then the same under the CUDA sanitizer (0 races)
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rs --timeout 60 tests >"$OUT/gpu_tests.log" 2>&1
log "gpu tests rc=$?: $(tail -1 "$OUT/gpu_tests.log")"
TORCH_CUDA_SANITIZER=1 timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 90 tests \
  >"$OUT/sanitizer.log" 2>&1
log "sanitizer rc=$?: $(grep -c 'possible data race' "$OUT/sanitizer.log") races; $(tail -1 "$OUT/sanitizer.log")"

# 2. the cases (bench_gpu.py), each its own process and timeout: a (all on the device), b (the ZeRO-Offload
# shape: steady and synchronized steps, with and without clipping), l (the 1.12B Llama in bf16), d (DeepSpeed,
# when it is installed and time is left)
bench() {  # name, timeout, extra args
  timeout "$2" python3 benchmarks/bench_gpu.py --cases "$1" --warmup 1 --steps 3 --json "$CASES/case_$1.json" \
    ${BENCH_ARGS:-} >>"$OUT/bench.log" 2>&1
  log "case $1 rc=$? $(python3 -c "import json,sys; d=json.load(open(sys.argv[1]))['$1']; print({k: d[k] for k in
  ('step_s','steady_s','ratio','speed') if k in d})" "$CASES/case_$1.json" 2>/dev/null || echo '(no result)')"
}
bench a 70
bench b 110
bench l 100
if python3 -c "import deepspeed" 2>/dev/null && [ "$(elapsed)" -lt 300 ]; then
  bench d 140
else
  log "case d skipped (deepspeed missing, or $(elapsed) s spent)"
fi

# 3. the largest model this machine trains (issue 42, item 5): the estimator's answer, then 3 steps of it
if [ "${LARGEST:-1}" = 1 ] && [ "$(elapsed)" -lt 400 ]; then
  timeout 60 python3 -m infinity estimate --largest llama --seq-len 1024 --json >"$CASES/largest_estimate.json" \
    2>"$OUT/largest.log"
  rc=$?; cat "$CASES/largest_estimate.json" >>"$OUT/largest.log"
  log "largest (estimate) rc=$rc"
  timeout $(( 460 - $(elapsed) )) python3 benchmarks/bench_largest.py --estimate "$CASES/largest_estimate.json" \
    --steps 3 --json "$CASES/largest.json" >>"$OUT/largest.log" 2>&1
  log "largest (3 steps) rc=$?"
else
  log "largest model skipped ($(elapsed) s spent)"
fi

cp "$CASES"/case_*.json "$CASES"/largest.json "$OUT/" 2>/dev/null  # (merged below, then removed: 8 files)
python3 benchmarks/gpu_check_report.py --logs "$OUT" --elapsed "$(elapsed)" \
  --json "$OUT/gpu_$(date +%F).json" >/tmp/gpu_check_report.log 2>&1
sed -n '1,/^{/p' /tmp/gpu_check_report.log | grep -v '^{' | tee -a "$OUT/check.log"
rm -f "$OUT"/case_*.json "$OUT/largest.json"
log "done"
