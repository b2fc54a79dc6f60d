#!/usr/bin/env bash
# The GPU check: the first thing run on a GPU machine, from the repo root (about 9 minutes on a bare H100 or H200):
#   bash benchmarks/gpu_check.sh                 # with the wheels the image lacks in .whl (docs/benchmarks.md)
# Each part has its own timeout, so a part that runs long is cut, not the whole check; what comes back under
# $OUT (at most 8 files): check.log (the bars, measured / bar), env.log, gpu_tests.log, sanitizer.log,
# bench.log, largest.log and gpu_<date>.json (commit it as benchmarks/results/gpu_<date>.json).
# The wheels the image lacks (docs/benchmarks.md, "The GPU check"): in $WHEELS (default .whl), installed with
# --no-deps into /tmp/site. A dry run of the flow on a CPU (tests/benchmarks/test_gpu_check.py):
#   OUT=/tmp/gc BENCH_ARGS="--tiny --device cpu" LARGEST=0 bash benchmarks/gpu_check.sh
# PARTS picks and orders the parts. The default puts first what has not been measured yet: the sanitizer over
# the gpu tests, the memory-bound cases m1 and m2, DeepSpeed's ZeRO-Offload on m1's model (d2), the largest
# model; then the gpu tests alone and the cases already met (b, l, a, d). What the budget leaves out is logged
# as skipped: run it in a second call (the largest model alone: PARTS=largest, its estimate and 420 s of steps,
# ~9 minutes with the wheels; then PARTS="tests b l" BUDGET_S=300). Cases b and l are also profiled by a run
# of their own (PROFILE=0: not), their summaries, timelines and Chrome traces back as profile.tgz; BUDGET_S
# (default 540) is the whole check's seconds: each part's timeout is cut to what is left, and a part with under
# 20 s left is skipped and says so. M2_DIR: where case m2's state may go on disk (default /tmp).
set -u
OUT=${OUT:-/tmp/gpu_check}; mkdir -p "$OUT"
CASES=/tmp/gpu_check_cases; rm -rf "$CASES"; mkdir -p "$CASES"
WHEELS=${WHEELS:-.whl}
START=$(date +%s)
elapsed() { echo $(( $(date +%s) - START )); }
BUDGET_S=${BUDGET_S:-540}
PARTS=${PARTS:-sanitizer m1 m2 d2 largest tests b l a d}
cap() {  # a part's timeout: its own, or what is left of the budget; 0 when under 20 s is left
  local left=$(( BUDGET_S - $(elapsed) )); [ "$left" -lt 20 ] && { echo 0; return; }
  [ "$1" -lt "$left" ] && echo "$1" || echo "$left"
}
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
part_tests() {
  timeout "$1" python3 -m pytest -q -m gpu -p no:cacheprovider -rs --timeout 60 tests >"$OUT/gpu_tests.log" 2>&1
  log "gpu tests rc=$?: $(tail -1 "$OUT/gpu_tests.log")"
}
part_sanitizer() {
  TORCH_CUDA_SANITIZER=1 timeout "$1" python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 90 tests \
    >"$OUT/sanitizer.log" 2>&1
  log "sanitizer rc=$?: $(grep -c 'possible data race' "$OUT/sanitizer.log") races; $(tail -1 "$OUT/sanitizer.log")"
}

