#!/usr/bin/env bash
# Idempotent: Debian's chromium (the browser tests never download a browser of their own) and Playwright
# for Python in .venv (its wheel ships the driver; `playwright install` is never run). Fast when done.
# Exit 0 when both are usable; non-zero (with a reason on stderr) when chromium cannot be installed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$ROOT/.venv/bin/python"
log() { printf '[setup_browser] %s\n' "$*" >&2; }

if ! command -v chromium >/dev/null 2>&1; then
  if ! command -v apt-get >/dev/null 2>&1; then
    log "no apt-get: install Debian's chromium yourself"; exit 2
  fi
  SUDO=""
  if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
      log "not root and no password-less sudo: cannot apt-get install chromium"; exit 2
    fi
  fi
  export DEBIAN_FRONTEND=noninteractive
  # Refresh the package lists only when apt does not know chromium yet.
  if ! apt-cache show chromium >/dev/null 2>&1; then
    log "apt-get update"
    $SUDO apt-get update -qq >/dev/null
  fi
  log "apt-get install chromium (about a minute)"
  if ! $SUDO apt-get install -y -qq --no-install-recommends chromium >/dev/null; then
    log "apt-get update and retry"
    $SUDO apt-get update -qq >/dev/null
    $SUDO apt-get install -y -qq --no-install-recommends chromium >/dev/null
  fi
fi

if ! "$PY" -c "import playwright.sync_api" >/dev/null 2>&1; then
  log "pip install playwright into .venv"
  "$PY" -m pip install -q playwright
fi
command -v chromium
