#!/usr/bin/env bash
# `make gpu-bundle`: write .gpu-bundle/ (git-ignored) with what a GPU machine without network lacks for
# scripts/gpu_run.sh: ComfyUI (the one scripts/setup.sh installed, without models/, user/, output/, input/,
# custom_nodes/ and caches) as comfyui.tar.gz, and torchsde, trampoline and torchao as cp312 wheels. comfy-kitchen
# (36 MB even without its 150 MB ROCm library) serves only the layers bench, a stage the default plan skips, so it is
# carried only with GPU_BUNDLE_KITCHEN=1 (as comfy_kitchen.tar.gz, CUDA backend). PyAV is not carried:
# harness/standins/av serves ComfyUI's start-up. Prints the bundle's path and size, and fails when it is over
# 60 MiB (the device tool carries 64 MiB in all, the working tree included).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$ROOT/.venv/bin/python"
[ -x "$PY" ] || PY=python3
BUNDLE="$ROOT/.gpu-bundle"
WHEELS=(torchsde==0.2.6 trampoline==0.1.2 torchao==0.18.0)  # torchao: the bench's peer rows (abi3, 3.4 MB)
KITCHEN=comfy-kitchen==0.2.40
log() { printf '[gpu-bundle] %s\n' "$*" >&2; }

COMFY="${COMFYUI_PATH:-$ROOT/.comfyui/ComfyUI}"
if [ ! -f "$COMFY/main.py" ] || [ ! -x "$PY" ]; then
  COMFY="$(bash "$ROOT/scripts/setup.sh")"
fi
rm -rf "$BUNDLE.partial"
mkdir -p "$BUNDLE.partial/wheels"
pip_download() {
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 "$@" 2> >(grep -v "is ignored: it is neither" >&2)
}
log "wheels: ${WHEELS[*]}"
pip_download -d "$BUNDLE.partial/wheels" "${WHEELS[@]}"

log "ComfyUI from $COMFY"
tar -C "$(dirname "$COMFY")" -czf "$BUNDLE.partial/comfyui.tar.gz" \
  --exclude="$(basename "$COMFY")/models" --exclude="$(basename "$COMFY")/user" \
  --exclude="$(basename "$COMFY")/output" --exclude="$(basename "$COMFY")/input" \
  --exclude="$(basename "$COMFY")/custom_nodes" --exclude='__pycache__' --exclude='*.pyc' \
  --transform "s,^$(basename "$COMFY"),ComfyUI," "$(basename "$COMFY")"

if [ "${GPU_BUNDLE_KITCHEN:-0}" = 1 ]; then
  log "$KITCHEN without its ROCm library"
  tmp="$(mktemp -d)"
  pip_download -d "$tmp" "$KITCHEN"
  (cd "$tmp" && "$PY" -m zipfile -e ./*.whl unpacked && rm -f unpacked/comfy_kitchen/backends/hip/_C*.so \
    && tar -C unpacked -czf "$BUNDLE.partial/comfy_kitchen.tar.gz" .)
  rm -rf "$tmp"
else
  log "comfy-kitchen left out (no default stage uses it; GPU_BUNDLE_KITCHEN=1 carries it)"
fi

{
  echo "made $(date -u +%Y-%m-%dT%H:%MZ) by scripts/gpu_bundle.sh"
  echo "ComfyUI $(sed -n 's/^__version__ = "\(.*\)"/\1/p' "$COMFY/comfyui_version.py")"
  (cd "$BUNDLE.partial" && ls -l wheels/*.whl ./*.tar.gz | awk '{print $5, $NF}')
} > "$BUNDLE.partial/MANIFEST.txt"
rm -rf "$BUNDLE"
mv "$BUNDLE.partial" "$BUNDLE"
bytes="$(du -sb "$BUNDLE" | cut -f1)"
echo "$BUNDLE $bytes bytes ($(awk -v b="$bytes" 'BEGIN {printf "%.1f", b / 1048576}') MiB, at most 60 MiB)"
if ((bytes > 60 * 1048576)); then
  log "the bundle is over 60 MiB: it and the working tree would not fit the device tool's 64 MiB"
  exit 1
fi