# 2. the cases (bench_gpu.py), each its own process and timeout: a (all on the device), b (the ZeRO-Offload
# shape: steady and synchronized steps, with and without clipping), l (the 1.12B Llama in bf16), d (DeepSpeed,
# when it is installed)
bench() {  # name, timeout, extra args
  timeout "$2" python3 benchmarks/bench_gpu.py --cases "$1" --warmup 1 --steps 8 --json "$CASES/case_$1.json" \
    ${BENCH_ARGS:-} "${@:3}" >>"$OUT/bench.log" 2>&1
  log "case $1 rc=$? $(python3 -c "import json,sys; d=json.load(open(sys.argv[1]))['$1']; print({k: d[k] for k in
  ('step_s','steady_s','ratio','speed') if k in d})" "$CASES/case_$1.json" 2>/dev/null || echo '(no result)')"
}
part_a() { bench a "$1"; }
PROF=(); [ "${PROFILE:-1}" = 1 ] && PROF=(--profile "$CASES/prof")
part_b() { bench b "$1" "${PROF[@]}"; }
part_l() { bench l "$1" "${PROF[@]}"; }
part_d() {
  if ! python3 -c "import deepspeed" 2>/dev/null; then log "case d skipped (deepspeed missing)"; return; fi
  local b  # case b's synchronized step when part b ran: case d compares with it instead of running b again
  b=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['b']['step_s'])" "$CASES/case_b.json" \
    2>/dev/null) && bench d "$1" --b-step-s "$b" || bench d "$1"
}
# 3. the memory-bound cases (bench_offload_bound.py): m1 (case l's Llama with no tail units: every update on the
# CPU), m2 (a Llama whose fp32 state is over 1.2x the GPU's memory, policy "auto"), d2 (DeepSpeed ZeRO-2 and ZeRO-3
# with offload_optimizer cpu on m1's model and batch, when it is installed)
mbench() {  # name, timeout, extra args
  timeout "$2" python3 benchmarks/bench_offload_bound.py --cases "$1" --json "$CASES/case_$1.json" \
    ${BENCH_ARGS:-} "${@:3}" >>"$OUT/bench.log" 2>&1
  log "case $1 rc=$? $(python3 -c "import json,sys; d=json.load(open(sys.argv[1]))['$1']; print({k: d[k] for k in
  ('steady_s','ratio','speed','clip_over_no_clip','accum4_speed','tflops','params','zero3_ratio') if k in d})" \
  "$CASES/case_$1.json" 2>/dev/null || echo '(no result)')"
}
part_m1() { mbench m1 "$1"; }
part_m2() { mbench m2 "$1" --dir "${M2_DIR:-/tmp}"; }
part_d2() {
  if ! python3 -c "import deepspeed" 2>/dev/null; then log "case d2 skipped (deepspeed missing)"; return; fi
  local m  # m1's steady step when part m1 ran: d2 compares with it instead of running m1 again
  m=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['m1']['steady_s'])" "$CASES/case_m1.json" \
    2>/dev/null) && mbench d2 "$1" --m1-steady-s "$m" || mbench d2 "$1"
}
# 4. the largest model this machine trains: the estimator's answer, then 3 steps of it, full fine-tune and LoRA
# (bf16 compute, as m2; one sequence a step: the answer hardly depends on it, and its steps are the shortest)
LARGEST_JOB=(--set precision.compute_dtype=bf16 --set run.batch_size=1)
part_largest() {
  if [ "${LARGEST:-1}" != 1 ]; then log "largest model skipped (LARGEST=${LARGEST:-})"; return; fi
  timeout 150 python3 -m infinity estimate --largest llama --seq-len 1024 --set run.checkpoint=false \
    --set run.eval_every=0 "${LARGEST_JOB[@]}" --json >"$CASES/largest_estimate.json" \
    2>"$OUT/largest.log"  # (as bench_largest runs it)
  local rc=$?; cat "$CASES/largest_estimate.json" >>"$OUT/largest.log"
  log "largest (estimate) rc=$rc"
  local mode t end=$(( $(elapsed) + $1 ))
  for mode in full lora; do  # (the full fine-tune at most half: a slow one leaves LoRA the rest)
    t=$(( end - $(elapsed) )); [ "$mode" = full ] && t=$(( $1 / 2 ))
    t=$(cap "$t"); [ "$t" = 0 ] && { log "largest ($mode, 3 steps) skipped: the budget is spent"; continue; }
    timeout "$t" python3 benchmarks/bench_largest.py --estimate "$CASES/largest_estimate.json" "${LARGEST_JOB[@]}" \
      --modes "$mode" --steps 3 --time-limit $(( t - 10 )) --json "$CASES/largest_$mode.json" \
      >>"$OUT/largest.log" 2>&1  # (it stops its training in time and reports the steps done; timeout: a backstop)
    log "largest ($mode, 3 steps) rc=$?"
  done
  python3 -c "import json, os, sys; parts = [json.load(open(p)) for p in sys.argv[2:] if os.path.exists(p)]
json.dump({k: v for part in parts for k, v in part.items()}, open(sys.argv[1], 'w'), indent=2)" \
    "$CASES/largest.json" "$CASES/largest_full.json" "$CASES/largest_lora.json"  # (one largest.json, both modes)
}

declare -A LIMIT=([tests]=120 [sanitizer]=150 [m1]=150 [m2]=240 [d2]=180 [a]=70 [b]=160 [l]=120 [d]=200
                  [largest]=420)  # (largest: after its estimate, up to 150 s; a 23B model materializes first)
for part in $PARTS; do
  t=$(cap "${LIMIT[$part]}")
  if [ "$t" = 0 ]; then log "$part skipped: $(elapsed) s of the ${BUDGET_S} s budget spent"; continue; fi
  "part_$part" "$t"
done

[ -d "$CASES/prof" ] && (cd "$CASES/prof" && tar czf "$OUT/profile.tgz" \
  $(find . -name summary.json -o -name timeline.png -o -name trace.json)) 2>/dev/null
cp "$CASES"/case_*.json "$CASES"/largest.json "$OUT/" 2>/dev/null  # (merged below, then removed: 8 files)
python3 benchmarks/gpu_check_report.py --logs "$OUT" --elapsed "$(elapsed)" \
  --json "$OUT/gpu_$(date +%F).json" >/tmp/gpu_check_report.log 2>&1
sed -n '1,/^{/p' /tmp/gpu_check_report.log | grep -v '^{' | tee -a "$OUT/check.log"
rm -f "$OUT"/case_*.json "$OUT/largest.json"
log "done"
