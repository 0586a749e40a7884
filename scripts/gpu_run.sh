#!/usr/bin/env bash
# The whole GPU run in one command, for a machine with an NVIDIA GPU and a CUDA build of torch already installed
# (no venv, no downloads), sized for one call of a lent GPU: it prints its plan first (each stage's limit, setup,
# the end, and the machine's 180 s start, summed) and refuses a plan over 14 minutes.
#
#   OUT=/some/folder bash scripts/gpu_run.sh   # results in $OUT: summary.md, run.log, junit.xml, the bench files
#
# The stages, most important first (a stage past the run's budget is not run):
#   1. kernel tests: row quantizer   the GPU tests of the one-pass row quantizer, which every INT8 row runs
#   2. kernel tests: GEMMs           the fused and the persistent TMA GEMM's tests; a kernel whose tests fail here
#                                    (or in 1) stops the bench rows that use it (GPU_RUN_FAILED_KERNELS)
#   3. bench: Flux, compiled rows    plain bf16 + Compile Model, INT8 + Compile Model, plain bf16 again (drift),
#                                    core's TorchCompileModel on plain bf16, torchao int8 (bench/gpu_models.py
#   4. bench: SDXL, compiled rows    COMPILED_ROWS; SDXL's Compile Model pair replays CUDA graphs, where INT8 can win)
#   5. bench: the rest               every other whole-model row, both families, as time allows
#   then, at limit 0 unless raised: the INT8 breakdown, the ComfyUI + compile tests, the speed-gate test, the layers.
#
# What it needs beside torch, numpy, pytest, pytest-timeout (pytest-xdist where present), safetensors, pillow and
# ComfyUI's other light requirements: ComfyUI itself and torchsde. It takes them from .gpu-bundle/ (`make
# gpu-bundle` on a machine with network; see docs/gpu.md) when they are missing: the wheels go to a temporary
# target, ComfyUI is unpacked to a temporary folder (or COMFYUI_PATH names one). PyAV, which ComfyUI imports at
# start-up, is replaced by harness/standins/av when it is not installed.
#
# Environment: PYTHON (default python3), OUT (default ./gpu-run-out), GPU_RUN_BUDGET_S (default: the plan's sum less
# the machine's start; the stages share it, each also capped by its own limit), GPU_RUN_<STAGE>_S (each stage's
# limit: ROWQ, GEMM, FLUX, SDXL, REST, BREAKDOWN, COMFY, SPEED, LAYERS; under 10 skips it), GPU_RUN_FLUX_VARIANTS /
# GPU_RUN_SDXL_VARIANTS / GPU_RUN_REST_VARIANTS (bench variants instead of the stage's rows, names separated by
# ';'), GPU_RUN_PLAN_ONLY=1 (print the plan and stop), GPU_RUN_DRY=1 (no CUDA needed: the CUDA check reports and
# the run goes on, the GPU tests are only collected, the bench runs tiny models on the CPU; for checking this
# script). Exits non-zero when the plan is refused, or the CUDA check or any stage failed or was cut.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
OUT="${OUT:-$ROOT/gpu-run-out}"
DRY="${GPU_RUN_DRY:-0}"

# ---- the plan -------------------------------------------------------------------------------------------------
MACHINE_START_S=180  # a lent machine's start, before this script runs (the device tool's)
SETUP_S=20           # the machine record, the bundle, the CUDA check
END_S=20             # the junit merge and the summary, and a cut stage's grace
PLAN_LIMIT_S=840     # 14 minutes of the 15 a lent GPU gives, start included
STAGE_NAMES=("kernel tests: row quantizer" "kernel tests: GEMMs" "bench: Flux, compiled rows"
  "bench: SDXL, compiled rows" "bench: the rest" "bench: INT8 breakdown" "ComfyUI + compile tests"
  "speed-gate test (alone)" "bench: layers")
STAGE_LIMITS=("${GPU_RUN_ROWQ_S:-25}" "${GPU_RUN_GEMM_S:-40}" "${GPU_RUN_FLUX_S:-200}" "${GPU_RUN_SDXL_S:-220}"
  "${GPU_RUN_REST_S:-50}" "${GPU_RUN_BREAKDOWN_S:-0}" "${GPU_RUN_COMFY_S:-0}" "${GPU_RUN_SPEED_S:-0}"
  "${GPU_RUN_LAYERS_S:-0}")
