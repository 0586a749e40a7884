#!/usr/bin/env bash
# For the GPU suite (`make test-gpu`): when .venv's torch is a CPU-only build, replace it (and torchvision) with
# the CUDA build of the same pinned versions (TORCH_SPEC in setup.sh), with the CUDA libraries it depends on. On
# Linux x86_64 PyPI's wheels of the pinned versions are that build (CUDA 13.0); INT8_ACCEL_TORCH_CUDA_INDEX names
# another wheel index (a CUDA build for an older driver, say).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$ROOT/.venv/bin/python"
INDEX="${INT8_ACCEL_TORCH_CUDA_INDEX:-}"
log() { printf '[setup-gpu] %s\n' "$*" >&2; }

if [ -n "$("$PY" -c 'import torch; print(torch.version.cuda or "")')" ]; then
  exit 0
fi
read -r -a spec < <(sed -n 's/^TORCH_SPEC=(\(.*\))$/\1/p' "$ROOT/scripts/setup.sh")
if [ "${#spec[@]}" -eq 0 ]; then
  log "cannot read TORCH_SPEC from scripts/setup.sh"
  exit 1
fi
source="${INDEX:-PyPI}"
log "torch is a CPU-only build: installing the CUDA build of ${spec[*]} from $source"
"$PY" -m pip install -q --force-reinstall ${INDEX:+--index-url "$INDEX"} "${spec[@]}"
if [ -z "$("$PY" -c 'import torch; print(torch.version.cuda or "")')" ]; then
  log "still a CPU-only torch after installing from $source"
  exit 1
fi
