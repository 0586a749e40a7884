#!/usr/bin/env bash
# Idempotent: .venv-torch211 with PyTorch 2.11 (Triton 3.6), ComfyUI's requirements and the test tools, so
# `make test` runs the kernel tier, the Compile Model tests and the INT8 -> DeepCache -> Compile smoke on it.
# Prints that PyTorch version on stdout. Fast when already done.
#
# PyPI's x86_64 torch 2.11 wheel is a CUDA build: its nvidia-* wheels are installed as declared. numpy stays
# below 2.4: Triton 3.6's interpreter converts one-element arrays to int, which NumPy 2.4 refuses.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-torch211"
PY="$VENV/bin/python"
COMFY="${COMFYUI_PATH:-$ROOT/.comfyui/ComfyUI}"
# No wheel cache: this venv's CUDA wheels would stay cached beside their install (see scripts/setup.sh).
export PIP_NO_CACHE_DIR=1
TORCH=2.11.0
TORCH_SPEC=(torch==$TORCH torchvision==0.26.0 "numpy<2.4")

log() { printf '[setup-torch211] %s\n' "$*" >&2; }

if [ ! -f "$COMFY/requirements.txt" ]; then
  echo "no ComfyUI at $COMFY: run scripts/setup.sh first" >&2; exit 1
fi
STAMP="$VENV/.int8accel-torch211-v1"
WANT="torch==$TORCH $(sha256sum "$COMFY/requirements.txt" | cut -c1-16)"

if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  if [ ! -x "$PY" ]; then
    log "creating virtual environment at .venv-torch211"
    python3 -m venv "$VENV"
  fi
  log "installing ${TORCH_SPEC[*]} (a CUDA build with its nvidia-* wheels), ComfyUI's requirements and the test tools"
  grep -v -E '^\s*(torch|torchvision|torchaudio)\s*([<>=!~].*)?$' "$COMFY/requirements.txt" > "$VENV/comfy-requirements.txt"
  "$PY" -m pip install -q "${TORCH_SPEC[@]}" -r "$VENV/comfy-requirements.txt" \
    safetensors pillow requests pytest pytest-timeout 2> >(grep -v "is ignored: it is neither" >&2)
  "$PY" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$TORCH')" \
    || { echo "torch in .venv-torch211 is not $TORCH" >&2; exit 1; }
  echo "$WANT" > "$STAMP"
fi
echo "$TORCH"