plan_sum=$((MACHINE_START_S + SETUP_S + END_S))
plan_lines=("machine start: ${MACHINE_START_S} s (before this script)" "setup: ${SETUP_S} s")
for i in "${!STAGE_NAMES[@]}"; do
  limit="${STAGE_LIMITS[$i]}"
  if ((limit < 10)); then
    plan_lines+=("$((i + 1)). ${STAGE_NAMES[$i]}: skipped (limit ${limit} s)")
  else
    plan_lines+=("$((i + 1)). ${STAGE_NAMES[$i]}: up to ${limit} s")
    plan_sum=$((plan_sum + limit))
  fi
done
plan_lines+=("end: ${END_S} s")
BUDGET="${GPU_RUN_BUDGET_S:-$((plan_sum - MACHINE_START_S))}"
{
  echo "[gpu-run] plan, in this order:"
  printf '[gpu-run]   %s\n' "${plan_lines[@]}"
  echo "[gpu-run] plan sum: ${plan_sum} s ($((plan_sum / 60)) min $((plan_sum % 60)) s) of at most ${PLAN_LIMIT_S} s" \
    "(14 min); this script's budget: ${BUDGET} s"
} >&2
if ((plan_sum > PLAN_LIMIT_S)); then
  echo "[gpu-run] refused: the plan's ${plan_sum} s is over ${PLAN_LIMIT_S} s (14 minutes); lower the stages'" \
    "limits (GPU_RUN_<STAGE>_S)" >&2
  exit 2
fi
[ "${GPU_RUN_PLAN_ONLY:-0}" = 1 ] && exit 0

BUNDLE="$ROOT/.gpu-bundle"
WORK="$(mktemp -d /tmp/int8-gpu-run.XXXXXX)"
START=$SECONDS
mkdir -p "$OUT"
LOG="$OUT/run.log"
SUMMARY="$OUT/summary.md"
: >"$LOG"
failures=0

say() { printf '[gpu-run %4ds] %s\n' "$((SECONDS - START))" "$*" | tee -a "$LOG" >&2; }
row() { printf '| %s | %s | %s | %s |\n' "$1" "$2" "$3" "$4" >>"$SUMMARY"; }

# ---- what the machine lacks: wheels, comfy-kitchen, ComfyUI, PyAV ---------------------------------------------
SITE="$WORK/site"
mkdir -p "$SITE"
# The bundle's wheels (import name: wheel names) for what this Python lacks: torchsde for ComfyUI's samplers,
# torchao for the bench's peer rows.
wanted=()
"$PY" -c 'import torchsde' 2>/dev/null || wanted+=(torchsde trampoline)
"$PY" -c 'import torchao' 2>/dev/null || wanted+=(torchao)
wheels=()
for name in ${wanted[@]+"${wanted[@]}"}; do
  found="$(compgen -G "$BUNDLE/wheels/${name}-*.whl" | head -n1)"
  if [ -n "$found" ]; then
    wheels+=("$found")
  else
    say "$name is missing and .gpu-bundle/wheels has no wheel of it: run \`make gpu-bundle\` where there is network"
  fi
