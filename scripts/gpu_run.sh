#!/usr/bin/env bash
# The whole GPU run in one command, for a machine with an NVIDIA GPU and a CUDA build of torch already installed
# (no venv, no downloads): the GPU suite in stages and the GPU bench, each stage with its own time limit.
#
#   OUT=/some/folder bash scripts/gpu_run.sh   # results: 7 files in $OUT (summary.md, run.log, junit.xml, bench)
#
# What it needs beside torch, numpy, pytest, pytest-timeout (pytest-xdist where present), safetensors, pillow and
# ComfyUI's other light requirements: ComfyUI itself and torchsde. It takes them from .gpu-bundle/ (`make
# gpu-bundle` on a machine with network; see docs/gpu.md) when they are missing: the wheels go to a temporary
# target, ComfyUI is unpacked to a temporary folder (or COMFYUI_PATH names one). PyAV, which ComfyUI imports at
# start-up, is replaced by harness/standins/av when it is not installed.
#
# Environment: PYTHON (default python3), OUT (default ./gpu-run-out), GPU_RUN_BUDGET_S (default 555: the stages
# share it, each also capped by its own limit), GPU_RUN_<STAGE>_S (each stage's limit; under 10 skips it),
# GPU_RUN_KERNELS_K (a pytest -k expression narrowing the kernel tests), GPU_RUN_SDXL_VARIANTS /
# GPU_RUN_FLUX_VARIANTS (the bench's variants, names separated by ';'), GPU_RUN_DRY=1 (no CUDA needed: the CUDA
# check reports and the run goes on, the GPU tests are only collected, the bench runs tiny models on the CPU; for
# checking this script).
# Exits non-zero when the CUDA check or any stage failed or was cut.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
OUT="${OUT:-$ROOT/gpu-run-out}"
BUDGET="${GPU_RUN_BUDGET_S:-555}"
DRY="${GPU_RUN_DRY:-0}"
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
for name in ("torch", "triton", "numpy", "pytest", "xdist", "safetensors", "PIL", "transformers"):
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
  echo "| stage | result | seconds | detail |"
  echo "|---|---|---|---|"
} >"$SUMMARY"
say "machine recorded in summary.md"

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
  detail="$(grep -E '(passed|failed|error|skipped|no tests ran|selected)' "$WORK/stage.log" | tail -n1 | tr -d '=|' | sed 's/^ *//')"
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

BENCH=("$PY" bench/bench_gpu.py)
[ "$DRY" = 1 ] && BENCH+=(--dry-run)
# The bench first: its whole-model rows, compiled like for like with the peers (torchao, core TorchCompileModel) in
# the same process first (bench/gpu_models.py VARIANTS), are what a GPU session is rarest for. One stage per whole
# model, so a slow SDXL cannot take the Flux model's time; the rows each writes stay in its file when it is cut.
# The defaults fit one 10-minute device call (about 15 s of setup, 245 + 225 + 40 s of stages, a cut stage's up to
# 15 s of grace) and leave the test stages for a later call: their limits default to 0.
run_stage "bench: SDXL" "${GPU_RUN_SDXL_S:-230}" "${GPU_ENV[@]}" "${BENCH[@]}" --part models --families sdxl \
  ${GPU_RUN_SDXL_VARIANTS:+--variants "$GPU_RUN_SDXL_VARIANTS"} --out "$OUT/gpu_models_sdxl.md"
run_stage "bench: Flux" "${GPU_RUN_FLUX_S:-210}" "${GPU_ENV[@]}" "${BENCH[@]}" --part models --families flux \
  ${GPU_RUN_FLUX_VARIANTS:+--variants "$GPU_RUN_FLUX_VARIANTS"} --out "$OUT/gpu_models_flux.md"
run_stage "bench: INT8 breakdown" "${GPU_RUN_BREAKDOWN_S:-40}" "${GPU_ENV[@]}" "$PY" bench/gpu_int8_breakdown.py \
  --out "$OUT/gpu_int8_breakdown.md"
# The tests when their limits are raised (GPU_RUN_KERNELS_S=60 runs the kernel tests of what no GPU has run yet, the
# default -k): the 89 kernel tests took about 95 s on the first H200 run, the 11 ComfyUI/compile tests about 25 s
# each of compiling (5 done in 137 s on 4 workers), the speed-gate test 9 s.
run_stage "kernel tests" "${GPU_RUN_KERNELS_S:-35}" "${GPU_ENV[@]}" "${PYTEST[@]}" --timeout 60 \
  -k "(not ($COMFY_TESTS or $SPEED_TESTS)) and (${GPU_RUN_KERNELS_K:-row_quantizer or fused_linear_gemm or never_sync})" \
  --junitxml "$WORK/junit-kernels.xml"
run_stage "ComfyUI + compile tests" "${GPU_RUN_COMFY_S:-0}" "${GPU_ENV[@]}" "${PYTEST[@]}" --timeout 150 \
  "${XDIST[@]}" -k "$COMFY_TESTS" --junitxml "$WORK/junit-comfy.xml"
run_stage "speed-gate test (alone)" "${GPU_RUN_SPEED_S:-0}" "${GPU_ENV[@]}" "${PYTEST[@]}" --timeout 25 \
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
run_stage "bench: layers" "${GPU_RUN_LAYERS_S:-0}" "${GPU_ENV[@]}" "${BENCH[@]}" --part layers --no-compile \
  --models sdxl,flux --reps 10 --out "$OUT/gpu_layers.md"

printf '\ntotal: %s s of a %s s budget; stages failed or cut: %s\n' "$((SECONDS - START))" "$BUDGET" "$failures" \
  >>"$SUMMARY"
say "done in $((SECONDS - START))s, $failures stage(s) failed or cut"
rm -rf "$WORK"
((failures == 0))
