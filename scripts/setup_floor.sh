#!/usr/bin/env bash
# Idempotent: .venv-floor with the oldest PyTorch pyproject.toml declares (`torch>=X`), ComfyUI's requirements
# and the test tools, so `make test` runs the kernel tier and an INT8 -> DeepCache -> Compile smoke on it.
# Prints that PyTorch version on stdout. Fast when already done.
#
# PyPI's x86_64 torch wheels of that age are CUDA builds: torch alone (about 800 MB) does not import without
# the nvidia-* wheels it pulls (about 2.5 GB downloaded, 5 GB installed, a minute or two here), so they are
# installed as declared rather than trimmed. numpy stays below 2: Triton 3.0's interpreter (what torch 2.4
# ships) converts one-element arrays to int, which NumPy 2 refuses.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-floor"
PY="$VENV/bin/python"
COMFY="${COMFYUI_PATH:-$ROOT/.comfyui/ComfyUI}"
# No wheel cache: this venv's CUDA wheels would stay cached beside their install (see scripts/setup.sh).
export PIP_NO_CACHE_DIR=1

log() { printf '[setup-floor] %s\n' "$*" >&2; }

FLOOR="$(sed -n 's/.*"torch>=\([0-9][0-9.]*\)".*/\1/p' "$ROOT/pyproject.toml" | head -n 1)"
if [ -z "$FLOOR" ]; then
  echo "pyproject.toml declares no \"torch>=X\" dependency" >&2; exit 1
fi
case "$FLOOR" in *.*.*) ;; *) FLOOR="$FLOOR.0" ;; esac  # ">=2.4" is first met by 2.4.0
if [ ! -f "$COMFY/requirements.txt" ]; then
  echo "no ComfyUI at $COMFY: run scripts/setup.sh first" >&2; exit 1
fi
STAMP="$VENV/.int8accel-floor-v1"
WANT="torch==$FLOOR $(sha256sum "$COMFY/requirements.txt" | cut -c1-16)"

if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  if [ ! -x "$PY" ]; then
    log "creating virtual environment at .venv-floor"
    python3 -m venv "$VENV"
  fi
  log "installing torch==$FLOOR (the declared floor; a CUDA build with its nvidia-* wheels), ComfyUI's requirements and the test tools"
  grep -v -E '^\s*(torch|torchvision|torchaudio)\s*([<>=!~].*)?$' "$COMFY/requirements.txt" > "$VENV/comfy-requirements.txt"
  "$PY" -m pip install -q "torch==$FLOOR" torchvision torchaudio "numpy<2" -r "$VENV/comfy-requirements.txt" \
    safetensors pillow requests pytest pytest-timeout 2> >(grep -v "is ignored: it is neither" >&2)
  "$PY" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$FLOOR')" \
    || { echo "torch in .venv-floor is not $FLOOR" >&2; exit 1; }
  echo "$WANT" > "$STAMP"
fi
echo "$FLOOR"