done
if ((${#wheels[@]})); then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "${wheels[@]}" \
    >>"$LOG" 2>&1 && say "installed $(basename -a "${wheels[@]}" | tr '\n' ' ')into $SITE" \
    || say "could not install the bundle's wheels (see above)"
fi
if ! "$PY" -c 'import comfy_kitchen' 2>/dev/null && [ -f "$BUNDLE/comfy_kitchen.tar.gz" ]; then
  tar -C "$SITE" -xzf "$BUNDLE/comfy_kitchen.tar.gz" && say "comfy-kitchen unpacked into $SITE"
fi
export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c 'import av' 2>/dev/null; then
  export PYTHONPATH="$PYTHONPATH:$ROOT/harness/standins"
  say "PyAV is not installed: harness/standins/av serves ComfyUI's imports"
fi
# ---- the machine ------------------------------------------------------------------------------------------------
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "host: $(uname -srm)"
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//') x $(nproc)"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader 2>&1 | sed 's/^/gpu: /'
  else
    echo "gpu: nvidia-smi not found"
  fi
  echo "python: $("$PY" -c 'import sys; print(sys.version.split()[0], sys.executable)')"
  "$PY" - <<'PYEOF' 2>&1
import importlib
for name in ("torch", "triton", "numpy", "pytest", "xdist", "safetensors", "PIL", "transformers", "torchao",
             "comfy_kitchen"):
    try:
        module = importlib.import_module(name)
        print(f"{name}: {getattr(module, '__version__', 'present')}")
    except Exception as exc:  # noqa: BLE001
        print(f"{name}: missing ({type(exc).__name__})")
import torch
print(f"torch cuda: {torch.version.cuda}, cudnn: {torch.backends.cudnn.version()}")
PYEOF
  echo "gcc: $(gcc --version 2>/dev/null | head -n1 || echo missing)"
  echo "nvcc: $(nvcc --version 2>/dev/null | tail -n1 || echo missing)"
  echo "Python.h: $("$PY" -c 'import os, sysconfig; p = os.path.join(sysconfig.get_paths()["include"], "Python.h"); print(p if os.path.exists(p) else "missing")')"
} >"$WORK/machine.txt" 2>&1
cat "$WORK/machine.txt" >>"$LOG"
{
  echo "# GPU run ($(date -u +%Y-%m-%dT%H:%MZ))"
  echo
  sed 's/^/    /' "$WORK/machine.txt"
  echo
  echo "Plan (sum ${plan_sum} s with the machine's start, of at most ${PLAN_LIMIT_S} s):"
  echo
  printf -- '- %s\n' "${plan_lines[@]}"
  echo
  echo "| stage | result | seconds | detail |"
  echo "|---|---|---|---|"
} >"$SUMMARY"
say "machine recorded in summary.md"

if [ -z "${COMFYUI_PATH:-}" ]; then
  if [ -f "$BUNDLE/comfyui.tar.gz" ]; then
    tar -C "$WORK" -xzf "$BUNDLE/comfyui.tar.gz" && export COMFYUI_PATH="$WORK/ComfyUI"
    say "ComfyUI unpacked to $COMFYUI_PATH"
  elif [ -f "$ROOT/.comfyui/ComfyUI/main.py" ]; then
    export COMFYUI_PATH="$ROOT/.comfyui/ComfyUI"
  fi
fi
if [ ! -f "${COMFYUI_PATH:-/nonexistent}/main.py" ]; then
  say "no ComfyUI: set COMFYUI_PATH or carry .gpu-bundle (make gpu-bundle)"
  row "setup" "failed" "$((SECONDS - START))" "no ComfyUI"
  exit 1
fi
mkdir -p "$COMFYUI_PATH/models" "$COMFYUI_PATH/user" "$COMFYUI_PATH/output" "$COMFYUI_PATH/input" \
  "$COMFYUI_PATH/custom_nodes"
export INT8_ACCEL_CACHE_DIR="$WORK/int8-cache"
export PYTHONUNBUFFERED=1
row "setup" "ok" "$((SECONDS - START))" "ComfyUI $(sed -n 's/^__version__ = "\(.*\)"/\1/p' "$COMFYUI_PATH/comfyui_version.py")"

# ---- CUDA computes --------------------------------------------------------------------------------------------
if "$PY" -m harness.cuda_check >>"$LOG" 2>&1; then
  row "CUDA check" "ok" "$((SECONDS - START))" "$(tail -n1 "$LOG")"
  say "$(tail -n1 "$LOG")"
elif [ "$DRY" = 1 ]; then
  row "CUDA check" "dry run" "$((SECONDS - START))" "$(tail -n1 "$LOG")"
  say "dry run: going on without CUDA ($(tail -n1 "$LOG"))"
else
  row "CUDA check" "failed" "$((SECONDS - START))" "$(tail -n1 "$LOG")"
  say "stopping: $(tail -n1 "$LOG")"
  exit 1
fi

# ---- stages -------------------------------------------------------------------------------------------------------
# run_stage NAME LIMIT COMMAND...: at most LIMIT seconds and never past the run's budget (less 20 s for the end);
# SIGINT first, so pytest still writes its junit file and summary, then SIGKILL 15 s later.
run_stage() {
  local name="$1" limit="$2"
  shift 2
  if ((limit < 10)); then
    row "$name" "skipped" 0 "its limit was set to ${limit}s"
    say "$name: skipped (limit ${limit}s)"
    return
  fi
  local left=$((BUDGET - (SECONDS - START) - 20))
  ((left < limit)) && limit=$left
  if ((limit < 10)); then
    row "$name" "not run" 0 "the run's budget of ${BUDGET}s was spent"
    say "$name: not run, budget spent"
    failures=$((failures + 1))
    return
  fi
  say "$name: up to ${limit}s: $*"
  local begin=$SECONDS status
  timeout -s INT -k 15 "$limit" "$@" >"$WORK/stage.log" 2>&1
  status=$?
  cat "$WORK/stage.log" >>"$LOG"
  local detail
  # pytest's summary line, else the bench rows the stage wrote (each printed as it is measured)
  detail="$(grep -E '^=* *([0-9/]+ .* in [0-9.]+s|no tests ran)' "$WORK/stage.log" | tail -n1 | tr -d '=|' | sed 's/^ *//')"
  if [ -z "$detail" ]; then
    local rows
    rows="$(sed -n 's/^gpu_models row: //p' "$WORK/stage.log")"
    [ -n "$rows" ] && detail="$(printf '%s\n' "$rows" | wc -l) bench row(s), the last: $(printf '%s\n' "$rows" \
      | tail -n1 | cut -d'|' -f2-3 | tr -d '|' | sed 's/^ *//' | cut -c1-120)"
  fi
  if ((status == 124 || status == 137 || status == 130)); then
    row "$name" "cut at ${limit}s" "$((SECONDS - begin))" "${detail:-}"
    failures=$((failures + 1))
  elif ((status != 0)); then
    row "$name" "failed (exit $status)" "$((SECONDS - begin))" "${detail:-$(tail -n1 "$WORK/stage.log")}"
    failures=$((failures + 1))
  else
    row "$name" "ok" "$((SECONDS - begin))" "${detail:-}"
  fi
  say "$name: exit $status after $((SECONDS - begin))s ${detail:-}"
}

GPU_ENV=(env INT8_ACCEL_TESTS_ON_GPU=1 TRITON_INTERPRET=0)
PYTEST=("$PY" -m pytest tests/gpu -q -m gpu -p no:randomly)
COMFY_TESTS="compile_model or reduce_overhead or stored_in or low_vram"
SPEED_TESTS="speed_gate"
XDIST=()
"$PY" -c 'import xdist' 2>/dev/null && XDIST=(-n 6)
if [ "$DRY" = 1 ]; then
  GPU_ENV+=(GPU_RUN_DRY=1)
  PYTEST+=(--collect-only)
  XDIST=()
fi
BENCH=("$PY" bench/bench_gpu.py --part models)
[ "$DRY" = 1 ] && BENCH+=(--dry-run)

# failed_kernels JUNIT KERNEL...: the kernels (of those named) whose tests failed in JUNIT, comma-separated. A GEMM
# test's id ends in its GEMM ("...-fused]", "...-fused-tma]"); the row quantizer's tests are all its own. No junit
# (the stage crashed or never ran) counts as failed: untested kernels do not feed the bench.
failed_kernels() {
  "$PY" - "$@" <<'PYEOF' 2>>"$LOG"
import os
import sys
import xml.etree.ElementTree as ET

path, kernels = sys.argv[1], sys.argv[2:]
if not os.path.exists(path):
    print(",".join(kernels))
    sys.exit()
failed = [case.get("name", "") for case in ET.parse(path).getroot().iter("testcase")
          if case.find("failure") is not None or case.find("error") is not None]
bad = []
for kernel in kernels:
    if kernel == "row-quantizer" and failed:
        bad.append(kernel)
    elif any(name.endswith(f"-{kernel}]") for name in failed):
        bad.append(kernel)
print(",".join(bad))
PYEOF
}
BAD_KERNELS=()
note_bad_kernels() {  # STAGE JUNIT KERNEL...
  local stage="$1"
  shift
  local bad
  bad="$(failed_kernels "$@")"
  if [ -n "$bad" ]; then
    BAD_KERNELS+=("$bad")
    say "$stage: failed kernel(s) $bad: the bench rows that use them are not run"
  fi
}

KERNEL_K="not ($COMFY_TESTS or $SPEED_TESTS)"
if ((${STAGE_LIMITS[0]} >= 10)); then
  run_stage "${STAGE_NAMES[0]}" "${STAGE_LIMITS[0]}" "${GPU_ENV[@]}" "${PYTEST[@]}" --timeout 60 \
    -k "($KERNEL_K) and row_quantizer" --junitxml "$WORK/junit-row-quantizer.xml"
  [ "$DRY" = 1 ] || note_bad_kernels "${STAGE_NAMES[0]}" "$WORK/junit-row-quantizer.xml" row-quantizer
else
  run_stage "${STAGE_NAMES[0]}" "${STAGE_LIMITS[0]}"
fi
if ((${STAGE_LIMITS[1]} >= 10)); then
  run_stage "${STAGE_NAMES[1]}" "${STAGE_LIMITS[1]}" "${GPU_ENV[@]}" "${PYTEST[@]}" --timeout 60 \
    -k "($KERNEL_K) and fused_linear_gemm" --junitxml "$WORK/junit-gemms.xml"
  [ "$DRY" = 1 ] || note_bad_kernels "${STAGE_NAMES[1]}" "$WORK/junit-gemms.xml" fused fused-tma
else
  run_stage "${STAGE_NAMES[1]}" "${STAGE_LIMITS[1]}"
fi
FAILED_KERNELS="$(IFS=,; echo "${BAD_KERNELS[*]-}")"
BENCH_ENV=("${GPU_ENV[@]}" GPU_RUN_FAILED_KERNELS="$FAILED_KERNELS")
stage_bench() {  # INDEX FAMILIES ROWS VARIANTS OUTFILE
  local args=(--families "$2")
  if [ -n "$4" ]; then args+=(--variants "$4"); else args+=(--rows "$3"); fi
  run_stage "${STAGE_NAMES[$1]}" "${STAGE_LIMITS[$1]}" "${BENCH_ENV[@]}" "${BENCH[@]}" "${args[@]}" --out "$OUT/$5"
}
stage_bench 2 flux compiled "${GPU_RUN_FLUX_VARIANTS:-}" gpu_models_flux.md
stage_bench 3 sdxl compiled "${GPU_RUN_SDXL_VARIANTS:-}" gpu_models_sdxl.md
stage_bench 4 flux,sdxl rest "${GPU_RUN_REST_VARIANTS:-}" gpu_models_rest.md
if [ "$DRY" = 1 ]; then  # the breakdown and the layers need CUDA: the dry run imports them only
  run_stage "${STAGE_NAMES[5]}" "${STAGE_LIMITS[5]}" "$PY" -c 'import sys; sys.path.insert(0, "bench"); import gpu_int8_breakdown'
else
  run_stage "${STAGE_NAMES[5]}" "${STAGE_LIMITS[5]}" "${BENCH_ENV[@]}" "$PY" bench/gpu_int8_breakdown.py \
    --out "$OUT/gpu_int8_breakdown.md"
fi
# The 11 ComfyUI/compile tests took about 25 s each of compiling on the H200 (5 done in 137 s on 4 workers), the
# speed-gate test 9 s.
run_stage "${STAGE_NAMES[6]}" "${STAGE_LIMITS[6]}" "${GPU_ENV[@]}" "${PYTEST[@]}" --timeout 150 \
  "${XDIST[@]}" -k "$COMFY_TESTS" --junitxml "$WORK/junit-comfy.xml"
run_stage "${STAGE_NAMES[7]}" "${STAGE_LIMITS[7]}" "${GPU_ENV[@]}" "${PYTEST[@]}" --timeout 25 \
  -k "$SPEED_TESTS" --junitxml "$WORK/junit-speed-gate.xml"
"$PY" - "$OUT/junit.xml" "$WORK"/junit-*.xml <<'PYEOF' 2>>"$LOG"
import os
import sys
import xml.etree.ElementTree as ET

merged = ET.Element("testsuites")
for path in filter(os.path.exists, sys.argv[2:]):
    root = ET.parse(path).getroot()
    merged.extend(root.iter("testsuite"))
ET.ElementTree(merged).write(sys.argv[1], encoding="utf-8", xml_declaration=True)
PYEOF
if [ "$DRY" = 1 ]; then
  run_stage "${STAGE_NAMES[8]}" "${STAGE_LIMITS[8]}" "${BENCH_ENV[@]}" "$PY" bench/bench_gpu.py --part layers --dry-run
else
  run_stage "${STAGE_NAMES[8]}" "${STAGE_LIMITS[8]}" "${BENCH_ENV[@]}" "$PY" bench/bench_gpu.py --part layers \
    --no-compile --models sdxl,flux --reps 10 --out "$OUT/gpu_layers.md"
fi
[ -n "$FAILED_KERNELS" ] && printf '\nkernels whose GPU tests failed (their bench rows not run): %s\n' \
  "$FAILED_KERNELS" >>"$SUMMARY"

printf '\ntotal: %s s of a %s s budget; stages failed or cut: %s\n' "$((SECONDS - START))" "$BUDGET" "$failures" \
  >>"$SUMMARY"
say "done in $((SECONDS - START))s, $failures stage(s) failed or cut"
rm -rf "$WORK"
((failures == 0))
